"""The decode step of the baselines' slots (``kvarn.slots``): planned as arrays (``slot_plan``),
every row's token written and the batch attended inside the graph (``SlotStepLayer``), the one
place a slot decode token is written and attended.

    plan      host        the batch's slots made consecutive (``SlotStore._place``), each row's
                          write position, the validity mask [Bp, 1, 1, Tb], the fused ragged
                          kernel's launch plan at a fixed size where it attends
    graph     arrays      one scatter per buffer writes every row's token at its own position of
                          its slot; the batch's slots [lo, lo + Bp) up to Tb tokens attended
    finish    host        the store takes the new buffers; each row's offset + 1

How it attends (``SlotStepLayer.attend``): on CUDA with fp16 slots the fused ragged decode kernel
(``metal.cuda.ragged_decode``: every row over exactly its own tokens, read in place); on another
GPU with deep rows one unmasked fused attention per row (host lengths: such a step is never a
graph); else mlx-lm's attention, one masked call over the batch's slice (the CPU, always).

A model run through a ``SlotBatch`` itself (a model with layers of their own, a per-row step)
takes the same step one layer at a time, unpadded and uncompiled (``slot_write``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from kvarn.decode_graph import ROW_BUCKETS, DecodePlan, bucket
from kvarn.step_context import StepContext, step_of
from metal import KERNELS
from metal.selector import FUSED
from metal.cuda.ragged_decode import planned_attention as ragged_planned
from metal.cuda.ragged_decode import static_plan as ragged_plan
from metal.cuda.ragged_decode import static_splits as ragged_splits

if TYPE_CHECKING:  # annotations only: ``kvarn.slots`` imports this module
    from kvarn.slots import SlotBatch, SlotStore

# On a GPU without the fused ragged kernel, MLX's fused decode attention has no kernel for an array
# mask: a masked batch falls back to matmul + softmax. Past this mean row length, one unmasked fused call per row over exactly its own
# tokens is faster (H200, 8B shape, 32 rows: one layer 2.29 vs 4.59 ms at 16k; a whole step 137 vs
# 205 ms at 16k, but 76 vs 60 ms at 4k, where the per-row calls' host time outweighs the gain).
PER_ROW_MIN_TOKENS = 8192


def attends_per_row(batch: SlotBatch) -> bool:
    """Whether a decode batch of fp16 slots attends row by row (GPU, deep rows) or in one masked call."""
    if batch.store.quantized or mx.default_device() == mx.cpu:
        return False
    return sum(row.offset for row in batch.rows) >= PER_ROW_MIN_TOKENS * len(batch.rows)


def fused_decode_available(batch: SlotBatch) -> bool:
    """Whether the fused ragged kernel may attend this batch's rows (a CUDA backend with the kernel
    whose verdict is fused; fp16 slots): its launch plan is then made with the step's, at a fixed
    size (``metal.cuda.ragged_decode.static_plan``)."""
    b = KERNELS.backend
    if batch.store.quantized or b is None or getattr(b, "ragged_decode", None) is None:
        return False
    return KERNELS.ragged_decode_path() in FUSED


def slot_plan(batches: Sequence[SlotBatch], pad: bool = True, per_row: bool = False,
              shared: StepContext | None = None) -> DecodePlan | None:
    """The step of ``batches`` (one ``SlotBatch`` per layer, the same rows in each) planned as
    arrays; None where the batch attends row by row (a GPU without the fused ragged kernel, deep
    rows) unless ``per_row`` allows it (a step run uncompiled: the rows' lengths ride in
    ``static``). Where the fused ragged kernel attends, its launch plan is made here at a fixed
    size. ``pad`` False: exact sizes (rows, tokens). ``shared``: a forward's context, whose
    layers planned one at a time share the step's arrays (``slot_write``)."""
    first = batches[0]
    fused = fused_decode_available(first)
    lengths = None
    if not fused and attends_per_row(first):
        if not per_row:
            return None
        lengths = tuple(row.offset + 1 for row in first.rows)
    for row in first.rows:  # a row's layers hold its tokens at one offset in one capacity: the first layer's speak for all
        row._check_room(1)
    starts = [batch.store._place(batch.rows) for batch in batches]
    positions = tuple(row.offset for row in first.rows)
    B = len(positions)
    Bp = (bucket(B, ROW_BUCKETS) or B) if pad else B
    if any(not _free(batch.store, lo + B, lo + Bp) for batch, lo in zip(batches, starts)):
        Bp = B  # padding rows write only into free slots
    stores = [batch.store for batch in batches]
    T_cap = stores[0].token_capacity
    T = max(positions) + 1
    Tb = min(-(-T // stores[0].token_step) * stores[0].token_step, T_cap) if pad else T
    shapes = tuple(tuple((buf.shape, buf.dtype) for buf in store._buffers) for store in stores)
    splits = ragged_splits(Bp, Tb, shapes[0][0][0][1]) if fused else 0
    what = (positions, Bp, T_cap, splits, tuple(sorted(set(starts))) if fused else ())
    inputs = dict(shared.get(("slot_step", *what), lambda: _inputs(*what)) if shared is not None else _inputs(*what))
    state = [buf for store in stores for buf in store._buffers]
    static = ("slots", shapes, tuple(starts), Bp, Tb, first.store.bits, first.store.group_size, splits, lengths)

    def finish(arrays: list[mx.array]) -> None:
        k = 0
        for batch in batches:
            n = len(batch.store._buffers)
            batch.store._buffers = list(arrays[k: k + n])
            k += n
            for row in batch.rows:
                row.offset += 1

    return DecodePlan(static, inputs, state, B, Bp, _slot_caches, finish)


def _inputs(positions: tuple[int, ...], Bp: int, T_cap: int, splits: int,
            starts: tuple[int, ...]) -> dict[str, mx.array]:
    """The step's arrays: RoPE offsets (a padding row's 0) and write positions (a padding row's the
    last of a free slot), from which the graph makes the validity mask and each head count's
    write rows (``SlotStepLayer``); the fused kernel's launch plan per start."""
    B, i32 = len(positions), mx.int32
    row_lengths = [p + 1 for p in positions] + [1] * (Bp - B)
    inputs = {"offset": mx.array(list(positions) + [0] * (Bp - B), dtype=i32),
              "at": mx.array(list(positions) + [T_cap - 1] * (Bp - B), dtype=i32)}
    for lo in starts:  # every row's tokens in ``splits`` work items (``metal.cuda.ragged_decode.static_plan``)
        work, row_work, rows = ragged_plan([lo + b for b in range(Bp)], row_lengths, splits)
        inputs["rg_work"], inputs["rg_row_work"], inputs[f"rg_rows{lo}"] = work, row_work, rows
    return inputs


def slot_write(batch: SlotBatch, keys: mx.array, values: mx.array) -> tuple[SlotStepLayer, tuple[Any, Any]]:
    """One token for each row of one layer's ``batch`` (``keys`` [B, H, 1, D]) outside a planned
    graph: the step's write (``SlotStepLayer``) on the store's buffers, handed back to the store,
    the rows advanced. Returns the layer (whose ``attend`` is the step's attention) and the
    batch's slots [B, H, T, ...] it read back (T = the longest row after the write)."""
    if keys.shape[0] != len(batch.rows) or keys.shape[2] != 1:
        raise ValueError(f"a decode step takes [{len(batch.rows)}, H, 1, D], not {list(keys.shape)}")
    if not batch.store._buffers:
        raise ValueError("a decode step of rows that hold no token yet")
    plan = slot_plan([batch], pad=False, per_row=True, shared=step_of(batch))
    layer = plan.build(plan.static, plan.inputs, plan.state)[0]
    fetched = layer.update_and_fetch(keys, values)
    plan.finish(layer.arrays())
    return layer, fetched


def _free(store: SlotStore, lo: int, hi: int) -> bool:
    """Whether slots [lo, hi) exist and hold no row."""
    return hi <= store.num_slots and all(store._rows[s] is None for s in range(lo, hi))


def _slot_caches(static: tuple, inputs: dict[str, mx.array], state: list[mx.array]) -> list[Any]:
    _, shapes, starts, Bp, Tb, bits, group_size, splits, lengths = static
    caches, k = [], 0
    for lo, layer_shapes in zip(starts, shapes):
        n = len(layer_shapes)
        caches.append(SlotStepLayer(list(state[k: k + n]), lo, Bp, Tb, inputs, bits, group_size, splits, lengths))
        k += n
    return caches


class SlotStepLayer:
    """One layer of a planned slot decode step: every row's token written at its own position of
    its slot (one scatter per buffer, over its flat [S*H*T_cap, W] view), then the batch's slots
    [lo, lo + Bp) up to ``Tb`` tokens attended (module docstring)."""

    def __init__(self, buffers: list[mx.array], lo: int, Bp: int, Tb: int, inputs: dict[str, mx.array],
                 bits: int | None, group_size: int, splits: int = 0, lengths: tuple[int, ...] | None = None) -> None:
        self.buffers, self.lo, self.Bp, self.Tb, self.inputs = buffers, lo, Bp, Tb, inputs
        self.splits = splits  # > 0: the fused ragged kernel attends, with the plan's launch plan
        self.lengths = lengths  # the rows' lengths after the write where each attends alone (host ints)
        if bits is not None:
            self.bits, self.group_size = bits, group_size

    @property
    def offset(self) -> mx.array:
        return self.inputs["offset"]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """Row b sees its first ``offset + 1`` positions (a padding row its first), made once a step."""
        mask = self.inputs.get("mask")
        if mask is None:
            lengths = self.inputs["offset"] + 1
            mask = self.inputs["mask"] = (mx.arange(self.Tb, dtype=mx.int32)[None] < lengths[:, None]).reshape(
                self.Bp, 1, 1, self.Tb)
        return mask

    def write_rows(self, H: int, T_cap: int) -> mx.array:
        """The rows of a [slots * H * T_cap, W] view of the buffers that row b's head h writes,
        (row, head) major to minor, relative to slot ``lo``; made once a step for each H."""
        key = f"rows{H}"
        rows = self.inputs.get(key)
        if rows is None:
            heads = mx.arange(H, dtype=mx.int32)[None]
            slots = mx.arange(self.Bp, dtype=mx.int32)[:, None]
            rows = self.inputs[key] = ((slots * H + heads) * T_cap + self.inputs["at"][:, None]).reshape(-1)
        return rows

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        if getattr(self, "bits", None) is None:
            parts = [keys, values]
        else:
            parts = [*mx.quantize(keys, group_size=self.group_size, bits=self.bits),
                     *mx.quantize(values, group_size=self.group_size, bits=self.bits)]
        shape0 = self.buffers[0].shape
        H, T_cap = shape0[1], shape0[2]
        rows = self.write_rows(H, T_cap) + self.lo * H * T_cap
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
        if self.lengths is not None:  # one unmasked fused attention per row over its own tokens
            outs = [mx.fast.scaled_dot_product_attention(queries[b: b + 1], keys[b: b + 1, :, :n],
                                                         values[b: b + 1, :, :n], scale=scale, sinks=sinks)
                    for b, n in enumerate(self.lengths)]
            return mx.concatenate(outs, axis=0)
        return default(queries, keys, values, cache=self, scale=scale, mask=mask, sinks=sinks)

    def arrays(self) -> list[mx.array]:
        return self.buffers
