"""One decode step of paged KVarN rows (``kvarn.paged``): the plan every layer of the step shares
(``StepIndex``: write targets, commits, block tables, the validity mask), made once per forward,
and the write of every row's new token with the commit of every tile that fills.

Per layer, one scatter writes every row's new token into its window (the sink part while the row
is shorter than G, else the tail part) and one batched quantizer call commits every tile that
filled. The rows' windows are kept consecutive in batch order (``place_windows``) so attention
reads them as one slice. A lone row decoding one token runs the same path with B = 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx

from kvarn.pool import PAD, STORE_DTYPE, quantize_window_tails
from kvarn.quantize import rotate
from kvarn.step import step_of
from metal.paged_plan import RowLengths

if TYPE_CHECKING:  # annotations only: the views and rows are ``kvarn.paged``'s, which imports this module
    from kvarn.paged import PagedLayer, PagedRow


def rounded(x: mx.array, dtype: mx.Dtype) -> mx.array:
    """Keys or values rotated and rounded to float16 (the contract), held in the window's dtype."""
    out = rotate(x.astype(mx.float32)).astype(STORE_DTYPE)
    return out if dtype == STORE_DTYPE else out.astype(dtype)


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


def plan_step(layers: Sequence[PagedLayer]) -> StepIndex:
    """Plan one decode step for rows at these views' offsets (taking new blocks for commits,
    dropping what windowed rows no longer attend): host work, done once a step."""
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
        return plan_step(layers)

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
        flat[rows] = rounded(x, pool.window_dtype).reshape(-1, D)
        setattr(a, name, flat.reshape(shape))
    if index.commit_rows:
        tiles = quantize_window_tails(a.win_k, a.win_v, index.commit_slots, view0.layout)  # read in place
        pool.write_records(l, index.commit_ids, tiles)
    advance(layers, index)
    return index


def advance(layers: Sequence[PagedLayer], index: StepIndex) -> None:
    """The views after the step's write: one more token each, a tail that filled committed."""
    G = layers[0].layout.tile_size
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
