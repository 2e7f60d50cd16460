"""Block ids for the KVarN pool (``kvarn.pool``): reference counts, a free queue of plain ids and
an LRU queue of cached (hashed) ones, as vLLM v1's block pool. Only ids and bookkeeping live
here; the arrays the ids index are the pool's."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any


class BlockAllocator:
    """Ids 1..capacity-1 (0 is the pad), reference counts, a free queue of plain ids and an LRU
    queue of *cached* ones (lazy eviction, as vLLM v1's block pool).

    Invariants: every id > 0 is exactly one of held (count > 0), plain free (no hash) or cached
    (count 0, hashed, findable by ``lookup``); a hashed block is in ``by_hash`` exactly while it
    has its hash. ``allocate`` hands out plain ids only; a cached block stays findable until it
    is evicted (``evict``: the least recently released first), which the pool does when it may
    not grow and the prefix cache does to keep its bytes within the KV budget."""

    def __init__(self, capacity: int = 1, lowest_first: bool = False, clock: Callable[[], int] | None = None) -> None:
        self.lowest_first = lowest_first  # hand out the lowest free id (ids without hashes: windows)
        self.capacity = max(capacity, 1)
        self.refs: list[int] = [0] * self.capacity
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, self.capacity))
        self.cached: OrderedDict[int, int] = OrderedDict()  # id -> release tick, least recent first
        self.hash_of: dict[int, Hashable] = {}
        self.by_hash: dict[Hashable, int] = {}
        self.meta_of: dict[int, Any] = {}  # what a hashed block holds (token ids), checked by its users
        self._clock = clock or counter()
        self.evicted = 0

    @property
    def num_held(self) -> int:
        return self.capacity - 1 - len(self.free) - len(self.cached)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def grow(self, capacity: int) -> None:
        """More ids, queued after the plain free ones."""
        if capacity <= self.capacity:
            return
        self.free.update((i, None) for i in range(self.capacity, capacity))
        self.refs += [0] * (capacity - self.capacity)
        self.capacity = capacity

    def shrink(self) -> int:
        """Drop the plain free ids above the highest id in use (held or cached), down to the pad
        alone; returns the new capacity. Ids in use are never moved."""
        capacity = self.capacity
        while capacity > 1 and capacity - 1 in self.free:
            capacity -= 1
        for block in range(capacity, self.capacity):
            del self.free[block]
        del self.refs[capacity:]
        self.capacity = capacity
        return capacity

    def allocate(self, n: int) -> list[int]:
        """``n`` plain ids with count 1 (lowest first or least recently freed first). The caller
        grows the allocator or evicts cached blocks first if fewer than ``n`` are free."""
        if n > len(self.free):
            raise MemoryError(f"{n} blocks asked, {len(self.free)} free")
        out = []
        for _ in range(n):
            if self.lowest_first:
                block = min(self.free)
                del self.free[block]
            else:
                block, _ = self.free.popitem(last=False)
            self.refs[block] = 1
            out.append(block)
        return out

    def incref(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if self.refs[block] == 0:  # a cached block comes back into use
                if block not in self.cached:
                    raise ValueError(f"block {block} is free")
                del self.cached[block]
            self.refs[block] += 1

    def decref(self, blocks: Sequence[int]) -> None:
        """Counts down; a block reaching 0 is cached (hashed) or plain free. Blocks are given in a
        row's order; they are released last-first so a row's tail blocks are evicted before its
        head (the head is what other prompts share, and a chain's later blocks are useless
        without its earlier ones)."""
        for block in reversed(blocks):
            if self.refs[block] <= 0:
                raise ValueError(f"block {block} is not held")
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.hash_of:
                    self.cached[block] = self._clock()
                else:
                    self.free[block] = None

    def set_hash(self, block: int, key: Hashable, meta: Any = None) -> bool:
        """Make a held block findable by ``key``; False if it has a hash already or another block
        holds ``key`` (the same content twice: this one stays plain)."""
        if self.refs[block] <= 0:
            raise ValueError(f"block {block} is not held")
        if block in self.hash_of or key in self.by_hash:
            return False
        self.hash_of[block] = key
        self.by_hash[key] = block
        self.meta_of[block] = meta
        return True

    def lookup(self, key: Hashable) -> int | None:
        """The block with this hash, if it still exists (held or cached); not counted."""
        return self.by_hash.get(key)

    def touch(self, block: int, key: Hashable) -> None:
        """A cached block that still has ``key`` becomes the most recently released."""
        if block in self.cached and self.hash_of.get(block) == key:
            self.cached[block] = self._clock()
            self.cached.move_to_end(block)

    def oldest_cached(self) -> tuple[int, int] | None:
        """(release tick, id) of the least recently released cached block."""
        if not self.cached:
            return None
        block, tick = next(iter(self.cached.items()))
        return tick, block

    def evict(self) -> int:
        """The least recently released cached block loses its hash and becomes plain free."""
        block, _ = self.cached.popitem(last=False)
        self._unhash(block)
        self.free[block] = None
        self.evicted += 1
        return block

    def drop_hashes(self) -> int:
        """Every block loses its hash (held ones stay held); returns how many cached blocks
        became plain free."""
        released = len(self.cached)
        for block in list(self.hash_of):
            self._unhash(block)
        self.free.update((block, None) for block in self.cached)
        self.cached.clear()
        return released

    def _unhash(self, block: int) -> None:
        key = self.hash_of.pop(block)
        del self.by_hash[key]
        self.meta_of.pop(block, None)


def counter() -> Callable[[], int]:
    ticks = itertools.count(1)
    return lambda: next(ticks)
