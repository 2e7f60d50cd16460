"""``PrefixCache``: the facade the engine uses. Keys (``apc.hashing``), the memory tier, the
disk tier and the checkpoint tier behind two pairs of calls:

- exact tier (caches whose rows cut at blocks of G tokens): ``lookup(tokens, salt)`` returns
  the payloads of the longest cached run of whole blocks (memory first, then the disk
  continues the chain; a disk hit is promoted to memory), never the block holding the last
  token; ``insert(chain, start, payloads)`` caches blocks ``start..`` of a chain made by
  ``chain(tokens, salt)``, in memory and (written behind) on disk;
- checkpoint tier (rows that cannot be cut: sliding windows, recurrent state):
  ``put_snapshot(tokens, salt, payload)`` / ``longest_snapshot(prompt, salt)``.

Payloads are ``apc.blocks.Payload``: opaque arrays with a kind, owned by the cache. Everything
here runs on the engine thread except the disk tier's writer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apc.blocks import Payload, payload_from_parts, payload_to_parts
from apc.checkpoint import CheckpointStore, snapshot_key
from apc.disk_tier import DiskTier
from apc.hashing import BlockKey, block_keys, prompt_keys, root_key
from apc.memory_tier import MemoryTier

logger = logging.getLogger(__name__)


@dataclass
class LookupStats:
    lookups: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    memory_hit_tokens: int = 0
    disk_hit_tokens: int = 0


class PrefixCache:
    def __init__(self, stamp: str, fingerprint: str, block_size: int, memory_bytes: int,
                 disk_dir: str | Path | None = None, disk_bytes: int = 0, tier: str = "exact") -> None:
        if tier not in ("exact", "checkpoint"):
            raise ValueError(f"unknown tier {tier!r}")
        self.stamp, self.fingerprint, self.block_size, self.tier = stamp, fingerprint, block_size, tier
        self.memory = MemoryTier(memory_bytes)
        self.checkpoints = CheckpointStore(memory_bytes)
        self.disk: DiskTier | None = None
        if disk_dir is not None:
            folder = Path(disk_dir) / ("blocks" if tier == "exact" else "snapshots")
            self.disk = DiskTier(folder, stamp, disk_bytes)
        self.stats = LookupStats()

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
    def lookup(self, tokens: Sequence[int], salt: str | None) -> tuple[list[BlockKey], list[Payload]]:
        """(keys, payloads) of the longest cached run of whole blocks that ``tokens`` (a prompt)
        may reuse: memory first, then the disk tier for the blocks after the memory hits."""
        chain = prompt_keys(tokens, self.block_size, self.root(salt))
        hits: list[Payload] = self.memory.lookup(chain)
        in_memory = len(hits)
        if self.disk is not None:
            for block in chain[len(hits):]:
                parts = self.disk.get(block.key, block.tokens)
                if parts is None:
                    break
                try:
                    payload = payload_from_parts(parts)
                except (ValueError, TypeError) as exc:  # parts that passed the checksum but do not decode
                    logger.warning("prefix cache: undecodable block %s (%s)", block.hex, exc)
                    break
                parent = chain[block.index - 1] if block.index else None
                self.memory.insert(block, parent, payload, payload.nbytes)
                hits.append(payload)
        self._count(len(tokens), in_memory * self.block_size, (len(hits) - in_memory) * self.block_size)
        return chain[: len(hits)], hits

    def insert(self, chain: Sequence[BlockKey], start: int, payloads: Sequence[Payload]) -> int:
        """Cache blocks ``start .. start + len(payloads) - 1`` of ``chain`` (memory, and disk if
        on). Returns how many the memory tier holds afterwards (a block whose parent was evicted
        is refused: it could never be reached)."""
        held = 0
        for offset, payload in enumerate(payloads):
            i = start + offset
            block, parent = chain[i], (chain[i - 1] if i else None)
            held += self.memory.insert(block, parent, payload, payload.nbytes)
            if self.disk is not None and self.disk.enabled and block.key not in self.disk:
                self.disk.put(block.key, block.tokens, payload_to_parts(payload))
        return held

    # --- checkpoint tier ---
    def put_snapshot(self, tokens: Sequence[int], salt: str | None, payload: Payload) -> bool:
        root = self.root(salt)
        held = self.checkpoints.put(root, tokens, self.block_size, payload, payload.nbytes)
        if self.disk is not None and self.disk.enabled:
            key = snapshot_key(root, tokens, self.block_size)
            if key not in self.disk:
                self.disk.put(key, tuple(int(t) for t in tokens), payload_to_parts(payload))
        return held

    def longest_snapshot(self, prompt: Sequence[int], salt: str | None) -> tuple[int, Payload] | None:
        """(length, payload) of the longest snapshot of a proper prefix of ``prompt``, from memory
        or (if longer there) from disk."""
        root = self.root(salt)
        found = self.checkpoints.longest(root, prompt, self.block_size)
        best = found[0] if found else 0
        source = "memory"
        if self.disk is not None:
            for length in sorted((n for n in self.disk.lengths() if best < n < len(prompt)), reverse=True):
                tokens = tuple(int(t) for t in prompt[:length])
                parts = self.disk.get(snapshot_key(root, tokens, self.block_size), tokens)
                if parts is None:
                    continue
                try:
                    payload = payload_from_parts(parts)
                except (ValueError, TypeError):
                    continue
                self.checkpoints.put(root, tokens, self.block_size, payload, payload.nbytes)
                found, source = (length, payload), "disk"
                break
        hit = found[0] if found else 0
        self._count(len(prompt), hit if source == "memory" else 0, hit if source == "disk" else 0)
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
        return self.memory.nbytes + self.checkpoints.bytes

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
            "memory": {"blocks": len(self.memory), "bytes": self.memory.nbytes, "budget_bytes": self.memory.budget_bytes,
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
        return released

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.flush()
            self.disk.close()
