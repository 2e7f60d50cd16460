"""Turning sampled tokens into text deltas: streaming detokenization, EOS and stop strings.

A choice's text is its tokens' pieces (``engine/token_text.py``: the UTF-8 decoding of their raw
bytes, each token giving the characters it completes), and each logprob entry carries its
token's piece and bytes, so the entries' pieces add up to the text (up to a stop string).
Stop strings are matched on text, so they are found across token boundaries: text that could
still be the start of a stop string is held back until it cannot, and a matched stop string
(and anything after it) is never emitted, unless the request keeps it
(``SamplingParams.include_stop_str_in_output``): then the text ends with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mlx_lm.tokenizer_utils import TokenizerWrapper

from engine.request import FinishReason, Request, TokenLogprob
from engine.step_types import PrefillChunk, PromptScores
from engine.token_text import TextStream, token_bytes_of


def new_text_stream(tokenizer: TokenizerWrapper) -> TextStream:
    """A fresh text stream for one request. A byte-level BPE text keeps the leading space of its
    first token (mlx-lm's detokenizer drops it: right for a chat turn shown alone, wrong for an
    API: " is" after "The ls command" must stay " is", as the tokenizer's own ``decode`` gives)."""
    return TextStream(token_bytes_of(tokenizer))


@dataclass
class OutputState:
    """Text-side state of one request: its text stream and the text not yet emitted."""

    stream: TextStream
    stop: tuple[str, ...]
    pending_text: str = ""
    pending_tokens: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_stream: TextStream | None = None  # the prompt's text, for its scored entries
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # scored, not handed out yet
    prompt_done: bool = False  # every prompt entry is in ``prompt_logprobs`` (or was handed out)

    def take_prompt_logprobs(self) -> tuple[TokenLogprob, ...] | None:
        """The prompt's entries, once they are all there, and only once."""
        if not self.prompt_done or self.prompt_stream is None:
            return None
        entries, self.prompt_logprobs, self.prompt_stream = tuple(self.prompt_logprobs), [], None
        return entries


def add_prompt_scores(state: OutputState, prompt_ids: list[int], chunk: PrefillChunk,
                      scores: PromptScores | None) -> None:
    """A chunk's prompt scores as entries with their text pieces (``PromptScores`` says which
    tokens a chunk scores); the first token gets its entry, with logprob None, with the first
    chunk, and the last one whatever its text held when the prompt ends."""
    if state.prompt_stream is None:
        state.prompt_stream = TextStream(state.stream.table)
    stream, entries = state.prompt_stream, state.prompt_logprobs
    if chunk.start_idx == 0:
        entries.append(TokenLogprob(prompt_ids[0], None, text=stream.add(prompt_ids[0]),
                                    raw=stream.table(prompt_ids[0])))
    for i, logprob in enumerate(scores.logprobs if scores is not None else ()):
        token_id = prompt_ids[scores.first + i]
        top = scores.top[i] if scores.top else ()
        top_text = tuple((stream.peek(t), stream.table(t)) for t, _ in top)
        entries.append(TokenLogprob(token_id, logprob, top, text=stream.add(token_id), raw=stream.table(token_id),
                                    top_text=top_text))
    if chunk.is_last:
        held = stream.finish()
        if held:
            entries[-1] = replace(entries[-1], text=entries[-1].text + held)
        state.prompt_done = True


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


def _stop_end(text: str, stops: tuple[str, ...], keep: bool) -> int | None:
    """Where ``text`` ends at its first stop string (None: none in it): before the stop string,
    or after it when ``keep`` (vLLM's ``include_stop_str_in_output``, SGLang's ``no_stop_trim``).
    Of stop strings found at the same place, the first listed wins."""
    hits = [(i, n) for i, n in ((text.find(s), len(s)) for s in stops) if i >= 0]
    if not hits:
        return None
    at, length = min(hits, key=lambda hit: hit[0])
    return at + length if keep else at


def advance(state: OutputState, request: Request, token_id: int, logprob: TokenLogprob | None,
            eos_token_ids: frozenset[int], context_length: int, grammar_end: FinishReason | None = None) -> Delta:
    """Account for one new token of ``request``; decide whether it ends the request.
    ``grammar_end``: the end its grammar decided with this token (a constrained row's EOS is
    the grammar's end even with ``ignore_eos``)."""
    params = request.params
    state.pending_tokens.append(token_id)
    finish: FinishReason | None = None
    # the alternatives' pieces in this place, before the token moves the stream on
    top_text = tuple((state.stream.peek(t), state.stream.table(t)) for t, _ in logprob.top) if logprob else ()
    is_eos = token_id in eos_token_ids and (not params.ignore_eos or grammar_end is not None)
    if is_eos:
        finish, piece = grammar_end or FinishReason.STOP, ""  # EOS is counted as a token but has no text
    else:
        piece, finish = state.stream.add(token_id), grammar_end
    if finish is None and (len(request.output_ids) >= params.max_tokens
                           or request.num_prompt_tokens + len(request.output_ids) >= context_length):
        finish = FinishReason.LENGTH
    if finish is not None:
        piece += state.stream.finish()
    if logprob is not None:  # the EOS's entry is marked: chat leaves it out, completions show it (as vLLM)
        state.pending_logprobs.append(replace(logprob, text=piece, raw=state.stream.table(token_id),
                                              top_text=top_text, eos=is_eos))
    state.pending_text += piece
    if state.stop:
        end = _stop_end(state.pending_text, state.stop, params.include_stop_str_in_output)
        if end is not None:
            state.pending_text = state.pending_text[:end]
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
