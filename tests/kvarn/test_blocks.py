"""KVarN rows as prefix-cache blocks: block 0 = the float16 sink, block i = record i - 1; a row
rebuilt from its first n blocks is the original row at token n*G, byte for byte, and continues
identically."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvarn.cache import Block, KVarNKVCache
from kvarn.layout import KVLayout

H, D, G = 2, 128, 64
LAYOUT = KVLayout.kvarn("k4v2", tile_size=G)


def kv(rng: np.random.Generator, n: int) -> tuple[mx.array, mx.array]:
    return (mx.array(rng.standard_normal((1, H, n, D)).astype(np.float32)),
            mx.array(rng.standard_normal((1, H, n, D)).astype(np.float32)))


def state_bytes(cache: KVarNKVCache) -> list[bytes]:
    mx.eval(cache.state)
    return [np.array(a).tobytes() for a in cache.state]


def fed(keys: mx.array, values: mx.array, stop: int) -> KVarNKVCache:
    cache = KVarNKVCache(LAYOUT)
    cache.update_and_fetch(keys[:, :, :stop], values[:, :, :stop])
    return cache


def test_a_row_rebuilt_from_blocks_is_the_row_at_that_token():
    rng = np.random.default_rng(0)
    keys, values = kv(rng, 5 * G + 7)
    whole = fed(keys, values, 5 * G + 7)  # sink + 4 records + a 7-token tail: 5 whole blocks
    for count in range(1, 6):
        blocks = whole.blocks(count)
        assert [b.kind for b in blocks] == ["sink"] + ["record"] * (count - 1)
        restored = KVarNKVCache.from_blocks(LAYOUT, blocks)
        reference = fed(keys, values, count * G)
        assert (restored.offset, restored.records.num_tiles, restored.tail_len) == (count * G, count - 1, 0)
        assert state_bytes(restored)[4:] == state_bytes(reference)[4:]  # records
        assert state_bytes(restored)[:2] == state_bytes(reference)[:2]  # sink
        assert restored.nbytes == reference.nbytes
        # both continue identically (the tail buffer's unused slots never matter)
        more_k, more_v = kv(rng, 2 * G + 5)
        restored.update_and_fetch(more_k, more_v)
        reference.update_and_fetch(more_k, more_v)
        a, b = state_bytes(restored), state_bytes(reference)
        assert a[:2] == b[:2] and a[4:] == b[4:] and restored.tail_len == reference.tail_len == 5
        tail = restored.tail_len
        for x, y in zip(a[2:4], b[2:4]):  # the tails' valid tokens
            assert np.array_equal(np.frombuffer(x, np.float16).reshape(1, H, G, D)[:, :, :tail],
                                  np.frombuffer(y, np.float16).reshape(1, H, G, D)[:, :, :tail])


def test_blocks_share_the_rows_arrays():
    rng = np.random.default_rng(1)
    row = fed(*kv(rng, 3 * G), 3 * G)
    blocks = row.blocks(3)
    assert blocks[0].arrays[0] is row.sink_k and blocks[0].arrays[1] is row.sink_v
    assert sum(b.nbytes for b in blocks[1:]) == row.records.nbytes
    assert row.blocks(0) == []


@pytest.mark.parametrize("tokens,most", [(0, 0), (G - 1, 0), (G, 1), (2 * G - 1, 1), (2 * G, 2)])
def test_only_whole_blocks_can_be_taken(tokens, most):
    rng = np.random.default_rng(2)
    row = fed(*kv(rng, max(tokens, 1)), tokens) if tokens else KVarNKVCache(LAYOUT)
    assert len(row.blocks(most)) == most
    with pytest.raises(ValueError):
        row.blocks(most + 1)


def test_blocks_out_of_order_are_refused():
    rng = np.random.default_rng(3)
    blocks = fed(*kv(rng, 3 * G), 3 * G).blocks(3)
    for bad in ([], blocks[1:], [blocks[0], blocks[2]], [Block(0, "record", blocks[1].arrays)]):
        with pytest.raises(ValueError):
            KVarNKVCache.from_blocks(LAYOUT, bad)


def test_record_blocks_are_copies_equal_to_the_rows_records():
    rng = np.random.default_rng(5)
    row = fed(*kv(rng, 4 * G), 4 * G)
    shared, copied = row.blocks(4)[1:], row.record_blocks(1, 4)
    for a, b in zip(shared, copied):
        assert a.index == b.index and a.kind == b.kind == "record"
        assert all(x is not y and np.array_equal(np.array(x), np.array(y)) for x, y in zip(a.arrays, b.arrays))


def test_sink_block_is_a_float16_copy_of_the_sink():
    rng = np.random.default_rng(4)
    row = fed(*kv(rng, G + 5), G + 5)
    block = row.sink_block()
    assert block.index == 0 and block.kind == "sink"
    assert all(x.dtype == mx.float16 for x in block.arrays)
    assert np.array_equal(np.array(block.arrays[0]), np.array(row.sink_k.astype(mx.float16)))
    assert np.array_equal(np.array(block.arrays[1]), np.array(row.sink_v.astype(mx.float16)))
    with pytest.raises(ValueError):
        fed(*kv(rng, G - 1), G - 1).sink_block()  # the sink is not whole yet


@pytest.mark.parametrize("count", [1, 2, 4])
def test_a_row_restored_inside_its_first_chunk_continues_like_the_original(count):
    """Every chunk attends with decode's view, so a row restored from the blocks of its first
    chunk (sink and records) continues byte for byte as the row that took the prompt at once:
    the same sink, records and tail, and the same window for the next chunk's attention."""
    rng = np.random.default_rng(count)
    keys, values = kv(rng, 4 * G + 20)
    whole = fed(keys, values, 4 * G + 20)
    first = fed(keys, values, 4 * G + 20)
    restored = KVarNKVCache.from_blocks(LAYOUT, [first.sink_block()] + first.record_blocks(1, count))
    assert restored.offset == count * G and restored.chunk is None
    restored.update_and_fetch(keys[:, :, count * G:], values[:, :, count * G:])
    assert restored.offset == whole.offset and restored.chunk.start == count * G
    assert state_bytes(restored) == state_bytes(whole)
    with pytest.raises(ValueError):
        KVarNKVCache.from_blocks(LAYOUT, first.record_blocks(1, 2))  # block 0 must be the sink


