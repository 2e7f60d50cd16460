"""A decode step as one pure function of arrays, so that it can run under ``mx.compile``; the KVarN
pool's decode step.

The one decode write and attention of each storage: rows in the KVarN pool (``kvarn.paged``:
``PagedStepLayer`` here) and rows in the baselines' slots (``kvarn.slot_step.SlotStepLayer``). A
step splits into three parts:

    plan      host, once a step    which window, position and block each row writes; which tiles
                                   commit; block tables; validity masks (``paged_plan``,
                                   ``kvarn.slot_step.slot_plan``)
    graph     arrays only          every layer's write, commit and attention inside the model's
                                   forward, reading the plan's arrays and the storage's arrays and
                                   returning the storage's new arrays (``DecodePlan.build`` /
                                   ``written``)
    finish    host, after          the storage takes the new arrays; rows advance (offsets, tails)

Everything that varies from step to step is an input array; what the graph is specialised on
is the plan's ``static`` part: rows padded to a bucket (1, 2, 4, 8, ...), block tables padded to
a width bucket, the number of commits padded to a bucket, where the batch's windows or slots
start, the storage's shapes. So one compiled graph serves every step of the same bucket
(``engine/model_runner.py: DecodeGraphs`` keeps them). Padding rows decode token 0 at position 0, write to
the pool's reserved pad window (id 0; slots: the last position of a free slot after the batch's,
or no padding where none is free) and attend one valid position; a padding
commit quantizes the pad window into the pad block (id 0, never read unmasked). Their outputs
are never read.

A model run through its caches itself (a lone row's decode token or a one-token prompt chunk
through ``PagedLayer``, a model with layers of their own through ``PagedBatch``) takes the same
step one layer at a time, unpadded and uncompiled (``decode_write``: the plan made once a forward).

Where the fused paged decode kernel attends (``metal.KERNELS``), the plan also holds its launch
plan at a fixed size (the same number of work items for every row, from the shapes alone:
``metal.paged_plan.static_plan``), so the kernel runs inside the compiled graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from kvarn.attention import decode_attention_over, fused_attention
from kvarn.step_context import step_of
from kvarn.layout import KVLayout
from kvarn.pool import PAD, RECORD_FIELDS, STORE_DTYPE, LayerArrays, quantize_window_tails
from kvarn.quantize import rotate, rotate_pair_to, rotate_to
from metal import KERNELS
from metal.paged_plan import DecodePlan as KernelPlan
from metal.paged_plan import static_plan, static_splits

if TYPE_CHECKING:  # annotations only: ``kvarn.paged`` imports this module
    from kvarn.paged import PagedLayer, PagedRow

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
COMMIT_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= n (None: past the largest)."""
    return next((b for b in buckets if b >= n), None)


def table_bucket(nb: int) -> int:
    """Block-table widths in steps of about 1.25x (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24,
    32, 40, 48, 64, ...): a long generation meets a new width every ~25% of its length, and
    padding costs at most a quarter more record reads."""
    if nb <= 6:
        return nb
    top = 1 << (nb - 1).bit_length()  # the next power of two
    for width in (top // 2 + top // 8, top // 2 + top // 4, top // 2 + 3 * top // 8, top):
        if width >= nb:
            return width
    return top


@dataclass
class DecodePlan:
    """One decode step of a batch, planned (module docstring). ``static``: what the graph is
    specialised on (hashable); ``inputs``/``state``: the step's arrays and the storage's arrays
    the graph reads; ``rows``: real rows (the first ``rows`` of ``padded``); ``build(static,
    inputs, state)`` makes the per-layer caches a model runs through inside the graph, and
    ``written(caches)`` gives the storage's arrays after the forward; ``finish(arrays)`` hands
    them back to the storage and advances the rows (host)."""

    static: tuple
    inputs: dict[str, mx.array]
    state: list[mx.array]
    rows: int
    padded: int
    build: Callable[[tuple, dict[str, mx.array], list[mx.array]], list[Any]]
    finish: Callable[[list[mx.array]], None]
    commits: int = 0  # tiles the step commits (padded): the graph holds the quantizer


def written(caches: Sequence[Any]) -> list[mx.array]:
    """The storage arrays the graph's caches hold after the forward, in ``state`` order."""
    return [a for cache in caches for a in cache.arrays()]


# --- the KVarN pool ---------------------------------------------------------------------------

def rounded(x: mx.array, dtype: mx.Dtype) -> mx.array:
    """Keys or values rotated and rounded to float16 (the contract), held in the window's dtype."""
    if dtype == mx.float32:  # the CPU's windows: rounded in the rotation's pass
        return rotate(x.astype(mx.float32), half=True)
    out = rotate_to(x, STORE_DTYPE)
    return out if dtype == STORE_DTYPE else out.astype(dtype)


def rounded_pair(keys: mx.array, values: mx.array, dtype: mx.Dtype) -> mx.array:
    """``rounded(concatenate([keys, values]), dtype)`` ([2B, ...]: keys then values); on the GPU one
    launch (``kvarn.quantize.rotate_pair_to``), with no concatenation."""
    if dtype == STORE_DTYPE and keys.shape == values.shape:
        return rotate_pair_to(keys, values, STORE_DTYPE)
    return rounded(mx.concatenate([keys, values]), dtype)


@dataclass(frozen=True)
class PagedStep:
    """One decode step of paged rows, planned once for every layer (host work): ``static`` and
    ``inputs`` as ``DecodePlan``'s, ``commit_rows`` the rows whose tail fills, ``counts`` the
    tokens each row (padding rows included) writes; ``rows`` real rows, ``padded`` with padding."""

    static: tuple
    inputs: dict[str, mx.array]
    commit_rows: tuple[int, ...]
    counts: tuple[int, ...]
    rows: int
    padded: int


def plan_paged(views: Sequence[PagedLayer], heads: Sequence[tuple[int, int] | None], pad: bool = True,
               counts: Sequence[int] | None = None) -> PagedStep:
    """The step of rows at these views' offsets (one layer's views; one table serves every layer)
    as arrays, for layers of these (heads, head_dim): windows placed, blocks taken for the tiles
    that fill, windowed rows' dropped records let go. A step in which rows write several tokens
    (a verify) attends through ``decode_attention_over`` even where the fused kernel attends one
    position a row: the same graph, every row's positions as more query rows under the step's
    mask. ``pad`` False: exact sizes and the rows' windows up to their longest (a step run once,
    uncompiled)."""
    pool, layout = views[0].row.pool, views[0].layout
    counts = list(counts) if counts is not None else [1] * len(views)
    # the fused kernel attends one position a row: its launch plan is made here, of a fixed size
    fused = fused_attention() and max(counts) == 1
    if any(n > 1 and (v.row.max_kv_size is not None or v.row.verify_room() < n) for v, n in zip(views, counts)):
        raise ValueError("a row writes several tokens in a decode step only inside its tile, unwindowed")
    place_windows([v.row for v in views])
    B, G, T = len(views), layout.tile_size, max(counts)
    before = [v.offset for v in views]
    write_pos, commits, blocks, sink_len, tail_len, kept = _host_plan(views)
    num_tiles = [len(k) for k in kept]  # records in each row's table row (a windowed row's start mid-sequence)
    slots = [v.row.slot for v in views]
    consecutive = slots == list(range(slots[0], slots[0] + B))
    Bp = (bucket(B, ROW_BUCKETS) or B) if pad else B
    if not consecutive or slots[0] + Bp > pool.windows.capacity:
        Bp = B if consecutive and slots[0] + B <= pool.windows.capacity else Bp
    slice_lo = slots[0] if consecutive and slots[0] + Bp <= pool.windows.capacity else None
    nb = max(num_tiles, default=0)
    nbp = table_bucket(nb) if pad else nb
    C = len(commits)
    Cp = (bucket(C, COMMIT_BUCKETS) or C) if pad else C
    # the windows' first W tokens are read: 2G in a graph, else up to the longest row's last valid one
    W = 2 * G if pad or T > 1 else max(G + t if t else s for s, t in zip(sink_len, tail_len))
    i32 = mx.int32
    extra = Bp - B
    counts += [1] * extra
    slots += [PAD] * extra
    num_tiles += [0] * extra
    write_pos += [0] * extra
    # position j of row b sees its window up to its own token j (the sink or the tail, as a one-token
    # step would after writing it) and every record of its table; a padding row position 0 of its window.
    # Token j of row b goes to (window, position): its own window from its write position on; a padding
    # token (past the row's count, or a padding row's) to the pad window at position j
    sink_end, tail_end, target_slot, target_pos = [], [], [], []
    for b, (s, p, n) in enumerate(zip(slots, write_pos, counts)):
        for j in range(T):
            k = min(j, n - 1)  # a padding position repeats the row's last real one (its output is dropped)
            if b >= B:
                sink_end.append(1), tail_end.append(0)
            elif before[b] < G:
                sink_end.append(before[b] + k + 1), tail_end.append(0)
            else:
                sink_end.append(G), tail_end.append(tail_len[b] + k)
            real = j < n and b < B
            target_slot.append(s if real else PAD), target_pos.append(p + j if real else j)
    # the mask and the write rows are made from these inside the graph (``step_mask``, ``write_rows``)
    inputs = {"offset": mx.array(before + [0] * extra, dtype=i32),
              "ends": mx.array([sink_end, tail_end, target_slot, target_pos], dtype=i32)}
    if nbp:
        inputs["num_tiles"] = mx.array(num_tiles, dtype=i32)
    if slice_lo is None:
        inputs["windows"] = mx.array(slots, dtype=i32)
    if nbp:  # PAD is 0: the padding columns and rows point at the pad block
        inputs["table"] = mx.array([k + [PAD] * (nbp - len(k)) for k in kept] + [[PAD] * nbp] * extra, dtype=i32)
    if Cp:
        inputs["commit_slots"] = mx.array([slots[b] for b in commits] + [PAD] * (Cp - C), dtype=i32)
        inputs["commit_ids"] = mx.array(blocks + [PAD] * (Cp - C), dtype=i32)
    splits = 0
    if fused:  # every row's sink, records and tail in ``splits`` work items (``metal.paged_plan.static_plan``)
        splits = static_splits(Bp, nbp, next(shape[0] for shape in heads if shape is not None))
        inputs["work"], inputs["row_work"], inputs["rows"] = static_plan(
            slots, sink_len + [1] * extra, tail_len + [0] * extra, num_tiles, splits)
    static = ("paged", layout, tuple(heads), Bp, nbp, Cp, slice_lo, T, splits, W)
    return PagedStep(static, inputs, tuple(commits), tuple(counts), B, Bp)


def step_mask(inputs: dict[str, mx.array], static: tuple) -> mx.array:
    """The step's validity mask [Bp, 1, T, W + nbp * G] from its plan (``plan_paged``): position j
    of row b sees its window's sink up to ``sink_end``, its tail up to ``tail_end`` and the first
    ``num_tiles`` records of its table row. Made once in the graph (every layer reads it)."""
    mask = inputs.get("mask")
    if mask is None:
        G, Bp, nbp, T, W = static[1].tile_size, static[3], static[4], static[7], static[9]
        i32 = mx.int32
        w = mx.arange(W, dtype=i32)[None]
        se, te = inputs["ends"][0][:, None], inputs["ends"][1][:, None]
        mask = (w < se) | ((w >= G) & (w < G + te))  # [Bp*T, W]
        if nbp:
            nt = mx.repeat(inputs["num_tiles"], T)[:, None]
            mask = mx.concatenate([mask, (mx.arange(nbp * G, dtype=i32)[None] // G) < nt], axis=1)
        mask = inputs["mask"] = mask.reshape(Bp, 1, T, -1)
    return mask


def write_rows(inputs: dict[str, mx.array], static: tuple, H: int) -> mx.array:
    """Rows of a layer's windows flattened to [windows * H * 2G, D] that the step's tokens go to,
    (row, head, token) major to minor, for layers of ``H`` heads (``plan_paged``'s targets)."""
    key = f"rows{H}"
    rows = inputs.get(key)
    if rows is None:
        G, Bp, T = static[1].tile_size, static[3], static[7]
        slot, pos = inputs["ends"][2].reshape(Bp, 1, T), inputs["ends"][3].reshape(Bp, 1, T)
        heads = mx.arange(H, dtype=mx.int32).reshape(1, H, 1)
        rows = inputs[key] = ((slot * H + heads) * (2 * G) + pos).reshape(-1)
    return rows


def _host_plan(views: Sequence[PagedLayer]) -> tuple[list[int], ...]:
    """Where each row's token goes and what it attends after the write (host ints): (write
    positions in the window: p < G the sink part, else G + its tail length; the rows whose tail
    fills and the blocks their tiles take; sink and tail lengths; each row's kept blocks, the new
    tile's included). Windowed rows drop what the new token no longer attends first (before the
    commits take blocks: a block freed there can serve one)."""
    G = views[0].layout.tile_size
    write_pos, commits, sink_len, tail_len, num_tiles = [], [], [], [], []
    for b, view in enumerate(views):
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
    for view in views:
        view.row.evict()
    blocks = [views[b].row.block_for(views[b].num_tiles) for b in commits]
    kept = [view.row.kept(view.offset + 1, n) for view, n in zip(views, num_tiles)]  # the whole table unwindowed
    return write_pos, commits, blocks, sink_len, tail_len, kept


def paged_plan(batches: Sequence[Any], pad: bool = True, counts: Sequence[int] | None = None) -> DecodePlan:
    """The step of ``batches`` (one ``PagedBatch`` per layer, the same rows in each) planned as
    arrays for one graph of every layer (``plan_paged``). ``counts``: the tokens each row writes
    this step (default one each; a row verifying drafts writes its last token and its drafts, all
    inside its tile: ``PagedRow.verify_room``; a windowed row writes one)."""
    views0 = batches[0].rows
    pool = views0[0].row.pool
    layers = [b.rows[0].l for b in batches]
    step = plan_paged(views0, [pool.shapes[l] for l in layers], pad, counts)
    state = [x for l in layers for x in _paged_state(pool.layers[l])]

    def finish(arrays: list[mx.array]) -> None:
        width = 2 + len(RECORD_FIELDS) if step.static[5] else 2  # records come back only where written
        for i, l in enumerate(layers):
            _hand_back(pool.layers[l], arrays[i * width: (i + 1) * width])
        advance(views0, step)  # every layer's views stood where the first layer's did: they follow it
        for batch in batches[1:]:
            for view, first in zip(batch.rows, views0):
                view.offset, view.tail_len, view.num_tiles, view.chunk = first.offset, first.tail_len, first.num_tiles, None

    return DecodePlan(step.static, step.inputs, state, step.rows, step.padded, _paged_caches, finish,
                      commits=step.static[5])


def decode_step(views: Sequence[PagedLayer]) -> PagedStep:
    """The step of one layer's ``views`` decoding a token each outside a planned graph (a lone
    row's token, a one-token prompt chunk, a batch a model runs through directly), exact sizes:
    planned by the first layer that asks and read by the others from the forward's
    ``StepContext`` (asked with the same rows at the same offsets, before their own writes); the
    first row's serial tells apart the batches of one forward."""
    row = views[0].row
    return step_of(views[0]).get(("paged_step", row.serial, len(views)),
                                 lambda: plan_paged(views, row.pool.shapes, pad=False))


def decode_write(views: Sequence[PagedLayer], keys: mx.array, values: mx.array) -> PagedStepLayer:
    """One token for each of one layer's ``views`` (``keys`` [B, H, 1, D]) outside a planned graph:
    the planned step's write (``PagedStepLayer``) on the pool's arrays, handed back to the pool,
    the views advanced. Returns the layer, whose ``attend`` is the step's attention."""
    if keys.shape[0] != len(views) or keys.shape[2] != 1:
        raise ValueError(f"a decode step of {len(views)} rows takes [B, H, 1, D] keys, not {keys.shape}")
    step = decode_step(views)
    _, H, _, D = keys.shape
    a = views[0].row.pool.ensure_layer(views[0].l, H, D)
    layer = PagedStepLayer(views[0].layout, _paged_state(a), step.inputs, step.static)
    layer.update_and_fetch(keys, values)
    _hand_back(a, layer.arrays())
    advance(views, step)
    return layer


def advance(views: Sequence[PagedLayer], step: PagedStep) -> None:
    """The views after the step's write: each row's tokens more (a tail that filled committed; a
    verify's tokens in the sink or the tail)."""
    G = views[0].layout.tile_size
    committing = set(step.commit_rows)
    for b, view in enumerate(views):
        view.chunk = None  # the row's last prompt chunk (raw keys and values) is no longer needed
        if view.offset >= G:
            if b in committing:
                view.num_tiles += 1
                view.tail_len = 0
            else:
                view.tail_len += 1
        view.offset += 1
        n = step.counts[b]
        if n > 1:  # the verify's other tokens (in the sink, or the tail)
            view.offset += n - 1
            if view.offset - (n - 1) > G:
                view.tail_len += n - 1


def place_windows(rows: Sequence[PagedRow]) -> None:
    """Give a decode batch's rows consecutive windows in batch order, so every layer reads them
    as one slice instead of a gather (on MLX's CPU a gathered batch made a step ~3x slower).

    The batch always takes the lowest windows, 1 .. B (0 is the pad), so that the range, which
    the step's graph is specialised on, is the same for every batch of B rows: a new wave of
    requests, whose windows were handed out in the order their prompts were prefilled, runs the
    graphs the last one compiled (on this project's CPU a new trace of the bundled model's step
    took 250-400 ms). A row whose window is elsewhere swaps windows with whatever holds its
    target (another batch row, a row still prefilling, or a free window). Nothing moves while
    the rows sit in order (the steady state: a row keeps its place in the batch, one that joins
    takes a hole or the end); after a membership change each moved window (2G tokens a layer) is
    copied once."""
    pool, B = rows[0].pool, len(rows)
    lo = PAD + 1
    if all(r.slot == lo + b for b, r in enumerate(rows)) or lo + B > pool.windows.capacity:
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


def _paged_state(a: LayerArrays) -> list[mx.array]:
    """What a layer's step reads and writes: its windows, then its records."""
    records = a.records
    return [a.win_k, a.win_v, *map(records.__getitem__, RECORD_FIELDS)]


def _hand_back(a: LayerArrays, arrays: Sequence[mx.array]) -> None:
    """A layer's arrays after its step (``_paged_state``'s order; the windows alone in a step
    that commits no tile) back into the pool."""
    a.win_k, a.win_v = arrays[0], arrays[1]
    if len(arrays) > 2:
        a.records = dict(zip(RECORD_FIELDS, arrays[2:]))


def _paged_caches(static: tuple, inputs: dict[str, mx.array], state: list[mx.array]) -> list[Any]:
    layout, heads = static[1], static[2]
    width = 2 + len(RECORD_FIELDS)
    return [PagedStepLayer(layout, state[i * width: (i + 1) * width], inputs, static) for i in range(len(heads))]


class PagedStepLayer:
    """One layer of a planned KVarN decode step inside the graph: mlx-lm's cache protocol over
    the pool's arrays as the graph's values (``offset`` for RoPE; ``update_and_fetch`` writes
    every row's token and commits the step's tiles; ``attend`` for the attention seam)."""

    def __init__(self, layout: KVLayout, state: list[mx.array], inputs: dict[str, mx.array], static: tuple) -> None:
        self.layout = layout
        self.inputs = inputs
        self.static = static
        self.records_written = static[5] > 0
        self.a = LayerArrays(records=dict(zip(RECORD_FIELDS, state[2:])), win_k=state[0], win_v=state[1])

    @property
    def offset(self) -> mx.array:
        return self.inputs["offset"]

    @property
    def windows(self) -> mx.array | tuple[int, int]:
        """The batch's windows: a ``(lo, hi)`` range read as one slice, else their ids."""
        slice_lo, Bp = self.static[6], self.static[3]
        return (slice_lo, slice_lo + Bp) if slice_lo is not None else self.inputs["windows"]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        return None  # the validity mask is the plan's

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        a = self.a
        _, H, _, D = keys.shape
        rows = write_rows(self.inputs, self.static, H)
        shape, n = a.win_k.shape, keys.shape[0]
        both = rounded_pair(keys, values, a.win_k.dtype)  # one rotation for both: fewer launches a layer
        for name, x in (("win_k", both[:n]), ("win_v", both[n:])):
            flat = getattr(a, name).reshape(-1, D)
            flat[rows] = x.reshape(-1, D)
            setattr(a, name, flat.reshape(shape))
        if self.records_written:
            tiles = quantize_window_tails(a.win_k, a.win_v, self.inputs["commit_slots"], self.layout)
            ids = self.inputs["commit_ids"]
            for name in RECORD_FIELDS:
                a.records[name][ids] = tiles[name].astype(a.records[name].dtype)
        return None, None

    def attend(self, queries: mx.array, keys: Any, values: Any, *, scale: float, mask: Any,
               sinks: mx.array | None, dispatch: Any, default: Any) -> mx.array:
        if sinks is not None:
            raise ValueError("KVarN attention does not support attention sinks")
        Bp, T, splits, W = self.static[3], self.static[7], self.static[8], self.static[9]
        if splits:
            out = self._fused(queries, scale, Bp * splits)
            if out is not None:
                return out
        B, n_q, _, D = queries.shape
        mask = step_mask(self.inputs, self.static)
        if T > 1:  # the T positions of a row as more query heads: head h's R*T rows are (r, t), r major
            queries = queries.reshape(B, n_q * T, 1, D)
            mask = mx.tile(mask, (1, 1, n_q // self.a.win_k.shape[1], 1))
        out = decode_attention_over(queries, self.a, self.layout, scale, windows=self.windows, win_len=W,
                                    table=self.inputs.get("table"), mask=mask)
        return out.reshape(B, n_q, T, D)

    def _fused(self, queries: mx.array, scale: float, num_items: int) -> mx.array | None:
        """The fused decode kernel over the pool in place, with the plan's fixed-size launch plan;
        None where it has no template for this shape (the reference path runs)."""
        a, layout = self.a, self.layout
        H, D = a.win_k.shape[1], a.win_k.shape[3]
        kernel = KERNELS.paged_decode(head_dim=D, tile_size=layout.tile_size, key_bits=layout.key_bits,
                                      value_bits=layout.value_bits, n_rep=queries.shape[1] // H)
        if kernel is None or a.win_k.dtype != mx.float16 or queries.dtype == mx.float32:
            return None
        plan = KernelPlan(work=self.inputs["work"], row_work=self.inputs["row_work"], rows=self.inputs["rows"],
                          num_items=num_items)
        return kernel(queries=queries, records=a.records, win_k=a.win_k, win_v=a.win_v, table=self.inputs.get("table"),
                      lengths=None, scale=scale, key_bits=layout.key_bits, value_bits=layout.value_bits, plan=plan)

    def arrays(self) -> list[mx.array]:
        """The arrays the step wrote: the windows, and the records where it commits tiles."""
        if not self.records_written:
            return [self.a.win_k, self.a.win_v]
        return [self.a.win_k, self.a.win_v, *(self.a.records[name] for name in RECORD_FIELDS)]
