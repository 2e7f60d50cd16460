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

The module owns the whole kernel: its CUDA text (``HEADER``, ``ATTENTION_SOURCE`` and
``COMBINE_SOURCE``, below the constants, with the thread layout), the split plan, the launches and
the wrapper.
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
HEADER = r"""
#define RD_THREADS 128
#define RD_FULL 0xffffffffu

__device__ __forceinline__ void rd_store(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void rd_store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void rd_store(float* p, float x) { *p = x; }

// one 16-byte load through the read-only path (8 halves or bfloat16s; the address is 16-byte aligned)
__device__ __forceinline__ uint4 rd_ld16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// 8 stored elements -> float32; the pointer argument only selects the storage type
__device__ __forceinline__ void rd_unpack(const uint4& u, float* f, const __half*) {
  const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}
__device__ __forceinline__ void rd_unpack(const uint4& u, float* f, const __nv_bfloat16*) {
  const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);          // bfloat16 -> float32 is exact: the high half
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
"""

ATTENTION_SOURCE = r"""
  constexpr int LPR = D / 8;                 // lanes a key row
  constexpr int RPW = 32 / LPR;              // key rows a warp-wide load
  constexpr int U = NR <= 4 ? 8 : 4;         // K and V rows a lane has in flight before the math
  constexpr int CH = RPW * U;                // tokens a warp pass
  constexpr float LOG2E = 1.4426950408889634f;
  __shared__ float s_o[4 * NR * D];          // [warp][NR][D] merged o of each warp
  __shared__ float s_ml[4 * NR * 2];         // [warp][NR] (m, l)

  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int grp = lane / LPR, sub = lane % LPR;
  const int wi = blockIdx.x, h = blockIdx.y, H = gridDim.y;
  const int b = work[wi * 3], t0 = work[wi * 3 + 1], t1 = work[wi * 3 + 2];
  const int T_cap = meta[0];
  const float sl2 = meta_f[0] * LOG2E;       // scores in the log2 domain: exp2(q.k scale log2 e - m)

  // this lane's 8 channels of the NR query heads, scaled by scale * log2(e)
  float q[NR][8];
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    rd_unpack(rd_ld16(queries + ((size_t)b * H * NR + (size_t)h * NR + r) * D + sub * 8), q[r], queries);
#pragma unroll
    for (int c = 0; c < 8; ++c) q[r][c] *= sl2;
  }

  float m[NR], l[NR], o[NR][8];
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int c = 0; c < 8; ++c) o[r][c] = 0.f;
  }

  const size_t head = ((size_t)rows[b] * H + h) * T_cap;  // row b's slot, KV head h, token 0
  const KT* kp = keys + head * D + sub * 8;
  const KT* vp = values + head * D + sub * 8;
  for (int base = t0 + warp * CH; base < t1; base += 4 * CH) {  // warp-uniform
    // ---- loads first: U key rows and U value rows, 16 bytes a lane each (zeros past the item) ----
    uint4 kr[U], vr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int tok = base + u * RPW + grp;
      if (tok < t1) {
        kr[u] = rd_ld16(kp + (size_t)tok * D);
        vr[u] = rd_ld16(vp + (size_t)tok * D);
      } else {
        kr[u] = make_uint4(0u, 0u, 0u, 0u);
        vr[u] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    // ---- scores: 8-channel partial dots, summed over the row's LPR lanes ----
    float x[U][NR];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[8];
      rd_unpack(kr[u], kf, keys);
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        float acc = 0.f;
#pragma unroll
        for (int c = 0; c < 8; ++c) acc += q[r][c] * kf[c];
        x[u][r] = acc;
      }
    }
#pragma unroll
    for (int s = LPR / 2; s > 0; s >>= 1)
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < NR; ++r) x[u][r] += __shfl_xor_sync(RD_FULL, x[u][r], s);
    // ---- online softmax of this group's U tokens (x becomes p) ----
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      float mn = m[r];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (base + u * RPW + grp < t1) mn = fmaxf(mn, x[u][r]);
      const float mu = mn == -INFINITY ? 0.f : mn;
      const float corr = exp2f(m[r] - mu);   // 0 while the group has seen no token
      float ps = 0.f;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float p = base + u * RPW + grp < t1 ? exp2f(x[u][r] - mu) : 0.f;
        x[u][r] = p;
        ps += p;
      }
      m[r] = mn;
      l[r] = l[r] * corr + ps;
#pragma unroll
      for (int c = 0; c < 8; ++c) o[r][c] *= corr;
    }
    // ---- values ----
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float vf[8];
      rd_unpack(vr[u], vf, values);
#pragma unroll
      for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int c = 0; c < 8; ++c) o[r][c] += x[u][r] * vf[c];
    }
  }

  // ---- merge: the RPW groups of a warp (shuffles), then the 4 warps (shared memory) ----
#pragma unroll
  for (int s = LPR; s < 32; s <<= 1)
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const float mo = __shfl_xor_sync(RD_FULL, m[r], s), lo = __shfl_xor_sync(RD_FULL, l[r], s);
      const float mn = fmaxf(m[r], mo), mu = mn == -INFINITY ? 0.f : mn;
      const float a = exp2f(m[r] - mu), e = exp2f(mo - mu);
      l[r] = l[r] * a + lo * e;
#pragma unroll
      for (int c = 0; c < 8; ++c) o[r][c] = o[r][c] * a + __shfl_xor_sync(RD_FULL, o[r][c], s) * e;
      m[r] = mn;
    }
  if (grp == 0) {
#pragma unroll
    for (int r = 0; r < NR; ++r) {
#pragma unroll
      for (int c = 0; c < 8; ++c) s_o[(warp * NR + r) * D + sub * 8 + c] = o[r][c];
      if (sub == 0) {
        s_ml[(warp * NR + r) * 2] = m[r];
        s_ml[(warp * NR + r) * 2 + 1] = l[r];
      }
    }
  }
  __syncthreads();
  for (int i = t; i < NR * D; i += RD_THREADS) {
    const int r = i / D, d = i % D;
    float mx_ = -INFINITY;
#pragma unroll
    for (int w = 0; w < 4; ++w) mx_ = fmaxf(mx_, s_ml[(w * NR + r) * 2]);
    const float mu = mx_ == -INFINITY ? 0.f : mx_;
    float ov = 0.f, lv = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float f = exp2f(s_ml[(w * NR + r) * 2] - mu);
      ov += f * s_o[(w * NR + r) * D + d];
      lv += f * s_ml[(w * NR + r) * 2 + 1];
    }
    if (FINAL) {  // the row's only work item: normalized, in the queries' dtype, [B, n_q, D]
      rd_store(part_o + ((size_t)b * H * NR + (size_t)h * NR + r) * D + d, lv > 0.f ? ov / lv : 0.f);
    } else {      // this split's partial: unnormalized o, running max m (log2 domain) and sum l
      rd_store(part_o + (((size_t)wi * H + h) * NR + r) * D + d, ov);
      if (d == 0) {
        part_ml[(((size_t)wi * H + h) * NR + r) * 2] = mx_;
        part_ml[(((size_t)wi * H + h) * NR + r) * 2 + 1] = lv;
      }
    }
  }
  if (FINAL && wi == 0 && h == 0 && t == 0) part_ml[0] = 0.f;  // the unused (1,) placeholder
"""

COMBINE_SOURCE = r"""
  // one thread per (row, query head, channel): the row's splits merged, normalized, cast
  const int d = threadIdx.x, qh = blockIdx.y, b = blockIdx.z, NQ = gridDim.y;
  const int H = NQ / NR, h = qh / NR, r = qh % NR;
  const int w0 = row_work[b], w1 = row_work[b + 1];
  float mx_ = -INFINITY;
#pragma unroll 8
  for (int w = w0; w < w1; ++w) mx_ = fmaxf(mx_, part_ml[(((size_t)w * H + h) * NR + r) * 2]);
  const float mu = mx_ == -INFINITY ? 0.f : mx_;
  float acc = 0.f, den = 0.f;
#pragma unroll 8
  for (int w = w0; w < w1; ++w) {
    const size_t i = ((size_t)w * H + h) * NR + r;
    const float e = exp2f(part_ml[i * 2] - mu);
    acc += e * part_o[i * D + d];
    den += e * part_ml[i * 2 + 1];
  }
  rd_store(out + ((size_t)b * NQ + qh) * D + d, den > 0.f ? acc / den : 0.f);
"""

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
