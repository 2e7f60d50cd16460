"""Turning sampled tokens into text deltas: streaming detokenization, EOS and stop strings.

Stop strings are matched on text, so they are found across token boundaries: text that could
still be the start of a stop string is held back until it cannot, and a matched stop string
(and anything after it) is never emitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, StreamingDetokenizer, TokenizerWrapper

from engine.request import FinishReason, Request, TokenLogprob


def new_detokenizer(tokenizer: TokenizerWrapper) -> StreamingDetokenizer:
    """A fresh streaming detokenizer for one request.

    mlx-lm's byte-level BPE detokenizer drops the leading space of the first token (right for a
    chat turn shown alone, wrong for an API: " is" after "The ls command" must stay " is", as
    the tokenizer's own ``decode`` gives). The trim is switched off on this instance.
    """
    detokenizer = tokenizer.detokenizer
    if isinstance(detokenizer, BPEStreamingDetokenizer):
        detokenizer._maybe_trim_space = lambda text: text  # type: ignore[method-assign]
    return detokenizer


@dataclass
class OutputState:
    """Text-side state of one request: its detokenizer and the text not yet emitted."""

    detokenizer: StreamingDetokenizer
    stop: tuple[str, ...]
    pending_text: str = ""
    pending_tokens: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: FinishReason | None


def _held_back_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def advance(state: OutputState, request: Request, token_id: int, logprob: TokenLogprob | None,
            eos_token_ids: frozenset[int], context_length: int, grammar_end: FinishReason | None = None) -> Delta:
    """Account for one new token of ``request``; decide whether it ends the request.
    ``grammar_end``: the end its grammar decided with this token (a constrained row's EOS is
    the grammar's end even with ``ignore_eos``)."""
    params = request.params
    state.pending_tokens.append(token_id)
    finish: FinishReason | None = None
    if token_id in eos_token_ids and (not params.ignore_eos or grammar_end is not None):
        finish = grammar_end or FinishReason.STOP  # EOS is counted as a token but has no text and no logprob entry
    else:
        state.detokenizer.add_token(token_id)
        if logprob is not None:
            state.pending_logprobs.append(logprob)
        finish = grammar_end
    if finish is None and (len(request.output_ids) >= params.max_tokens
                           or request.num_prompt_tokens + len(request.output_ids) >= context_length):
        finish = FinishReason.LENGTH
    if finish is not None:
        state.detokenizer.finalize()
    state.pending_text += state.detokenizer.last_segment
    if state.stop:
        hit = min((i for i in (state.pending_text.find(s) for s in state.stop) if i >= 0), default=-1)
        if hit >= 0:
            state.pending_text = state.pending_text[:hit]
            finish = FinishReason.STOP
    keep = 0 if finish is not None else _held_back_len(state.pending_text, state.stop)
    emit_text = state.pending_text[: len(state.pending_text) - keep]
    state.pending_text = state.pending_text[len(emit_text):]
    if keep and not emit_text:
        return Delta("", (), (), None)
    delta = Delta(emit_text, tuple(state.pending_tokens), tuple(state.pending_logprobs), finish)
    state.pending_tokens.clear()
    state.pending_logprobs.clear()
    return delta
