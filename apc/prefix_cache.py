"""``PrefixCache``: the facade the engine uses. Keys (``apc.hashing``), a memory tier, the disk
tier and the checkpoint tier behind a few calls:

- exact tier (caches whose rows cut at blocks of G tokens): ``lookup(tokens, salt)`` returns the
  keys and memory hits of the longest cached run of whole blocks, never the block holding the
  last token; where the chain continues on disk it starts reading those blocks on the disk
  tier's reader thread and answers ``PENDING`` (ask again once ``poll()`` has taken the read in:
  the blocks are then memory hits); ``insert(chain, start, items)`` caches blocks ``start..`` of
  a chain made by ``chain(tokens, salt)`` in memory and (written behind) on disk;
- checkpoint tier (rows that cannot be cut: sliding windows, recurrent state):
  ``put_snapshot(tokens, salt, payload)`` / ``longest_snapshot(prompt, salt)`` (``PENDING``
  likewise while a snapshot is read from disk).

The memory tier is one of two with the same calls: ``MemoryTier`` (payload copies: the fp16 and
affine baselines) or the engine's block-pool tier (KVarN blocks kept in the pool itself, shared
by reference count: ``apc/pool_tier.py``). ``record(...)`` counts a hit the engine took.
A cache made with ``events`` (exact tier) tells routers what it holds (``apc.events``): blocks
stored in memory (inserted, or read from disk) and written to disk, blocks evicted from either
tier (memory evictions are found once a step, by ``sync_events``), and a reset.
Everything here runs on the engine thread except the disk tier's reader and writer threads,
which never touch MLX.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apc.blocks import Payload, payload_from_parts, payload_to_parts
from apc.checkpoint import CheckpointStore, snapshot_key
from apc.disk_tier import DiskTier, Part
from apc.events import MEDIUM_DISK, MEDIUM_MEMORY, CacheEvents
from apc.hashing import BlockKey, block_keys, prompt_keys, root_key
from apc.memory_tier import MemoryTier

logger = logging.getLogger(__name__)


class _Pending:
    def __repr__(self) -> str:
        return "PENDING"


PENDING: Any = _Pending()  # a lookup whose answer is being read from disk: ask again after ``poll()``


@dataclass
class LookupStats:
    lookups: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    memory_hit_tokens: int = 0
    disk_hit_tokens: int = 0


class PrefixCache:
    def __init__(self, stamp: str, fingerprint: str, block_size: int, memory: Any = None,
                 disk_dir: str | Path | None = None, disk_bytes: int = 0, tier: str = "exact",
                 headroom: Callable[[], int] | None = None, *, events: CacheEvents | None = None) -> None:
        """``memory``: the exact tier's memory store, or a cap in bytes (None: no cap) for a
        ``MemoryTier`` of copies; the checkpoint store gets the same cap. ``headroom()``: the
        bytes the KV budget leaves for cached blocks (None: no KV budget to share). ``events``:
        where the exact tier's changes go from the start (None: nowhere); the checkpoint tier's
        snapshots are not blocks a router can index, so it takes none."""
        if tier not in ("exact", "checkpoint"):
            raise ValueError(f"unknown tier {tier!r}")
        if events is not None and tier != "exact":
            raise ValueError("KV events describe blocks: only the exact tier publishes them")
        self.stamp, self.fingerprint, self.block_size, self.tier = stamp, fingerprint, block_size, tier
        cap = memory if memory is None or isinstance(memory, int) else None
        self.memory = MemoryTier(cap, headroom) if cap is not None or memory is None else memory
        self.checkpoints = CheckpointStore(cap, headroom)
        self.disk: DiskTier | None = None
        if disk_dir is not None:
            folder = Path(disk_dir) / ("blocks" if tier == "exact" else "snapshots")
            self.disk = DiskTier(folder, stamp, disk_bytes)
            if events is not None:
                self.disk.on_written = lambda note: events.stored([note[0]], note[1], MEDIUM_DISK)
                self.disk.on_removed = lambda keys: events.removed(keys, MEDIUM_DISK)
        self.stats = LookupStats()
        self._done: queue.Queue[Callable[[], None]] = queue.Queue()  # finished reads, applied by ``poll``
        self._reading: set[bytes] = set()  # reads in flight, by the key they start at
        self._from_disk: set[bytes] = set()  # blocks loaded from disk and not yet counted as hits
        self.events = events
        self._published: set[bytes] = set()  # memory-tier blocks routers were told of
        self._evicted_seen = 0

    # --- keys ---
    def root(self, salt: str | None) -> bytes:
        return root_key(self.stamp, self.fingerprint, salt)

    def chain(self, tokens: Sequence[int], salt: str | None, known: Sequence[BlockKey] = ()) -> list[BlockKey]:
        """Keys of every whole block of ``tokens``, reusing ``known`` (keys of a prefix of them)."""
        G, known = self.block_size, list(known)
        count = len(tokens) // G
        if len(known) >= count:
            return known[:count]
        previous = known[-1].key if known else self.root(salt)
        rest = block_keys(tokens[len(known) * G: count * G], G, previous)
        return known + [BlockKey(len(known) + k.index, k.key, k.tokens) for k in rest]

    # --- exact tier ---
    def lookup(self, tokens: Sequence[int], salt: str | None, disk: bool = True,
               chain: Sequence[BlockKey] | None = None) -> tuple[list[BlockKey], list[Any]] | Any:
        """(keys, memory hits) of the longest cached run of whole blocks that ``tokens`` (a
        prompt) may reuse, or ``PENDING`` while the blocks after the memory hits are read from
        disk (started here if ``disk`` and the disk has the next one). Counts nothing:
        ``record`` counts the hit a request takes. ``chain``: the prompt's keys, if known."""
        chain = list(chain) if chain is not None else prompt_keys(tokens, self.block_size, self.root(salt))
        hits = self.memory.lookup(chain)
        rest = chain[len(hits):]
        if rest and self.disk is not None:
            if rest[0].key in self._reading:
                return PENDING
            if disk and self.disk.enabled and rest[0].key in self.disk:
                self._read_blocks(rest, chain[len(hits) - 1] if hits else None)
                return PENDING
        return chain[: len(hits)], hits

    def _read_blocks(self, blocks: list[BlockKey], parent: BlockKey | None) -> None:
        """Read ``blocks`` (a chain's continuation) on the reader thread, up to the first miss;
        ``poll`` then loads them into the memory tier."""
        start = blocks[0].key
        self._reading.add(start)
        disk = self.disk

        def job() -> None:
            read = disk.get_many([(block.key, block.tokens) for block in blocks])
            found: list[tuple[BlockKey, list[Part]]] = list(zip(blocks, read))
            self._done.put(lambda: self._load_blocks(start, parent, found))

        disk.submit(job)

    def _load_blocks(self, start: bytes, parent: BlockKey | None, found: list[tuple[BlockKey, list[Part]]]) -> None:
        self._reading.discard(start)
        loaded, bad = self.memory.load(parent, found)
        if bad is not None and self.disk is not None:  # verified, but not a block of this layout
            self.disk.discard_bad(bad)
        self._publish_stored([block for block, _ in found[:loaded]], parent)
        self._from_disk.update(block.key for block, _ in found[:loaded])

    def record(self, query_tokens: int, keys: Sequence[BlockKey], tail_tokens: int = 0) -> None:
        """Count one request's lookup and the hit it took (blocks loaded from disk for it count
        as disk hits; ``tail_tokens`` of a cached partial tile after them, memory hits)."""
        on_disk = sum(1 for k in keys if k.key in self._from_disk)
        self._from_disk.difference_update(k.key for k in keys)
        G = self.block_size
        self._count(query_tokens, (len(keys) - on_disk) * G + tail_tokens, on_disk * G)

    def insert(self, chain: Sequence[BlockKey], start: int, items: Sequence[Any]) -> int:
        """Cache blocks ``start .. start + len(items) - 1`` of ``chain`` (memory, and disk if
        on). Returns how many the memory tier holds afterwards (a block whose parent is not
        cached is refused: it could never be reached)."""
        held, stored = 0, []
        for offset, item in enumerate(items):
            i = start + offset
            block, parent = chain[i], (chain[i - 1] if i else None)
            cached = self.memory.insert(block, parent, item)
            held += cached
            if cached:
                stored.append(block)
            if cached and self.disk is not None and self.disk.enabled and block.key not in self.disk:
                self.disk.put(block.key, block.tokens, self.memory.parts(item), note=(block, parent))
        if stored:
            self._publish_stored(stored, chain[stored[0].index - 1] if stored[0].index else None)
        return held

    def _publish_stored(self, blocks: Sequence[BlockKey], parent: BlockKey | None) -> None:
        """Tell routers of memory-tier blocks (a chain's consecutive blocks after ``parent``) they
        were not told of yet."""
        if self.events is None or not blocks:
            return
        new = [b for b in blocks if b.key not in self._published]
        if not new:
            return
        first = blocks.index(new[0])
        run = list(blocks[first:])  # from the first new block on: one run of the chain
        self._published.update(b.key for b in run)
        self.events.stored(run, blocks[first - 1] if first else parent, MEDIUM_MEMORY)

    def sync_events(self) -> None:
        """Publish the memory tier's evictions since the last call (engine thread, once a step)."""
        if self.events is None:
            return
        evicted = self.memory.stats.evicted
        if evicted == self._evicted_seen and len(self.memory) >= len(self._published):
            return
        self._evicted_seen = evicted
        gone = [key for key in self._published if key not in self.memory]
        self._published.difference_update(gone)
        self.events.removed(gone, MEDIUM_MEMORY)

    # --- checkpoint tier ---
    def put_snapshot(self, tokens: Sequence[int], salt: str | None, payload: Payload) -> bool:
        root = self.root(salt)
        held = self.checkpoints.put(root, tokens, self.block_size, payload, payload.nbytes)
        if self.disk is not None and self.disk.enabled:
            key = snapshot_key(root, tokens, self.block_size)
            if key not in self.disk:
                self.disk.put(key, tuple(int(t) for t in tokens), payload_to_parts(payload))
        return held

    def longest_snapshot(self, prompt: Sequence[int], salt: str | None, disk: bool = True) -> tuple[int, Payload] | None | Any:
        """(length, payload) of the longest snapshot of a proper prefix of ``prompt`` in memory,
        or ``PENDING`` while a longer one is read from disk (started here if ``disk``)."""
        root = self.root(salt)
        found = self.checkpoints.longest(root, prompt, self.block_size)
        best = found[0] if found else 0
        if self.disk is not None:
            longer = sorted((n for n in self.disk.lengths() if best < n < len(prompt)), reverse=True)
            # only lengths whose file is this prompt's (another prompt's or salt's is no reason to wait)
            longer = [n for n in longer if snapshot_key(root, prompt[:n], self.block_size) in self.disk]
            if longer:
                first = snapshot_key(root, prompt[:longer[0]], self.block_size)
                if first in self._reading:
                    return PENDING
                if disk and self.disk.enabled:
                    self._read_snapshot(root, prompt, longer, first)
                    return PENDING
        return found

    def _read_snapshot(self, root: bytes, prompt: Sequence[int], lengths: list[int], ident: bytes) -> None:
        self._reading.add(ident)
        disk, G = self.disk, self.block_size
        candidates = [(tuple(int(t) for t in prompt[:n]), snapshot_key(root, prompt[:n], G)) for n in lengths]

        def job() -> None:
            got = None
            for tokens, key in candidates:
                parts = disk.get(key, tokens)
                if parts is not None:
                    got = (tokens, key, parts)
                    break
            self._done.put(lambda: self._load_snapshot(ident, root, got))

        disk.submit(job)

    def _load_snapshot(self, ident: bytes, root: bytes, got: tuple | None) -> None:
        self._reading.discard(ident)
        if got is None:
            return
        tokens, key, parts = got
        try:
            payload = payload_from_parts(parts)
        except (ValueError, TypeError):
            self.disk.discard_bad(key)
            return
        if self.checkpoints.put(root, tokens, self.block_size, payload, payload.nbytes):
            self._from_disk.add(key)

    def record_snapshot(self, query_tokens: int, root: bytes, tokens: Sequence[int] | None) -> None:
        """Count one request's snapshot lookup and the hit it took (``tokens``: the snapshot's)."""
        if tokens is None:
            self._count(query_tokens, 0, 0)
            return
        key = snapshot_key(root, tokens, self.block_size)
        on_disk = key in self._from_disk
        self._from_disk.discard(key)
        self._count(query_tokens, 0 if on_disk else len(tokens), len(tokens) if on_disk else 0)

    # --- reads in flight ---
    @property
    def reading(self) -> bool:
        return bool(self._reading)

    def poll(self) -> int:
        """Take finished disk reads into memory (engine thread); returns how many."""
        taken = 0
        while True:
            try:
                apply = self._done.get_nowait()
            except queue.Empty:
                return taken
            apply()
            taken += 1

    def wait(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for a read in flight to finish, then ``poll``."""
        if self._reading:
            try:
                apply = self._done.get(timeout=timeout)
            except queue.Empty:
                return 0
            apply()
            return 1 + self.poll()
        return self.poll()

    def lookup_now(self, tokens: Sequence[int], salt: str | None) -> tuple[list[BlockKey], list[Any]]:
        """``lookup`` that waits for its disk reads (tests, benchmarks), counted as one lookup."""
        found = self.lookup(tokens, salt)
        while found is PENDING:
            self.wait(30.0)
            found = self.lookup(tokens, salt, disk=False)
        self.record(len(tokens), found[0])
        return found

    def longest_snapshot_now(self, prompt: Sequence[int], salt: str | None) -> tuple[int, Payload] | None:
        found = self.longest_snapshot(prompt, salt)
        while found is PENDING:
            self.wait(30.0)
            found = self.longest_snapshot(prompt, salt, disk=False)
        self.record_snapshot(len(prompt), self.root(salt), prompt[: found[0]] if found else None)
        return found

    # --- upkeep ---
    def _count(self, query: int, memory_hit: int, disk_hit: int) -> None:
        s = self.stats
        s.lookups += 1
        s.query_tokens += query
        s.memory_hit_tokens += memory_hit
        s.disk_hit_tokens += disk_hit
        s.hit_tokens += memory_hit + disk_hit

    @property
    def memory_bytes(self) -> int:
        """Bytes the cache keeps in memory that no running request holds (what it may evict)."""
        return self.memory.nbytes + self.checkpoints.bytes

    def evict_to(self, target: int) -> int:
        """Evict until the cache keeps at most ``target`` bytes in memory (admission makes room)."""
        evicted = self.checkpoints.evict_to(target - self.memory.nbytes)
        return evicted + self.memory.evict_to(target - self.checkpoints.bytes)

    @property
    def memory_cap(self) -> int | None:
        return self.checkpoints.budget_bytes if self.tier == "checkpoint" else self.memory.budget_bytes

    def describe(self) -> dict[str, Any]:
        s, m = self.stats, self.memory.stats
        disk = None
        if self.disk is not None:
            d = self.disk.stats
            disk = {"enabled": self.disk.enabled, "dir": str(self.disk.folder), "files": len(self.disk),
                    "bytes": d.bytes, "cap_bytes": self.disk.cap_bytes, "reads": d.reads, "hits": d.hits,
                    "writes": d.writes, "evicted": d.evicted, "bad_files": d.bad_files,
                    "write_errors": d.write_errors}
        return {
            "enabled": True, "tier": self.tier, "block_size": self.block_size, "stamp": self.stamp,
            "lookups": s.lookups, "query_tokens": s.query_tokens, "hit_tokens": s.hit_tokens,
            "memory_hit_tokens": s.memory_hit_tokens, "disk_hit_tokens": s.disk_hit_tokens,
            "hit_rate": s.hit_tokens / s.query_tokens if s.query_tokens else 0.0,
            "memory": {"blocks": len(self.memory), "bytes": self.memory.nbytes, "cap_bytes": self.memory_cap,
                       "inserted": m.inserted, "evicted": m.evicted, "refused": m.refused, "hit_blocks": m.hit_blocks},
            "checkpoints": {"snapshots": len(self.checkpoints), "bytes": self.checkpoints.bytes,
                            "hits": self.checkpoints.hits, "evicted": self.checkpoints.evicted},
            "disk": disk,
        }

    def reset(self) -> dict[str, int]:
        """Drop everything cached, in memory and on disk; returns the bytes released per tier."""
        released = {"memory_bytes": self.memory.clear() + self.checkpoints.clear(), "disk_bytes": 0}
        if self.disk is not None:
            released["disk_bytes"] = self.disk.clear()
        if self.events is not None:
            self._published.clear()
            self.events.cleared()
        return released

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.flush()
            self.disk.close()
