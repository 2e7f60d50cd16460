"""Paged KVarN rows, the one KVarN storage: a row is a block table into the pool (``kvarn.pool``)
and a window slot (its float16 sink and tail); one cache object per layer, speaking mlx-lm's
cache protocol, for a row's prompt chunks, and the decode batch of one layer's rows. Every decode
token is written and attended by the pool's one decode step (``kvarn.decode_graph``).

    row (all layers)   table [b3 b9 b4]  window w5  (ids shared by every layer)
    layer view         PagedLayer(row, l): offset, committed tiles, the latest chunk (prefill)
    decode batch       PagedBatch([views of layer l]): the rows a planned step decodes together

A row's tokens are ``[sink | record 0 .. record n-1 | tail]``: keys and values rotated and
rounded to float16 on arrival, the first G tokens in the sink, a record committed each time the
tail holds a full tile, so a record depends only on its own G tokens (byte-identical however the
prompt was chunked). A commit quantizes the full tail straight into a free block (no history is
copied); a fork copies the table and counts its blocks; ``trim`` touches the tail only; a
snapshot copies the row out (window and records) and ``restore`` writes it into a fresh row.

Block ids are taken by the first layer that commits a tile (``PagedRow.block_for``) and reused by
the others, so one table serves every layer. A row made outside the engine (``kvarn.rows.make_cache``:
tests, ``kvarn kld``) is a row of a pool of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_lm.models.cache import _BaseCache, create_attention_mask

from kvarn.attention import Chunk, attention_dtype, chunk_attention_over
from kvarn.step_context import step_of
from kvarn.batch import BatchRows
from kvarn.decode_graph import PagedStepLayer, decode_step, decode_write, rounded, rounded_pair
from kvarn.layout import KVLayout
from kvarn.pool import RECORD_FIELDS, STORE_DTYPE, KVarNPool, block_nbytes, dequantize_blocks, quantize_blocks, \
    record_shapes
from kvarn.window import evicted_records
from metal import KERNELS


class PagedRow:
    """One sequence's storage in the pool: its record block table and window slot, and one
    ``PagedLayer`` view per layer that takes the layout (``layer_ids``)."""

    def __init__(self, pool: KVarNPool, layer_ids: Sequence[int], max_kv_size: int | None = None) -> None:
        self.pool = pool
        pool.rows_made += 1
        self.serial = pool.rows_made
        self.max_kv_size = max_kv_size  # the attention window in tokens (None: unbounded; ``kvarn.window``)
        self.table: list[int] = []  # blocks of records first, first + 1, ...
        self.first = 0  # records before it were evicted (windowed rows only)
        self.sink: tuple[int, object] | None = None  # (id, key) of the cached copy of its sink, if any
        self.slot = pool.allocate("windows", 1)[0]
        pool.window_rows[self.slot] = self
        self.released = False
        self.draft_from: int | None = None  # a verify in flight: its first drafted position (``hold``)
        self.layers = {l: PagedLayer(self, l) for l in layer_ids}

    def block_for(self, tile: int) -> int:
        """The block of record ``tile`` (taken from the pool by the first layer that commits it)."""
        return self.blocks_for(tile, 1)[0]

    def blocks_for(self, first: int, n: int) -> list[int]:
        """Blocks of records ``first .. first + n - 1`` (the missing ones taken in one allocation)."""
        at = first - self.first
        if at < 0:
            raise ValueError(f"record {first} committed after it was evicted (the table starts at {self.first})")
        missing = at + n - len(self.table)
        if missing > 0:
            if at > len(self.table):
                raise ValueError(f"record {first} committed before record {self.first + len(self.table)}")
            self.table += self.pool.allocate("records", missing)
        return self.table[at: at + n]

    def record_block(self, record: int) -> int | None:
        """The block of record ``record``, None if it is not in the table (evicted or not yet committed)."""
        at = record - self.first
        return self.table[at] if 0 <= at < len(self.table) else None

    def kept(self, num_tokens: int, num_records: int) -> list[int]:
        """The blocks a layer view of ``num_records`` committed records attends once the row holds
        ``num_tokens`` tokens: the whole table without a window, its newest records within it."""
        lo = max(evicted_records(num_tokens, self.max_kv_size, self.pool.layout.tile_size) - self.first, 0)
        return self.table[lo: num_records - self.first]

    def evict(self) -> None:
        """Drop the records no layer will attend again from the table (windowed rows): those
        before the window of the next token of the layer that is furthest behind (layers take a
        prompt chunk one after the other, so one may still read what another is done with).
        Their blocks are decref'd back to the pool (a block the prefix cache hashed stays cached)."""
        if self.max_kv_size is None:
            return
        offset = min(view.offset for view in self.layers.values())
        drop = evicted_records(offset + 1, self.max_kv_size, self.pool.layout.tile_size) - self.first
        if drop > 0:
            gone, self.table = self.table[:drop], self.table[drop:]
            self.first += len(gone)
            self.pool.records.decref(gone)

    # --- speculative verify: drafted tokens stay in the float16 window until accepted ---
    def hold(self) -> None:
        """The next chunk is a verify (its last token and the drafts after it): its tokens stay in
        the window (the sink or the tail) and it must end before its tile's last position
        (``verify_room``), so it commits no record."""
        self.draft_from = min(view.offset for view in self.layers.values())

    def verify_room(self) -> int:
        """How many tokens a verify may write from the row's offset: up to its tile's last
        position but one. The token that fills a tile is decoded alone: decode commits the tile
        first and that token attends its tile quantized, as every row's does, so a tile is
        committed only from accepted tokens.

            tile t:  [ ..held.. | room ... | last ]      room = G - 1 - offset % G
        """
        G = self.pool.layout.tile_size
        return G - 1 - min(view.offset for view in self.layers.values()) % G

    def accept(self, rejected: int) -> None:
        """End a verify: its ``rejected`` newest tokens leave every layer's window (the sink or the
        tail, never a record)."""
        if self.draft_from is None:
            raise RuntimeError("accept without a verify in flight")
        for view in self.layers.values():
            view.reject(rejected, self.draft_from)
        self.draft_from = None

    def fork(self) -> PagedRow:
        """A second row with this history: the table's blocks are shared by count, never copied;
        the window (2G float16 tokens: sink and tail) is copied into the fork's own slot."""
        pool = self.pool
        child = PagedRow(pool, self.layers, self.max_kv_size)
        child.table, child.first = list(self.table), self.first
        pool.records.incref(child.table)
        child.sink = self.sink
        for l, view in self.layers.items():
            if pool.shapes[l] is not None:
                a = pool.layers[l]
                a.win_k, a.win_v = (_copy_slot(x, self.slot, child.slot) for x in (a.win_k, a.win_v))
            other = child.layers[l]
            other.offset, other.tail_len, other.num_tiles = view.offset, view.tail_len, view.num_tiles
        return child

    # --- whole-row snapshots (the prefix cache's checkpoint tier, for models with layers of their own) ---
    def snapshot(self) -> tuple[dict[str, Any], list[mx.array]]:
        """The row copied out of the pool: for each layer it has written, its window (sink and tail,
        [1, H, 2G, D]) and its records (block-major fields [n, ...], the table's order), with each
        view's counters; what ``restore`` writes into a fresh row."""
        table = mx.array(self.table, dtype=mx.int32) if self.table else None
        written = [l for l in self.layers if self.pool.shapes[l] is not None]
        arrays: list[mx.array] = []
        for l in written:
            a = self.pool.layers[l]
            arrays += [mx.array(a.win_k[self.slot: self.slot + 1]), mx.array(a.win_v[self.slot: self.slot + 1])]
            if table is not None:
                arrays += [mx.array(a.records[name][table]) for name in RECORD_FIELDS]
        meta = {"first": self.first, "records": len(self.table), "written": written,
                "views": {str(l): [v.offset, v.tail_len, v.num_tiles] for l, v in self.layers.items()}}
        return meta, arrays

    def restore(self, meta: dict[str, Any], arrays: Sequence[mx.array]) -> None:
        """Write a ``snapshot`` into this fresh row (new blocks, this row's window): it then holds
        what the snapshotted row held, byte for byte."""
        if self.table or any(v.offset for v in self.layers.values()):
            raise ValueError("a snapshot is restored into a fresh row")
        if sorted(meta["views"], key=int) != sorted(map(str, self.layers), key=int):
            raise ValueError("a snapshot of a row with other layers")
        n = meta["records"]
        width = 2 + (len(RECORD_FIELDS) if n else 0)
        if len(arrays) != width * len(meta["written"]):
            raise ValueError("a snapshot with missing arrays")
        self.first, self.table = meta["first"], self.pool.allocate("records", n) if n else []
        for i, l in enumerate(meta["written"]):
            parts = arrays[i * width: (i + 1) * width]
            _, H, _, D = parts[0].shape
            a = self.pool.ensure_layer(l, H, D)
            a.win_k[self.slot: self.slot + 1] = parts[0].astype(self.pool.window_dtype)
            a.win_v[self.slot: self.slot + 1] = parts[1].astype(self.pool.window_dtype)
            if n:
                self.pool.write_records(l, self.table, dict(zip(RECORD_FIELDS, parts[2:])))
        for l, (offset, tail_len, num_tiles) in meta["views"].items():
            view = self.layers[int(l)]
            view.offset, view.tail_len, view.num_tiles, view.chunk = offset, tail_len, num_tiles, None

    def release(self) -> None:
        """Give the row's blocks and window back (idempotent)."""
        if self.released:
            return
        self.released = True
        self.pool.records.decref(self.table)
        if self.sink is not None:  # after its records: the chain's head is the last of it evicted
            self.pool.sinks.touch(*self.sink)
        self.pool.windows.decref([self.slot])
        del self.pool.window_rows[self.slot]
        self.table = []


def _copy_slot(buffer: mx.array, src: int, dst: int) -> mx.array:
    """``buffer`` with entry ``dst`` := entry ``src`` (the piece is copied and evaluated first, so
    the write does not hold a view of the buffer it writes and MLX updates it in place)."""
    piece = mx.array(buffer[src: src + 1])
    mx.eval(piece)
    buffer[dst: dst + 1] = piece
    return buffer


def single_tile(fields: dict[str, mx.array]) -> tuple[mx.array, ...]:
    """One block's block-major fields as the prefix cache stores a block (its disk format: each
    field with the unit axes of a one-tile row)."""
    k_codes, k_alpha, k_beta, k_r, v_codes, v_alpha, v_beta, v_c = (fields[n] for n in RECORD_FIELDS)
    return (k_codes[None], k_alpha[None, ..., None], k_beta[None, ..., None], k_r[None], v_codes[None, :, None],
            v_alpha[None, :, None], v_beta[None, :, None], v_c[None, :, None])


@functools.lru_cache(maxsize=64)
def single_tile_shapes(layout: KVLayout, H: int, D: int) -> tuple[tuple[tuple[int, ...], np.dtype], ...]:
    """(shape, NumPy dtype) of each array ``single_tile`` gives for one block of H heads of D
    channels (what a prefix-cache block read from disk must hold)."""
    shapes = record_shapes(layout, H, D)
    axes = {"k_codes": (0,), "k_alpha": (0, -1), "k_beta": (0, -1), "k_r": (0,), "v_codes": (0, 2),
            "v_alpha": (0, 2), "v_beta": (0, 2), "v_c": (0, 2)}  # where single_tile adds unit axes
    out = []
    for name in RECORD_FIELDS:
        shape, dtype = shapes[name]
        full = list(shape)
        for axis in axes[name]:
            full.insert(len(full) + 1 + axis if axis < 0 else axis, 1)
        out.append((tuple(full), np.dtype(np.uint32 if dtype == mx.uint32 else np.float16)))
    return tuple(out)


def block_major(arrays: Sequence[mx.array]) -> dict[str, mx.array]:
    """The inverse of ``single_tile``, for n blocks: their single-tile arrays concatenated along
    the first axis -> block-major fields [n, ...]."""
    k_codes, k_alpha, k_beta, k_r, v_codes, v_alpha, v_beta, v_c = arrays
    return {"k_codes": k_codes, "k_alpha": k_alpha[..., 0], "k_beta": k_beta[..., 0], "k_r": k_r,
            "v_codes": v_codes[:, :, 0], "v_alpha": v_alpha[:, :, 0], "v_beta": v_beta[:, :, 0], "v_c": v_c[:, :, 0]}


class PagedLayer(_BaseCache):
    """Layer ``l`` of a paged row, speaking mlx-lm's cache protocol (one row's prompt chunks, and
    lone decode tokens through the pool's decode step with one row). Invariants:
    ``offset`` = tokens seen; the sink holds ``min(offset, G)``; ``num_tiles`` records were
    committed (the true count: positions follow from it), ``num_tiles * G`` tokens; the tail holds
    ``tail_len`` < G; trim is tail-only (tokens in the sink or a committed record stay). A
    windowed row's table holds only records ``row.first ..`` (``PagedRow.kept``: the ones this
    view attends). ``update_and_fetch`` writes and fetches nothing: the view attends through its
    own storage (``attend``, which the attention seam calls)."""

    def __init__(self, row: PagedRow, l: int) -> None:
        self.row = row
        self.l = l
        self.offset = 0
        self.tail_len = 0
        self.num_tiles = 0
        self.chunk: Chunk | None = None
        self.decoding: PagedStepLayer | None = None  # a lone decode token's step layer, for its attention

    @property
    def layout(self) -> KVLayout:
        return self.row.pool.layout

    # --- mlx-lm's cache protocol ---
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

    # --- writing (one row, any number of tokens) ---
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        if keys.shape[2] == 1 and self.offset > 0:
            self.decoding = decode_write([self], keys, values)  # a lone decode token: the decode step with B = 1
            return None, None  # nothing to fetch: the storage attends itself (``attend``)
        self.decoding = None
        self.row.evict()
        self.write_chunk(keys, values)
        return None, None  # nothing to fetch: the storage attends itself (``attend``)

    def write_chunk(self, keys: mx.array, values: mx.array) -> None:
        """Tokens ``[offset, offset + L)``: rotated and rounded to float16, the first G into the
        sink, the rest after the tail (committing every full tile; a verify's tokens never fill
        one: ``PagedRow.hold``); where they sit is kept for the chunk's attention (``Chunk``)."""
        L = keys.shape[2]
        G = self.layout.tile_size
        start = self.offset
        if self.row.draft_from is not None and start % G + L > G - 1:
            raise ValueError(f"a verify of {L} tokens from position {start} reaches the end of its tile of {G}")
        _, H, _, D = keys.shape
        self.row.pool.ensure_layer(self.l, H, D)
        dtype = self.row.pool.window_dtype  # float16 values (held as float32 on the CPU)
        if dtype == STORE_DTYPE:  # a GPU's float16 windows: one rotation for both (one launch with its kernel)
            both = rounded_pair(keys, values, dtype)
            k_rot, v_rot = both[: keys.shape[0]], both[keys.shape[0]:]
        else:  # the CPU's: each rounded in its rotation's pass, read in place
            k_rot, v_rot = rounded(keys, dtype), rounded(values, dtype)
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

    def _write_sink(self, k_rot: mx.array, v_rot: mx.array, start: int) -> None:
        a, s = self.row.pool.layers[self.l], self.row.slot
        a.win_k[s: s + 1, :, start: start + k_rot.shape[2]] = k_rot
        a.win_v[s: s + 1, :, start: start + v_rot.shape[2]] = v_rot

    def _append_tail(self, k_new: mx.array, v_new: mx.array) -> tuple[mx.array, mx.array]:
        """Tokens after the tail, committing every full tile into its block; returns the tail as it
        was followed by the new tokens (the window a later chunk attends to in float16)."""
        G = self.layout.tile_size
        pool, row = self.row.pool, self.row
        a = pool.layers[self.l]
        k_all, v_all = k_new, v_new
        if self.tail_len:  # (read only where there is a tail: a read of the windows before another row's
            # write in the same forward keeps that version alive, and the write then copies every window)
            slot = mx.array([row.slot], dtype=mx.int32)  # a gather, not a view: the write below is then in place
            k_all = mx.concatenate([a.win_k[slot][..., G: G + self.tail_len, :], k_new], axis=2)
            v_all = mx.concatenate([a.win_v[slot][..., G: G + self.tail_len, :], v_new], axis=2)
        _, H, total, D = k_all.shape
        num_full = total // G
        if num_full:
            tiles_k = k_all[0, :, : num_full * G].reshape(H, num_full, G, D).transpose(1, 0, 2, 3)
            tiles_v = v_all[0, :, : num_full * G].reshape(H, num_full, G, D).transpose(1, 0, 2, 3)
            blocks = row.blocks_for(self.num_tiles, num_full)
            pool.write_records(self.l, blocks, quantize_blocks(tiles_k.astype(STORE_DTYPE), tiles_v.astype(STORE_DTYPE),
                                                               self.layout))
            self.num_tiles += num_full
        rest = total - num_full * G
        if rest:
            a.win_k[row.slot: row.slot + 1, :, G: G + rest] = k_all[..., num_full * G:, :]
            a.win_v[row.slot: row.slot + 1, :, G: G + rest] = v_all[..., num_full * G:, :]
        self.tail_len = rest
        return k_all, v_all

    def reject(self, n: int, draft_from: int) -> None:
        """Drop the ``n`` newest tokens, all drafted at or after ``draft_from`` (a verify's; in
        the sink or the tail, never a committed record)."""
        if n < 0 or self.offset - n < draft_from:
            raise ValueError(f"cannot reject {n} tokens of a verify from {draft_from} at offset {self.offset}")
        if self.offset > self.layout.tile_size:
            self.tail_len -= n
        self.offset -= n

    # --- attention (the seam's entry for one row: ``kvarn.rows``; the math: ``kvarn.attention``) ---
    def attend(self, queries: mx.array, keys: Any, values: Any, *, scale: float, mask: Any,
               sinks: mx.array | None, dispatch: Any, default: Any) -> mx.array:
        """One row's prompt chunk (the first one too: ``kvarn.attention.chunk_attention_over``) or
        lone decode token (the decode batch's path with one row)."""
        if sinks is not None:
            raise ValueError("KVarN attention does not support attention sinks")
        chunk = self.chunk
        if chunk is not None and (queries.shape[2] > 1 or chunk.start == 0):  # a prompt chunk (the first too)
            sink_k, sink_v, rec_k, rec_v = self.history(attention_dtype(queries))
            return chunk_attention_over(queries, sink_k, sink_v, rec_k, rec_v, chunk, self.layout.tile_size, scale,
                                        rec_first=self.row.first, window=self.row.max_kv_size, step=step_of(self))
        if self.decoding is None:
            raise RuntimeError("paged decode attention before update_and_fetch")
        return self.decoding.attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks, dispatch=dispatch,
                                    default=default)

    # --- reading one row (prefill attention) ---
    def history(self, dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array | None, mx.array | None]:
        """(sink_k, sink_v) [1,H,sink_len,D] and the dequantized records [1,H,n*G,D] (None if none):
        records ``row.first .. num_tiles - 1`` (all of them unless the row is windowed)."""
        a = self.row.pool.layers[self.l]
        slot = mx.array([self.row.slot], dtype=mx.int32)
        sink_k = a.win_k[slot][..., : self.sink_len, :].astype(dtype)
        sink_v = a.win_v[slot][..., : self.sink_len, :].astype(dtype)
        blocks = self.row.table[: self.num_tiles - self.row.first]  # a windowed row's: from record ``row.first``
        if not blocks:
            return sink_k, sink_v, None, None
        table = mx.array(blocks, dtype=mx.int32)[None]
        kernels = KERNELS.cpu() if dtype == mx.float32 else None
        if kernels is not None and kernels.is_supported(head_dim=a.win_k.shape[-1], key_bits=self.layout.key_bits,
                                                        value_bits=self.layout.value_bits):
            rec_k, rec_v = kernels.dequantize_records(a.records, table, key_bits=self.layout.key_bits,
                                                      value_bits=self.layout.value_bits)  # in place, same bits
        else:
            rec_k, rec_v = dequantize_blocks(self.row.pool.gather_records(self.l, table), self.layout, dtype)
        return sink_k, sink_v, rec_k, rec_v

    def release(self) -> None:
        self.row.release()

    @property
    def nbytes(self) -> int:
        """What this row holds in this layer: sink + tail (G float16 tokens each, K and V) once
        written, plus its records (``KVLayout.sequence_bytes``, what capacity pricing charges)."""
        shape = self.row.pool.shapes[self.l]
        if self.offset == 0 or shape is None:
            return 0
        H, D = shape
        G = self.layout.tile_size
        records = len(self.row.table[: self.num_tiles - self.row.first])
        return 4 * G * H * D * self.row.pool.window_dtype.size + records * block_nbytes(self.layout, H, D)

    @property
    def state(self) -> list[mx.array]:
        """The pool arrays this layer's row lives in (what evaluating a step must settle). The
        prefix cache shares a row block by block (``apc/pool_tier.py``) or, for models with layers
        of their own, copies it whole (``PagedRow.snapshot``)."""
        return self.row.pool.layers[self.l].arrays()

    @property
    def meta_state(self) -> tuple[str, ...]:
        return tuple(map(str, (self.offset, self.tail_len, self.num_tiles)))


class PagedBatch(BatchRows):
    """Layer ``l`` of the rows decoding together: what the pool's decode step plans for every layer
    at once (``kvarn.decode_graph.paged_plan``). Rows join (``extend``) and leave (``filter``)
    between steps; nothing of theirs is copied. A model run through the batch itself (a model
    with layers of their own) takes the same step layer by layer (``decode_write``)."""

    row_type = PagedLayer

    def __init__(self, rows: Sequence[PagedLayer] = ()) -> None:
        self.decoding: PagedStepLayer | None = None
        super().__init__(rows)

    def extend(self, rows: Sequence[PagedLayer]) -> None:
        rows = list(rows)
        for row in rows:
            if not isinstance(row, PagedLayer):
                raise TypeError(f"PagedBatch takes PagedLayer rows, not {type(row).__name__}")
        anchor = (self.rows or rows)[:1]
        if anchor and any(r.row.pool is not anchor[0].row.pool or r.l != anchor[0].l for r in rows):
            raise ValueError("a paged batch holds one layer of one pool")
        super().extend(rows)

    def filter(self, keep: Sequence[int]) -> None:
        super().filter(keep)
        self.decoding = None

    @property
    def offset(self) -> mx.array:
        return decode_step(self.rows).inputs["offset"]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        self.decoding = decode_write(self.rows, keys, values)
        return None, None  # nothing to fetch: the storage attends itself (``attend``)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        return None  # the validity mask is the step's

    def attend(self, queries: mx.array, keys: Any, values: Any, *, scale: float, mask: Any,
               sinks: mx.array | None, dispatch: Any, default: Any) -> mx.array:
        """Every row's decode attention in one graph: the step's (``PagedStepLayer.attend``)."""
        if self.decoding is None:
            raise RuntimeError("paged batch attention before update_and_fetch")
        return self.decoding.attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks, dispatch=dispatch,
                                    default=default)
