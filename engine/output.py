"""Sampled tokens to text: each token's raw bytes and its piece of the text (streaming
detokenization), then the text deltas a request hands out (EOS, stop strings).

Token to text. A sequence's text is the UTF-8 decoding of its tokens' raw bytes (added tokens,
special ones too, are their own text). A token that ends inside a multi-byte character adds nothing; the
token that completes the character adds all of it:

    tokens   'Ġ'     'æĹ'      '¥'     'æľ¬'
    bytes    20      e6 97     a5      e6 9c ac
    pieces   " "     ""        "日"    "本"         "".join(pieces) == " 日本" == the text

So pieces always add up to the text (``text_offset`` = running sum of their lengths), and a
token's ``bytes`` are its own raw bytes, also for the part of a character it carries. Raw bytes
are read from the vocabulary for byte-level BPE (GPT-2's byte alphabet) and SentencePiece
(``▁`` is a space, ``<0xNN>`` a byte) tokenizers, the kinds mlx-lm's streaming detokenizers
know; for any other tokenizer a token's bytes are its decoding alone and a piece is what the
tokenizer's ``decode`` adds (held back while it ends in U+FFFD), its text resting on that
``decode``. Pure Python (a token table and text streams are safe on any thread).

Text to deltas. Each logprob entry carries its token's piece and bytes, so the entries' pieces add
up to the text (up to a stop string). Stop strings are matched on text, so they are found across
token boundaries: text that could still be the start of a stop string is held back until it
cannot, and a matched stop string (and anything after it) is never emitted, unless the request
keeps it (``SamplingParams.include_stop_str_in_output``): then the text ends with it.
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, TokenizerWrapper, _byte_decoder

from engine.request import FinishReason, Request, TokenLogprob
from engine.step_types import PrefillChunk, PromptScores

_SPM_SPACE = "\u2581".encode("utf-8")
_REPLACEMENT = "\ufffd"


class TokenBytes:
    """Each token id's raw bytes (``table(token_id)``), memoized. ``exact`` is False for a
    tokenizer whose vocabulary is neither byte-level BPE nor SentencePiece: a token's bytes
    are then its decoding alone (U+FFFD's bytes for part of a character)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        detokenizer = getattr(tokenizer, "_detokenizer", None)
        self.kind = ("bpe" if isinstance(detokenizer, BPEStreamingDetokenizer)
                     else "spm" if isinstance(detokenizer, SPMStreamingDetokenizer) else "naive")
        self._tokenmap = detokenizer.tokenmap if self.kind != "naive" else None
        self._added = {i: str(t) for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
        self._memo: dict[int, bytes] = {}

    @property
    def exact(self) -> bool:
        return self.kind != "naive"

    @property
    def trims_first_space(self) -> bool:
        """SentencePiece decoding drops the space that starts a text (as mlx-lm's detokenizer and
        the tokenizer's ``decode`` do); byte-level BPE keeps it."""
        return self.kind == "spm"

    def __call__(self, token_id: int) -> bytes:
        raw = self._memo.get(token_id)
        if raw is None:
            raw = self._memo[token_id] = self._lookup(token_id)
        return raw

    def _lookup(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode("utf-8")
        if self.kind == "naive" or token_id >= len(self._tokenmap):
            return self.tokenizer.decode([token_id]).encode("utf-8")
        if self.kind == "spm":
            return self._tokenmap[token_id].replace(_SPM_SPACE, b" ")
        decoder = _byte_decoder()
        out = bytearray()
        for char in self._tokenmap[token_id]:
            byte = decoder.get(char)
            out.extend(char.encode("utf-8") if byte is None else (byte,))
        return bytes(out)


@functools.lru_cache(maxsize=8)
def token_bytes_of(tokenizer: Any) -> TokenBytes:
    """The one table of a tokenizer (mlx-lm's ``TokenizerWrapper``), built on first use."""
    return TokenBytes(tokenizer)


class TextStream:
    """The text of one sequence, one token at a time: ``add`` gives the token's piece, ``peek``
    the piece another token would have given in its place, ``finish`` what is still held (part
    of a character: U+FFFD, as ``decode`` with errors="replace" gives). Invariant: the pieces
    given so far, joined, are the text of the tokens added so far, less what is held."""

    def __init__(self, table: TokenBytes, trim_first_space: bool | None = None) -> None:
        self.table = table
        self.trim = table.trims_first_space if trim_first_space is None else trim_first_space
        self.started = False  # a piece of text has been given
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._tokens: list[int] = []  # naive tokenizers: the tokens since the last newline
        self._given = ""  # naive: what those tokens gave so far

    def add(self, token_id: int) -> str:
        if not self.table.exact:
            return self._add_naive(token_id)
        return self._start(self._decoder.decode(self.table(token_id)))

    def peek(self, token_id: int) -> str:
        """``add(token_id)``'s piece, leaving the stream as it is."""
        if not self.table.exact:
            text = self.table.tokenizer.decode([*self._tokens, token_id])
            return "" if text.endswith(_REPLACEMENT) else text[len(self._given):]
        state = self._decoder.getstate()
        piece = self._decoder.decode(self.table(token_id))
        self._decoder.setstate(state)
        return self._trimmed(piece) if not self.started else piece

    def finish(self) -> str:
        """What is held, flushed (the sequence ended)."""
        if not self.table.exact:
            text = self.table.tokenizer.decode(self._tokens) if self._tokens else ""
            self._tokens, held, self._given = [], text[len(self._given):], ""
            return self._start(held)
        return self._start(self._decoder.decode(b"", final=True))

    def _add_naive(self, token_id: int) -> str:
        self._tokens.append(token_id)
        text = self.table.tokenizer.decode(self._tokens)
        if text.endswith(_REPLACEMENT):  # part of a character: wait for the rest
            return ""
        piece = text[len(self._given):]
        self._given = text
        if text.endswith("\n"):  # a line is final: decode the next from scratch (linear cost)
            self._tokens, self._given = [], ""
        return self._start(piece)

    def _start(self, piece: str) -> str:
        if not self.started:
            piece = self._trimmed(piece)
            self.started = bool(piece)
        return piece

    def _trimmed(self, piece: str) -> str:
        return piece[1:] if self.trim and piece.startswith(" ") else piece


def text_pieces(table: TokenBytes, token_ids: Iterable[int], trim_first_space: bool | None = None) -> list[str]:
    """Each token's piece of the whole sequence's text, the last one with whatever was held."""
    stream = TextStream(table, trim_first_space)
    pieces = [stream.add(t) for t in token_ids]
    if pieces:
        pieces[-1] += stream.finish()
    return pieces


def decode_exactly(table: TokenBytes, token_ids: Sequence[int]) -> str:
    """The text of ``token_ids`` (the pieces joined)."""
    return "".join(text_pieces(table, token_ids))


# --- text to deltas ---

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


class Delta(msgspec.Struct, frozen=True):  # a msgspec struct: one a row a step
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
