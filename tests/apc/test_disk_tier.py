"""apc.disk_tier: written behind, atomic, owner-only, verified on every read (truncated,
bit-flipped, wrong-stamp and half-written files are misses, removed and counted), re-indexed
at start, LRU within a byte cap, and off with one warning when the disk fails."""

from __future__ import annotations

import errno
import logging
import os
import stat
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

from apc.blocks import from_parts, to_parts
from apc.disk_tier import DiskTier, Part
from apc.hashing import block_keys, root_key
from apc.pool_tier import PoolTier
from kvarn.layout import KVLayout
from kvarn.paged import PagedRow, single_tile
from kvarn.pool import RECORD_FIELDS, KVarNPool

G = 64
LAYOUT = KVLayout.kvarn("k4v2", tile_size=G)


@dataclass(frozen=True)
class Block:
    """One prefix-cache block of a KVarN row as the disk tier stores it: the float16 sink, or a
    record in the single-tile format."""

    kind: str
    arrays: tuple[mx.array, ...]


def blocks_of_a_row(n_blocks: int = 3):
    """A row of n_blocks * G tokens in a pool of its own, its blocks and their keys."""
    rng = np.random.default_rng(0)
    k = mx.array(rng.standard_normal((1, 2, n_blocks * G, 128)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, 2, n_blocks * G, 128)).astype(np.float32))
    pool = KVarNPool(LAYOUT, 1)
    row = PagedRow(pool, [0])
    row.layers[0].update_and_fetch(k, v)
    a, s = pool.layers[0], row.slot
    blocks = [Block("sink", (a.win_k[s: s + 1, :, :G].astype(mx.float16), a.win_v[s: s + 1, :, :G].astype(mx.float16)))]
    if n_blocks > 1:
        fields = pool.gather_records(0, mx.array(row.table[: n_blocks - 1], dtype=mx.int32))
        blocks += [Block("record", single_tile({name: x[i] for name, x in fields.items()}))
                   for i in range(n_blocks - 1)]
    tokens = list(range(1000, 1000 + n_blocks * G))
    return row, blocks, block_keys(tokens, G, root_key("stamp", "model"))


def same(x: mx.array, y: mx.array) -> bool:
    x, y = np.array(x), np.array(y)
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def parts_equal(a: list[Part], b: list[Part]) -> bool:
    return [(p.name, p.dtype, p.shape, p.data) for p in a] == [(p.name, p.dtype, p.shape, p.data) for p in b]


@pytest.fixture
def tier(tmp_path):
    t = DiskTier(tmp_path, "stamp", cap_bytes=10 * 2**20)
    yield t
    t.close()


def test_round_trip_permissions_and_restart(tmp_path, tier):
    row, blocks, keys = blocks_of_a_row()
    for block, key in zip(blocks, keys):
        tier.put(key.key, key.tokens, to_parts(block.kind, block.arrays))
    tier.flush()
    assert tier.stats.writes == 3 and len(tier) == 3
    folder = tmp_path / "stamp"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in folder.iterdir())
    restarted = DiskTier(tmp_path, "stamp", cap_bytes=10 * 2**20)  # a fresh process: the index is rebuilt
    try:
        assert len(restarted) == 3 and restarted.stats.bytes == tier.stats.bytes
        got = [restarted.get(k.key, k.tokens) for k in keys]
        assert all(parts_equal(g, to_parts(b.kind, b.arrays)) for g, b in zip(got, blocks))
        kinds_arrays = [from_parts(p) for p in got]
        assert [kind for kind, _ in kinds_arrays] == ["sink", "record", "record"]
        for (_, arrays), block in zip(kinds_arrays, blocks):
            assert len(arrays) == len(block.arrays) and all(same(x, y) for x, y in zip(arrays, block.arrays))
        # the blocks read back rebuild the row in a fresh pool, byte for byte
        pool = KVarNPool(LAYOUT, 1)
        memory = PoolTier(pool)
        assert memory.load(None, list(zip(keys, got))) == (3, None)
        rebuilt = PagedRow(pool, [0])
        memory.adopt(memory.pin(memory.lookup(keys)), rebuilt)
        view, original = rebuilt.layers[0], row.layers[0]
        assert (view.offset, view.num_tiles, view.tail_len) == (original.offset, original.num_tiles, 0) == (3 * G, 2, 0)
        assert same(pool.layers[0].win_k[rebuilt.slot, :, :G], row.pool.layers[0].win_k[row.slot, :, :G])
        assert same(pool.layers[0].win_v[rebuilt.slot, :, :G], row.pool.layers[0].win_v[row.slot, :, :G])
        mine = pool.gather_records(0, mx.array(rebuilt.table, dtype=mx.int32))
        theirs = row.pool.gather_records(0, mx.array(row.table, dtype=mx.int32))
        assert all(same(mine[name], theirs[name]) for name in RECORD_FIELDS)
    finally:
        restarted.close()


def corrupt(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "bit-flip":
        data[-10] ^= 0x04
        path.write_bytes(bytes(data))
    elif how == "garbage":
        path.write_bytes(b"not a block file")


@pytest.mark.parametrize("how", ["truncated", "bit-flip", "garbage"])
def test_bad_files_are_misses_removed_and_counted(tmp_path, tier, how):
    _, blocks, keys = blocks_of_a_row(1)
    tier.put(keys[0].key, keys[0].tokens, to_parts(blocks[0].kind, blocks[0].arrays))
    tier.flush()
    path = tmp_path / "stamp" / (keys[0].hex + ".blk")
    corrupt(path, how)
    assert tier.get(keys[0].key, keys[0].tokens) is None
    assert not path.exists() and tier.stats.bad_files == 1 and keys[0].key not in tier


def test_wrong_stamp_other_tokens_and_half_written_files(tmp_path, tier):
    _, blocks, keys = blocks_of_a_row(2)
    for block, key in zip(blocks, keys):
        tier.put(key.key, key.tokens, to_parts(block.kind, block.arrays))
    tier.flush()
    # a file of another layout copied under this stamp: removed when the index is rebuilt
    other = DiskTier(tmp_path, "other-stamp", cap_bytes=2**20)
    other.put(keys[0].key, keys[0].tokens, to_parts(blocks[0].kind, blocks[0].arrays))
    other.flush()
    other.close()
    moved = tmp_path / "stamp" / "00112233445566778899aabbccddeeff.blk"
    os.replace(tmp_path / "other-stamp" / (keys[0].hex + ".blk"), moved)
    (tmp_path / "stamp" / "ffff.tmp").write_bytes(b"half")  # a write cut short
    restarted = DiskTier(tmp_path, "stamp", cap_bytes=10 * 2**20)
    try:
        assert not moved.exists() and not (tmp_path / "stamp" / "ffff.tmp").exists()
        assert restarted.stats.bad_files == 2 and len(restarted) == 2
        # same key asked with other tokens: never served
        assert restarted.get(keys[1].key, tuple(range(G))) is None and restarted.stats.bad_files == 3
        assert restarted.get(keys[0].key, keys[0].tokens) is not None
    finally:
        restarted.close()


def test_lru_keeps_the_folder_under_its_cap(tmp_path):
    _, blocks, keys = blocks_of_a_row(3)
    records = [(key, to_parts(block.kind, block.arrays)) for block, key in zip(blocks[1:], keys[1:])]
    probe = DiskTier(tmp_path, "probe", cap_bytes=10 * 2**20)
    probe.put(records[0][0].key, records[0][0].tokens, records[0][1])
    probe.flush()
    file_bytes = probe.stats.bytes  # one record block's file
    probe.close()
    tier = DiskTier(tmp_path, "stamp", cap_bytes=file_bytes + file_bytes // 2)  # room for one file
    try:
        for key, parts in records:
            tier.put(key.key, key.tokens, parts)
            tier.flush()
            assert tier.stats.bytes <= tier.cap_bytes
        assert len(tier) == 1 and tier.stats.evicted == 1
        assert keys[2].key in tier and keys[1].key not in tier  # the older one went
    finally:
        tier.close()
    tiny = DiskTier(tmp_path, "tiny", cap_bytes=file_bytes // 2)  # a file larger than the cap is not written
    try:
        tiny.put(records[0][0].key, records[0][0].tokens, records[0][1])
        tiny.flush()
        assert len(tiny) == 0 and tiny.stats.writes == 0
    finally:
        tiny.close()


def test_a_failing_disk_turns_the_tier_off_with_one_warning(tmp_path, monkeypatch, caplog):
    _, blocks, keys = blocks_of_a_row(2)
    tier = DiskTier(tmp_path, "stamp", cap_bytes=10 * 2**20)
    real_open = os.open

    def full(path, *args, **kwargs):
        if str(path).endswith(".tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", full)
    with caplog.at_level(logging.WARNING, logger="apc.disk_tier"):
        for block, key in zip(blocks, keys):
            tier.put(key.key, key.tokens, to_parts(block.kind, block.arrays))
        tier.flush()
    tier.close()
    assert not tier.enabled and tier.stats.write_errors == 1 and len(tier) == 0
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1 and len(caplog.records) == 1
    assert list((tmp_path / "stamp").glob("*.tmp")) == []
    # a folder that cannot be made (a file is in the way): off from the start, memory only
    blocker = tmp_path / "file"
    blocker.write_text("x")
    off = DiskTier(blocker, "stamp", cap_bytes=2**20)
    assert not off.enabled and off.get(keys[0].key, keys[0].tokens) is None
    off.close()


def test_a_flip_of_any_byte_header_included_is_a_miss_removed_and_counted(tmp_path, tier):
    """The digest covers the whole file: one flipped bit at any of ~120 positions spread over the
    magic, the section lengths, the JSON header (stamp, key, tokens) and layout (dtypes, shapes,
    offsets), the payload and the digest itself is a miss, the file is removed and counted, and
    nothing raises."""
    _, blocks, keys = blocks_of_a_row(1)
    parts = to_parts(blocks[0].kind, blocks[0].arrays)
    tier.put(keys[0].key, keys[0].tokens, parts)
    tier.flush()
    path = tmp_path / "stamp" / (keys[0].hex + ".blk")
    pristine = path.read_bytes()
    header_end = pristine.index(b"}]") + 2  # the end of the layout section (the header before it ends "]}")
    positions = sorted({*range(0, 14), *range(14, header_end, max(header_end // 60, 1)), header_end - 1,
                        *range(header_end, len(pristine), max((len(pristine) - header_end) // 40, 1)),
                        *range(len(pristine) - 16, len(pristine))})
    assert len(positions) > 100
    for n, pos in enumerate(positions):
        for bit in (0x01, 0x80):
            blob = bytearray(pristine)
            blob[pos] ^= bit
            path.write_bytes(bytes(blob))
            with tier._lock:  # as if indexed: the read must find the damage itself
                tier._index[keys[0].key] = (len(blob), 0.0)
            assert tier.get(keys[0].key, keys[0].tokens) is None, pos
            assert not path.exists()
    assert tier.stats.bad_files == 2 * len(positions)
    path.write_bytes(pristine)
    with tier._lock:
        tier._index[keys[0].key] = (len(pristine), 0.0)
    assert parts_equal(tier.get(keys[0].key, keys[0].tokens), parts)  # the intact file still reads


def test_a_consistent_but_wrong_header_is_a_miss(tmp_path, tier):
    """Headers are validated field by field even when the digest matches (a file written by
    something else, or by a later format): shapes that disagree with a part's bytes, a missing
    key, an unknown dtype, another format version, a payload longer than its parts."""
    import json
    import struct

    from apc.disk_tier import DIGEST, MAGIC, VERSION, digest

    _, blocks, keys = blocks_of_a_row(1)
    parts = to_parts(blocks[0].kind, blocks[0].arrays)
    tier.put(keys[0].key, keys[0].tokens, parts)
    tier.flush()
    path = tmp_path / "stamp" / (keys[0].hex + ".blk")
    blob = path.read_bytes()
    (length,) = struct.unpack_from("<I", blob, len(MAGIC))
    start = len(MAGIC) + 4
    header, at = json.loads(blob[start: start + length]), start + length
    (n,) = struct.unpack_from("<I", blob, at)
    layout, payload = json.loads(blob[at + 4: at + 4 + n]), blob[at + 4 + n: -DIGEST]

    def rewritten(edit, extra: bytes = b"") -> bytes:
        h = {"header": json.loads(json.dumps(header)), "parts": json.loads(json.dumps(layout))}
        edit(h)
        text, parts_text = json.dumps(h["header"]).encode(), json.dumps(h["parts"]).encode()
        body = (MAGIC + struct.pack("<I", len(text)) + text + struct.pack("<I", len(parts_text)) + parts_text
                + payload + extra)
        return body + digest(body)

    edits = {
        "reversed shape": lambda h: h["parts"][0].update(shape=h["parts"][0]["shape"][::-1] + [2]),
        "renamed field": lambda h: h["parts"][0].update(size=h["parts"][0].pop("nbytes")),
        "unknown dtype": lambda h: h["parts"][0].update(dtype="<f8"),
        "other version": lambda h: h["header"].update(version=VERSION + 1),
        "no tokens": lambda h: h["header"].pop("tokens"),
        "overlapping parts": lambda h: h["parts"][1].update(offset=0),
        "layout not a list": lambda h: h.update(parts={"parts": h["parts"]}),
    }
    for name, edit in edits.items():
        path.write_bytes(rewritten(edit))
        with tier._lock:
            tier._index[keys[0].key] = (1, 0.0)
        assert tier.get(keys[0].key, keys[0].tokens) is None, name
        assert not path.exists(), name
    path.write_bytes(rewritten(lambda h: None, extra=b"\0" * 8))  # bytes no part accounts for
    with tier._lock:
        tier._index[keys[0].key] = (1, 0.0)
    assert tier.get(keys[0].key, keys[0].tokens) is None and tier.stats.bad_files == len(edits) + 1


def test_get_many_reads_a_chain_in_order_up_to_its_first_miss(tmp_path, tier):
    """A chain's files are read concurrently but taken in order: a damaged file ends the hit
    (removed and counted), the files after it are neither counted nor touched, a key without a
    file ends it without a read."""
    _, blocks, keys = blocks_of_a_row(4)
    for block, key in zip(blocks, keys):
        tier.put(key.key, key.tokens, to_parts(block.kind, block.arrays))
    tier.flush()
    wanted = [(k.key, k.tokens) for k in keys]
    got = tier.get_many(wanted)
    assert len(got) == 4 and tier.stats.reads == 4 and tier.stats.hits == 4
    assert all(parts_equal(g, to_parts(b.kind, b.arrays)) for g, b in zip(got, blocks))
    last = tmp_path / "stamp" / (keys[3].hex + ".blk")
    os.utime(last, (1.0, 1.0))
    corrupt(tmp_path / "stamp" / (keys[2].hex + ".blk"), "bit-flip")
    got = tier.get_many(wanted)
    assert len(got) == 2 and tier.stats.reads == 4 + 3 and tier.stats.hits == 4 + 2
    assert tier.stats.bad_files == 1 and keys[2].key not in tier and keys[3].key in tier
    assert last.stat().st_mtime == 1.0  # read, but after the miss: not touched
    assert tier.get_many([wanted[0], (b"\0" * 16, keys[1].tokens), wanted[1]]) == got[:1]
    assert tier.stats.reads == 7 + 1


def test_a_file_of_an_older_format_is_a_miss(tmp_path, tier):
    """Format 3 (the layout inside the header) and format 2 (BLAKE2b digest), each with its own
    magic, are not read by format 4: a miss, removed, counted."""
    import hashlib
    import json
    import struct

    from apc.disk_tier import DIGEST, MAGIC

    _, blocks, keys = blocks_of_a_row(1)
    tier.put(keys[0].key, keys[0].tokens, to_parts(blocks[0].kind, blocks[0].arrays))
    tier.flush()
    path = tmp_path / "stamp" / (keys[0].hex + ".blk")
    blob = path.read_bytes()
    (length,) = struct.unpack_from("<I", blob, len(MAGIC))
    start = len(MAGIC) + 4
    header, at = json.loads(blob[start: start + length]), start + length
    (n,) = struct.unpack_from("<I", blob, at)
    old = json.dumps(header | {"version": 3, "parts": json.loads(blob[at + 4: at + 4 + n])}).encode()
    body = b"KVARNAPC3\n" + struct.pack("<I", len(old)) + old + blob[at + 4 + n: -DIGEST]
    path.write_bytes(body + hashlib.sha256(body).digest()[:DIGEST])
    assert tier.get(keys[0].key, keys[0].tokens) is None and not path.exists() and tier.stats.bad_files == 1
    tier.put(keys[0].key, keys[0].tokens, to_parts(blocks[0].kind, blocks[0].arrays))
    tier.flush()
    body = b"KVARNAPC2\n" + path.read_bytes()[len(MAGIC): -DIGEST]
    path.write_bytes(body + hashlib.blake2b(body, digest_size=DIGEST).digest())
    with tier._lock:
        tier._index[keys[0].key] = (1, 0.0)
    assert tier.get(keys[0].key, keys[0].tokens) is None and not path.exists() and tier.stats.bad_files == 2
