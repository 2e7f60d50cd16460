"""The memory tier: cached blocks by chained key, least-recently-used within a byte budget.

Payloads are opaque (for KVarN rows, ``kvarn.cache.Block``: the sink or one record, whose MLX
arrays are immutable and shared with the live rows that made them, never copied). The tier keeps
the block's token ids too and serves a block only if they equal the asker's (a hash collision
can never serve wrong tokens).

Keys are chained, so a block is reachable only through its whole ancestry: eviction therefore
takes the least recently used *leaf* (a block no cached block continues), never a block whose
descendants would become unreachable garbage still holding bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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
    budget_bytes: int
    stats: TierStats = field(default_factory=TierStats)

    def __post_init__(self) -> None:
        if self.budget_bytes < 0:
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

    def insert(self, block: BlockKey, parent: BlockKey | None, payload: Any, nbytes: int) -> bool:
        """Cache ``block`` (``parent``: the block before it, None for block 0). Evicts least
        recently used leaves to make room; refuses a block whose parent is not cached (it could
        never be reached) or that is larger than the whole budget. Returns whether it is cached."""
        if block.key in self._entries:
            self._entries.move_to_end(block.key)
            return True
        parent_key = parent.key if parent is not None else None
        if (parent_key is not None and parent_key not in self._entries) or nbytes > self.budget_bytes:
            self.stats.refused += 1
            return False
        protected = {parent_key} if parent_key is not None else set()
        while self.stats.bytes + nbytes > self.budget_bytes:
            if not self._evict_one(protected):
                self.stats.refused += 1
                return False
        self._entries[block.key] = _Entry(block.tokens, payload, nbytes, parent_key)
        if parent_key is not None:
            self._entries[parent_key].children += 1
        self.stats.bytes += nbytes
        self.stats.inserted += 1
        return True

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
