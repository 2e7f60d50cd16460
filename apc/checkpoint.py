"""The checkpoint tier's keys and memory store: whole-row snapshots at chosen token counts.

For caches that cannot be cut at tile boundaries (sliding windows, recurrent state), the prefix
cache keeps the whole row as it was after exactly L tokens (the end of a system prompt, the end
of a prompt). Its key extends the block chain of ``apc.hashing`` with the partial last block and
the length, so it carries the same salts (layout stamp, model, ``cache_salt``):

    snapshot(L) = H("snapshot" | h_{L//G - 1} (or the root) | tokens[(L//G)*G : L] | L)

A lookup tries the snapshot lengths the store holds, longest first, never the whole prompt (the
last prompt token is always computed). Payloads are opaque, with their size; the store is a
least-recently-used map within what the KV budget leaves free (``headroom``) and an optional cap
(``budget_bytes``), and also compares the stored token ids on a hit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from apc.hashing import digest, token_bytes, block_keys


def snapshot_key(root: bytes, tokens: Sequence[int], block_size: int) -> bytes:
    """The key of a row's state after exactly ``tokens``."""
    chain = block_keys(tokens, block_size, root)
    previous = chain[-1].key if chain else root
    rest = tokens[len(chain) * block_size:]
    return digest(b"snapshot", previous, token_bytes(rest), len(tokens).to_bytes(8, "little"))


@dataclass
class _Snapshot:
    tokens: tuple[int, ...]
    payload: Any
    nbytes: int


@dataclass
class CheckpointStore:
    budget_bytes: int | None = None
    headroom: Callable[[], int] | None = None
    hits: int = 0
    evicted: int = 0
    bytes: int = 0
    _entries: OrderedDict[bytes, _Snapshot] = field(default_factory=OrderedDict)
    _lengths: dict[int, int] = field(default_factory=dict)  # snapshot length -> how many held

    def limit(self) -> int | None:
        """The most the store may hold now (None: no limit)."""
        limits = [self.budget_bytes] if self.budget_bytes is not None else []
        if self.headroom is not None:
            limits.append(self.bytes + self.headroom())
        return min(limits) if limits else None

    def put(self, root: bytes, tokens: Sequence[int], block_size: int, payload: Any, nbytes: int) -> bool:
        limit = self.limit()
        if (limit is not None and nbytes > limit) or not tokens:
            return False
        key = snapshot_key(root, tokens, block_size)
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        if limit is not None:
            self.evict_to(limit - nbytes)
        self._entries[key] = _Snapshot(tuple(int(t) for t in tokens), payload, nbytes)
        self._lengths[len(tokens)] = self._lengths.get(len(tokens), 0) + 1
        self.bytes += nbytes
        return True

    def longest(self, root: bytes, prompt: Sequence[int], block_size: int) -> tuple[int, Any] | None:
        """(length, payload) of the longest held snapshot that is a proper prefix of ``prompt``."""
        for length in sorted((n for n in self._lengths if n < len(prompt)), reverse=True):
            key = snapshot_key(root, prompt[:length], block_size)
            entry = self._entries.get(key)
            if entry is not None and entry.tokens == tuple(int(t) for t in prompt[:length]):
                self._entries.move_to_end(key)
                self.hits += 1
                return length, entry.payload
        return None

    def evict_to(self, target: int) -> int:
        """Evict least recently used snapshots until at most ``target`` bytes stay."""
        evicted = 0
        while self.bytes > max(target, 0) and self._entries:
            _, old = self._entries.popitem(last=False)
            self._forget(old)
            self.evicted += 1
            evicted += 1
        return evicted

    def _forget(self, entry: _Snapshot) -> None:
        self.bytes -= entry.nbytes
        count = self._lengths[len(entry.tokens)] - 1
        if count:
            self._lengths[len(entry.tokens)] = count
        else:
            del self._lengths[len(entry.tokens)]

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> int:
        released = self.bytes
        self._entries.clear()
        self._lengths.clear()
        self.bytes = 0
        return released
