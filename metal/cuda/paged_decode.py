"""Fused paged decode attention over the KVarN block pool (CUDA, ``mx.fast.cuda_kernel``).

One launch attends every decoding row of one layer: split-K flash decoding over each row's tiles,
read in place from the pool (``kvarn/pool.py``: records block-major, windows one a row), K and V
dequantized in registers, online softmax in float32, the n_q/H query heads of a KV head folded into
one block so each tile is read once per KV head. A second tiny launch combines the splits and
rotates back. Design notes: docs/kernels.md.

A row's tiles, in sequence order, and how the work list cuts them into splits (the plan is
``metal.paged_plan``'s, shared with the Metal twin)::

    tile  0      1 .. nt                 nt+1 (only if tail_len > 0)
          sink | record table[b][0] ... | tail
          win[slot, :, 0:sink_len]       win[slot, :, G:G+tail_len]
    work item = (row b, first tile, end tile); one block per (work item, KV head)

Scores use the factored keys K[g, d] = (code[d, g] * alpha[d] + beta[d]) * r[g]:
s[g] = sum_s r[s, g] * (sum_{d in s} (q[d] alpha[d]) code[d, g] + sum_{d in s} q[d] beta[d]); values
likewise: o[d] += c[d] * (sum_g (p[g] v_alpha[g]) code[g, d] + sum_g p[g] v_beta[g]) per tile.

The module owns the CUDA header both bodies share (``HEADER``), the scalar body
(``ATTENTION_SOURCE``) and the combine (``COMBINE_SOURCE``), below the constants; the launches and
the wrapper. The tensor-core body is ``metal.cuda.paged_decode_mma``'s.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from metal.cuda.paged_decode_mma import MMA_HEADER, MMA_SOURCE, mma_shared_bytes, mma_supported
from metal.launch import minify, scalar_inputs
from metal.paged_plan import SCALAR_BLOCKS_PER_SM, DecodePlan, RowLengths, make_plan
from metal.records import RECORD_FIELDS

NUM_THREADS = 128  # one block: 4 warps
SUPPORTED_BITS = (2, 3, 4, 8)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_TILE_SIZES = (64, 128)
MAX_REP = 8  # query heads per KV head folded into one block
MAX_SHARED = 227 * 1024  # dynamic shared memory one block may have (Hopper)

ATTENTION_INPUTS = ["queries", "win_k", "win_v", *RECORD_FIELDS, "table", "rows", "work", "meta", "meta_f"]
ATTENTION_OUTPUTS = ["part_o", "part_ml"]
COMBINE_INPUTS = ["part_o", "part_ml", "row_work"]
COMBINE_OUTPUTS = ["out"]


# ---- the CUDA source: a shared header, the scalar split-K attention body and the combine body, as
# ``mx.fast.cuda_kernel`` takes them (bodies only: MLX writes the signature from the input and output
# names and the template arguments). The layout and the algorithm: the module docstring and
# docs/kernels.md; the tensor-core body is ``metal.cuda.paged_decode_mma``'s.
HEADER = r"""
#define KV_THREADS 128
#define KV_FULL 0xffffffffu

template <int B>
__device__ __forceinline__ unsigned int kv_code(const unsigned int* s, int bit) {
  // b-bit code at stream bit `bit` of a little-endian bit stream (3-bit codes straddle words)
  const int w = bit >> 5, o = bit & 31;
  unsigned int v = s[w] >> o;
  if (32 % B != 0) {
    if (o > 32 - B) v |= s[w + 1] << (32 - o);
  }
  return v & ((1u << B) - 1u);
}

// NR per-head factors at p (16-byte loads when NR is a multiple of 4; p is then 16-byte aligned)
template <int NR>
__device__ __forceinline__ void kv_rep(const float* p, float* out) {
  if (NR % 4 == 0) {
    for (int i = 0; i < NR / 4; ++i) {
      const float4 v = reinterpret_cast<const float4*>(p)[i];
      out[4 * i] = v.x; out[4 * i + 1] = v.y; out[4 * i + 2] = v.z; out[4 * i + 3] = v.w;
    }
  } else {
    for (int i = 0; i < NR; ++i) out[i] = p[i];
  }
}

__device__ __forceinline__ float kv_warp_sum(float v) {
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(KV_FULL, v, m);
  return v;
}

__device__ __forceinline__ float kv_warp_max(float v) {
  for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(KV_FULL, v, m));
  return v;
}

__device__ __forceinline__ float kv_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float kv_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float kv_f(float x) { return x; }
__device__ __forceinline__ void kv_store(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void kv_store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void kv_store(float* p, float x) { *p = x; }

// eight consecutive window values (16-byte loads; float windows: two)
__device__ __forceinline__ void kv_load8(const __half* p, float* out) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const unsigned int w[4] = {u.x, u.y, u.z, u.w};
  for (int i = 0; i < 4; ++i) {
    __half2 h2 = *reinterpret_cast<const __half2*>(&w[i]);
    float2 f = __half22float2(h2);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void kv_load8(const float* p, float* out) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}
"""

ATTENTION_SOURCE = r"""
  constexpr int W = D > 128 ? 128 : D;      // channels per slice
  constexpr int S = D / W;                  // slices
  constexpr int KGW = G * KB / 32;          // K code words per channel
  constexpr int KCW = D * KGW;              // K code words per tile and head
  constexpr int VDW = D * VB / 32;          // V code words per token
  constexpr int VCW = G * VDW;              // V code words per tile and head
  constexpr int TPT = KV_THREADS / G;       // QK: threads per token (they split the channels)
  constexpr int CT = D < KV_THREADS ? D : KV_THREADS;  // PV: threads per channel set
  constexpr int TPC = KV_THREADS / CT;      // PV: token partitions
  constexpr int NCH = D / CT;               // PV: channels per thread
  constexpr int RS = NR * (1 + S);          // reduction slots per warp
  constexpr float LOG2E = 1.4426950408889634f;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned int* s_kc = reinterpret_cast<unsigned int*>(smem_raw);  // [KCW]
  unsigned int* s_vc = s_kc + KCW;           // [VCW]
  float* s_q = reinterpret_cast<float*>(s_vc + VCW);  // [D][NR] rotated queries
  float* s_qa = s_q + D * NR;                // [D][NR] q * k_alpha
  float* s_kr = s_qa + D * NR;               // [S][G] k_r
  float* s_va = s_kr + S * G;                // [G][S] v_alpha
  float* s_vb = s_va + G * S;                // [G][S] v_beta
  float* s_cv = s_vb + G * S;                // [D] v_c
  float* s_pa = s_cv + D;                    // [S][G][NR] p * v_alpha (p for window tiles)
  float* s_qb = s_pa + S * G * NR;           // [4][S][NR] per-warp partial q . k_beta
  float* s_red = s_qb + 4 * S * NR;          // [4][RS] per-warp max / sums
  float* s_o = s_red + 4 * RS;               // [NR][D] scratch

  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int wi = blockIdx.x, h = blockIdx.y, H = gridDim.y;
  const int b = work[wi * 3], t0 = work[wi * 3 + 1], t1 = work[wi * 3 + 2];
  const int slot = rows[b * 4], sink_len = rows[b * 4 + 1], tail_len = rows[b * 4 + 2], nt = rows[b * 4 + 3];
  const int nb = meta[0];
  const float sl2 = meta_f[0] * LOG2E;

  // queries of this KV head -> s_o [NR][D], rotated (Hadamard per W-slice), rounded to half
  for (int i = t; i < NR * D; i += KV_THREADS)
    s_o[i] = kv_f(queries[((size_t)b * H * NR + (size_t)h * NR) * D + i]);
  __syncthreads();
  for (int len = 1; len < W; len <<= 1) {
    for (int k = t; k < NR * D / 2; k += KV_THREADS) {
      const int r = k / (D / 2), kk = k % (D / 2);
      const int i = r * D + (kk / len) * 2 * len + (kk % len), j = i + len;
      const float a = s_o[i], c = s_o[j];
      s_o[i] = a + c;
      s_o[j] = a - c;
    }
    __syncthreads();
  }
  const float inv_w = 1.0f / sqrtf((float)W);
  for (int i = t; i < NR * D; i += KV_THREADS) {
    const int r = i / D, d = i % D;
    const float qr = s_o[i] * inv_w;  // rounded to half as the reference rounds it (half windows)
    s_q[d * NR + r] = sizeof(WT) == 2 ? __half2float(__float2half_rn(qr)) : qr;
  }

  float m[NR], l[NR], o[NCH][NR];
  for (int r = 0; r < NR; ++r) { m[r] = -INFINITY; l[r] = 0.f; }
  for (int j = 0; j < NCH; ++j) for (int r = 0; r < NR; ++r) o[j][r] = 0.f;

  const int g = t / TPT, sub = t % TPT;      // QK: this thread's token and channel subset
  const int pc = t % CT, pp = t / CT;        // PV: channel and token partition

  for (int ti = t0; ti < t1; ++ti) {
    const bool is_rec = ti >= 1 && ti <= nt;
    const int len = is_rec ? G : (ti == 0 ? sink_len : tail_len);
    const int base = ti == 0 ? 0 : G;        // window part (tail tiles only; records ignore it)
    __syncthreads();                         // the previous tile is done with shared memory
    if (is_rec) {
      const size_t nh = (size_t)table[b * nb + ti - 1] * H + h;
      const uint4* gk = reinterpret_cast<const uint4*>(k_codes + nh * KCW);
      const uint4* gv = reinterpret_cast<const uint4*>(v_codes + nh * VCW);
      uint4* sk = reinterpret_cast<uint4*>(s_kc);
      uint4* sv = reinterpret_cast<uint4*>(s_vc);
#pragma unroll
      for (int x = 0; x < (KCW / 4 + KV_THREADS - 1) / KV_THREADS; ++x) {
        const int i = t + x * KV_THREADS;
        if (i < KCW / 4) sk[i] = gk[i];
      }
#pragma unroll
      for (int x = 0; x < (VCW / 4 + KV_THREADS - 1) / KV_THREADS; ++x) {
        const int i = t + x * KV_THREADS;
        if (i < VCW / 4) sv[i] = gv[i];
      }
      for (int i = t; i < S * G; i += KV_THREADS) s_kr[i] = kv_f(k_r[nh * S * G + i]);
      for (int i = t; i < G * S; i += KV_THREADS) {
        s_va[i] = kv_f(v_alpha[nh * G * S + i]);
        s_vb[i] = kv_f(v_beta[nh * G * S + i]);
      }
      for (int i = t; i < D; i += KV_THREADS) s_cv[i] = kv_f(v_c[nh * D + i]);
#pragma unroll
      for (int j = 0; j < (D + KV_THREADS - 1) / KV_THREADS; ++j) {
        const int d = t + j * KV_THREADS;
        const int s = (j * KV_THREADS) / W;  // one slice per pass
        float pq[NR];
        if (d < D) {
          const float al = kv_f(k_alpha[nh * D + d]), be = kv_f(k_beta[nh * D + d]);
          for (int r = 0; r < NR; ++r) {
            const float qv = s_q[d * NR + r];
            s_qa[d * NR + r] = qv * al;
            pq[r] = qv * be;
          }
        } else {
          for (int r = 0; r < NR; ++r) pq[r] = 0.f;
        }
        for (int r = 0; r < NR; ++r) {
          const float v = kv_warp_sum(pq[r]);
          if (lane == 0) s_qb[(warp * S + s) * NR + r] = v;
        }
      }
    }
    __syncthreads();

    // ---- scores of this thread's token, all NR heads (log2 domain) ----
    float x[NR];
    {
      float part[NR];
      for (int r = 0; r < NR; ++r) part[r] = 0.f;
      if (is_rec) {
#pragma unroll
        for (int s = 0; s < S; ++s) {
          float acc[NR];
          for (int r = 0; r < NR; ++r) acc[r] = 0.f;
#pragma unroll 8
          for (int c = 0; c < W / TPT; ++c) {
            const int d = s * W + c * TPT + sub;
            const float code = (float)kv_code<KB>(s_kc + d * KGW, g * KB);
            float qa[NR];
            kv_rep<NR>(s_qa + d * NR, qa);
            for (int r = 0; r < NR; ++r) acc[r] += qa[r] * code;
          }
          const float kr = s_kr[s * G + g];
          for (int r = 0; r < NR; ++r) part[r] += kr * acc[r];
        }
      } else if (g < len) {
        const WT* row = win_k + (((size_t)slot * H + h) * 2 * G + base + g) * D;
        for (int c = 0; c < D / 8 / TPT; ++c) {
          const int d0 = (c * TPT + sub) * 8;
          float kv[8];
          kv_load8(row + d0, kv);
          for (int e = 0; e < 8; ++e)
            for (int r = 0; r < NR; ++r) part[r] += s_q[(d0 + e) * NR + r] * kv[e];
        }
      }
      if (TPT == 2)
        for (int r = 0; r < NR; ++r) part[r] += __shfl_xor_sync(KV_FULL, part[r], 1);
      if (is_rec) {
        for (int s = 0; s < S; ++s) {
          const float kr = s_kr[s * G + g];
          for (int r = 0; r < NR; ++r) {
            const float qb = s_qb[(0 * S + s) * NR + r] + s_qb[(1 * S + s) * NR + r] +
                             s_qb[(2 * S + s) * NR + r] + s_qb[(3 * S + s) * NR + r];
            part[r] += kr * qb;
          }
        }
      }
      const bool valid = g < len;
      for (int r = 0; r < NR; ++r) x[r] = valid ? part[r] * sl2 : -INFINITY;
    }

    // ---- online softmax: tile max, rescale, p, sums ----
    for (int r = 0; r < NR; ++r) {
      const float v = kv_warp_max(x[r]);
      if (lane == 0) s_red[warp * RS + r] = v;
    }
    __syncthreads();
    float corr[NR], mu[NR];
    for (int r = 0; r < NR; ++r) {
      const float mt = fmaxf(fmaxf(s_red[r], s_red[RS + r]), fmaxf(s_red[2 * RS + r], s_red[3 * RS + r]));
      const float mn = fmaxf(m[r], mt);
      corr[r] = m[r] == -INFINITY ? 0.f : exp2f(m[r] - mn);
      mu[r] = mn == -INFINITY ? 0.f : mn;
      m[r] = mn;
    }
    __syncthreads();                         // s_red is read; it is reused below
    float p[NR];
    const float own = sub == 0 ? 1.f : 0.f;  // TPT == 2: both lanes hold the token; count it once
    for (int r = 0; r < NR; ++r) p[r] = exp2f(x[r] - mu[r]);
    for (int r = 0; r < NR; ++r) {
      const float v = kv_warp_sum(p[r] * own);
      if (lane == 0) s_red[warp * RS + r] = v;
    }
    if (is_rec) {
      for (int s = 0; s < S; ++s)
        for (int r = 0; r < NR; ++r) {
          const float v = kv_warp_sum(p[r] * own * s_vb[g * S + s]);
          if (lane == 0) s_red[warp * RS + NR + s * NR + r] = v;
        }
    }
    if (sub == 0)
      for (int s = 0; s < S; ++s)
        for (int r = 0; r < NR; ++r) s_pa[(s * G + g) * NR + r] = is_rec ? p[r] * s_va[g * S + s] : p[r];
    __syncthreads();
    for (int r = 0; r < NR; ++r)
      l[r] = l[r] * corr[r] + (s_red[r] + s_red[RS + r] + s_red[2 * RS + r] + s_red[3 * RS + r]);

    // ---- values: this thread's channels, its token partition ----
#pragma unroll
    for (int j = 0; j < NCH; ++j) {
      const int d = pc + j * CT;
      const int s = d / W;
      float acc[NR];
      for (int r = 0; r < NR; ++r) acc[r] = 0.f;
      if (is_rec) {
#pragma unroll 8
        for (int gi = pp; gi < G; gi += TPC) {
          const float code = (float)kv_code<VB>(s_vc + gi * VDW, d * VB);
          float pa[NR];
          kv_rep<NR>(s_pa + (s * G + gi) * NR, pa);
          for (int r = 0; r < NR; ++r) acc[r] += pa[r] * code;
        }
        const float cv = s_cv[d];
        for (int r = 0; r < NR; ++r) {
          const float pb = pp == 0 ? (s_red[NR + s * NR + r] + s_red[RS + NR + s * NR + r] +
                                      s_red[2 * RS + NR + s * NR + r] + s_red[3 * RS + NR + s * NR + r]) : 0.f;
          o[j][r] = o[j][r] * corr[r] + cv * (acc[r] + pb);
        }
      } else {
        const WT* col = win_v + (((size_t)slot * H + h) * 2 * G + base) * D + d;
        for (int gi = pp; gi < len; gi += TPC) {
          const float v = kv_f(col[(size_t)gi * D]);
          for (int r = 0; r < NR; ++r) acc[r] += s_pa[gi * NR + r] * v;
        }
        for (int r = 0; r < NR; ++r) o[j][r] = o[j][r] * corr[r] + acc[r];
      }
    }
  }

  // ---- this split's partial output: unnormalized o, running max m and sum l ----
  __syncthreads();
  if (TPC == 2) {
    if (pp == 1)
      for (int j = 0; j < NCH; ++j) for (int r = 0; r < NR; ++r) s_o[r * D + pc + j * CT] = o[j][r];
    __syncthreads();
    if (pp == 0)
      for (int j = 0; j < NCH; ++j) for (int r = 0; r < NR; ++r) o[j][r] += s_o[r * D + pc + j * CT];
  }
  if (pp == 0)
    for (int j = 0; j < NCH; ++j)
      for (int r = 0; r < NR; ++r) part_o[(((size_t)wi * H + h) * NR + r) * D + pc + j * CT] = o[j][r];
  if (t == 0)
    for (int r = 0; r < NR; ++r) {
      part_ml[(((size_t)wi * H + h) * NR + r) * 2] = m[r];
      part_ml[(((size_t)wi * H + h) * NR + r) * 2 + 1] = l[r];
    }
"""

COMBINE_SOURCE = r"""
  constexpr int W = D > 128 ? 128 : D;
  __shared__ float s_v[D];
  const int d = threadIdx.x, qh = blockIdx.y, b = blockIdx.z, NQ = gridDim.y;
  const int H = NQ / NR, h = qh / NR, r = qh % NR;
  const int w0 = row_work[b], w1 = row_work[b + 1];
  float mx_ = -INFINITY;
#pragma unroll 8
  for (int w = w0; w < w1; ++w) mx_ = fmaxf(mx_, part_ml[(((size_t)w * H + h) * NR + r) * 2]);
  float acc = 0.f, den = 0.f;
#pragma unroll 8
  for (int w = w0; w < w1; ++w) {
    const size_t i = ((size_t)w * H + h) * NR + r;
    const float mw = part_ml[i * 2];
    const float e = mw == -INFINITY ? 0.f : exp2f(mw - mx_);
    acc += e * part_o[i * D + d];
    den += e * part_ml[i * 2 + 1];
  }
  s_v[d] = den > 0.f ? acc / den : 0.f;
  __syncthreads();
  for (int len = 1; len < W; len <<= 1) {
    if (d < D / 2) {
      const int i = (d / len) * 2 * len + (d % len), j = i + len;
      const float a = s_v[i], c = s_v[j];
      s_v[i] = a + c;
      s_v[j] = a - c;
    }
    __syncthreads();
  }
  kv_store(out + ((size_t)b * NQ + qh) * D + d, s_v[d] * (1.0f / sqrtf((float)W)));
"""


def shared_bytes(head_dim: int, tile_size: int, key_bits: int, value_bits: int, n_rep: int) -> int:
    """Dynamic shared memory of the attention kernel (the layout at the top of ATTENTION_SOURCE)."""
    D, G, NR = head_dim, tile_size, n_rep
    S = max(1, D // 128)
    words = D * G * key_bits // 32 + G * D * value_bits // 32
    floats = 2 * D * NR + S * G + 2 * G * S + D + S * G * NR + 4 * S * NR + 4 * NR * (1 + S) + NR * D
    return 4 * (words + floats)


@dataclass(frozen=True)
class Variant:
    """Which attention body runs and its compile-time knobs (the benchmark compares them).

    ``kind``: "auto" (the tensor-core body where ``mma_supported``, else the scalar one), "mma" or
    "scalar"; ``stages``: cp.async stages of the tensor-core body; ``fold_k`` / ``fold_v``: keep the
    1024 offset of the int->half conversion in the product and subtract it from the float32 result
    (one instruction less per code pair) instead of converting to exact codes."""

    kind: str = "auto"
    stages: int = 2
    fold_k: int = 0
    fold_v: int = 0


DEFAULT_VARIANT = Variant()


@functools.cache
def _kernel(name: str, header: str, source: str, input_names: tuple[str, ...], output_names: tuple[str, ...],
            smem: int):
    """The compiled kernel of one text and shared-memory size (MLX caches the templates under it)."""
    return mx.fast.cuda_kernel(name=name, input_names=list(input_names), output_names=list(output_names),
                               source=source, header=header, shared_memory=smem)


def is_supported(*, head_dim: int, tile_size: int, key_bits: int, value_bits: int, n_rep: int) -> bool:
    """Whether the kernel has a template for this shape (else callers use the reference)."""
    return (head_dim in SUPPORTED_HEAD_DIMS and tile_size in SUPPORTED_TILE_SIZES and key_bits in SUPPORTED_BITS
            and value_bits in SUPPORTED_BITS and 1 <= n_rep <= MAX_REP)


_MMA_TEXT = (minify(HEADER + MMA_HEADER), minify(MMA_SOURCE))
_SCALAR_TEXT = (minify(HEADER), minify(ATTENTION_SOURCE))
_COMBINE_TEXT = (minify(HEADER), minify(COMBINE_SOURCE))


def mma_stages(variant: Variant, **shape) -> int:
    """The tensor-core body's cp.async stages for this shape (the variant's, fewer where the shared
    memory would pass MAX_SHARED), or 0: the scalar body runs."""
    if variant.kind == "scalar" or not mma_supported(**shape):
        if variant.kind == "mma":
            raise ValueError(f"the tensor-core body has no template for {shape}")
        return 0
    for stages in range(variant.stages, 1, -1):
        if mma_shared_bytes(**shape, stages=stages) <= MAX_SHARED:
            return stages
    return 0


@dataclass(frozen=True)
class Launch:
    """One kernel call: its source and arguments as ``mx.fast.cuda_kernel`` takes them (also what
    the tests' CPU emulator of the CUDA source takes)."""

    name: str
    final: bool  # the attention launch writes the output itself (every row one work item): no combine
    header: str
    source: str
    input_names: list
    output_names: list
    shared_memory: int
    inputs: list
    template: list
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: list
    output_dtypes: list


@functools.lru_cache(maxsize=256)
def _attention_kernel(q_dtype: mx.Dtype, w_dtype: mx.Dtype, D: int, G: int, bits: tuple[int, int], NR: int,
                      variant: Variant, final: bool) -> tuple[str, tuple[str, str], tuple, int, bool]:
    """(name, (header, body), template, shared memory, final) of the attention launch for a shape."""
    shape = dict(head_dim=D, tile_size=G, key_bits=bits[0], value_bits=bits[1], n_rep=NR)
    stages = mma_stages(variant, **shape)
    template = (("QT", q_dtype), ("WT", w_dtype), ("D", D), ("G", G), ("KB", bits[0]), ("VB", bits[1]), ("NR", NR))
    if stages:
        template += (("NST", stages), ("FK", variant.fold_k), ("FV", variant.fold_v), ("FINAL", int(final)))
        return "kvarn_paged_decode_mma", _MMA_TEXT, template, mma_shared_bytes(**shape, stages=stages), final
    return "kvarn_paged_decode", _SCALAR_TEXT, template, shared_bytes(D, G, bits[0], bits[1], NR), False


def attention_launch(queries: mx.array, records: dict[str, mx.array], win_k: mx.array, win_v: mx.array,
                     table: mx.array | None, plan: DecodePlan, scale: float, bits: tuple[int, int],
                     variant: Variant = DEFAULT_VARIANT) -> Launch:
    """The attention launch: the tensor-core body where it has the shape (writing the output itself
    when every row is one work item), else the scalar body; both write per-split partials otherwise."""
    B, n_q, _, D = queries.shape
    H, G = win_k.shape[1], win_k.shape[2] // 2
    NR = n_q // H
    if table is None:
        table = mx.zeros((B, 1), dtype=mx.int32)
    name, text, template, smem, final = _attention_kernel(queries.dtype, win_k.dtype, D, G, tuple(bits), NR, variant,
                                                          plan.num_items == B)
    outputs = ([(B, n_q, D), (1,)], [queries.dtype, mx.float32]) if final else \
        ([(plan.num_items, H, NR, D), (plan.num_items, H, NR, 2)], [mx.float32, mx.float32])
    nb_arr, scale_arr = scalar_inputs(table.shape[1], float(scale))
    return Launch(
        name=name, final=final, header=text[0], source=text[1], input_names=ATTENTION_INPUTS,
        output_names=ATTENTION_OUTPUTS, shared_memory=smem,
        inputs=[queries.reshape(B, n_q, D), win_k, win_v, *(records[n] for n in RECORD_FIELDS), table, plan.rows,
                plan.work, nb_arr, scale_arr],
        template=list(template), grid=(plan.num_items * NUM_THREADS, H, 1), threadgroup=(NUM_THREADS, 1, 1),
        output_shapes=outputs[0], output_dtypes=outputs[1])


def combine_launch(part_o: mx.array, part_ml: mx.array, plan: DecodePlan, queries: mx.array) -> Launch:
    B, n_q, _, D = queries.shape
    NR = part_o.shape[2]
    return Launch(name="kvarn_paged_combine", final=True, header=_COMBINE_TEXT[0], source=_COMBINE_TEXT[1],
                  input_names=COMBINE_INPUTS,
                  output_names=COMBINE_OUTPUTS, shared_memory=0, inputs=[part_o, part_ml, plan.row_work],
                  template=[("QT", queries.dtype), ("D", D), ("NR", NR)], grid=(D, n_q, B), threadgroup=(D, 1, 1),
                  output_shapes=[(B, n_q, D)], output_dtypes=[queries.dtype])


def _run(call: Launch) -> list[mx.array]:
    kernel = _kernel(call.name, call.header, call.source, tuple(call.input_names), tuple(call.output_names),
                     call.shared_memory)
    return kernel(inputs=call.inputs, template=call.template, grid=call.grid, threadgroup=call.threadgroup,
                  output_shapes=call.output_shapes, output_dtypes=call.output_dtypes)


def paged_decode_attention(*, queries: mx.array, records: dict[str, mx.array], win_k: mx.array, win_v: mx.array,
                           table: mx.array | None, lengths: RowLengths, scale: float,
                           key_bits: int, value_bits: int, plan: DecodePlan | None = None,
                           variant: Variant = DEFAULT_VARIANT) -> mx.array:
    """Decode attention of every row (queries [B, n_q, 1, D], unrotated) over its window and its
    records read in place from the pool; returns [B, n_q, 1, D] in the queries' dtype (unrotated).

    ``records``: one layer's record fields (``kvarn/pool.py`` shapes, block-major), ``win_k``/
    ``win_v`` [Nw, H, 2G, D]; ``table`` [B, nb] (pad-filled; None if no row has records);
    ``lengths``: per-row window slot, sink and tail lengths and record counts (host ints).
    ``plan``: the step's split plan (``metal.paged_plan.make_plan``; built here when not given;
    a compiled step passes one of fixed size, ``static_plan``, and no ``lengths``);
    ``variant``: which body (the tensor-core one where it has the shape, else the scalar one) and
    its knobs."""
    B, n_q, _, D = queries.shape
    H = win_k.shape[1]
    if plan is None:
        plan = make_plan(lengths.slots, lengths.sink_len, lengths.tail_len, lengths.num_tiles, H)
    if lengths is not None and plan.num_items == B and not mma_stages(
            variant, head_dim=D, tile_size=win_k.shape[2] // 2, key_bits=key_bits, value_bits=value_bits,
            n_rep=n_q // H):  # (a plan made ahead, ``lengths`` None, runs as it is: a compiled step's)
        if "scalar" not in plan.memo:  # the scalar body wants its rows split (the step's layers share this)
            L = lengths
            plan.memo["scalar"] = make_plan(L.slots, L.sink_len, L.tail_len, L.num_tiles, H,
                                            blocks_per_sm=SCALAR_BLOCKS_PER_SM, single=False)
        plan = plan.memo["scalar"]
    call = attention_launch(queries, records, win_k, win_v, table, plan, scale, (key_bits, value_bits), variant)
    part_o, part_ml = _run(call)
    if call.final:
        return part_o.reshape(B, n_q, 1, D)
    (out,) = _run(combine_launch(part_o, part_ml, plan, queries))
    return out.reshape(B, n_q, 1, D)
