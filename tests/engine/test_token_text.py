"""Token bytes and text pieces on the bundled model's byte-level BPE vocabulary: every token's own
raw bytes (also part of a character), pieces that add up to the text, as the engine streams them."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from engine.engine import make_engine
from engine.kv_config import ApcConfig
from engine.request import Request, RequestId, SamplingParams
from engine.output import TextStream, decode_exactly, text_pieces, token_bytes_of
from tests.server.conftest import MODEL_DIR

MULTIBYTE = "héllo → 日本語 😀 naïve «ß» ✓"


@pytest.fixture(scope="module")
def table(loaded):
    return token_bytes_of(loaded.tokenizer)


def _gpt2_bytes() -> dict[str, int]:
    """GPT-2's byte alphabet written out independently of mlx-lm: printable bytes map to
    themselves, the others to U+0100 onwards in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def _valid(data: bytes) -> bool:
    try:
        data.decode()
        return True
    except UnicodeDecodeError:
        return False


def test_every_token_has_its_own_raw_bytes(table):
    """Each vocabulary entry's bytes, read from tokenizer.json with the GPT-2 alphabet (added
    tokens: their text), for all 8,192 tokens, partial characters included."""
    hf = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    alphabet, added = _gpt2_bytes(), {t.content for t in hf.get_added_tokens_decoder().values()}
    partial = 0
    for token_id in range(hf.get_vocab_size()):
        token = hf.id_to_token(token_id)
        expected = token.encode() if token in added else bytes(alphabet[c] for c in token)
        assert table(token_id) == expected, token_id
        try:
            expected.decode("utf-8")
        except UnicodeDecodeError:
            partial += 1
    assert table.exact and partial > 100  # the vocabulary has many tokens that are part of a character


def test_pieces_add_up_to_the_decoded_text(loaded, table):
    """For random token sequences (invalid UTF-8 included) the pieces join to exactly what the
    tokenizer's decode gives, and each piece is the characters its token completes."""
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.randrange(loaded.vocab_size) for _ in range(rng.randrange(1, 48))]
        assert "".join(text_pieces(table, ids)) == decode_exactly(table, ids) == loaded.tokenizer.decode(ids)
    ids = loaded.tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    pieces = text_pieces(table, ids)
    assert "".join(pieces) == MULTIBYTE
    assert b"".join(table(i) for i in ids) == MULTIBYTE.encode()
    for k in range(len(ids)):  # the pieces so far are the whole characters the tokens so far complete
        done = b"".join(table(i) for i in ids[:k + 1])
        cut = next(c for c in range(4) if _valid(done[:len(done) - c]))
        assert "".join(pieces[:k + 1]) == done[:len(done) - cut].decode()
    assert "" in pieces and "😀" in pieces


def test_peek_is_what_add_would_give(loaded, table):
    ids = loaded.tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    stream = TextStream(table)
    for token_id in ids:
        peeked = [stream.peek(t) for t in (token_id, 83, 5170)]
        assert stream.add(token_id) == peeked[0]
    assert stream.finish() == ""
    held = TextStream(table)
    assert held.add(ids[1]) == "" and held.finish() == "\ufffd"  # part of "é", flushed as decode does


def test_generated_entries_carry_pieces_that_add_up_to_the_text(loaded, table):
    """Through the engine: a completion forced through multi-byte characters (the prompt repeats
    them, greedy continues them); every entry's raw bytes are its token's, the pieces join to
    the emitted text, and alternatives carry their own bytes."""
    engine = make_engine(loaded, apc=ApcConfig(enabled=False))
    prompt = loaded.tokenizer.encode("日本語 日本語 日本語 日本語 日本", add_special_tokens=False)
    request = Request(RequestId("mb"), prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                              logprobs=True, top_logprobs=3))
    engine.add_request(request)
    text, entries = "", []
    while engine.has_work():
        for out in engine.step():
            text += out.text
            entries += out.logprobs
    assert [e.token_id for e in entries] == request.output_ids
    assert "".join(e.text for e in entries) == text == loaded.tokenizer.decode(request.output_ids)
    assert any(e.text == "" for e in entries)  # some generated token ended inside a character
    for entry in entries:
        assert entry.raw == table(entry.token_id)
        assert [raw for _, raw in entry.top_text] == [table(t) for t, _ in entry.top]
        if entry.top[0][0] == entry.token_id:  # greedy: the top alternative is the token, piece and all
            assert entry.top_text[0][0] == entry.text
