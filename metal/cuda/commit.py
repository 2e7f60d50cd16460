"""Fused KVarN tile commit (CUDA, ``mx.fast.cuda_kernel``): the whole quantizer of
docs/kvarn.md ("The quantizer": two-axis log-domain normalization with the best-iterate rule,
min/max RTN, absorption, packing) for every tile given, all heads, K and V, in one launch.

Input: rotated float16 tiles ``keys``/``values`` [n, H, G, D]. Output: the block-major record
fields of ``kvarn/pool.py`` for n blocks::

    k_codes [n, H, S, W, G*kb/32] uint32   k_alpha, k_beta [n, H, S, W] f16   k_r [n, H, S, G] f16
    v_codes [n, H, G, D*vb/32]    uint32   v_alpha, v_beta [n, H, G, S] f16   v_c [n, H, D]    f16

One block per matrix (K or V of one tile, head and 128-channel slice; S = D / W slices), the
matrix held in registers (ROWS rows of 4 columns a thread) and shared memory.

**Same bytes as the pure-MLX quantizer on the GPU.** ``kvarn.pool.quantize_blocks_reference``
runs as MLX CUDA kernels whose float32 results depend on the order of their sums. The kernel repeats
them: every elementwise step is the same IEEE operation (``/`` and ``sqrt`` correctly rounded,
``expf``/``logf`` as MLX's ``cuda::std::exp``/``log``, no fused multiply-add: the ``_rn``
intrinsics forbid contraction), and every sum is added in MLX's order: a sum along the
contiguous axis (MLX's row reduce) adds runs of 4 consecutive values from 0 per thread, then
a 32-lane butterfly (xor 16, 8, 4, 2, 1); a sum along a strided axis (MLX's column reduce)
adds the values 32 apart in order, then the same butterfly over the 32 partial sums. Which axis
is contiguous follows from the layouts MLX gives the arrays (row-major after every fused
kernel; for a K tile quantized on its own when G != W, the first stds read a transposed view:
see ``SPECIAL`` in the source). Maxima and minima are exact in any order. Where MLX's own order
differs (another MLX version, the CPU backend), codes differ only where a value sits within
float noise of a rounding boundary: tests/metal/test_commit.py counts them.

The module owns the whole kernel: its CUDA text (``HEADER`` and ``SOURCE``, below the constants,
with the thread layout), the launch arithmetic and the wrappers that run it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import lru_cache

import mlx.core as mx

from metal.launch import minify, no_slots
from metal.records import RECORD_FIELDS, output_shapes

log = logging.getLogger(__name__)
SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_TILE_SIZES = (64, 128)
DEFAULT_ROWS = 4  # rows a thread holds: 1,024 threads a block at G = W = 128 (H200, 32 tiles of one layer:
                  # 0.40 ms against 0.51 at 8 rows; 1 tile: 0.056 against 0.063 ms; bench/commit_cost.py)
INPUTS = ["keys", "values", "bits", "slots"]


# ---- the CUDA source: a shared header and the kernel body, as ``mx.fast.cuda_kernel`` takes them (MLX
# writes the signature from the input and output names and the template arguments). The algorithm and
# why each reduction runs in the order it does: the module docstring and docs/kernels.md.
#
# One block quantizes one matrix: K or V (blockIdx.y) of one tile, head and 128-channel slice
# (blockIdx.x = (tile * H + head) * S + slice). The matrix M is R x C (K: channels x tokens, V:
# tokens x channels); thread (unit u, column group cl) holds NR = TPU * KR rows of 4 consecutive
# columns 4cl..4cl+3: rows u*TPU + t + 32 k (t < TPU, k < KR). So a row's C/4 lanes sit in one warp
# (row sums: 4 values in order, then a butterfly, as MLX's row reduce), and the rows t + 32 k of a
# column are summed in k order by one thread (as MLX's column reduce), the 32 partials then by a
# butterfly over lanes.
HEADER = r"""
#define KC_FULL 0xffffffffu
// float32 operations rounded once each, never contracted into a fused multiply-add (MLX rounds
// every elementwise result); on the CPU emulator (g++, no FMA contraction) the plain operators
#ifdef __CUDACC__
#define KC_MUL(a, b) __fmul_rn(a, b)
#define KC_ADD(a, b) __fadd_rn(a, b)
#define KC_SUB(a, b) __fsub_rn(a, b)
#define KC_DIV(a, b) __fdiv_rn(a, b)
#define KC_FMA(a, b, c) __fmaf_rn(a, b, c)
#define KC_RCP(a) __frcp_rn(a)
#else
#define KC_MUL(a, b) ((a) * (b))
#define KC_ADD(a, b) ((a) + (b))
#define KC_SUB(a, b) ((a) - (b))
#define KC_DIV(a, b) ((a) / (b))
#define KC_FMA(a, b, c) std::fmaf(a, b, c)
#define KC_RCP(a) (1.0f / (a))
#endif

// x / y correctly rounded, given r = RN(1 / y): q = RN(x r) is within an ulp of x / y, the remainder
// x - q y is exact in one fused multiply-add, and RN(q + r (x - q y)) is RN(x / y) (Markstein's
// theorem; it needs no overflow or underflow, which the kernel's ranges exclude: |x| <= 65504 over
// y >= exp(-0.3), or a row's range over a step >= 1e-10). Three operations where an IEEE division
// (__fdiv_rn) is about ten; the reciprocal is made once per row or column. A zero quotient keeps
// the sign of x r, as the division gives it. MK = 0 (a template knob) divides as before.
template <int MK>
__device__ __forceinline__ float kc_divr(float x, float y, float r) {
  if (!MK) return KC_DIV(x, y);
  const float q = KC_MUL(x, r);
  if (q == 0.0f) return q;
  return KC_FMA(KC_FMA(-q, y, x), r, q);
}
template <int MK>
__device__ __forceinline__ float kc_rcp(float y) { return MK ? KC_RCP(y) : 1.0f; }

// float32 constants as MLX makes them from kvarn/quantize.py's Python floats (double -> float)
#define KC_STD_MIN ((float)1e-3)
#define KC_STD_MAX ((float)1e3)
#define KC_LOG_MIN ((float)-0.3)
#define KC_LOG_MAX ((float)10.0)
#define KC_FLOOR ((float)1e-8)
#define KC_STEP_MIN ((float)1e-10)

// MLX's maximum / minimum (no NaN can arise here)
__device__ __forceinline__ float kc_max(float a, float b) { return a > b ? a : b; }
__device__ __forceinline__ float kc_min(float a, float b) { return a < b ? a : b; }
__device__ __forceinline__ float kc_clip(float x, float lo, float hi) { return kc_min(kc_max(x, lo), hi); }

// the log-domain step: clip(l + log(clip(std, 1e-3, 1e3)), -0.3, 10)
__device__ __forceinline__ float kc_step(float l, float sd) {
  return kc_clip(KC_ADD(l, logf(kc_clip(sd, KC_STD_MIN, KC_STD_MAX))), KC_LOG_MIN, KC_LOG_MAX);
}

// butterfly over the lanes of a group of L (a power of two): MLX's cg::reduce order
template <int L>
__device__ __forceinline__ float kc_bsum(float v) {
  for (int m = L / 2; m > 0; m >>= 1) v = KC_ADD(v, __shfl_xor_sync(KC_FULL, v, m));
  return v;
}
template <int L>
__device__ __forceinline__ float kc_bmax(float v) {
  for (int m = L / 2; m > 0; m >>= 1) v = kc_max(v, __shfl_xor_sync(KC_FULL, v, m));
  return v;
}
template <int L>
__device__ __forceinline__ float kc_bmin(float v) {
  for (int m = L / 2; m > 0; m >>= 1) v = kc_min(v, __shfl_xor_sync(KC_FULL, v, m));
  return v;
}

// MLX's row reduce of a run: each thread sums 4 consecutive values from 0, in order
__device__ __forceinline__ float kc_sum4(float a, float b, float c, float d) {
  return KC_ADD(KC_ADD(KC_ADD(KC_ADD(0.0f, a), b), c), d);
}

// sample std (ddof = 1) of a row of C values held 4 per lane by the row's C/4 lanes
template <int C>
__device__ __forceinline__ float kc_row_std(const float* a) {
  constexpr int LPR = C / 4;
  const float mean = KC_MUL(kc_bsum<LPR>(kc_sum4(a[0], a[1], a[2], a[3])), 1.0f / C);
  float d[4];
  for (int i = 0; i < 4; ++i) d[i] = KC_SUB(a[i], mean);
  const float ss = kc_bsum<LPR>(kc_sum4(KC_MUL(d[0], d[0]), KC_MUL(d[1], d[1]), KC_MUL(d[2], d[2]),
                                        KC_MUL(d[3], d[3])));
  return sqrtf(KC_DIV(ss, (float)(C - 1)));
}

__device__ __forceinline__ void kc_load4(const __half* p, float* out) {
  // 4 halves at a 4-byte aligned address
  const __half2 a = reinterpret_cast<const __half2*>(p)[0];
  const __half2 b = reinterpret_cast<const __half2*>(p)[1];
  const float2 fa = __half22float2(a), fb = __half22float2(b);
  out[0] = fa.x; out[1] = fa.y; out[2] = fb.x; out[3] = fb.y;
}

__device__ __forceinline__ void kc_load4(const float* p, float* out) {
  const float4 v = reinterpret_cast<const float4*>(p)[0];
  out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
}

// The imbalance of the current iterate (every thread computes the same value):
// max/min of the column stds + max/min of the row stds (min floored at 1e-8)
template <int R, int C>
__device__ __forceinline__ float kc_imbalance(const float* cstd, const float* rstd, int lane) {
  float cmax = cstd[lane], cmin = cstd[lane], rmax = rstd[lane], rmin = rstd[lane];
  for (int c = lane + 32; c < C; c += 32) { cmax = kc_max(cmax, cstd[c]); cmin = kc_min(cmin, cstd[c]); }
  for (int r = lane + 32; r < R; r += 32) { rmax = kc_max(rmax, rstd[r]); rmin = kc_min(rmin, rstd[r]); }
  cmax = kc_bmax<32>(cmax); cmin = kc_bmin<32>(cmin); rmax = kc_bmax<32>(rmax); rmin = kc_bmin<32>(rmin);
  return KC_ADD(KC_DIV(cmax, kc_max(cmin, KC_FLOOR)), KC_DIV(rmax, kc_max(rmin, KC_FLOOR)));
}

// Shared memory (bytes), the same for K and V blocks: the staged matrix (halves, rows padded by 2),
// the column partials (32 x (CM + 1) floats; later the codes, one byte each), then CM floats each
// of lc, ec, best lc, column stats, the row stds, the reciprocals of ec and the best row factors.
template <int G, int W>
struct KcSmem {
  static constexpr int CM = G > W ? G : W;
  static constexpr int MS_A = W * (G + 2), MS_B = G * (W + 2);
  static constexpr int MS = ((2 * (MS_A > MS_B ? MS_A : MS_B) + 15) / 16) * 16;
  static constexpr int P = ((4 * 32 * (CM + 1) + 15) / 16) * 16;
  static constexpr int VEC = 4 * CM;
  static constexpr int TOTAL = MS + P + 7 * VEC;
};

// Quantize the R x C matrix of one block. src: the tile slice (G tokens x W channels, row
// stride src_stride halves); KEYS: M[r][c] = src[c][r], else M[r][c] = src[r][c]. SPECIAL: the
// first column and row stds are summed in the orders MLX uses for the transposed view of a
// K tile quantized on its own (kvarn.quantize.quantize_keys, G != W): column means by rows of
// the view's memory, column squares by columns; row means by columns, row squares by rows.
template <int R, int C, int ITERS, int ROWS, bool KEYS, bool SPECIAL, int G, int W, int MK>
__device__ void kc_matrix(const __half* src, int src_stride, unsigned char* smem, int B, unsigned int* codes,
                          int code_stride, __half* alpha, __half* beta, int fstride, __half* colf) {
  using L = KcSmem<G, W>;
  constexpr int MS = C + 2;              // staged row stride (halves)
  constexpr int PS = C + 1;              // partial row stride (floats)
  constexpr int LPR = C / 4;             // lanes per row
  constexpr int RPP = 32 / LPR;          // rows per warp at once
  constexpr int NU = R / ROWS;           // row units
  constexpr int NW = NU / RPP;           // warps
  constexpr int NT = NW * 32;
  constexpr int TPU = 32 / NU;           // column-partial indices (ty) per unit
  constexpr int KR = R / 32;             // rows per ty
  constexpr int NR = TPU * KR;           // rows per thread (= ROWS)
  const float LEVELS = (float)((1 << B) - 1);
  static_assert(NR == ROWS && NW * 32 * 4 * ROWS == R * C, "thread layout");

  __half* Ms = reinterpret_cast<__half*>(smem);
  float* P = reinterpret_cast<float*>(smem + L::MS);
  unsigned char* Q = smem + L::MS;       // the codes, over P once P is free
  float* lc = reinterpret_cast<float*>(smem + L::MS + L::P);
  float* ec = lc + L::CM;
  float* blc = ec + L::CM;
  float* cst = blc + L::CM;              // column means, then column stds
  float* rst = cst + L::CM;              // row stds
  float* rc = rst + L::CM;               // RN(1 / ec) (MK)
  float* sblr = rc + L::CM;              // the best iterate's row factors

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int u = warp * RPP + lane / LPR; // row unit
  const int cl = lane % LPR;             // columns 4cl .. 4cl+3
  const int c0 = 4 * cl;

  // stage the matrix: global reads along channels, 4 bytes a thread
  for (int e = tid; e < G * W / 2; e += NT) {
    const int g = e / (W / 2), w = 2 * (e % (W / 2));
    const __half2 v = *reinterpret_cast<const __half2*>(src + g * src_stride + w);
    if (KEYS) {
      Ms[w * MS + g] = v.x;
      Ms[(w + 1) * MS + g] = v.y;
    } else {
      *reinterpret_cast<__half2*>(Ms + g * MS + w) = v;
    }
  }
  if (tid < C) { lc[tid] = 0.0f; blc[tid] = 0.0f; }
  __syncthreads();

  float b[NR][4];
  float lr[NR];  // the best iterate's row factors are kept in shared memory (sblr): fewer registers
  for (int j = 0; j < NR; ++j) {
    lr[j] = 0.0f;
    if (cl == 0) sblr[u * TPU + j / KR + 32 * (j % KR)] = 0.0f;
  }

  // column stds of b into cst (block collective; leaves cst valid after its last barrier)
  auto col_std = [&]() {
    float p[TPU][4];
    for (int t = 0; t < TPU; ++t) {
      for (int i = 0; i < 4; ++i) p[t][i] = 0.0f;
      for (int k = 0; k < KR; ++k)
        for (int i = 0; i < 4; ++i) p[t][i] = KC_ADD(p[t][i], b[t * KR + k][i]);
      for (int i = 0; i < 4; ++i) P[(u * TPU + t) * PS + c0 + i] = p[t][i];
    }
    __syncthreads();
    for (int c = warp; c < C; c += NW) {
      const float s = kc_bsum<32>(P[lane * PS + c]);
      if (lane == 0) cst[c] = KC_MUL(s, 1.0f / R);
    }
    __syncthreads();
    float mean[4];
    kc_load4(cst + c0, mean);
    for (int t = 0; t < TPU; ++t) {
      for (int i = 0; i < 4; ++i) p[t][i] = 0.0f;
      for (int k = 0; k < KR; ++k)
        for (int i = 0; i < 4; ++i) {
          const float d = KC_SUB(b[t * KR + k][i], mean[i]);
          p[t][i] = KC_ADD(p[t][i], KC_MUL(d, d));
        }
      for (int i = 0; i < 4; ++i) P[(u * TPU + t) * PS + c0 + i] = p[t][i];
    }
    __syncthreads();
    for (int c = warp; c < C; c += NW) {
      const float s = kc_bsum<32>(P[lane * PS + c]);
      if (lane == 0) cst[c] = sqrtf(KC_DIV(s, (float)(R - 1)));
    }
    __syncthreads();
  };

  // the start (lr = lc = 0, balanced = M): its row and column stds
  for (int j = 0; j < NR; ++j) {
    const int r = u * TPU + j / KR + 32 * (j % KR);
    kc_load4(Ms + r * MS + c0, b[j]);
  }
  if (SPECIAL) {
    // column c over rows r: mean by runs of 4 rows, squares by rows r = lane + 32 k
    for (int c = warp; c < C; c += NW) {
      float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (4 * lane < R)
        for (int i = 0; i < 4; ++i) a[i] = __half2float(Ms[(4 * lane + i) * MS + c]);
      const float mean = KC_MUL(kc_bsum<32>(kc_sum4(a[0], a[1], a[2], a[3])), 1.0f / R);
      float q = 0.0f;
      for (int k = 0; k < KR; ++k) {
        const float d = KC_SUB(__half2float(Ms[(lane + 32 * k) * MS + c]), mean);
        q = KC_ADD(q, KC_MUL(d, d));
      }
      q = kc_bsum<32>(q);
      if (lane == 0) cst[c] = sqrtf(KC_DIV(q, (float)(R - 1)));
    }
    // row r over columns c: mean by columns c = lane + 32 k, squares by runs of 4 columns
    for (int r = warp; r < R; r += NW) {
      float s = 0.0f;
      for (int k = 0; k < C / 32; ++k) s = KC_ADD(s, __half2float(Ms[r * MS + lane + 32 * k]));
      const float mean = KC_MUL(kc_bsum<32>(s), 1.0f / C);
      float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (4 * lane < C)
        for (int i = 0; i < 4; ++i) d[i] = KC_SUB(__half2float(Ms[r * MS + 4 * lane + i]), mean);
      const float q = kc_bsum<32>(kc_sum4(KC_MUL(d[0], d[0]), KC_MUL(d[1], d[1]), KC_MUL(d[2], d[2]),
                                          KC_MUL(d[3], d[3])));  // lanes past the row add zeros, as MLX
      if (lane == 0) rst[r] = sqrtf(KC_DIV(q, (float)(C - 1)));
    }
    __syncthreads();
  } else {
    for (int j = 0; j < NR; ++j) {
      const float sd = kc_row_std<C>(b[j]);
      if (cl == 0) rst[u * TPU + j / KR + 32 * (j % KR)] = sd;
    }
    col_std();
  }
  float best = kc_imbalance<R, C>(cst, rst, lane);

  for (int it = 0; it < ITERS; ++it) {
    if (tid < C) {
      const float l = kc_step(lc[tid], cst[tid]);
      lc[tid] = l;
      ec[tid] = expf(l);
      if (MK) rc[tid] = kc_rcp<MK>(ec[tid]);
    }
    __syncthreads();
    float e[4], re[4];
    if (!MK) kc_load4(ec + c0, e);
    for (int j = 0; j < NR; ++j) {
      const int r = u * TPU + j / KR + 32 * (j % KR);
      float x[4], t[4], b1[4];
      if (MK) { kc_load4(ec + c0, e); kc_load4(rc + c0, re); }  // per row: fewer registers live across the loop
      kc_load4(Ms + r * MS + c0, x);
      const float er0 = expf(lr[j]), rr0 = kc_rcp<MK>(er0);
      for (int i = 0; i < 4; ++i) { t[i] = kc_divr<MK>(x[i], e[i], re[i]); b1[i] = kc_divr<MK>(t[i], er0, rr0); }
      lr[j] = kc_step(lr[j], kc_row_std<C>(b1));
      const float er1 = expf(lr[j]), rr1 = kc_rcp<MK>(er1);
      for (int i = 0; i < 4; ++i) b[j][i] = kc_divr<MK>(t[i], er1, rr1);
      const float sd = kc_row_std<C>(b[j]);
      if (cl == 0) rst[r] = sd;
    }
    col_std();
    const float imb = kc_imbalance<R, C>(cst, rst, lane);
    if (imb <= best) {  // ties go to the later iterate
      best = imb;
      if (cl == 0)
        for (int j = 0; j < NR; ++j) sblr[u * TPU + j / KR + 32 * (j % KR)] = lr[j];
      if (tid < C) blc[tid] = lc[tid];
    }
  }
  __syncthreads();

  // round the best iterate's balanced rows (min/max RTN), absorb, then pack
  if (MK && tid < C) { ec[tid] = expf(blc[tid]); rc[tid] = kc_rcp<MK>(ec[tid]); }
  if (MK) __syncthreads();
  float e[4], re[4];
  if (!MK) for (int i = 0; i < 4; ++i) e[i] = expf(blc[c0 + i]);
  for (int j = 0; j < NR; ++j) {
    const int r = u * TPU + j / KR + 32 * (j % KR);
    float x[4];
    if (MK) { kc_load4(ec + c0, e); kc_load4(rc + c0, re); }
    kc_load4(Ms + r * MS + c0, x);
    const float er = expf(sblr[r]), rr = kc_rcp<MK>(er);
    float lo, hi;
    for (int i = 0; i < 4; ++i) {
      b[j][i] = kc_divr<MK>(kc_divr<MK>(x[i], e[i], re[i]), er, rr);
      lo = i ? kc_min(lo, b[j][i]) : b[j][i];
      hi = i ? kc_max(hi, b[j][i]) : b[j][i];
    }
    lo = kc_bmin<LPR>(lo);
    hi = kc_bmax<LPR>(hi);
    const float step = kc_max(KC_DIV(KC_SUB(hi, lo), LEVELS), KC_STEP_MIN), rs = kc_rcp<MK>(step);
    for (int i = 0; i < 4; ++i) b[j][i] = kc_clip(rintf(kc_divr<MK>(KC_SUB(b[j][i], lo), step, rs)), 0.0f, LEVELS);
    if (cl == 0) {
      alpha[r * fstride] = __float2half_rn(KC_MUL(er, step));
      beta[r * fstride] = __float2half_rn(KC_MUL(er, lo));
    }
  }
  if (tid < C) colf[tid] = __float2half_rn(expf(blc[tid]));
  for (int j = 0; j < NR; ++j) {
    const int r = u * TPU + j / KR + 32 * (j % KR);
    for (int i = 0; i < 4; ++i) Q[r * C + c0 + i] = (unsigned char)b[j][i];
  }
  __syncthreads();
  // a row's codes as a little-endian stream of B-bit values, C * B / 32 words
  const int RW = C * B / 32;
  for (int e2 = tid; e2 < R * RW; e2 += NT) {
    const int r = e2 / RW, w = e2 % RW, bit0 = 32 * w;
    unsigned int word = 0;
    for (int jc = bit0 / B; jc <= (bit0 + 31) / B && jc < C; ++jc) {
      const int sh = jc * B - bit0;
      const unsigned int q = Q[r * C + jc];
      word |= sh >= 0 ? (q << sh) : (q >> -sh);
    }
    codes[r * code_stride + w] = word;
  }
}
"""

# Template arguments: G (tile), D (head_dim), ITERS, ROWS (rows per thread), WIN, NH and MK (divisions by a
# row's or column's factor through its reciprocal: ``kc_divr``); the bits
# are an input (bits = [key_bits, value_bits], int32), so one compile serves every width.
# WIN = 0: inputs keys/values [n, H, G, D] float16 (NH = 1, ``slots`` unread). WIN = 1: keys/values
# are a pool's window buffers [Nw, NH, 2G, D] float16 and tile t is the tail (positions G .. 2G-1)
# of window slots[t], read in place (a decode step's commit: no gather, no copy).
# Outputs the record fields of kvarn/pool.py.
SOURCE = r"""
  constexpr int W = D > 128 ? 128 : D;
  constexpr int S = D / W;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int mat = blockIdx.x;            // (tile * H + head) * S + slice
  const int th = mat / S, s = mat % S;
  const long base = WIN ? ((long)(slots[th / NH] * NH + th % NH) * (2 * G) + G) * D + s * W
                        : (long)th * G * D + s * W;
  const int KB = bits[0], VB = bits[1];
  if (blockIdx.y == 0) {
    kc_matrix<W, G, ITERS, ROWS, true, (G != W), G, W, MK>(
        keys + base, D, smem_raw, KB, k_codes + mat * W * (G * KB / 32), G * KB / 32,
        k_alpha + mat * W, k_beta + mat * W, 1, k_r + mat * G);
  } else {
    kc_matrix<G, W, ITERS, ROWS, false, false, G, W, MK>(
        values + base, D, smem_raw, VB, v_codes + th * G * (D * VB / 32) + s * (W * VB / 32), D * VB / 32,
        v_alpha + th * G * S + s, v_beta + th * G * S + s, S, v_c + th * D + s * W);
  }
"""


def _round16(x: int) -> int:
    return (x + 15) // 16 * 16


def shared_bytes(head_dim: int, tile_size: int) -> int:
    """Dynamic shared memory of one block (``KcSmem`` in the source)."""
    G, W = tile_size, min(head_dim, 128)
    cm = max(G, W)
    return _round16(2 * max(W * (G + 2), G * (W + 2))) + _round16(4 * 32 * (cm + 1)) + 7 * 4 * cm


def is_supported(*, head_dim: int, tile_size: int, key_bits: int, value_bits: int) -> bool:
    """Whether the kernel has a template for this layout (else callers use the reference)."""
    return (head_dim in SUPPORTED_HEAD_DIMS and tile_size in SUPPORTED_TILE_SIZES and key_bits in SUPPORTED_BITS
            and value_bits in SUPPORTED_BITS)


@dataclass(frozen=True)
class Launch:
    """One kernel call's arguments, as ``mx.fast.cuda_kernel`` takes them (also what the tests'
    CPU emulator of the CUDA source takes)."""

    inputs: list
    template: list
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: list
    output_dtypes: list


@lru_cache(maxsize=64)
def _bits(key_bits: int, value_bits: int) -> mx.array:
    """The kernel's bits input, made once per layout (not one array from host data per layer of
    every step that commits)."""
    return mx.array([key_bits, value_bits], dtype=mx.int32)


def commit_launch(keys: mx.array, values: mx.array, key_bits: int, value_bits: int, iters: int,
                  rows: int = DEFAULT_ROWS, slots: mx.array | None = None, *, reciprocal: bool = True) -> Launch:
    """The launch for tiles ``keys``/``values`` [n, H, G, D], or, with ``slots`` ([n] int32), for
    the tails of those windows of window buffers ``keys``/``values`` [Nw, H, 2G, D] (read in
    place: template WIN = 1). ``reciprocal`` (template MK): divide through reciprocals (``kc_divr``:
    the same IEEE quotients in fewer instructions); False: ``__fdiv_rn`` (``bench/commit_cost.py``
    times both)."""
    if slots is None:
        n, H, G, D = keys.shape
    else:
        (n,), (_, H, G2, D) = slots.shape, keys.shape
        G = G2 // 2
    template, grid, threadgroup, shapes, dtypes = _launch_shape(n, H, G, D, key_bits, value_bits, iters, rows,
                                                                slots is not None, int(reciprocal))
    return Launch(inputs=[keys.astype(mx.float16), values.astype(mx.float16), _bits(key_bits, value_bits),
                          no_slots() if slots is None else slots],
                  template=list(template), grid=grid, threadgroup=threadgroup, output_shapes=list(shapes),
                  output_dtypes=list(dtypes))


@lru_cache(maxsize=256)
def _launch_shape(n: int, H: int, G: int, D: int, key_bits: int, value_bits: int, iters: int, rows: int,
                  window: bool, mk: int = 1) -> tuple:
    """A launch's template, grid and outputs, made once per shape (a decode step asks once a layer)."""
    template = (("G", G), ("D", D), ("ITERS", iters), ("ROWS", rows), ("WIN", int(window)), ("NH", H if window else 1),
                ("MK", int(mk)))
    W = min(D, 128)
    threads = G * W // (4 * rows)
    shapes = output_shapes(n, H, G, D, key_bits, value_bits)
    dtypes = tuple(mx.uint32 if name.endswith("codes") else mx.float16 for name in RECORD_FIELDS)
    return (template, (n * H * (D // W) * threads, 2, 1), (threads, 1, 1),
            tuple(shapes[name] for name in RECORD_FIELDS), dtypes)


KERNEL_TEXT = (minify(HEADER), minify(SOURCE))  # what is compiled: MLX rehashes the text at every call


@lru_cache(maxsize=None)
def _kernel(smem: int):
    """The compiled kernel of one shared-memory size (MLX caches the templates under it)."""
    return mx.fast.cuda_kernel(name=f"kvarn_commit_{smem}", input_names=INPUTS, output_names=list(RECORD_FIELDS),
                               source=KERNEL_TEXT[1], header=KERNEL_TEXT[0], shared_memory=smem)


def quantize_tiles(*, keys: mx.array, values: mx.array, key_bits: int, value_bits: int, iters: int = 8,
                   rows: int = DEFAULT_ROWS, reciprocal: bool = True) -> dict[str, mx.array]:
    """Quantize rotated float16 tiles [n, H, G, D] into n blocks of record fields (the module
    docstring's shapes), the same bytes as ``kvarn.pool.quantize_blocks_reference`` with a layout
    of these bits, tile size G and ``iters``. ``rows``: 4 or 8 rows a thread; ``reciprocal``: how
    the kernel divides (``commit_launch``); both speed knobs only."""
    n, H, G, D = keys.shape
    if values.shape != keys.shape:
        raise ValueError(f"keys {keys.shape} and values {values.shape} differ")
    if not is_supported(head_dim=D, tile_size=G, key_bits=key_bits, value_bits=value_bits):
        raise ValueError(f"no commit kernel for head_dim {D}, tile {G}, bits k{key_bits}v{value_bits}")
    if n == 0:
        return {name: mx.zeros(shape, dtype) for (name, shape), dtype in zip(
            output_shapes(0, H, G, D, key_bits, value_bits).items(),
            [mx.uint32 if f.endswith("codes") else mx.float16 for f in RECORD_FIELDS])}
    call = commit_launch(keys, values, key_bits, value_bits, iters, rows, reciprocal=reciprocal)
    return _launch(call, D, G, (key_bits, value_bits))


def quantize_window_tails(*, win_k: mx.array, win_v: mx.array, slots: mx.array, key_bits: int, value_bits: int,
                          iters: int = 8, rows: int = DEFAULT_ROWS, reciprocal: bool = True) -> dict[str, mx.array]:
    """``quantize_tiles`` of the tails of windows ``slots`` ([n] int32) of a pool's float16 window
    buffers ``win_k``/``win_v`` [Nw, H, 2G, D] (a window is [sink: G tokens | tail: G tokens]),
    read in place: a decode step's commit with no gather or copy of the tiles. The same bytes as
    ``quantize_tiles(keys=win_k[slots][:, :, G:], ...)``."""
    _, H, G2, D = win_k.shape
    G = G2 // 2
    if win_v.shape != win_k.shape or win_k.dtype != mx.float16 or win_v.dtype != mx.float16:
        raise ValueError(f"window buffers {win_k.shape} {win_k.dtype} / {win_v.shape} {win_v.dtype}: "
                         "need two float16 [Nw, H, 2G, D]")
    if not is_supported(head_dim=D, tile_size=G, key_bits=key_bits, value_bits=value_bits):
        raise ValueError(f"no commit kernel for head_dim {D}, tile {G}, bits k{key_bits}v{value_bits}")
    call = commit_launch(win_k, win_v, key_bits, value_bits, iters, rows, slots=slots, reciprocal=reciprocal)
    return _launch(call, D, G, (key_bits, value_bits))


@lru_cache(maxsize=None)
def _blocks_start(template: tuple, threadgroup: tuple[int, int, int], D: int, G: int, bits: tuple[int, int]) -> bool:
    """Whether blocks of this template and size start on this device: a fact of the device and the
    driver, asked once per template by one small launch. The driver compiles the kernel's PTX
    itself, and where it needs more than 64 registers a thread (nvcc here gives 60 at 4 rows a
    thread), a 1,024-thread block cannot start ("too many resources requested for launch")."""
    t = dict(template)
    heads = t["NH"] if t["WIN"] else 1  # one tile: of window 1 of two (WIN = 1), else of one head
    shape = (2, heads, 2 * G, D) if t["WIN"] else (1, 1, G, D)
    slots = mx.ones((1,), mx.int32) if t["WIN"] else no_slots()
    probe = Launch(inputs=[mx.zeros(shape, mx.float16), mx.zeros(shape, mx.float16), _bits(*bits), slots],
                   template=list(template), grid=(heads * (D // min(D, 128)) * threadgroup[0], 2, 1),
                   threadgroup=threadgroup, output_shapes=list(output_shapes(1, heads, G, D, *bits).values()),
                   output_dtypes=[mx.uint32 if name.endswith("codes") else mx.float16 for name in RECORD_FIELDS])
    try:
        mx.eval(list(_run(probe, D, G).values()))
    except RuntimeError as exc:
        log.warning("kvarn: the commit kernel's %d-thread blocks do not start here (%s); using 8 rows a thread",
                    threadgroup[0], exc)
        return False
    return True


def _launch(call: Launch, D: int, G: int, bits: tuple[int, int]) -> dict[str, mx.array]:
    """Run ``call`` (of layout ``bits`` = (key_bits, value_bits)), re-cut to 8 rows a thread where
    its blocks do not start here."""
    if call.threadgroup[0] > 512 and not _blocks_start(tuple(call.template), call.threadgroup, D, G, bits):
        call = _with_rows(call, 8, D, G)
    return _run(call, D, G)


def _with_rows(call: Launch, rows: int, D: int, G: int) -> Launch:
    template = [(k, rows if k == "ROWS" else v) for k, v in call.template]
    threads = G * min(D, 128) // (4 * rows)
    blocks = call.grid[0] // call.threadgroup[0]
    return replace(call, template=template, grid=(blocks * threads, call.grid[1], call.grid[2]),
                   threadgroup=(threads, 1, 1))


def _run(call: Launch, D: int, G: int) -> dict[str, mx.array]:
    outs = _kernel(shared_bytes(D, G))(
        inputs=call.inputs, template=call.template, grid=call.grid, threadgroup=call.threadgroup,
        output_shapes=call.output_shapes, output_dtypes=call.output_dtypes)
    return dict(zip(RECORD_FIELDS, outs))
