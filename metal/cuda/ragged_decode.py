"""Fused ragged decode attention over the fp16 baseline's slot buffers (CUDA, ``mx.fast.cuda_kernel``).

One launch attends every decoding row of one layer (plus a tiny combine launch when rows are
split): split-K flash decoding over each row's tokens, K and V read in place from the shared
``[N, H, T_cap, D]`` buffers of ``kvarn.slots.SlotStore`` (row b: tokens [0, lengths[b]) of slot
slots[b]), online softmax in float32, the n_q/H query heads of a KV head folded into one block so
each K/V row is read once per KV head. No tensor cores: it is bandwidth bound, so the body is about
bytes in flight (16-byte loads, 8 K and 8 V rows a lane issued before the math). Design notes and
what was verified where: docs/kernels.md.

A row's tokens and how the work list cuts them into splits::

    slot slots[b], KV head h:  keys[slots[b], h, 0 : lengths[b], :]   (the rest of T_cap is never read)
    work item = (row b, first token, end token); one block per (work item, KV head)
    every row one item (FINAL): the attention launch writes [B, n_q, D] itself, no combine
    else: partials o [items, H, NR, D] f32 and (m, l) [items, H, NR, 2] f32, then the combine launch

The buffers must be the store's whole, row-contiguous arrays (``mx.fast.cuda_kernel`` copies a
non-contiguous view first: pass ``buf``, not ``buf[lo:hi, :, :T]``); T_cap is read from their
shape and passed as a kernel input, so a store that grows does not recompile anything. Templates:
the queries' and the K/V dtypes, D and n_rep (and FINAL) only.

The kernel's CUDA text is ``metal/cuda/src/ragged_decode.cuh`` (header), ``ragged_decode.cu``
(attention body) and ``ragged_decode_combine.cu`` (combine body), read at import
(``metal.sources``) into ``HEADER``, ``ATTENTION_SOURCE`` and ``COMBINE_SOURCE``; the thread layout
is described below the constants. The module owns the split plan, the launches and the wrapper.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from metal.cuda.paged_decode import Launch
from metal.device import planning_sms
from metal.launch import minify, scalar_inputs
from metal.sources import source

NUM_THREADS = 128  # one block: 4 warps
# The split policy (bench/kernel_ragged_decode.py compares it with one item a row and with always splitting). A
# wave is (the device's multiprocessors: metal.device) x RESIDENT_BLOCKS blocks; when the batch's tokens x KV
# heads would give fewer than TARGET_WAVES waves of blocks at one item a row, the rows are cut into splits of about
# (all tokens x KV heads) / (TARGET_WAVES waves) tokens, so a long row does not leave the GPU idle behind it;
# never into splits shorter than MIN_SPLIT tokens (rows under 2 x MIN_SPLIT tokens stay one item: a split's
# fixed cost, its query load, merge and partial write, would outweigh its ~MIN_SPLIT x 512 bytes of K/V a head).
# The kernel benchmark (bench/kernel_ragged_decode.py, its K/V re-read from the L2 cache) favoured one item a row
# for a few rows of up to 16k tokens, but inside the engine's step, K/V streamed from HBM, one 4k row decoded in
# 9.3 ms a step split against 12.2 ms as one item, at 1k 8.6 against 9.0 (H100, 8B shape): so there is no
# one-item exception for few rows (docs/benchmarks.md, "Kernels").
RESIDENT_BLOCKS = 3  # blocks resident per SM (an estimate from the register count: bench --compile)
TARGET_WAVES = 2
MIN_SPLIT = 256
SPLIT_ALIGN = 64  # split edges at multiples of this many tokens (one pass of the 4 warps at D = 128)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (mx.float16, mx.bfloat16)
MAX_REP = 8  # query heads per KV head folded into one block

ATTENTION_INPUTS = ["queries", "keys", "values", "rows", "work", "meta", "meta_f"]
ATTENTION_OUTPUTS = ["part_o", "part_ml"]
COMBINE_INPUTS = ["part_o", "part_ml", "row_work"]
COMBINE_OUTPUTS = ["out"]


# ---- the CUDA source: a small header, the split-K attention body and the combine body, as
# ``mx.fast.cuda_kernel`` takes them (bodies only: MLX writes the signature from the input and output
# names and the template arguments QT, KT, D, NR, FINAL). The layout and the algorithm: the module
# docstring and docs/kernels.md.
#
# Thread layout of one block (one work item x one KV head, 128 threads = 4 warps):
#
#     LPR = D / 8 lanes read one key row, 16 bytes (8 elements) each: D = 64 / 128 / 256 -> 8 / 16 / 32
#     RPW = 32 / LPR key rows per warp-wide load (a group of LPR lanes per row): 4 / 2 / 1
#     U   = 8 (NR <= 4) or 4 rows a lane loads, K and V, before any math: CH = RPW * U tokens a warp pass
#     warp w takes the item's tokens [t0 + (4 i + w) CH, t0 + (4 i + w + 1) CH), i = 0, 1, ...
#     lane (group g, sub s) reads channels [8 s, 8 s + 8) of tokens base + u RPW + g, u < U
#
# Each group keeps its own online-softmax state (m, l, o over its 8 channels) for the NR heads; at the
# end of the item the groups of a warp are merged through shuffles, the 4 warps through shared memory.
HEADER = source("cuda", "ragged_decode.cuh")
ATTENTION_SOURCE = source("cuda", "ragged_decode.cu")
COMBINE_SOURCE = source("cuda", "ragged_decode_combine.cu")

_ATTENTION_TEXT = (minify(HEADER), minify(ATTENTION_SOURCE))
_COMBINE_TEXT = (minify(HEADER), minify(COMBINE_SOURCE))


@functools.cache
def _kernel(name: str, header: str, source: str, input_names: tuple[str, ...], output_names: tuple[str, ...]):
    """The compiled kernel of one text (MLX caches the templates under it)."""
    return mx.fast.cuda_kernel(name=name, input_names=list(input_names), output_names=list(output_names),
                               source=source, header=header)


@dataclass(frozen=True)
class RaggedPlan:
    """One step's split of every row's tokens into work items (host lists and their device arrays);
    built once a step (``make_plan``) and shared by every layer of it.

    ``work`` [num_items, 3]: (row, first token, end token); ``row_work`` [B + 1]: row b's items are
    ``row_work[b]:row_work[b+1]``; ``rows`` [B]: row b's slot; ``items``: ``work`` as host tuples;
    ``slots`` / ``lengths``: what it was made for (the wrapper checks a given plan against them)."""

    work: mx.array
    row_work: mx.array
    rows: mx.array
    num_items: int
    items: tuple[tuple[int, int, int], ...]
    slots: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def final(self) -> bool:
        """Every row is one work item: the attention launch writes the output itself."""
        return self.num_items == len(self.lengths)


def plan_splits(lengths: Sequence[int], n_kv_heads: int, num_sms: int | None = None,
                resident_blocks: int = RESIDENT_BLOCKS, waves: int = TARGET_WAVES, min_split: int = MIN_SPLIT,
                align: int = SPLIT_ALIGN, single: bool | None = None) -> list[tuple[int, int, int]]:
    """Cut each row's tokens [0, length) into work items (row, first, end), in row order.

    ``single`` True: one item a row; False: the finest split (``per = min_split``, whatever the
    batch); None: the policy below. Split size: ``per = max(min_split, ceil(sum(lengths)
    x n_kv_heads / (waves x num_sms x resident_blocks)))`` tokens; row b gets ``max(1, min(ceil(len /
    per), len // min_split))`` items of about the same size, inner edges rounded to multiples of
    ``align`` (so every item has >= min_split - align tokens unless the row is shorter). ``num_sms``:
    the multiprocessors to fill (None: the device's, ``metal.device.planning_sms``)."""
    lengths = [int(n) for n in lengths]
    if single:
        return [(b, 0, n) for b, n in enumerate(lengths)]
    target = max(1, waves * planning_sms(num_sms) * resident_blocks)
    per = max(1, min_split, math.ceil(sum(lengths) * n_kv_heads / target))
    if single is False:
        per = max(1, min_split)
    work = []
    for b, n in enumerate(lengths):
        k = max(1, min(-(-n // per), n // max(1, min_split)))
        edges = [0] + [min(n, round(n * i / k / align) * align) for i in range(1, k)] + [n]
        edges = sorted(set(edges))  # (no duplicates where align <= min_split; kept for any align)
        work.extend((b, lo, hi) for lo, hi in zip(edges, edges[1:]))
    return work


def make_plan(slots: Sequence[int], lengths: Sequence[int], n_kv_heads: int, **policy) -> RaggedPlan:
    """The step's plan (``plan_splits``'s keywords pass through)."""
    slots, lengths = tuple(int(s) for s in slots), tuple(int(n) for n in lengths)
    if len(slots) != len(lengths) or not lengths:
        raise ValueError(f"{len(slots)} slots for {len(lengths)} lengths")
    if min(lengths) < 1 or min(slots) < 0:
        raise ValueError(f"lengths must be >= 1 and slots >= 0 (lengths {lengths}, slots {slots})")
    work = plan_splits(lengths, n_kv_heads, **policy)
    row_work = [0] * (len(slots) + 1)
    for b, _, _ in work:
        row_work[b + 1] += 1
    for b in range(len(slots)):
        row_work[b + 1] += row_work[b]
    i32 = mx.int32
    return RaggedPlan(work=mx.array(work, dtype=i32).reshape(-1, 3), row_work=mx.array(row_work, dtype=i32),
                      rows=mx.array(slots, dtype=i32), num_items=len(work), items=tuple(work), slots=slots,
                      lengths=lengths)


def static_splits(rows: int, tokens: int, n_kv_heads: int, num_sms: int | None = None) -> int:
    """Work items a row for a step whose shapes are fixed ahead (a compiled decode step: ``rows``
    padded to a bucket, rows of at most ``tokens`` tokens), from those shapes alone, by
    ``plan_splits``' policy at that size: the split count of a ``tokens``-long row."""
    target = max(1, TARGET_WAVES * planning_sms(num_sms) * RESIDENT_BLOCKS)
    per = max(1, MIN_SPLIT, math.ceil(rows * tokens * n_kv_heads / target))
    return max(1, min(-(-tokens // per), tokens // MIN_SPLIT))


def static_plan(slots: Sequence[int], lengths: Sequence[int], splits: int) -> tuple[mx.array, mx.array, mx.array]:
    """(work, row_work, rows) arrays of a plan with exactly ``splits`` items a row (a row shorter
    than its items leaves some empty: the kernel gives an empty item no weight), so the launch's
    grid depends on the shapes only and a compiled step replays it (``planned_attention``)."""
    work = [(b, n * i // splits, n * (i + 1) // splits) for b, n in enumerate(lengths) for i in range(splits)]
    i32 = mx.int32
    return (mx.array(work, dtype=i32).reshape(-1, 3), mx.array([b * splits for b in range(len(lengths) + 1)], dtype=i32),
            mx.array(list(slots), dtype=i32))


def planned_attention(queries: mx.array, keys: mx.array, values: mx.array, work: mx.array, row_work: mx.array,
                      rows: mx.array, splits: int, scale: float) -> mx.array:
    """``ragged_decode_attention`` with a plan of ``splits`` items a row given as arrays
    (``static_plan``'s, or a compiled step's values of them): no host integer of the step."""
    B = queries.shape[0]
    plan = RaggedPlan(work=work, row_work=row_work, rows=rows, num_items=B * splits, items=(), slots=(),
                      lengths=(0,) * B)
    return _attend(queries, keys, values, plan, scale)


def _attend(queries: mx.array, keys: mx.array, values: mx.array, plan: RaggedPlan, scale: float) -> mx.array:
    """The attention launch, then the combine where rows are split: [B, n_q, 1, D]."""
    B, n_q, _, D = queries.shape
    call = attention_launch(queries, keys, values, plan, scale)
    part_o, part_ml = _run(call)
    if call.final:
        return part_o.reshape(B, n_q, 1, D)
    (out,) = _run(combine_launch(part_o, part_ml, plan, queries))
    return out.reshape(B, n_q, 1, D)


def is_supported(*, head_dim: int, n_rep: int, dtype: mx.Dtype = mx.float16, kv_dtype: mx.Dtype | None = None) -> bool:
    """Whether the kernel has a template for this shape (queries' ``dtype``, K/V ``kv_dtype``, default
    the same); else callers use the reference."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    return (head_dim in SUPPORTED_HEAD_DIMS and 1 <= n_rep <= MAX_REP and dtype in SUPPORTED_DTYPES
            and kv_dtype in SUPPORTED_DTYPES)


@functools.lru_cache(maxsize=64)
def _template(q_dtype: mx.Dtype, kv_dtype: mx.Dtype, D: int, NR: int, final: bool) -> tuple:
    return (("QT", q_dtype), ("KT", kv_dtype), ("D", D), ("NR", NR), ("FINAL", int(final)))


def attention_launch(queries: mx.array, keys: mx.array, values: mx.array, plan: RaggedPlan, scale: float) -> Launch:
    """The attention launch: writes the output itself when every row is one work item (FINAL),
    else per-split partials for ``combine_launch``."""
    B, n_q, _, D = queries.shape
    H, T_cap = keys.shape[1], keys.shape[2]
    NR = n_q // H
    final = plan.final
    outputs = ([(B, n_q, D), (1,)], [queries.dtype, mx.float32]) if final else \
        ([(plan.num_items, H, NR, D), (plan.num_items, H, NR, 2)], [mx.float32, mx.float32])
    t_cap_arr, scale_arr = scalar_inputs(T_cap, float(scale))
    return Launch(
        name="kvarn_ragged_decode", final=final, header=_ATTENTION_TEXT[0], source=_ATTENTION_TEXT[1],
        input_names=ATTENTION_INPUTS, output_names=ATTENTION_OUTPUTS, shared_memory=0,
        inputs=[queries.reshape(B, n_q, D), keys, values, plan.rows, plan.work, t_cap_arr, scale_arr],
        template=list(_template(queries.dtype, keys.dtype, D, NR, final)),
        grid=(plan.num_items * NUM_THREADS, H, 1), threadgroup=(NUM_THREADS, 1, 1),
        output_shapes=outputs[0], output_dtypes=outputs[1])


def combine_launch(part_o: mx.array, part_ml: mx.array, plan: RaggedPlan, queries: mx.array) -> Launch:
    B, n_q, _, D = queries.shape
    NR = part_o.shape[2]
    return Launch(name="kvarn_ragged_combine", final=True, header=_COMBINE_TEXT[0], source=_COMBINE_TEXT[1],
                  input_names=COMBINE_INPUTS, output_names=COMBINE_OUTPUTS, shared_memory=0,
                  inputs=[part_o, part_ml, plan.row_work],
                  template=[("QT", queries.dtype), ("D", D), ("NR", NR)], grid=(D, n_q, B), threadgroup=(D, 1, 1),
                  output_shapes=[(B, n_q, D)], output_dtypes=[queries.dtype])


def _run(call: Launch) -> list[mx.array]:
    kernel = _kernel(call.name, call.header, call.source, tuple(call.input_names), tuple(call.output_names))
    return kernel(inputs=call.inputs, template=call.template, grid=call.grid, threadgroup=call.threadgroup,
                  output_shapes=call.output_shapes, output_dtypes=call.output_dtypes)


def check_arguments(queries: mx.array, keys: mx.array, values: mx.array, slots: Sequence[int],
                    lengths: Sequence[int], plan: RaggedPlan | None) -> None:
    """Raise ValueError unless the kernel takes these (shapes, dtypes, the plan's rows)."""
    if queries.ndim != 4 or queries.shape[2] != 1 or keys.ndim != 4:
        raise ValueError(f"queries {queries.shape} must be [B, n_q, 1, D] and keys {keys.shape} [N, H, T_cap, D]")
    B, n_q, _, D = queries.shape
    N, H, T_cap, Dk = keys.shape
    if values.shape != keys.shape or values.dtype != keys.dtype or Dk != D or n_q % H:
        raise ValueError(f"queries {queries.shape}, keys {keys.shape} {keys.dtype}, values {values.shape} "
                         f"{values.dtype} do not fit")
    if not is_supported(head_dim=D, n_rep=n_q // H, dtype=queries.dtype, kv_dtype=keys.dtype):
        raise ValueError(f"no ragged decode kernel for head_dim {D}, n_rep {n_q // H}, queries {queries.dtype}, "
                         f"K/V {keys.dtype}")
    if len(slots) != B or len(lengths) != B:
        raise ValueError(f"{B} rows but {len(slots)} slots and {len(lengths)} lengths")
    if max(lengths) > T_cap or min(lengths) < 1 or max(slots) >= N or min(slots) < 0:
        raise ValueError(f"lengths {tuple(lengths)} must be in [1, {T_cap}] and slots {tuple(slots)} in [0, {N})")
    if plan is not None and (plan.slots != tuple(slots) or plan.lengths != tuple(lengths)):
        raise ValueError("the plan was made for other slots or lengths")


def ragged_decode_attention(*, queries: mx.array, keys: mx.array, values: mx.array, slots: Sequence[int],
                            lengths: Sequence[int], scale: float, plan: RaggedPlan | None = None) -> mx.array:
    """Decode attention of every row (queries [B, n_q, 1, D], float16 or bfloat16) over tokens
    [0, lengths[b]) of slot slots[b] of ``keys``/``values`` [N, H, T_cap, D] (float16 or bfloat16,
    one dtype for both); query head qh reads KV head qh // (n_q / H). Returns [B, n_q, 1, D] in the
    queries' dtype. ``slots``, ``lengths``: host ints; ``plan``: the step's split plan
    (``make_plan(slots, lengths, H)``, shared by the layers of a step; built here when not given).
    Raises ValueError where ``is_supported`` says no or the arguments do not fit."""
    check_arguments(queries, keys, values, slots, lengths, plan)
    if plan is None:
        plan = make_plan(slots, lengths, keys.shape[1])
    return _attend(queries, keys, values, plan, scale)
