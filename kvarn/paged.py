"""Paged KVarN rows: a row is a block table into the pool (``kvarn.pool``) and a window slot (its
float16 sink and tail); one cache object per layer for a whole decode batch.

    row (all layers)   table [b3 b9 b4]  window w5  (ids shared by every layer)
    layer view         PagedLayer(row, l): offset, committed tiles, the latest chunk (prefill)
    decode batch       PagedBatch([views of layer l]): one graph per layer for all rows

A row's tokens are ``[sink | record 0 .. record n-1 | tail]`` exactly as in ``KVarNKVCache``
(the single-stream cache, which stays the reference): keys and values rotated and rounded to
float16 on arrival, the first G tokens in the sink, a record committed each time the tail holds a
full tile. A commit quantizes the full tail straight into a free block (no history is copied); a
fork copies the table and counts its blocks; ``trim`` touches the tail only.

Block ids are taken by the first layer that commits a tile (``PagedRow.block_for``) and reused by
the others, so one table serves every layer.

Decode (``PagedBatch.update_and_fetch`` then ``decode_attention``): per layer, one scatter writes
every row's new token into its window (the sink part while the row is shorter than G, else the
tail part), one batched quantizer call commits every tile that filled, and attention reads each
row's window (a plain slice when the batch's windows are consecutive, else a gather) and its
records (gathered, dequantized) as one ``[B, H, T, D]`` operand for one fused SDPA under a
per-row validity mask. The index arrays and the mask are the same for every layer of a step and
are built once per step (``StepIndex``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from kvarn.cache import Block, Chunk, KVarNRowProtocol
from kvarn.batch import BatchRows
from kvarn.layout import KVLayout
from kvarn.pool import PAD, RECORD_FIELDS, STORE_DTYPE, KVarNPool, block_nbytes, quantize_blocks
from kvarn.quantize import rotate
from kvarn.record import RecordArrays


class PagedRow:
    """One sequence's storage in the pool: its record block table and window slot, and one
    ``PagedLayer`` view per layer that takes the layout (``layer_ids``)."""

    def __init__(self, pool: KVarNPool, layer_ids: Sequence[int]) -> None:
        self.pool = pool
        pool.rows_made += 1
        self.serial = pool.rows_made
        self.table: list[int] = []
        self.slot = pool.allocate("windows", 1)[0]
        pool.window_rows[self.slot] = self
        self.released = False
        self.layers = {l: PagedLayer(self, l) for l in layer_ids}

    def block_for(self, tile: int) -> int:
        """The block of record ``tile`` (taken from the pool by the first layer that commits it)."""
        return self.blocks_for(tile, 1)[0]

    def blocks_for(self, first: int, n: int) -> list[int]:
        """Blocks of records ``first .. first + n - 1`` (the missing ones taken in one allocation)."""
        missing = first + n - len(self.table)
        if missing > 0:
            if first > len(self.table):
                raise ValueError(f"record {first} committed before record {len(self.table)}")
            self.table += self.pool.allocate("records", missing)
        return self.table[first: first + n]

    def fork(self) -> PagedRow:
        """A second row with this history: the table's blocks are shared by count, never copied;
        the window (2G float16 tokens: sink and tail) is copied into the fork's own slot."""
        pool = self.pool
        child = PagedRow(pool, self.layers)
        child.table = list(self.table)
        pool.records.incref(child.table)
        for l, view in self.layers.items():
            if pool.shapes[l] is not None:
                a = pool.layers[l]
                a.win_k, a.win_v = (_copy_slot(x, self.slot, child.slot) for x in (a.win_k, a.win_v))
            other = child.layers[l]
            other.offset, other.tail_len, other.num_tiles, other.pending = (view.offset, view.tail_len,
                                                                           view.num_tiles, view.pending)
        return child

    def release(self) -> None:
        """Give the row's blocks and window back (idempotent)."""
        if self.released:
            return
        self.released = True
        self.pool.records.decref(self.table)
        self.pool.windows.decref([self.slot])
        del self.pool.window_rows[self.slot]
        self.table = []


def _rounded(x: mx.array, dtype: mx.Dtype) -> mx.array:
    """Keys or values rotated and rounded to float16 (the contract), held in the window's dtype."""
    out = rotate(x.astype(mx.float32)).astype(STORE_DTYPE)
    return out if dtype == STORE_DTYPE else out.astype(dtype)


def _copy_slot(buffer: mx.array, src: int, dst: int) -> mx.array:
    """``buffer`` with entry ``dst`` := entry ``src`` (the piece is copied and evaluated first, so
    the write does not hold a view of the buffer it writes and MLX updates it in place)."""
    piece = mx.array(buffer[src: src + 1])
    mx.eval(piece)
    buffer[dst: dst + 1] = piece
    return buffer


def _single_tile(fields: dict[str, mx.array]) -> tuple[mx.array, ...]:
    """One block's block-major fields in ``RecordArrays``'s single-tile layout (the prefix
    cache's block format, shared with ``KVarNKVCache``)."""
    k_codes, k_alpha, k_beta, k_r, v_codes, v_alpha, v_beta, v_c = (fields[n] for n in RECORD_FIELDS)
    return (k_codes[None], k_alpha[None, ..., None], k_beta[None, ..., None], k_r[None], v_codes[None, :, None],
            v_alpha[None, :, None], v_beta[None, :, None], v_c[None, :, None])


def _block_major(arrays: Sequence[mx.array]) -> dict[str, mx.array]:
    """The inverse of ``_single_tile`` for one block."""
    k_codes, k_alpha, k_beta, k_r, v_codes, v_alpha, v_beta, v_c = arrays
    return {"k_codes": k_codes[0], "k_alpha": k_alpha[0, ..., 0], "k_beta": k_beta[0, ..., 0], "k_r": k_r[0],
            "v_codes": v_codes[0, :, 0], "v_alpha": v_alpha[0, :, 0], "v_beta": v_beta[0, :, 0], "v_c": v_c[0, :, 0]}


class PagedLayer(KVarNRowProtocol):
    """Layer ``l`` of a paged row, speaking mlx-lm's cache protocol (one row's prompt chunks run
    through it; decode runs through ``PagedBatch``). Invariants as ``KVarNKVCache``: ``offset`` =
    tokens seen; the sink holds ``min(offset, G)``; ``num_tiles`` records hold ``num_tiles * G``;
    the tail holds ``tail_len`` < G; trim is tail-only."""

    def __init__(self, row: PagedRow, l: int) -> None:
        self.row = row
        self.l = l
        self.offset = 0
        self.tail_len = 0
        self.num_tiles = 0
        self.chunk: Chunk | None = None
        self.pending: tuple[mx.array, mx.array] | None = None  # restored fresh blocks, as in KVarNKVCache

    @property
    def layout(self) -> KVLayout:
        return self.row.pool.layout

    # --- writing (one row, any number of tokens) ---
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        if self.pending is None and keys.shape[2] == 1 and self.offset > 0:
            decode_update([self], keys, values)  # a lone decode token: the batched path with B = 1
            self.chunk = None
            return self, self
        self.write_chunk(keys, values)
        return self, self

    def _window_for(self, keys: mx.array) -> mx.Dtype:
        _, H, _, D = keys.shape
        self.row.pool.ensure_layer(self.l, H, D)
        return self.row.pool.window_dtype

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

    # --- reading one row (prefill attention, the prefix cache) ---
    def history(self, dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array | None, mx.array | None]:
        """(sink_k, sink_v) [1,H,sink_len,D] and the dequantized records [1,H,n*G,D] (None if none)."""
        a = self.row.pool.layers[self.l]
        slot = mx.array([self.row.slot], dtype=mx.int32)
        sink_k = a.win_k[slot][..., : self.sink_len, :].astype(dtype)
        sink_v = a.win_v[slot][..., : self.sink_len, :].astype(dtype)
        if not self.num_tiles:
            return sink_k, sink_v, None, None
        table = mx.array(self.row.table[: self.num_tiles], dtype=mx.int32)[None]
        rec_k, rec_v = dequantize_blocks(self.row.pool.gather_records(self.l, table), self.layout, dtype)
        return sink_k, sink_v, rec_k, rec_v

    def record_blocks(self, start: int, stop: int) -> list[Block]:
        """Blocks ``[start, stop)`` (``start >= 1``: block i is record i - 1) in the prefix
        cache's format, as arrays of their own (gathered from the pool)."""
        if start < 1 or stop - 1 > self.num_tiles:
            raise ValueError(f"records {start - 1}..{stop - 2} of {self.num_tiles}")
        out = []
        for i in range(start, stop):
            ids = mx.array([self.row.table[i - 1]], dtype=mx.int32)
            fields = {name: x[0] for name, x in self.row.pool.gather_records(self.l, ids).items()}
            out.append(Block(i, "record", _single_tile(fields)))
        return out

    def load_blocks(self, blocks: list[Block], continue_fresh: bool = False) -> PagedLayer:
        """This (empty) layer filled with ``blocks`` 0, 1, ... (the sink or fresh blocks, then
        records), byte for byte what the row that made them held (``KVarNKVCache.from_blocks``)."""
        self.fill_from_blocks(blocks, continue_fresh)
        return self

    def _load_sink(self, sink_k: mx.array, sink_v: mx.array) -> None:
        _, H, G, D = sink_k.shape
        a = self.row.pool.ensure_layer(self.l, H, D)
        s = self.row.slot
        a.win_k[s: s + 1, :, :G] = sink_k.astype(STORE_DTYPE).astype(a.win_k.dtype)
        a.win_v[s: s + 1, :, :G] = sink_v.astype(STORE_DTYPE).astype(a.win_v.dtype)

    def _load_records(self, records: list[Block]) -> None:
        fields = [_block_major(b.arrays) for b in records]
        stacked = {name: mx.stack([f[name] for f in fields]) for name in RECORD_FIELDS}
        self.row.pool.write_records(self.l, self.row.blocks_for(self.num_tiles, len(records)), stacked)
        self.num_tiles += len(records)

    def release(self) -> None:
        self.row.release()

    @property
    def nbytes(self) -> int:
        """What this row holds in this layer, as ``KVarNKVCache`` counts it: sink + tail (G float16
        tokens each, K and V) once written, plus its records."""
        if self.pending is not None:
            return sum(a.nbytes for a in self.pending)
        shape = self.row.pool.shapes[self.l]
        if self.offset == 0 or shape is None:
            return 0
        H, D = shape
        G = self.layout.tile_size
        return 4 * G * H * D * self.row.pool.window_dtype.size + self.num_tiles * block_nbytes(self.layout, H, D)

    @property
    def state(self) -> list[mx.array]:
        """The pool arrays this layer's row lives in (what evaluating a step must settle). Paged
        rows are cut at blocks by the prefix cache, never snapshotted whole."""
        return self.row.pool.layers[self.l].arrays()

    @property
    def meta_state(self) -> tuple[str, ...]:
        return tuple(map(str, (self.offset, self.tail_len, self.num_tiles)))


@dataclass(frozen=True)
class StepIndex:
    """What every layer of one decode step shares: write targets, commits and attention indices.

    ``write_slots``/``write_pos`` send each row's new token into its window (position p < G: the
    sink part; else G + its tail length); ``commit_rows`` are the rows whose tail fills (windows
    ``commit_slots``, new blocks ``commit_blocks``); after the write, ``windows`` (the batch's
    window ids, or a ``(lo, hi)`` range when they are consecutive: read as a slice), ``table``
    [B, nb] (pad-filled) and ``mask`` [B, 1, 1, 2G + nb*G] select each row's valid sink, tail and
    record tokens; ``offset`` is the rows' RoPE offsets before the write."""

    offset: mx.array
    write_slots: mx.array
    write_pos: mx.array
    commit_rows: tuple[int, ...]
    commit_slots: mx.array | None
    commit_blocks: tuple[int, ...]
    windows: mx.array | tuple[int, int]
    table: mx.array | None
    mask: mx.array


def _step_index(layers: Sequence[PagedLayer]) -> StepIndex:
    """Plan one decode step for rows at these views' offsets (taking new blocks for commits)."""
    G = layers[0].layout.tile_size
    write_pos, commits, sink_len, tail_len, num_tiles = [], [], [], [], []
    for b, view in enumerate(layers):
        p = view.offset
        if p < G:
            write_pos.append(p)
            sink_len.append(p + 1), tail_len.append(0), num_tiles.append(view.num_tiles)
            continue
        write_pos.append(G + view.tail_len)
        sink_len.append(G)
        if view.tail_len == G - 1:
            commits.append(b)
            tail_len.append(0), num_tiles.append(view.num_tiles + 1)
        else:
            tail_len.append(view.tail_len + 1), num_tiles.append(view.num_tiles)
    blocks = tuple(layers[b].row.block_for(layers[b].num_tiles) for b in commits)
    nb = max(num_tiles)
    i32 = mx.int32
    table = None
    if nb:
        table = mx.array([view.row.table[:n] + [PAD] * (nb - n) for view, n in zip(layers, num_tiles)], dtype=i32)
    slots = [view.row.slot for view in layers]
    windows = (slots[0], slots[0] + len(slots)) if slots == list(range(slots[0], slots[0] + len(slots))) \
        else mx.array(slots, dtype=i32)
    sl, tl, nt = (mx.array(x, dtype=i32)[:, None] for x in (sink_len, tail_len, num_tiles))
    w = mx.arange(2 * G, dtype=i32)[None]
    parts = [(w < sl) | ((w >= G) & (w < G + tl))]
    if nb:
        parts.append((mx.arange(nb * G, dtype=i32)[None] // G) < nt)
    return StepIndex(
        offset=mx.array([v.offset for v in layers], dtype=i32),
        write_slots=mx.array(slots, dtype=i32),
        write_pos=mx.array(write_pos, dtype=i32),
        commit_rows=tuple(commits),
        commit_slots=mx.array([slots[b] for b in commits], dtype=i32) if commits else None,
        commit_blocks=blocks,
        windows=windows,
        table=table,
        mask=mx.concatenate(parts, axis=1)[:, None, None, :] if nb else parts[0][:, None, None, :],
    )


class _IndexMemo:
    """The step index of the latest decode step (every layer of a step asks with the same rows at
    the same offsets; the first layer builds it)."""

    key: tuple | None = None
    value: StepIndex | None = None


def step_index(layers: Sequence[PagedLayer]) -> StepIndex:
    memo = layers[0].row.pool.__dict__.setdefault("_step_memo", _IndexMemo())
    key = tuple((v.row.serial, v.offset, v.tail_len, v.num_tiles) for v in layers)
    if memo.key != key:
        place_windows([v.row for v in layers])
        memo.key, memo.value = key, _step_index(layers)
    return memo.value


def place_windows(rows: Sequence[PagedRow]) -> None:
    """Give a decode batch's rows consecutive windows in batch order, so every layer reads them
    as one slice instead of a gather (on MLX's CPU a gathered batch made a step ~3x slower).

    The batch takes the range of windows that starts at its lowest one; a row whose window is
    elsewhere swaps windows with whatever holds its target (another batch row, a row still
    prefilling, or a free window). Nothing moves while the rows sit in order (the steady state:
    rows join at the end, windows are handed out lowest first); after a membership change each
    moved window (2G tokens a layer) is copied once."""
    pool = rows[0].pool
    lo = min(r.slot for r in rows)
    if all(r.slot == lo + b for b, r in enumerate(rows)) or lo + len(rows) > pool.windows.capacity:
        return
    origin: dict[int, int] = {}  # window -> the window whose tokens end up there

    def swap(x: int, y: int) -> None:
        origin[x], origin[y] = origin.get(y, y), origin.get(x, x)

    for b, row in enumerate(rows):
        src, target = row.slot, lo + b
        if src == target:
            continue
        holder = pool.window_rows.get(target)
        swap(src, target)
        row.slot, pool.window_rows[target] = target, row
        if holder is not None:
            holder.slot, pool.window_rows[src] = src, holder
        else:  # a free window: the allocator follows the move
            del pool.window_rows[src]
            pool.windows.refs[target], pool.windows.refs[src] = pool.windows.refs[src], 0
            del pool.windows.free[target]
            pool.windows.free[src] = None
    moved = [(d, o) for d, o in origin.items() if d != o]
    dst = mx.array([d for d, _ in moved], dtype=mx.int32)
    src = mx.array([o for _, o in moved], dtype=mx.int32)
    for l, shape in enumerate(pool.shapes):
        if shape is not None:
            a = pool.layers[l]
            pieces = [a.win_k[src], a.win_v[src]]
            mx.eval(pieces)  # copied out first, so the writes below update the buffers in place
            a.win_k[dst], a.win_v[dst] = pieces


def decode_update(layers: Sequence[PagedLayer], keys: mx.array, values: mx.array) -> StepIndex:
    """One token for each row (``keys`` [B,H,1,D], one row per view, all of one layer): rotate,
    write into the windows in one scatter per buffer, commit every tail that fills in one
    quantizer call, advance the views. Returns the step's index (for attention)."""
    index = step_index(layers)
    view0 = layers[0]
    pool, l = view0.row.pool, view0.l
    _, H, _, D = keys.shape
    a = pool.ensure_layer(l, H, D)
    G = view0.layout.tile_size
    a.win_k[index.write_slots, :, index.write_pos] = _rounded(keys, pool.window_dtype)[:, :, 0]
    a.win_v[index.write_slots, :, index.write_pos] = _rounded(values, pool.window_dtype)[:, :, 0]
    if index.commit_rows:
        tiles = quantize_blocks(a.win_k[index.commit_slots][:, :, G:].astype(STORE_DTYPE),
                                a.win_v[index.commit_slots][:, :, G:].astype(STORE_DTYPE), view0.layout)
        pool.write_records(l, index.commit_blocks, tiles)
    committing = set(index.commit_rows)
    for b, view in enumerate(layers):
        if view.offset >= G:
            if b in committing:
                view.num_tiles += 1
                view.tail_len = 0
            else:
                view.tail_len += 1
        view.offset += 1
    return index


def dequantize_blocks(fields: dict[str, mx.array], layout: KVLayout, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """Gathered record fields [B, nb, H, ...] -> rotated keys and values [B, H, nb*G, D] in ``dtype``."""
    k_codes = fields["k_codes"]
    B, nb, H, S, W, _ = k_codes.shape
    G = layout.tile_size
    k = mx.dequantize(k_codes, fields["k_alpha"][..., None].astype(dtype), fields["k_beta"][..., None].astype(dtype),
                      group_size=G, bits=layout.key_bits)  # [B,nb,H,S,W,G]
    k = k * fields["k_r"][..., None, :].astype(dtype)
    k = k.transpose(0, 2, 1, 5, 3, 4).reshape(B, H, nb * G, S * W)
    v = mx.dequantize(fields["v_codes"], fields["v_alpha"].astype(dtype), fields["v_beta"].astype(dtype),
                      group_size=W, bits=layout.value_bits)  # [B,nb,H,G,D]
    v = v * fields["v_c"][:, :, :, None, :].astype(dtype)
    v = v.transpose(0, 2, 1, 3, 4).reshape(B, H, nb * G, S * W)
    return k, v


def attention_dtype(queries: mx.array) -> mx.Dtype:
    """Float32 where that is the compute dtype, else float16 (the storage dtype: bfloat16 would
    round the float16 history again)."""
    return mx.float32 if queries.dtype == mx.float32 else mx.float16


def decode_attention(queries: mx.array, layers: Sequence[PagedLayer], index: StepIndex, scale: float) -> mx.array:
    """Decode attention of every row of one layer (queries [B, n_q, 1, D]) in one fused SDPA over
    [window (sink, tail) | records] read from the pool, after ``decode_update``."""
    view0 = layers[0]
    a = view0.row.pool.layers[view0.l]
    dtype = attention_dtype(queries)
    w = index.windows
    keys, vals = (a.win_k[w[0]: w[1]], a.win_v[w[0]: w[1]]) if isinstance(w, tuple) else (a.win_k[w], a.win_v[w])
    keys, vals = keys.astype(dtype), vals.astype(dtype)
    if index.table is not None:
        rec_k, rec_v = dequantize_blocks(view0.row.pool.gather_records(view0.l, index.table), view0.layout, dtype)
        keys, vals = mx.concatenate([keys, rec_k], axis=2), mx.concatenate([vals, rec_v], axis=2)
    q = rotate(queries.astype(mx.float32)).astype(dtype)
    out = mx.fast.scaled_dot_product_attention(q, keys, vals, scale=scale, mask=index.mask)
    return rotate(out.astype(mx.float32)).astype(queries.dtype)


class PagedBatch(BatchRows):
    """Layer ``l`` of the rows decoding together: one graph for all of them (the seam sends it to
    ``paged_attention``, never row by row). Rows join (``extend``) and leave (``filter``) between
    steps; nothing of theirs is copied."""

    row_type = PagedLayer

    def __init__(self, rows: Iterable[PagedLayer] = ()) -> None:
        self.index: StepIndex | None = None
        super().__init__(rows)

    def extend(self, rows: Iterable[PagedLayer]) -> None:
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
        self.index = None

    @property
    def offset(self) -> mx.array:
        return step_index(self.rows).offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        if keys.shape[0] != len(self.rows) or keys.shape[2] != 1:
            raise ValueError(f"a paged batch of {len(self.rows)} rows takes [B, H, 1, D] keys, not {keys.shape}")
        self.index = decode_update(self.rows, keys, values)
        return self, self

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        return None  # the validity mask is the step index's


def paged_attention(queries: mx.array, cache: PagedLayer | PagedBatch, scale: float, mask: Any) -> mx.array:
    """The seam's entry for paged caches: a whole decode batch, or one row's chunk or token."""
    from kvarn.attention import chunk_attention_over

    if isinstance(cache, PagedBatch):
        if cache.index is None:
            raise RuntimeError("paged batch attention before update_and_fetch")
        return decode_attention(queries, cache.rows, cache.index, scale)
    chunk = cache.chunk
    L = queries.shape[2]
    if chunk is not None and chunk.fresh:
        return mx.fast.scaled_dot_product_attention(queries, chunk.keys, chunk.values, scale=scale, mask=mask)
    if L > 1 and chunk is not None:
        sink_k, sink_v, rec_k, rec_v = cache.history(attention_dtype(queries))
        return chunk_attention_over(queries, sink_k, sink_v, rec_k, rec_v, chunk, cache.layout.tile_size, scale)
    return decode_attention(queries, [cache], step_index_after(cache), scale)


def step_index_after(view: PagedLayer) -> StepIndex:
    """The index a lone row's decode token was written with (its memo entry)."""
    memo = view.row.pool.__dict__.get("_step_memo")
    if memo is None or memo.value is None or memo.key is None or memo.key[0][0] != view.row.serial:
        raise RuntimeError("paged decode attention before update_and_fetch")
    return memo.value


def fork_rows(cache: list[Any]) -> list[Any]:
    """A row's per-layer caches forked: paged layers through their row (once for all layers)."""
    from kvarn.baselines import fork_cache

    forked: dict[int, PagedRow] = {}
    out = []
    for layer in cache:
        if isinstance(layer, PagedLayer):
            row = forked.get(id(layer.row))
            if row is None:
                row = forked[id(layer.row)] = layer.row.fork()
            out.append(row.layers[layer.l])
        else:
            out.append(fork_cache([layer])[0])
    return out


def as_record_arrays(fields: dict[str, mx.array]) -> RecordArrays:
    """Block-major fields of n blocks [n, ...] as one row's ``RecordArrays`` (the single-stream
    layout), for comparing the pool with ``KVarNKVCache`` byte for byte."""
    singles = [_single_tile({k: v[i] for k, v in fields.items()}) for i in range(fields["k_codes"].shape[0])]
    axes = {"k_codes": 4, "k_alpha": 4, "k_beta": 4, "k_r": 3, "v_codes": 2, "v_alpha": 2, "v_beta": 2, "v_c": 2}
    return RecordArrays(**{name: mx.concatenate([s[j] for s in singles], axis=axes[name])
                           for j, name in enumerate(RECORD_FIELDS)})
