"""``KVarNKVCache``: a single-stream KVarN cache for one layer, speaking mlx-lm's cache protocol.

A sequence is ``[sink | record 0 .. record n-1 | tail]``. Keys and values are rotated and
rounded to float16 on arrival; the first G tokens stay in the sink; later tokens gather in the
tail and a record is committed each time the tail holds a full tile, so a record depends only
on its own G tokens (byte-identical whatever the chunking). ``update_and_fetch`` returns the
cache itself: the attention seam (``kvarn.attention``) reads sink, records and tail from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from kvarn.layout import KVLayout
from kvarn.quantize import rotate
from kvarn.record import TILE_AXIS, RecordArrays, RecordStore, quantize_tiles

STORE_DTYPE = mx.float16


def _write(buffer: mx.array, update: mx.array, start: int) -> mx.array:
    """``buffer`` with ``update`` written at token ``start``, as a new array: never an in-place
    write, so arrays handed out by ``state`` (or adopted by its setter) never change under
    their other holders (a snapshot, a fork of the same prefix)."""
    return mx.slice_update(buffer, update, mx.array([start]), axes=(2,))


@dataclass(frozen=True)
class Chunk:
    """Where the latest update of several tokens (a prompt chunk) sits, for its attention.

    ``window_k``/``window_v`` hold the rotated float16 keys and values of tokens
    ``[window_start, offset)``: the tail as it was before the chunk, then the chunk's own tokens
    past the sink (None if the chunk fits in the sink). Every token gets the view decode gives
    it (``kvarn.attention.chunk_attention_over``): the sink, the records of the tiles committed
    before it, and its own tile in float16 from this window, the first chunk of a prompt as
    much as any later one (so no chunk keeps raw keys, and a prompt's cache does not depend on
    how it was chunked)."""

    start: int = 0
    window_start: int = 0
    window_k: mx.array | None = None
    window_v: mx.array | None = None


@dataclass(frozen=True)
class Block:
    """G tokens of a row as the prefix cache keeps them: ``kind`` "sink" (the rotated float16 sink)
    or "record" (the record fields of one tile, in ``RecordArrays`` order)."""

    index: int
    kind: str
    arrays: tuple[mx.array, ...]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


class KVarNRowProtocol(_BaseCache):
    """mlx-lm's cache protocol for a KVarN row (``offset`` tokens, ``tail_len`` of them in the
    tail, ``layout``): shared by the single-stream cache and the pool's paged rows."""

    offset: int
    tail_len: int
    layout: KVLayout
    chunk: Chunk | None

    @property
    def sink_len(self) -> int:
        return min(self.offset, self.layout.tile_size)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        return create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=window_size)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Remove up to ``n`` newest tokens, from the tail only; returns how many were removed."""
        removable = self.tail_len if self.offset > self.layout.tile_size else 0
        n = min(n, removable)
        self.tail_len -= n
        self.offset -= n
        return n

    # --- writing (the row's storage comes from ``_window_for``, ``_write_sink``, ``_append_tail``) ---
    def write_chunk(self, keys: mx.array, values: mx.array) -> None:
        """Tokens ``[offset, offset + L)``: rotated and rounded to float16, the first G into the
        sink, the rest after the tail (committing every full tile); where they sit is kept for
        the chunk's attention (``Chunk``)."""
        L = keys.shape[2]
        G = self.layout.tile_size
        start = self.offset
        dtype = self._window_for(keys)
        k_rot = rotate(keys.astype(mx.float32)).astype(STORE_DTYPE).astype(dtype)
        v_rot = rotate(values.astype(mx.float32)).astype(STORE_DTYPE).astype(dtype)
        used = 0
        if start < G:
            used = min(G - start, L)
            self._write_sink(k_rot[..., :used, :], v_rot[..., :used, :], start)
        window = (None, None)
        if used < L:
            window = self._append_tail(k_rot[..., used:, :], v_rot[..., used:, :])
        if L == 1 and start > 0:  # a decode token: decode reads the tail itself
            self.chunk = None
        else:
            window_start = start + used - (window[0].shape[2] - (L - used) if window[0] is not None else 0)
            self.chunk = Chunk(start=start, window_start=window_start, window_k=window[0], window_v=window[1])
        self.offset += L

class KVarNKVCache(KVarNRowProtocol):
    """Invariants: ``offset`` = tokens seen; sink holds ``min(offset, G)`` of them; records hold
    ``records.num_tiles * G``; the tail holds the rest (< G). Trim is tail-only: tokens already
    in the sink or in a committed record cannot be removed (``trim`` stops at that boundary)."""

    def __init__(self, layout: KVLayout) -> None:
        if layout.scheme != "kvarn":
            raise ValueError("KVarNKVCache needs a kvarn layout")
        self.layout = layout
        self.offset = 0
        self.sink_k: mx.array | None = None
        self.sink_v: mx.array | None = None
        self.tail_k: mx.array | None = None
        self.tail_v: mx.array | None = None
        self.tail_len = 0
        self.records = RecordStore(layout)
        self.chunk: Chunk | None = None
        self.evicted = 0  # records a windowed cache dropped (``layout.max_kv_size``; ``kvarn.window``)

    # --- writing ---
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        self._evict(keys.shape[2])
        self.write_chunk(keys, values)
        return self, self

    def _evict(self, num_new: int) -> None:
        """A windowed cache drops the records its next token no longer attends. Its prompt
        chunks must stay within the window (their attention, ``kvarn.attention.chunk_attention``,
        sees every record; the engine's paged rows attend window by window instead)."""
        window = getattr(self.layout, "max_kv_size", None)
        if window is None:
            return
        from kvarn.window import evicted_records

        G = self.layout.tile_size
        first = evicted_records(self.offset + 1, window, G)
        if num_new > 1 and evicted_records(self.offset + num_new, window, G) > first:
            raise ValueError(f"a windowed single-stream KVarN cache takes prompt chunks within its window "
                             f"({window} tokens), not tokens {self.offset}..{self.offset + num_new - 1}")
        if first > self.evicted:
            self.records.drop_front(first - self.evicted)
            self.evicted = first

    def _window_for(self, keys: mx.array) -> mx.Dtype:
        B, H, _, D = keys.shape
        window = getattr(mx, self.layout.window_dtype)  # float16 values (held as float32 on the CPU)
        if self.sink_k is None:
            self.sink_k, self.sink_v, self.tail_k, self.tail_v = (mx.zeros((B, H, self.layout.tile_size, D), window)
                                                                  for _ in range(4))
        return window

    def _write_sink(self, k_rot: mx.array, v_rot: mx.array, start: int) -> None:
        self.sink_k = _write(self.sink_k, k_rot, start)
        self.sink_v = _write(self.sink_v, v_rot, start)

    def _append_tail(self, k_new: mx.array, v_new: mx.array) -> tuple[mx.array, mx.array]:
        """Add rotated tokens after the tail, committing every full tile; returns the tail as it
        was followed by the new tokens (the window a later chunk's tokens attend to in float16)."""
        G = self.layout.tile_size
        k_all = mx.concatenate([self.tail_k[..., : self.tail_len, :], k_new], axis=2)
        v_all = mx.concatenate([self.tail_v[..., : self.tail_len, :], v_new], axis=2)
        total = k_all.shape[2]
        num_full = total // G
        if num_full:
            B, H, _, D = k_all.shape
            tiles_k = k_all[..., : num_full * G, :].reshape(B, H, num_full, G, D)
            tiles_v = v_all[..., : num_full * G, :].reshape(B, H, num_full, G, D)
            self.commit(quantize_tiles(tiles_k, tiles_v, self.layout), num_full)
        rest = total - num_full * G
        if rest:
            self.tail_k = _write(self.tail_k, k_all[..., num_full * G:, :], 0)
            self.tail_v = _write(self.tail_v, v_all[..., num_full * G:, :], 0)
        self.tail_len = rest
        return k_all, v_all

    def commit(self, tiles: RecordArrays, num_tiles: int) -> None:
        self.records.append(tiles, num_tiles)

    def fork(self) -> KVarNKVCache:
        """A copy of this row that shares every array (sink, tail, records): all writes make new
        arrays, so the two rows diverge without touching each other and without re-quantizing."""
        other = KVarNKVCache.__new__(KVarNKVCache)
        other.__dict__.update(self.__dict__)
        other.records = self.records.fork()
        other.chunk = None
        return other

    # --- blocks (the prefix cache's unit: G tokens each) ---
    def blocks(self, count: int) -> list[Block]:
        """The first ``count`` blocks of this row: block 0 is the float16 sink, block i > 0 is
        record i - 1. Arrays are shared, never copied (they are never written in place)."""
        G = self.layout.tile_size
        if self.evicted:
            raise ValueError("a windowed row that evicted records has no whole prefix of blocks")
        if count < 0 or count > (1 + self.records.num_tiles if self.offset >= G else 0):
            raise ValueError(f"a row of {self.offset} tokens ({self.records.num_tiles} records) has no {count} "
                             "whole blocks")
        out = [Block(0, "sink", (self.sink_k, self.sink_v))] if count else []
        return out + self.record_blocks(1, count, copy=False)

    def sink_block(self) -> Block:
        """Block 0, the float16 sink, as arrays of its own (once the row holds G tokens)."""
        if self.offset < self.layout.tile_size:
            raise ValueError(f"a row of {self.offset} tokens has no whole sink")
        return Block(0, "sink", (mx.array(self.sink_k.astype(STORE_DTYPE)), mx.array(self.sink_v.astype(STORE_DTYPE))))

    def record_blocks(self, start: int, stop: int, copy: bool = True) -> list[Block]:
        """Blocks ``[start, stop)`` (``start >= 1``) as records. With ``copy`` each block gets
        arrays of its own: a slice of the row's records is a view that would keep the row's whole
        record buffer alive, so a cache that holds blocks past the row's end copies them."""
        if start < 1 or stop - 1 > self.records.num_tiles:
            raise ValueError(f"records {start - 1}..{stop - 2} of {self.records.num_tiles}")
        out = []
        for i in range(start, stop):
            record = self.records.tile(i - 1)
            arrays = tuple(getattr(record, name) for name in RecordArrays.__dataclass_fields__)
            out.append(Block(i, "record", tuple(mx.array(a) for a in arrays) if copy else arrays))
        return out

    @classmethod
    def from_blocks(cls, layout: KVLayout, blocks: list[Block]) -> KVarNKVCache:
        """A row holding exactly ``blocks`` (``len(blocks) * G`` tokens, empty tail): what the
        original row held at that token, byte for byte, without re-quantizing records.
        ``blocks`` are blocks 0, 1, ... in order: the sink then records."""
        kinds = [b.kind for b in blocks]
        if not blocks or [b.index for b in blocks] != list(range(len(blocks))) \
                or kinds[0] != "sink" or any(kind != "record" for kind in kinds[1:]):
            raise ValueError("blocks must be the sink then records, in order from block 0, into an empty row")
        cache = cls(layout)
        cache._load_sink(*blocks[0].arrays)
        if blocks[1:]:
            cache._load_records(blocks[1:])
        cache.offset = len(blocks) * layout.tile_size
        return cache

    def _load_sink(self, sink_k: mx.array, sink_v: mx.array) -> None:
        window = getattr(mx, self.layout.window_dtype)
        self.sink_k, self.sink_v = sink_k.astype(window), sink_v.astype(window)
        self.tail_k, self.tail_v = mx.zeros_like(self.sink_k), mx.zeros_like(self.sink_v)

    def _load_records(self, records: list[Block]) -> None:
        fields = {name: mx.concatenate([b.arrays[j] for b in records], axis=TILE_AXIS[name])
                  for j, name in enumerate(RecordArrays.__dataclass_fields__)}  # one concatenation per field
        self.records.append(RecordArrays(**fields), len(records))

    @property
    def nbytes(self) -> int:
        if self.sink_k is None:
            return 0
        buffers = sum(a.nbytes for a in (self.sink_k, self.sink_v, self.tail_k, self.tail_v))
        return buffers + self.records.nbytes

    @property
    def state(self) -> list[mx.array]:
        if self.sink_k is None:
            return []
        view = self.records.view()
        records = [] if view is None else [getattr(view, name) for name in vars(view)]
        return [self.sink_k, self.sink_v, self.tail_k, self.tail_v, *records]

    @state.setter
    def state(self, arrays: list[mx.array]) -> None:
        self.records = RecordStore(self.layout)
        if not arrays:
            self.sink_k = self.sink_v = self.tail_k = self.tail_v = None
            return
        self.sink_k, self.sink_v, self.tail_k, self.tail_v = arrays[:4]
        if len(arrays) > 4:
            names = list(RecordArrays.__dataclass_fields__)
            view = RecordArrays(**dict(zip(names, arrays[4:])))
            self.records.append(view, view.v_c.shape[2])

    @property
    def meta_state(self) -> tuple[str, ...]:
        layout = self.layout
        return tuple(map(str, (layout.key_bits, layout.value_bits, layout.tile_size, layout.iters,
                               layout.format_version, layout.storage_dtype, self.offset, self.tail_len)))

    @meta_state.setter
    def meta_state(self, values: tuple[str, ...]) -> None:
        key_bits, value_bits, tile, iters, version = map(int, values[:5])
        offset, tail_len = int(values[6]), int(values[7])
        self.layout = KVLayout(scheme="kvarn", key_bits=key_bits, value_bits=value_bits, tile_size=tile,
                               iters=iters, format_version=version, storage_dtype=values[5])
        self.offset, self.tail_len = offset, tail_len
        if getattr(self, "records", None) is not None:
            self.records.layout = self.layout
        self.chunk = None

    @classmethod
    def from_state(cls, state: list[mx.array], meta_state: tuple[str, ...]) -> KVarNKVCache:
        """Rebuild a cache from ``state`` and ``meta_state`` (the layout comes from the latter)."""
        cache = cls.__new__(cls)
        cache.records = None
        cache.evicted = 0
        cache.meta_state = meta_state
        cache.state = state
        return cache
