"""The memory tier: cached blocks by chained key, least-recently-used within a byte budget.

Payloads are ``apc.blocks.Payload`` copies (the fp16 and affine baselines, rows of models served
by the exact tier without a block pool): the tier owns them, so its byte count is what it
really holds. The tier keeps the block's token ids too and serves a block only if they equal the
asker's (a hash collision can never serve wrong tokens).

It is one of two memory tiers behind the same calls (``lookup``, ``insert``, ``load``, ``parts``,
``evict_to``, ``nbytes``, ``clear``); the other keeps KVarN blocks in the engine's block pool
itself (``apc/pool_tier.py``). Neither has a share of the KV budget of its own: the tier may
hold what running requests leave free (``headroom``), up to an optional cap (``budget_bytes``),
and admission evicts from it (``evict_to``) when a request needs the room.

Keys are chained, so a block is reachable only through its whole ancestry: eviction therefore
takes the least recently used *leaf* (a block no cached block continues), never a block whose
descendants would become unreachable garbage still holding bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from apc.blocks import Payload, payload_from_parts, payload_to_parts
from apc.disk_tier import Part
from apc.hashing import BlockKey


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    payload: Any
    nbytes: int
    parent: bytes | None
    children: int = 0


@dataclass
class TierStats:
    lookups: int = 0
    hit_blocks: int = 0
    inserted: int = 0
    evicted: int = 0
    refused: int = 0  # blocks larger than the whole budget, or whose parent is not cached
    bytes: int = 0


@dataclass
class MemoryTier:
    """``budget_bytes``: a cap on what the tier holds (None: none); ``headroom()``: the bytes the
    KV budget leaves free beyond what running requests hold and what the tier holds (None: no
    KV budget to share)."""

    budget_bytes: int | None = None
    headroom: Callable[[], int] | None = None
    stats: TierStats = field(default_factory=TierStats)

    def __post_init__(self) -> None:
        if self.budget_bytes is not None and self.budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    @property
    def nbytes(self) -> int:
        return self.stats.bytes

    def lookup(self, chain: Sequence[BlockKey]) -> list[Any]:
        """Payloads of the longest cached prefix of ``chain`` (block 0 first). The hit blocks
        become the most recently used, the shallowest most recent of all."""
        self.stats.lookups += 1
        hits = []
        for block in chain:
            entry = self._entries.get(block.key)
            if entry is None or entry.tokens != block.tokens:
                break
            hits.append(block.key)
        for key in reversed(hits):
            self._entries.move_to_end(key)
        self.stats.hit_blocks += len(hits)
        return [self._entries[key].payload for key in hits]

    def limit(self) -> int | None:
        """The most the tier may hold now (None: no limit)."""
        limits = [self.budget_bytes] if self.budget_bytes is not None else []
        if self.headroom is not None:
            limits.append(self.stats.bytes + self.headroom())
        return min(limits) if limits else None

    def insert(self, block: BlockKey, parent: BlockKey | None, payload: Any, nbytes: int | None = None) -> bool:
        """Cache ``block`` (``parent``: the block before it, None for block 0). Evicts least
        recently used leaves to stay within ``limit()``; refuses a block whose parent is not
        cached (it could never be reached) or that cannot fit. Returns whether it is cached."""
        nbytes = payload.nbytes if nbytes is None else nbytes
        if block.key in self._entries:
            self._entries.move_to_end(block.key)
            return True
        parent_key = parent.key if parent is not None else None
        limit = self.limit()
        if (parent_key is not None and parent_key not in self._entries) or (limit is not None and nbytes > limit):
            self.stats.refused += 1
            return False
        protected = {parent_key} if parent_key is not None else set()
        while limit is not None and self.stats.bytes + nbytes > limit:
            if not self._evict_one(protected):
                self.stats.refused += 1
                return False
        self._entries[block.key] = _Entry(block.tokens, payload, nbytes, parent_key)
        if parent_key is not None:
            self._entries[parent_key].children += 1
        self.stats.bytes += nbytes
        self.stats.inserted += 1
        return True

    def load(self, parent: BlockKey | None,
             blocks: Sequence[tuple[BlockKey, Sequence[Part]]]) -> tuple[int, bytes | None]:
        """Cache blocks read from disk (a chain's continuation after ``parent``), in order, up to
        the first that cannot be; returns how many are cached and the key of a block whose parts
        do not make a payload (its file is then removed), if that is what stopped it."""
        for count, (block, parts) in enumerate(blocks):
            try:
                payload = payload_from_parts(parts)
            except (ValueError, TypeError):  # parts that verified but do not make arrays
                return count, block.key
            if not self.insert(block, parent, payload):
                return count, None
            parent = block
        return len(blocks), None

    @staticmethod
    def parts(payload: Payload) -> list[Part]:
        """What the disk tier writes for a cached payload."""
        return payload_to_parts(payload)

    def evict_to(self, target: int) -> int:
        """Evict least recently used leaves until at most ``target`` bytes stay; returns how many."""
        evicted = 0
        while self.stats.bytes > max(target, 0) and self._evict_one(set()):
            evicted += 1
        return evicted

    def _evict_one(self, protected: set[bytes | None]) -> bool:
        victim = next((k for k, e in self._entries.items() if e.children == 0 and k not in protected), None)
        if victim is None:
            return False
        entry = self._entries.pop(victim)
        if entry.parent is not None and entry.parent in self._entries:
            self._entries[entry.parent].children -= 1
        self.stats.bytes -= entry.nbytes
        self.stats.evicted += 1
        return True

    def clear(self) -> int:
        """Drop everything; returns the bytes released."""
        released = self.stats.bytes
        self._entries.clear()
        self.stats.bytes = 0
        return released
