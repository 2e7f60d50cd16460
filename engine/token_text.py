"""What each token is and what it adds to a text: its raw bytes, and its piece of the text.

A sequence's text is the UTF-8 decoding of its tokens' raw bytes (added tokens, special ones
too, are their own text). A token that ends inside a multi-byte character adds nothing; the
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
``decode``. Pure Python: safe on any thread.
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Iterable, Sequence
from typing import Any

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, _byte_decoder

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
