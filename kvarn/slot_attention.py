"""How a decode batch of baseline slots (``kvarn.slots.SlotBatch``) attends on a GPU, where one
masked call over the batch's slice is not the fastest path.

* CUDA, fp16: the fused ragged decode kernel (``metal.cuda.ragged_decode``), one launch a layer that
  reads every row's own slot of the store's buffers in place over exactly its ``offset`` tokens
  (no mask), where the kernel has the shape and passed its self-check;
* other GPUs (or no kernel for the shape), deep rows: one unmasked fused SDPA per row;
* else (and always on the CPU): the caller's one masked call over the batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from kvarn.step import step_of
from metal import KERNELS
from metal.selector import FUSED
from metal.cuda.ragged_decode import make_plan as make_ragged_plan
from metal.cuda.ragged_decode import ragged_decode_attention

if TYPE_CHECKING:  # annotations only: ``kvarn.slots`` imports this module
    from kvarn.slots import SlotBatch


def fused_decode(cache: SlotBatch, queries: mx.array, sinks: mx.array | None) -> bool:
    """Whether a decode batch of fp16 slots runs the fused ragged decode kernel
    (``metal.cuda.ragged_decode``: one launch a layer over every row's own slot, no mask): where
    ``metal.KERNELS`` has it for the shape (CUDA; its self-check passed at first use)."""
    if cache.store.quantized or sinks is not None:
        return False
    buf = cache.store._buffers[0]
    return queries.shape[1] % buf.shape[1] == 0 and KERNELS.ragged_decode(
        head_dim=buf.shape[3], n_rep=queries.shape[1] // buf.shape[1], dtype=queries.dtype,
        kv_dtype=buf.dtype) is not None


def fused_decode_available(cache: SlotBatch) -> bool:
    """Whether the fused ragged kernel may attend this batch's rows (a CUDA backend with the kernel
    whose verdict is fused; fp16 slots): such a step is not planned as arrays (the kernel plans
    its launch from host integers)."""
    b = KERNELS.backend
    if cache.store.quantized or b is None or getattr(b, "ragged_decode", None) is None:
        return False
    return KERNELS.ragged_decode_path() in FUSED


def fused_decode_attention(queries: mx.array, cache: SlotBatch, scale: float) -> mx.array:
    """Every row of the batch over tokens [0, offset) of its own slot, read in place from the
    store's buffers by the fused kernel (after ``update_and_fetch`` wrote this step's token)."""
    keys, values = cache.store._buffers
    slots = tuple(row.slot for row in cache.rows)
    lengths = tuple(row.offset for row in cache.rows)
    H = keys.shape[1]
    plan = step_of(cache).get(("ragged_plan", H), lambda: make_ragged_plan(slots, lengths, H))  # one a forward
    return ragged_decode_attention(queries=queries, keys=keys, values=values, slots=slots, lengths=lengths,
                                   scale=scale, plan=plan)


# On a GPU without the fused ragged kernel, MLX's fused decode attention has no kernel for an array
# mask: a masked batch falls back to matmul + softmax. Past this mean row length, one unmasked fused call per row over exactly its own
# tokens is faster (H200, 8B shape, 32 rows: one layer 2.29 vs 4.59 ms at 16k; a whole step 137 vs
# 205 ms at 16k, but 76 vs 60 ms at 4k, where the per-row calls' host time outweighs the gain).
PER_ROW_MIN_TOKENS = 8192


def attends_per_row(cache: SlotBatch) -> bool:
    """Whether a decode batch of fp16 slots attends row by row (GPU, deep rows) or in one masked call."""
    if cache.store.quantized or mx.default_device() == mx.cpu:
        return False
    return sum(row.offset for row in cache.rows) >= PER_ROW_MIN_TOKENS * len(cache.rows)


def per_row_attention(queries: mx.array, keys: mx.array, values: mx.array, cache: SlotBatch,
                      scale: float, sinks: mx.array | None) -> mx.array:
    """One unmasked fused attention per row over its own ``offset`` tokens of the batch's view."""
    outs = [mx.fast.scaled_dot_product_attention(queries[b: b + 1], keys[b: b + 1, :, : row.offset],
                                                 values[b: b + 1, :, : row.offset], scale=scale, sinks=sinks)
            for b, row in enumerate(cache.rows)]
    return mx.concatenate(outs, axis=0)
