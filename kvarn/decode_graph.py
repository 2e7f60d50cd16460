"""A decode step as one pure function of arrays, so that it can run under ``mx.compile``.

A decode step of a batch (``kvarn.paged_batch.PagedBatch`` rows in the KVarN pool, or
``kvarn.slots.SlotBatch`` rows in the baselines' slots) splits into three parts:

    plan      host, once a step    which window, position and block each row writes; which tiles
                                   commit; block tables; validity masks (``paged_plan``, ``slot_plan``)
    graph     arrays only          every layer's write, commit and attention inside the model's
                                   forward, reading the plan's arrays and the storage's arrays and
                                   returning the storage's new arrays (``DecodePlan.caches`` /
                                   ``DecodePlan.written``)
    finish    host, after          the storage takes the new arrays; rows advance (offsets, tails)

Everything that varies from step to step is an input array; what the graph is specialised on
is the plan's ``static`` part: rows padded to a bucket (1, 2, 4, 8, ...), block tables padded to
a width bucket, the number of commits padded to a bucket, where the batch's windows or slots
start, the storage's shapes. So one compiled graph serves every step of the same bucket
(``engine/compiled_step.py`` keeps them). Padding rows decode token 0 at position 0, write to
the pool's reserved pad window (id 0; slots: a stale position of a slot inside the batch's
slice, which its own row rewrites before reading) and attend one valid position; a padding
commit quantizes the pad window into the pad block (id 0, never read unmasked). Their outputs
are never read.

Where a fused decode kernel attends (``metal.KERNELS``: the paged one for KVarN rows, the ragged
one for fp16 slots), the plan also holds its launch plan at a fixed size (the same number of work
items for every row, from the shapes alone: ``metal.paged_plan.static_plan``,
``metal.cuda.ragged_decode.static_plan``), so the kernel runs inside the compiled graph. Slot rows
on a GPU without the ragged kernel attend row by row and run through their caches' own
``update_and_fetch``/``attend`` (``plan_decode`` returns None).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from kvarn.layout import KVLayout
from kvarn.paged_attention import decode_attention_over, fused_attention
from kvarn.paged_step import advance, place_windows, plan_step, rounded
from kvarn.pool import PAD, RECORD_FIELDS, LayerArrays, quantize_window_tails
from kvarn.slot_attention import attends_per_row, fused_decode_available
from metal import KERNELS
from metal.paged_plan import DecodePlan as KernelPlan
from metal.paged_plan import static_plan, static_splits
from metal.cuda.ragged_decode import planned_attention as ragged_planned
from metal.cuda.ragged_decode import static_plan as ragged_plan
from metal.cuda.ragged_decode import static_splits as ragged_splits

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

def paged_plan(batches: Sequence[Any], pad: bool = True, counts: Sequence[int] | None = None) -> DecodePlan | None:
    """The step of ``batches`` (one ``PagedBatch`` per layer, the same rows in each) planned as
    arrays, or None where a fused kernel attends (it plans from host integers). ``counts``: the
    tokens each row writes this step (default one each; a row verifying drafts writes its last
    token and its drafts, all inside its tile: ``PagedRow.verify_room``; a windowed row writes one)."""
    views0 = batches[0].rows
    pool, layout = views0[0].row.pool, views0[0].layout
    fused = fused_attention()  # the fused kernel attends: its launch plan is made here, of a fixed size
    counts = list(counts) if counts is not None else [1] * len(views0)
    if fused and max(counts) > 1:
        return None  # the kernel attends one position a row: verifies run in a chunk forward
    if any(n > 1 and (v.row.max_kv_size is not None or v.row.verify_room() < n) for v, n in zip(views0, counts)):
        raise ValueError("a row writes several tokens in a decode step only inside its tile, unwindowed")
    place_windows([v.row for v in views0])
    before = [(v.offset, v.tail_len) for v in views0]
    index = plan_step(views0)
    B, G, T = len(views0), layout.tile_size, max(counts)
    Bp = (bucket(B, ROW_BUCKETS) or B) if pad else B
    lo = min(index.lengths.slots)
    consecutive = isinstance(index.windows, tuple)
    if not consecutive or lo + Bp > pool.windows.capacity:
        Bp = B if consecutive and lo + B <= pool.windows.capacity else Bp
    slice_lo = lo if consecutive and lo + Bp <= pool.windows.capacity else None
    L = index.lengths
    nb = max(L.num_tiles, default=0)
    nbp = table_bucket(nb) if pad else nb
    C = len(index.commit_rows)
    Cp = (bucket(C, COMMIT_BUCKETS) or C) if pad else C
    i32 = mx.int32
    extra = Bp - B
    counts += [1] * extra
    slots = list(L.slots) + [PAD] * extra
    num_tiles = list(L.num_tiles) + [0] * extra
    write_pos = [p for _, p in index.writes] + [0] * extra
    # position j of row b sees its window up to its own token j (the sink or the tail, as a one-token
    # step would after writing it) and every record of its table; a padding row position 0 of its window
    sink_end, tail_end = [], []
    for b in range(Bp):
        for j in range(T):
            k = min(j, counts[b] - 1)  # a padding position repeats the row's last real one (its output is dropped)
            if b >= B:
                sink_end.append(1), tail_end.append(0)
            elif before[b][0] < G:
                sink_end.append(before[b][0] + k + 1), tail_end.append(0)
            else:
                sink_end.append(G), tail_end.append(L.tail_len[b] + k)
    w = mx.arange(2 * G, dtype=i32)[None]
    se, te = (mx.array(x, dtype=i32)[:, None] for x in (sink_end, tail_end))
    mask = (w < se) | ((w >= G) & (w < G + te))  # [Bp*T, 2G]
    if nbp:
        nt = mx.repeat(mx.array(num_tiles, dtype=i32), T)[:, None]
        mask = mx.concatenate([mask, (mx.arange(nbp * G, dtype=i32)[None] // G) < nt], axis=1)
    commit_slots = [slots[b] for b in index.commit_rows] + [PAD] * (Cp - C)
    commit_ids = list(index.commit_blocks) + [PAD] * (Cp - C)
    layers = [b.rows[0].l for b in batches]
    heads = tuple(pool.shapes[l] for l in layers)
    inputs = {"offset": mx.array([v.offset for v in views0] + [0] * extra, dtype=i32),
              "mask": mask.reshape(Bp, 1, T, -1)}
    # (window, position) of token j of row b: its own window from its write position on; a padding
    # token (past the row's count, or a padding row's) goes to the pad window at position j
    targets = [(s, p + j) if j < n and b < B else (PAD, j)
               for b, (s, p, n) in enumerate(zip(slots, write_pos, counts)) for j in range(T)]
    for H in sorted({h for h, _ in heads}):
        inputs[f"rows{H}"] = mx.array([(s * H + h) * 2 * G + p for b in range(Bp) for h in range(H)
                                       for s, p in targets[b * T: (b + 1) * T]], dtype=i32)
    if slice_lo is None:
        inputs["windows"] = mx.array(slots, dtype=i32)
    if nbp:  # PAD is 0: the padding columns and rows point at the pad block
        inputs["table"] = mx.pad(index.table, ((0, extra), (0, nbp - nb))) if nb else mx.zeros((Bp, nbp), i32)
    if Cp:
        inputs["commit_slots"] = mx.array(commit_slots, dtype=i32)
        inputs["commit_ids"] = mx.array(commit_ids, dtype=i32)
    splits = 0
    if fused:  # every row's sink, records and tail in ``splits`` work items (``metal.paged_plan.static_plan``)
        splits = static_splits(Bp, nbp, heads[0][0])
        sink_len = list(L.sink_len) + [1] * extra
        tail_len = list(L.tail_len) + [0] * extra
        inputs["work"], inputs["row_work"], inputs["rows"] = static_plan(slots, sink_len, tail_len, num_tiles, splits)
    state = [x for l in layers for x in _paged_state(pool.layers[l])]
    static = ("paged", layout, heads, Bp, nbp, Cp, slice_lo, T, splits)

    def finish(arrays: list[mx.array]) -> None:
        k = 0
        for l in layers:
            a = pool.layers[l]
            a.win_k, a.win_v = arrays[k], arrays[k + 1]
            a.records = dict(zip(RECORD_FIELDS, arrays[k + 2: k + 2 + len(RECORD_FIELDS)]))
            k += 2 + len(RECORD_FIELDS)
        for batch in batches:
            advance(batch.rows, index)
            for view, n in zip(batch.rows, counts):
                if n > 1:  # the verify's other tokens (in the sink, or the tail)
                    view.offset += n - 1
                    if view.offset - (n - 1) > G:
                        view.tail_len += n - 1
            batch.index = None

    return DecodePlan(static, inputs, state, B, Bp, _paged_caches, finish, commits=Cp)


def _paged_state(a: LayerArrays) -> list[mx.array]:
    """What a layer's step reads and writes: its windows, then its records."""
    return [a.win_k, a.win_v, *(a.records[name] for name in RECORD_FIELDS)]


def _paged_caches(static: tuple, inputs: dict[str, mx.array], state: list[mx.array]) -> list[Any]:
    _, layout, heads, Bp, nbp, Cp, slice_lo, T, splits = static
    width = 2 + len(RECORD_FIELDS)
    return [PagedStepLayer(layout, state[i * width: (i + 1) * width], inputs, static)
            for i in range(len(heads))]


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

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        return None  # the validity mask is the plan's

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        a, G = self.a, self.layout.tile_size
        _, H, _, D = keys.shape
        rows = self.inputs[f"rows{H}"]
        shape = a.win_k.shape
        for name, x in (("win_k", keys), ("win_v", values)):
            flat = getattr(a, name).reshape(-1, D)
            flat[rows] = rounded(x, a.win_k.dtype).reshape(-1, D)
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
        _, _, _, Bp, nbp, _, slice_lo, T, splits = self.static
        G = self.layout.tile_size
        if splits:
            out = self._fused(queries, scale, Bp * splits)
            if out is not None:
                return out
        windows = (slice_lo, slice_lo + Bp) if slice_lo is not None else self.inputs["windows"]
        B, n_q, _, D = queries.shape
        mask = self.inputs["mask"]
        if T > 1:  # the T positions of a row as more query heads: head h's R*T rows are (r, t), r major
            queries = queries.reshape(B, n_q * T, 1, D)
            mask = mx.tile(mask, (1, 1, n_q // self.a.win_k.shape[1], 1))
        out = decode_attention_over(queries, self.a, self.layout, scale, windows=windows, win_len=2 * G,
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
        return [self.a.win_k, self.a.win_v, *(self.a.records[name] for name in RECORD_FIELDS)]


# --- the baselines' slots ----------------------------------------------------------------------

def slot_plan(batches: Sequence[Any], pad: bool = True) -> DecodePlan | None:
    """The step of ``batches`` (one ``SlotBatch`` per layer, the same rows in each) planned as
    arrays, or None where the batch attends row by row (a GPU without the fused ragged kernel).
    Where the fused ragged kernel attends, its launch plan is made here at a fixed size."""
    first = batches[0]
    fused = fused_decode_available(first)
    if not fused and attends_per_row(first):
        return None
    for batch in batches:
        for row in batch.rows:
            row._check_room(1)
    starts = [batch.store._place(batch.rows) for batch in batches]
    positions = [row.offset for row in first.rows]
    B = len(positions)
    Bp = (bucket(B, ROW_BUCKETS) or B) if pad else B
    if any(not _free(batch.store, lo + B, lo + Bp) for batch, lo in zip(batches, starts)):
        Bp = B  # padding rows write only into free slots
    stores = [batch.store for batch in batches]
    T_cap = stores[0].token_capacity
    T = max(positions) + 1
    Tb = min(-(-T // stores[0].token_step) * stores[0].token_step, T_cap) if pad else T
    i32 = mx.int32
    lengths = mx.array([p + 1 for p in positions] + [1] * (Bp - B), dtype=i32)
    inputs = {"offset": mx.array(positions + [0] * (Bp - B), dtype=i32),
              "mask": (mx.arange(Tb, dtype=i32)[None] < lengths[:, None]).reshape(Bp, 1, 1, Tb)}
    shapes = tuple(tuple((buf.shape, buf.dtype) for buf in store._buffers) for store in stores)
    for H in sorted({s[0][0][1] for s in shapes}):
        at = positions + [T_cap - 1] * (Bp - B)  # a padding row: the last position of a free slot
        inputs[f"rows{H}"] = mx.array([((b * H) + h) * T_cap + p for b, p in enumerate(at) for h in range(H)],
                                      dtype=i32)  # relative to the batch's first slot (``SlotStepLayer``)
    splits = 0
    if fused:  # every row's tokens in ``splits`` work items (``metal.cuda.ragged_decode.static_plan``)
        H = shapes[0][0][0][1]
        splits = ragged_splits(Bp, Tb, H)
        row_lengths = [p + 1 for p in positions] + [1] * (Bp - B)
        for lo in sorted(set(starts)):
            work, row_work, rows = ragged_plan([lo + b for b in range(Bp)], row_lengths, splits)
            inputs["rg_work"], inputs["rg_row_work"], inputs[f"rg_rows{lo}"] = work, row_work, rows
    state = [buf for store in stores for buf in store._buffers]
    static = ("slots", shapes, tuple(starts), Bp, Tb, first.store.bits, first.store.group_size, splits)

    def finish(arrays: list[mx.array]) -> None:
        k = 0
        for batch in batches:
            n = len(batch.store._buffers)
            batch.store._buffers = list(arrays[k: k + n])
            k += n
            for row in batch.rows:
                row.offset += 1

    return DecodePlan(static, inputs, state, B, Bp, _slot_caches, finish)


def _free(store: Any, lo: int, hi: int) -> bool:
    """Whether slots [lo, hi) exist and hold no row."""
    return hi <= store.num_slots and all(store._rows[s] is None for s in range(lo, hi))


def _slot_caches(static: tuple, inputs: dict[str, mx.array], state: list[mx.array]) -> list[Any]:
    _, shapes, starts, Bp, Tb, bits, group_size, splits = static
    caches, k = [], 0
    for lo, layer_shapes in zip(starts, shapes):
        n = len(layer_shapes)
        caches.append(SlotStepLayer(list(state[k: k + n]), lo, Bp, Tb, inputs, bits, group_size, splits))
        k += n
    return caches


class SlotStepLayer:
    """One layer of a planned slot decode step inside the graph: every row's token written at its
    own position of its slot (one scatter per buffer), then the batch's slots [lo, lo + Bp) up to
    ``Tb`` tokens under the plan's mask, through mlx-lm's attention (``kvarn.slots.SlotBatch``'s
    CPU path, as arrays)."""

    def __init__(self, buffers: list[mx.array], lo: int, Bp: int, Tb: int, inputs: dict[str, mx.array],
                 bits: int | None, group_size: int, splits: int = 0) -> None:
        self.buffers, self.lo, self.Bp, self.Tb, self.inputs = buffers, lo, Bp, Tb, inputs
        self.splits = splits  # > 0: the fused ragged kernel attends, with the plan's launch plan
        if bits is not None:
            self.bits, self.group_size = bits, group_size

    @property
    def offset(self) -> mx.array:
        return self.inputs["offset"]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        return self.inputs["mask"]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        if getattr(self, "bits", None) is None:
            parts = [keys, values]
        else:
            parts = [*mx.quantize(keys, group_size=self.group_size, bits=self.bits),
                     *mx.quantize(values, group_size=self.group_size, bits=self.bits)]
        shape0 = self.buffers[0].shape
        H, T_cap = shape0[1], shape0[2]
        rows = self.inputs[f"rows{H}"] + self.lo * H * T_cap
        for i, (buf, part) in enumerate(zip(self.buffers, parts, strict=True)):
            flat = buf.reshape(-1, buf.shape[3])
            flat[rows] = part.reshape(-1, part.shape[3]).astype(buf.dtype)
            self.buffers[i] = flat.reshape(buf.shape)
        view = [buf[self.lo: self.lo + self.Bp, :, : self.Tb] for buf in self.buffers]
        if len(view) == 2:
            return view[0], view[1]
        return tuple(view[:3]), tuple(view[3:])

    def attend(self, queries: mx.array, keys: Any, values: Any, *, scale: float, mask: Any,
               sinks: mx.array | None, dispatch: Any, default: Any) -> mx.array:
        if self.splits and sinks is None and len(self.buffers) == 2:
            buf_k, buf_v = self.buffers
            H, D = buf_k.shape[1], buf_k.shape[3]
            if KERNELS.ragged_decode(head_dim=D, n_rep=queries.shape[1] // H, dtype=queries.dtype,
                                     kv_dtype=buf_k.dtype) is not None:
                return ragged_planned(queries, buf_k, buf_v, self.inputs["rg_work"], self.inputs["rg_row_work"],
                                      self.inputs[f"rg_rows{self.lo}"], self.splits, scale)
        return default(queries, keys, values, cache=self, scale=scale, mask=mask, sinks=sinks)

    def arrays(self) -> list[mx.array]:
        return self.buffers
