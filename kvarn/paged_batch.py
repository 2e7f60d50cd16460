"""A decode batch of paged KVarN rows (``kvarn.paged``): one graph per layer for all of them.

Per layer, one scatter writes every row's new token into its window (the sink part while the row
is shorter than G, else the tail part), one batched quantizer call commits every tile that filled,
and attention reads each row's window (one slice: ``place_windows`` keeps a batch's windows
consecutive in batch order) and its records (gathered, dequantized) as one ``[B, H, T, D]`` operand
for one fused SDPA under a per-row validity mask. The index arrays and the mask are the same for
every layer of a step and are built once per step (``StepIndex``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from kvarn.batch import BatchRows
from kvarn.paged import PagedLayer, PagedRow, _rounded
from kvarn.pool import PAD, dequantize_blocks, quantize_window_tails
from kvarn.quantize import rotate
from kvarn.step import step_of
from metal import KERNELS
from metal.paged_plan import RowLengths, make_plan

@dataclass(frozen=True)
class StepIndex:
    """What every layer of one decode step shares: write targets, commits and attention indices.

    ``write_slots``/``write_pos`` send each row's new token into its window (position p < G: the
    sink part; else G + its tail length), ``writes`` the same (window, position) pairs as host
    ints; ``commit_rows`` are the rows whose tail fills (windows ``commit_slots``, new blocks
    ``commit_blocks``, the same as an array ``commit_ids``); after the write, ``windows`` (the
    batch's window ids, or a ``(lo, hi)`` range when they are consecutive: read as a slice) of
    which the first ``win_len`` tokens hold every row's valid ones, ``table`` [B, nb] (pad-filled)
    and ``mask`` [B, 1, 1, win_len + nb*G] select each row's valid sink, tail and record tokens;
    ``offset`` is the rows' RoPE offsets before the write; ``lengths`` the same per-row lengths as
    host ints (the fused kernel's split plan, memoized per head count in ``plans``, as are the
    windows' flat write rows: ``window_rows``)."""

    offset: mx.array
    write_slots: mx.array
    write_pos: mx.array
    commit_rows: tuple[int, ...]
    commit_slots: mx.array | None
    commit_blocks: tuple[int, ...]
    commit_ids: mx.array | None
    windows: mx.array | tuple[int, int]
    win_len: int
    table: mx.array | None
    mask: mx.array
    lengths: RowLengths
    writes: tuple[tuple[int, int], ...] = ()
    plans: dict = field(default_factory=dict, compare=False)

    def window_rows(self, H: int, G: int) -> mx.array:
        """[B*H] rows of the windows' flat [Nw*H*2G, D] view that this step's tokens go to (row b,
        head h: window ``write_slots[b]``, position ``write_pos[b]``), made once per head count."""
        key = ("rows", H)
        if key not in self.plans:
            self.plans[key] = mx.array([(slot * H + h) * 2 * G + pos for slot, pos in self.writes for h in range(H)],
                                       dtype=mx.int32)
        return self.plans[key]


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
    for view in layers:  # windowed rows drop what the new token no longer attends (before taking blocks)
        view.row.evict()
    blocks = tuple(layers[b].row.block_for(layers[b].num_tiles) for b in commits)
    kept = [view.row.kept(view.offset + 1, n) for view, n in zip(layers, num_tiles)]  # the whole table unwindowed
    num_tiles = [len(k) for k in kept]  # records in each row's table row (a windowed row's start mid-sequence)
    nb = max(num_tiles)
    i32 = mx.int32
    table = None
    if nb:
        table = mx.array([k + [PAD] * (nb - len(k)) for k in kept], dtype=i32)
    slots = [view.row.slot for view in layers]
    windows = (slots[0], slots[0] + len(slots)) if slots == list(range(slots[0], slots[0] + len(slots))) \
        else mx.array(slots, dtype=i32)
    win_len = max(G + t if t else s for s, t in zip(sink_len, tail_len))  # a sink-full row: G + its tail
    sl, tl, nt = (mx.array(x, dtype=i32)[:, None] for x in (sink_len, tail_len, num_tiles))
    w = mx.arange(win_len, dtype=i32)[None]
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
        commit_ids=mx.array(blocks, dtype=i32) if blocks else None,
        windows=windows,
        win_len=win_len,
        table=table,
        mask=mx.concatenate(parts, axis=1)[:, None, None, :] if nb else parts[0][:, None, None, :],
        lengths=RowLengths(tuple(slots), tuple(sink_len), tuple(tail_len), tuple(num_tiles)),
        writes=tuple(zip(slots, write_pos)),
    )


def step_index(layers: Sequence[PagedLayer]) -> StepIndex:
    """The step index for rows at these views' offsets: built by the first layer of a forward
    and read by the others from the forward's ``StepContext`` (they ask with the same rows at the
    same offsets, before their own writes). A forward holds one decode batch, or lone rows each
    decoding one token (a one-token prompt chunk): the first row's serial tells them apart."""
    def make() -> StepIndex:
        place_windows([v.row for v in layers])
        return _step_index(layers)

    return step_of(layers[0]).get(("paged_index", layers[0].row.serial), make)


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
    rows = index.window_rows(H, G)  # one scatter per buffer over its flat [Nw*H*2G, D] view: 4 nodes, no index ops
    shape = a.win_k.shape
    for name, x in (("win_k", keys), ("win_v", values)):
        flat = getattr(a, name).reshape(-1, D)
        flat[rows] = _rounded(x, pool.window_dtype).reshape(-1, D)
        setattr(a, name, flat.reshape(shape))
    if index.commit_rows:
        tiles = quantize_window_tails(a.win_k, a.win_v, index.commit_slots, view0.layout)  # read in place
        pool.write_records(l, index.commit_ids, tiles)
    committing = set(index.commit_rows)
    for b, view in enumerate(layers):
        view.chunk = None  # the row's last prompt chunk (raw keys and values) is no longer needed
        if view.offset >= G:
            if b in committing:
                view.num_tiles += 1
                view.tail_len = 0
            else:
                view.tail_len += 1
        view.offset += 1
    return index


def attention_dtype(queries: mx.array) -> mx.Dtype:
    """Float32 where that is the compute dtype, else float16 (the storage dtype: bfloat16 would
    round the float16 history again)."""
    return mx.float32 if queries.dtype == mx.float32 else mx.float16


def decode_attention(queries: mx.array, layers: Sequence[PagedLayer], index: StepIndex, scale: float) -> mx.array:
    """Decode attention of every row of one layer (queries [B, n_q, 1, D]) after ``decode_update``:
    the fused kernel (``metal.cuda.paged_decode``, on Apple GPUs ``metal.msl.paged_decode``: reads
    the pool in place) where ``metal.KERNELS`` has one for the shape,
    else one SDPA over [window (sink, tail) | records]
    gathered and dequantized from the pool (the reference path; where MLX reads quantized codes,
    the CPU and Metal, the records are read straight from the pool's codes instead:
    ``_quantized_matmul_attention``)."""
    view0 = layers[0]
    a = view0.row.pool.layers[view0.l]
    layout = view0.layout
    H, D = a.win_k.shape[1], a.win_k.shape[3]
    kernel = KERNELS.paged_decode(head_dim=D, tile_size=layout.tile_size, key_bits=layout.key_bits,
                                  value_bits=layout.value_bits, n_rep=queries.shape[1] // H)
    if kernel is not None and a.win_k.dtype == mx.float16 and queries.dtype != mx.float32:
        L = index.lengths
        plan = index.plans.get(H)
        if plan is None:
            plan = index.plans[H] = make_plan(L.slots, L.sink_len, L.tail_len, L.num_tiles, H)
        return kernel(queries=queries, records=a.records, win_k=a.win_k, win_v=a.win_v, table=index.table,
                      lengths=L, scale=scale, key_bits=layout.key_bits, value_bits=layout.value_bits, plan=plan)
    if reads_codes_directly():
        return _quantized_matmul_attention(queries, a, index, layout, scale)
    dtype = attention_dtype(queries)
    keys, vals = _windows(a, index)
    keys, vals = keys.astype(dtype), vals.astype(dtype)
    if index.table is not None:
        rec_k, rec_v = dequantize_blocks(view0.row.pool.gather_records(view0.l, index.table), view0.layout, dtype)
        keys, vals = mx.concatenate([keys, rec_k], axis=2), mx.concatenate([vals, rec_v], axis=2)
    q = rotate(queries.astype(mx.float32)).astype(dtype)
    out = mx.fast.scaled_dot_product_attention(q, keys, vals, scale=scale, mask=index.mask)
    return rotate(out.astype(mx.float32)).astype(queries.dtype)


def reads_codes_directly() -> bool:
    """Whether MLX here has ``quantized_matmul`` kernels for KVarN's transpose=False shapes (the CPU
    and Metal; MLX's CUDA backend has none for some of them, e.g. 2-bit values with few rows)."""
    return mx.default_device() == mx.cpu or mx.metal.is_available()


def _windows(a: Any, index: StepIndex) -> tuple[mx.array, mx.array]:
    """The batch's windows, their first ``index.win_len`` tokens (a slice when consecutive)."""
    w, n = index.windows, index.win_len
    if isinstance(w, tuple):
        return a.win_k[w[0]: w[1], :, :n], a.win_v[w[0]: w[1], :, :n]
    return a.win_k[w][:, :, :n], a.win_v[w][:, :, :n]


def _quantized_matmul_attention(queries: mx.array, a: Any, index: StepIndex, layout: Any, scale: float) -> mx.array:
    """The reference path where MLX reads quantized codes (CPU, Metal): scores and values of the
    records straight from the pool's codes through ``mx.gather_qmm`` (the block table picks each
    row's blocks: nothing is gathered or dequantized), the windows by plain matmuls, one softmax
    under the step's validity mask, in float32; the factored form keeps the per-token factors
    (k_r, v_c) outside the products. 10-13x the gather-and-dequantize path on a CPU at 900-2,000
    tokens a row (docs/benchmarks.md, "Decode speed")."""
    B, n_q, _, D = queries.shape
    H = a.win_k.shape[1]
    R, G, f32 = n_q // H, layout.tile_size, mx.float32
    win_k, win_v = _windows(a, index)
    q = rotate(queries.astype(f32)).reshape(B, H, R, D) * scale
    scores = [q @ mx.swapaxes(win_k, -1, -2).astype(f32)]
    table = index.table
    if table is not None:
        rec = a.records
        N, _, S, W, Gw = rec["k_codes"].shape
        nb = table.shape[1]
        heads = mx.arange(H)[:, None] * S + mx.arange(S)[None]  # [H, S]: (head, slice) of a block
        rows = mx.broadcast_to(mx.arange(B)[:, None, None, None] * (H * S) + heads, (B, nb, H, S))
        blocks = table[:, :, None, None] * (H * S) + heads  # [B, nb, H, S]
        q_s = q.reshape(B, H, R, S, W).transpose(0, 1, 3, 2, 4).reshape(B * H * S, R, W)
        raw = mx.gather_qmm(q_s, rec["k_codes"].reshape(N * H * S, W, Gw), rec["k_alpha"].reshape(N * H * S, W, 1),
                            rec["k_beta"].reshape(N * H * S, W, 1), lhs_indices=rows, rhs_indices=blocks,
                            transpose=False, group_size=G, bits=layout.key_bits)  # [B, nb, H, S, R, G]
        k_r = rec["k_r"][table].astype(f32)  # [B, nb, H, S, G]
        s_rec = mx.sum(raw * k_r[:, :, :, :, None, :], axis=3)  # [B, nb, H, R, G]
        scores.append(s_rec.transpose(0, 2, 3, 1, 4).reshape(B, H, R, nb * G))
    s = mx.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0]
    p = mx.softmax(mx.where(index.mask, s, -mx.inf), axis=-1)
    n = index.win_len
    out = p[..., :n] @ win_v.astype(f32)
    if table is not None:
        Dw = rec["v_codes"].shape[-1]
        p_r = p[..., n:].reshape(B, H, R, nb, G).transpose(0, 3, 1, 2, 4).reshape(B * nb * H, R, G)
        part = mx.gather_qmm(p_r, rec["v_codes"].reshape(N * H, G, Dw), rec["v_alpha"].reshape(N * H, G, S),
                             rec["v_beta"].reshape(N * H, G, S), lhs_indices=mx.arange(B * nb * H).reshape(B, nb, H),
                             rhs_indices=table[:, :, None] * H + mx.arange(H), transpose=False, group_size=D // S,
                             bits=layout.value_bits)  # [B, nb, H, R, D]
        out = out + mx.sum(part * rec["v_c"][table].astype(f32)[:, :, :, None, :], axis=1)
    return rotate(out).astype(queries.dtype).reshape(B, n_q, 1, D)


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
    if chunk is not None and (queries.shape[2] > 1 or chunk.start == 0):  # a prompt chunk (the first too)
        sink_k, sink_v, rec_k, rec_v = cache.history(attention_dtype(queries))
        return chunk_attention_over(queries, sink_k, sink_v, rec_k, rec_v, chunk, cache.layout.tile_size, scale,
                                    rec_first=cache.row.first, window=cache.row.max_kv_size, step=step_of(cache))
    if cache.index is None:
        raise RuntimeError("paged decode attention before update_and_fetch")
    return decode_attention(queries, [cache], cache.index, scale)
