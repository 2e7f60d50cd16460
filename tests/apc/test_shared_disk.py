"""One disk tier folder shared by several processes: writers, evictors and readers at once, a
writer killed mid-write, and the byte cap kept across processes (``apc.disk_usage``).

Blocks here are plain bytes whose content is a function of their key, so a reader can tell a right
block from a wrong one without the writer; every ``get`` must return exactly that content or a
miss. Processes are spawned (no MLX: the disk tier is pure Python).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import pathlib
import signal
import threading
import time
from pathlib import Path

from apc.disk_tier import SUFFIX, DiskTier, Part, decode
from apc.disk_usage import SharedUsage

STAMP = "shared"
BLOCK_BYTES = 32 * 1024
CAP = 40 * BLOCK_BYTES  # far fewer than the blocks written: evictions all the time


def block(i: int) -> tuple[bytes, tuple[int, ...], list[Part]]:
    key = hashlib.blake2b(f"block {i}".encode(), digest_size=16).digest()
    data = hashlib.shake_256(key).digest(BLOCK_BYTES)
    return key, tuple(range(i, i + 128)), [Part("record.0", "|u1", (BLOCK_BYTES,), data)]


def _worker(root: str, seed: int, rounds: int, result: mp.Queue, start: mp.Barrier) -> None:
    """Write blocks of its own range, read every block any process writes, check each hit. The
    processes start their rounds together and each lands its block before reading the others'
    latest, so they overlap however slowly they were spawned."""
    tier = DiskTier(Path(root), STAMP, CAP)
    hits = wrong = 0
    start.wait(120)
    for r in range(rounds):
        key, tokens, parts = block(seed * 1000 + r)
        tier.put(key, tokens, parts)
        tier.flush()
        for other in range(4):  # the other processes' latest blocks, and our own
            k, t, want = block(other * 1000 + max(r - 1, 0))
            got = tier.get(k, t)
            if got is not None:
                hits += 1
                wrong += bytes(got[0].data) != want[0].data
    tier.flush()
    tier.close()
    result.put((hits, wrong, tier.stats.bad_files, tier.stats.write_errors))


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*" + SUFFIX))


def test_concurrent_writers_evictors_and_readers_never_read_a_wrong_block(tmp_path):
    ctx = mp.get_context("spawn")
    result, start = ctx.Queue(), ctx.Barrier(4)
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), seed, 120, result, start)) for seed in range(4)]
    for p in procs:
        p.start()
    outcomes = [result.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sum(hits for hits, *_ in outcomes) > 0  # processes did read each other's blocks
    assert [(wrong, bad, errors) for _, wrong, bad, errors in outcomes] == [(0, 0, 0)] * 4
    folder = tmp_path / STAMP
    assert _folder_bytes(folder) <= CAP  # the cap held across the four writers
    for path in folder.glob("*" + SUFFIX):  # every file left is whole and right for its name
        blob = path.read_bytes()
        key = bytes.fromhex(path.stem)
        parts = decode(blob, STAMP, key, _tokens_of(blob))
        assert bytes(parts[0].data) == hashlib.shake_256(key).digest(BLOCK_BYTES)


def _tokens_of(blob: bytes) -> tuple[int, ...]:
    import json
    import struct

    from apc.disk_tier import MAGIC

    (length,) = struct.unpack_from("<I", blob, len(MAGIC))
    return tuple(json.loads(blob[len(MAGIC) + 4: len(MAGIC) + 4 + length])["tokens"])


def _writer_forever(root: str) -> None:
    tier = DiskTier(Path(root), STAMP, CAP)
    i = 0
    while True:
        key, tokens, parts = block(5000 + i)
        tier.put(key, tokens, parts)
        tier.flush()
        i += 1


def test_a_writer_killed_mid_write_leaves_only_whole_right_files(tmp_path):
    ctx = mp.get_context("spawn")
    for _ in range(3):
        proc = ctx.Process(target=_writer_forever, args=(str(tmp_path),))
        proc.start()
        deadline = time.monotonic() + 60
        while not any((tmp_path / STAMP).glob("*" + SUFFIX)) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    folder = tmp_path / STAMP
    survivor = DiskTier(tmp_path, STAMP, CAP)  # a replica (re)starting over what the crashes left
    try:
        assert not list(folder.glob("*.tmp"))  # temp files of dead writers on this host: removed
        assert _folder_bytes(folder) <= CAP
        files = list(folder.glob("*" + SUFFIX))
        assert files
        for path in files:
            key = bytes.fromhex(path.stem)
            got = survivor.get(key, _tokens_of(path.read_bytes()))
            assert got is not None and bytes(got[0].data) == hashlib.shake_256(key).digest(BLOCK_BYTES)
        assert survivor.stats.bytes == _folder_bytes(folder)  # the shared total, rescanned at start
    finally:
        survivor.close()


def test_a_block_another_process_wrote_is_found_and_its_removal_is_a_miss(tmp_path):
    writer, reader = DiskTier(tmp_path, STAMP, CAP), DiskTier(tmp_path, STAMP, CAP)
    try:
        key, tokens, parts = block(1)
        assert key not in reader
        writer.put(key, tokens, parts)
        writer.flush()
        assert key in reader and bytes(reader.get(key, tokens)[0].data) == parts[0].data
        (tmp_path / STAMP / (key.hex() + SUFFIX)).unlink()  # another process evicted it
        assert reader.get(key, tokens) is None
        assert reader.stats.bad_files == 0 and key not in reader
    finally:
        writer.close()
        reader.close()


def test_the_folder_is_never_over_its_cap_while_writers_of_other_tiers_are_mid_write(tmp_path):
    """Four tiers (each its own lock descriptor, as four processes have) write at once while a
    watcher, holding the folder's lock, sums the block files again and again: no sum passes the
    cap. A write whose bytes were counted before its file was in place would be missed by another
    writer's eviction scan, and the folder would pass the cap once it landed."""
    cap = 8 * BLOCK_BYTES
    tiers = [DiskTier(tmp_path, STAMP, cap) for _ in range(4)]
    watcher = SharedUsage(tmp_path / STAMP, SUFFIX)
    sums: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            with watcher.locked():
                sums.append(_folder_bytes(tmp_path / STAMP))

    def write(t: int) -> None:
        for i in range(60):
            key, tokens, parts = block(t * 1000 + i)
            tiers[t].put(key, tokens, parts)
        tiers[t].flush(120)

    looking = threading.Thread(target=watch)
    looking.start()
    writers = [threading.Thread(target=write, args=(t,)) for t in range(4)]
    try:
        for w in writers:
            w.start()
        for w in writers:
            w.join(120)
    finally:
        done.set()
        looking.join(30)
        watcher.close()
        for tier in tiers:
            tier.close()
    assert sum(tier.stats.writes for tier in tiers) == 240 and sum(tier.stats.evicted for tier in tiers) > 0
    assert len(sums) > 10 and max(sums) <= cap
    assert _folder_bytes(tmp_path / STAMP) <= cap
    assert all(tier.stats.bad_files == 0 and tier.stats.write_errors == 0 for tier in tiers)


def test_a_file_evicted_while_a_starting_tier_lists_the_folder_is_no_bad_file(tmp_path, monkeypatch):
    """A tier starting beside running ones lists the block files, then reads each header; a file
    another process evicted in between is gone, not bad: it is neither counted nor reported."""
    writer = DiskTier(tmp_path, STAMP, CAP)
    key, tokens, parts = block(1)
    writer.put(key, tokens, parts)
    writer.flush()
    writer.close()
    gone = tmp_path / STAMP / (block(2)[0].hex() + SUFFIX)  # listed, then evicted before it is read
    listing = pathlib.Path.glob

    def glob_then_evict(self, pattern):
        found = list(listing(self, pattern))
        return found + [gone] if pattern == "*" + SUFFIX else found

    monkeypatch.setattr(pathlib.Path, "glob", glob_then_evict)
    starting = DiskTier(tmp_path, STAMP, CAP)
    try:
        assert starting.stats.bad_files == 0
        assert key in starting and len(starting) == 1
    finally:
        starting.close()
