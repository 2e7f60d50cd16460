"""The prefix cache's memory tier for KVarN rows in the block pool: the pool's hashed blocks *are*
the cache.

    block 0 (the float16 sink)   a cached sink: ``KVarNPool.sinks``, one copy of a row's sink
    block i >= 1 (record i - 1)  the pool's record block itself: ``KVarNPool.records``

- **Insert** (after a step): a row's record block gets the block's key (``set_hash``: nothing is
  copied; the row keeps holding it); a row's sink is copied once into a sink block, which the
  cache alone holds. When rows let go of hashed blocks they stay in the pool, cached, until
  evicted (least recently released first).
- **Lookup / pin**: the longest run of cached blocks whose token ids match; the engine pins a
  hit (reference counts) from admission on, and the new row's table takes the record blocks
  as they are: N requests sharing a prompt hold its blocks once. The sink is copied into the
  row's window (rows read their sink and tail as one window).
- **Bytes**: ``nbytes`` counts the blocks only the cache keeps (count 0); they live in what the KV
  budget leaves free (``headroom``, up to an optional cap) and admission evicts them
  (``evict_to``) when a request needs the room. Held blocks are the rows' (``engine/scheduler.py``).
- **Disk**: ``parts`` reads a block out of the pool for the disk tier's writer (the same block
  format: the sink's float16 keys and values, or a record's fields with the unit axes of a
  one-tile row, ``kvarn.paged.single_tile``, per layer); ``load`` writes a block read from disk into a free pool block.

Engine thread only (it makes MLX arrays)."""

from __future__ import annotations

import hashlib

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from apc.blocks import host_arrays, to_parts
from apc.disk_tier import Part
from apc.hashing import BlockKey
from apc.memory_tier import TierStats
from kvarn.paged import PagedRow, block_major, single_tile, single_tile_shapes
from kvarn.pool import KVarNPool

_WIDTH = {"sink": 2, "record": 8}  # arrays per layer of a block's disk payload


_MX_DTYPES = {np.dtype(np.uint32): mx.uint32, np.dtype(np.float16): mx.float16}  # a record's (``_fits``)


def _stacked_fields(blocks: Sequence[Sequence[Part]], first: Sequence[np.ndarray]) -> list[mx.array]:
    """Each part of ``blocks`` (every block with the part layout of the first, whose arrays are
    ``first``) stacked over the blocks, ``[n, *shape[1:]]`` a part: the payloads joined on the
    host and sent to the device as one array, each part a column range of it there (one transfer
    however many parts: making an MLX array from a host array costs ~0.15 ms on the H200's host)."""
    n = len(blocks)
    host = np.frombuffer(b"".join(p.data for parts in blocks for p in parts), dtype=np.uint8).reshape(n, -1)
    device = mx.array(host)
    out, start = [], 0
    for a in first:
        column = mx.contiguous(device[:, start: start + a.nbytes])
        out.append(column.view(_MX_DTYPES[a.dtype]).reshape((n,) + a.shape[1:]))
        start += a.nbytes
    return out


@dataclass(frozen=True)
class SinkOf:
    """What a row offers as block 0: its window's sink."""

    row: PagedRow


@dataclass
class PoolHit:
    """Pinned blocks of a hit: the sink id and the record ids, and a cached tail (``tail`` a sink
    id of which the first ``tail_len`` positions are reused) (counted for the hit's holder until
    ``PoolTier.adopt`` or ``PoolTier.unpin``)."""

    sink: int
    records: list[int]
    pinned: bool = True
    tail: int | None = None
    tail_len: int = 0


def tail_key(parent: BlockKey) -> bytes:
    """The key of the tail cached after block ``parent`` (the float16 tokens of the partial tile
    that followed it in a prompt)."""
    return hashlib.blake2b(parent.key + b"/tail", digest_size=len(parent.key)).digest()


@dataclass
class PoolTier:
    pool: KVarNPool
    budget_bytes: int | None = None
    headroom: Callable[[], int] | None = None
    counters: TierStats = field(default_factory=TierStats)

    # --- what the facade asks ---
    def _find(self, block: BlockKey) -> int | None:
        allocator = self.pool.sinks if block.index == 0 else self.pool.records
        found = allocator.lookup(block.key)
        if found is None or allocator.meta_of.get(found) != block.tokens:
            return None
        return found

    def lookup(self, chain: Sequence[BlockKey]) -> list[int]:
        """Ids of the longest cached prefix of ``chain`` (block 0 a sink id, then record ids)."""
        self.counters.lookups += 1
        hits = []
        for block in chain:
            found = self._find(block)
            if found is None:
                break
            hits.append(found)
        self.counters.hit_blocks += len(hits)
        return hits

    def __contains__(self, key: bytes) -> bool:
        return self.pool.records.lookup(key) is not None or self.pool.sinks.lookup(key) is not None

    def __len__(self) -> int:
        """Cached blocks (the sinks' and records'; a cached tail, fewer than G tokens, is no block)."""
        G = self.pool.layout.tile_size
        sinks = sum(1 for b in self.pool.sinks.hash_of if len(self.pool.sinks.meta_of.get(b) or ()) == G)
        return len(self.pool.records.hash_of) + sinks

    def insert(self, block: BlockKey, parent: BlockKey | None, item: Any) -> bool:
        """Cache ``block``: ``item`` is a held record id (hashed in place) or ``SinkOf(row)``
        (the row's sink copied into a sink block, if the budget has room)."""
        if block.key in self:
            return True
        if parent is not None and parent.key not in self:
            self.counters.refused += 1
            return False
        if isinstance(item, SinkOf):
            if not self._room_for(self.pool.sink_bytes()):
                return False
            sink = self.pool.save_sink(item.row.slot)
            self.pool.sinks.set_hash(sink, block.key, block.tokens)
            self.pool.sinks.decref([sink])  # the cache's alone; the row touches it when it ends
            item.row.sink = (sink, block.key)
        elif not self.pool.records.set_hash(item, block.key, block.tokens):
            self.counters.refused += 1
            return False
        self.counters.inserted += 1
        return True

    def load(self, parent: BlockKey | None,
             blocks: Sequence[tuple[BlockKey, Sequence[Part]]]) -> tuple[int, bytes | None]:
        """Cache blocks read from disk (a chain's continuation after ``parent``): written into free
        pool blocks, all of them at once, as many as the budget has room for, in order, up to the
        first block that does not fit this pool's layout. Returns how many are cached and the key
        of the block that did not fit, if one stopped it (its file is then removed).

        The first record block is checked field by field (shapes and dtypes against the layout);
        the others must have its part layout exactly (names, dtypes, shapes: one list comparison a
        block). Their payloads are then stacked into one ``[blocks, bytes]`` array, sent to the
        device at once, and each record field of each layer is one column range of it: one
        host-to-device copy, one scatter per field and layer, however many blocks, and no per-part
        work per block."""
        L = len(self.pool.layers)
        sink, records, bad, layout, first = None, [], None, None, None
        for block, parts in blocks:  # checked on the host first: nothing is written for a bad block
            if block.key in self:
                break
            want = "sink" if block.index == 0 else "record"
            shape_of = [(p.name, p.dtype, p.shape) for p in parts]
            if want == "record" and layout is not None:
                if shape_of != layout:
                    bad = block.key
                    break
                records.append((block, parts))
                continue
            kind, host, _ = host_arrays(parts)
            arrays = [a for a, _ in host]
            if kind != want or len(host) != _WIDTH[want] * L or len(parts) != len(host) \
                    or any(bf16 for _, bf16 in host) or not self._fits(want, arrays):
                bad = block.key
                break
            if want == "sink":
                sink = (block, arrays)
            else:
                layout, first = shape_of, arrays
                records.append((block, parts))
        if not (sink or records) or (parent is not None and parent.key not in self):
            return 0, bad
        self._learn_shapes(sink[1] if sink else None, first)
        need = (self.pool.sink_bytes() if sink else 0) + len(records) * self.pool.block_bytes()
        while need and not self._room_for(need):  # as many as fit, in chain order
            if not records:
                return 0, None
            records.pop()
            need -= self.pool.block_bytes()
            bad = None  # what stops it now is the budget, not the block
        count, sid = 0, None
        if sink is not None:
            block, arrays = sink
            sid = self.pool.allocate("sinks", 1)[0]
            for l in range(L):
                self.pool.write_sink(l, sid, mx.array(arrays[2 * l]), mx.array(arrays[2 * l + 1]))
            self.pool.sinks.set_hash(sid, block.key, block.tokens)
            count = 1
        if records:
            ids = self.pool.allocate("records", len(records))
            fields = _stacked_fields([parts for _, parts in records], first)
            for l in range(L):
                self.pool.write_records(l, ids, block_major(fields[8 * l: 8 * l + 8]))
            for rid, (block, _) in zip(ids, records):
                self.pool.records.set_hash(rid, block.key, block.tokens)
            self.pool.records.decref(ids)  # released last-first, like a row's: a chain's tail is evicted first
            count += len(records)
        if sid is not None:  # and its head (the sink) last
            self.pool.sinks.decref([sid])
        self.counters.inserted += count
        return count, bad

    def _fits(self, kind: str, arrays: list) -> bool:
        """Whether a block's arrays have the shapes and dtypes this pool's layout gives a block,
        for heads and channels that agree with the layers the pool knows."""
        G = self.pool.layout.tile_size
        for l in range(len(self.pool.layers)):
            if kind == "sink":
                k, v = arrays[2 * l: 2 * l + 2]
                if k.ndim != 4 or k.shape != v.shape or k.shape[0] != 1 or k.shape[2] != G \
                        or k.dtype != np.float16 or v.dtype != np.float16:
                    return False
                H, D = k.shape[1], k.shape[3]
            else:
                codes = arrays[8 * l]
                if codes.ndim != 5:
                    return False
                H, D = codes.shape[1], codes.shape[2] * codes.shape[3]
                try:
                    want = single_tile_shapes(self.pool.layout, H, D)
                except ValueError:  # no KVarN layout has such heads
                    return False
                if any(a.shape != shape or a.dtype != dtype for a, (shape, dtype) in zip(arrays[8 * l: 8 * l + 8], want)):
                    return False
            if self.pool.shapes[l] not in (None, (H, D)):
                return False
        return True

    def _learn_shapes(self, sink: list | None, record: list | None) -> None:
        """A fresh process learns each layer's (heads, head_dim) from a block read from disk."""
        for l in range(len(self.pool.layers)):
            if sink is not None:
                _, H, _, D = sink[2 * l].shape
            else:
                _, H, S, W, _ = record[8 * l].shape
                D = S * W
            self.pool.ensure_layer(l, H, D)

    def parts(self, item: Any) -> list[Part]:
        """A block's disk payload, read out of the pool."""
        arrays: list[mx.array] = []
        if isinstance(item, SinkOf):
            G = self.pool.layout.tile_size
            for a in self.pool.layers:
                s = item.row.slot
                arrays += [a.win_k[s: s + 1, :, :G].astype(mx.float16), a.win_v[s: s + 1, :, :G].astype(mx.float16)]
            kind = "sink"
        else:
            ids = mx.array([item], dtype=mx.int32)
            for l in range(len(self.pool.layers)):
                fields = {name: x[0] for name, x in self.pool.gather_records(l, ids).items()}
                arrays += list(single_tile(fields))
            kind = "record"
        mx.eval(arrays)
        return to_parts(kind, arrays)

    # --- tails: a prompt's partial tile after its last whole block (token-granular hits) ---
    def insert_tail(self, parent: BlockKey, row: PagedRow, tokens: Sequence[int]) -> bool:
        """Cache the tail a row holds after block ``parent`` (its window's tail part, whose
        tokens are ``tokens``, 1 to G - 1 of them) in a sink block, if none is cached there yet
        and the budget has free room (a tail evicts nothing). Memory only: tails are neither
        written to disk nor published."""
        key = tail_key(parent)
        if not 0 < len(tokens) < self.pool.layout.tile_size or parent.key not in self \
                or self.pool.sinks.lookup(key) is not None or not self._free_room_for(self.pool.sink_bytes()):
            return False
        tail = self.pool.save_sink(row.slot, part="tail")
        self.pool.sinks.set_hash(tail, key, tuple(tokens))
        self.pool.sinks.decref([tail])  # the cache's alone
        return True

    def find_tail(self, parent: BlockKey, following: Sequence[int]) -> tuple[int, int] | None:
        """(sink id, tokens reused) of the tail cached after ``parent`` whose first tokens are
        ``following``'s (the longest common run, at least one), or None."""
        tail = self.pool.sinks.lookup(tail_key(parent))
        if tail is None:
            return None
        cached = self.pool.sinks.meta_of.get(tail) or ()
        n = 0
        for a, b in zip(cached, following):
            if a != b:
                break
            n += 1
        return (tail, n) if n else None

    # --- hits ---
    def pin(self, hits: list[int], tail: tuple[int, int] | None = None) -> PoolHit:
        self.pool.sinks.incref(hits[:1])
        self.pool.records.incref(hits[1:])
        if tail is not None:
            self.pool.sinks.incref([tail[0]])
        return PoolHit(hits[0], list(hits[1:]), tail=tail[0] if tail else None, tail_len=tail[1] if tail else 0)

    def unpin(self, hit: PoolHit) -> None:
        if hit.pinned:
            hit.pinned = False
            self.pool.sinks.decref([hit.sink] + ([hit.tail] if hit.tail is not None else []))
            self.pool.records.decref(hit.records)

    def adopt(self, hit: PoolHit, row: PagedRow) -> None:
        """An empty row takes a pinned hit: its table the record blocks (their pins become the
        row's references), its window a copy of the sink (whose pin is let go: the row touches it
        in the cache's LRU order when it ends, after its records)."""
        if not hit.pinned or row.table or any(view.offset for view in row.layers.values()):
            raise ValueError("a hit is adopted once, by an empty row")
        G = self.pool.layout.tile_size
        self.pool.load_sink(hit.sink, row.slot)
        row.sink = (hit.sink, self.pool.sinks.hash_of[hit.sink])
        self.pool.sinks.decref([hit.sink])
        row.table = list(hit.records)  # the records' pins become the row's references
        if hit.tail is not None:  # the tail's first ``tail_len`` tokens into the window's tail part
            self.pool.load_sink(hit.tail, row.slot, part="tail")
            self.pool.sinks.decref([hit.tail])
        hit.pinned = False
        for view in row.layers.values():
            view.offset = (1 + len(hit.records)) * G + hit.tail_len
            view.num_tiles, view.tail_len = len(hit.records), hit.tail_len

    # --- bytes ---
    @property
    def nbytes(self) -> int:
        return self.pool.cached_bytes()

    @property
    def stats(self) -> TierStats:
        self.counters.evicted = self.pool.records.evicted + self.pool.sinks.evicted
        self.counters.bytes = self.nbytes
        return self.counters

    def _room_for(self, nbytes: int) -> bool:
        """Make room for ``nbytes`` more cached bytes within the cap and the headroom (evicting
        least recently released blocks); False if it cannot be made."""
        limits = [self.budget_bytes] if self.budget_bytes is not None else []
        if self.headroom is not None:
            limits.append(self.nbytes + self.headroom())
        if not limits:
            return True
        limit = min(limits)
        if nbytes > limit:
            self.counters.refused += 1
            return False
        self.evict_to(limit - nbytes)
        return True

    def _free_room_for(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more cached bytes fit the cap and the headroom as they are: a tail
        (a part of a tile) never evicts a whole block."""
        limits = [self.budget_bytes] if self.budget_bytes is not None else []
        if self.headroom is not None:
            limits.append(self.nbytes + self.headroom())
        return all(self.nbytes + nbytes <= limit for limit in limits)

    def evict_to(self, target: int) -> int:
        return self.pool.evict_to(target)

    def clear(self) -> int:
        """Forget every cached block (held ones stay with their rows); returns the bytes freed."""
        released = self.nbytes
        self.pool.records.drop_hashes()
        self.pool.sinks.drop_hashes()
        return released

