"""Fused KVarN tile commit on Apple GPUs (``mx.fast.metal_kernel``): the Metal twin of
``metal.cuda.commit`` (the whole quantizer of docs/kvarn.md for every tile given,
all heads, K and V, in one launch), with the CUDA wrappers' signatures and outputs:
``quantize_tiles(keys=, values=, ...)`` over tiles [n, H, G, D] and ``quantize_window_tails(win_k=,
win_v=, slots=, ...)`` over the tails of a pool's float16 windows, read in place. Output: the
block-major record fields of ``kvarn/pool.py`` (``metal.records.output_shapes``).

Limits it is written to (Apple GPUs): one threadgroup per matrix, of G * W / (4 * ROWS) threads:
512 at G = W = 128 with the default 8 rows a thread (the CUDA kernel's 4 rows
would be 1,024, Metal's maximum, reachable only if the compiled kernel's registers allow it);
19,072 bytes of threadgroup memory at G = W = 128 (of 32 KB: ``threadgroup_bytes``); 32-lane
simdgroups. The comment above ``HEADER`` says what differs from the CUDA kernel and how the code
keeps the compiler from contracting products into fused multiply-adds.

**What was verified where** (docs/kernels.md, "Metal twins"): the Metal text run by a g++ emulator
of the Metal execution model on Linux CPUs (``tests/metal/metal_emulator.py``) against
``kvarn.pool.quantize_blocks_reference``; never compiled by Apple's Metal compiler on this
project's machines. On an Apple GPU the selector (``metal.selector.Kernels``) compiles it and checks it against
the pure-MLX quantizer per layout, and falls back to that quantizer if the check fails.

The module owns the whole kernel: its Metal text (``HEADER`` and ``SOURCE``, below the constants),
the launch arithmetic and the wrappers that run it.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from metal.launch import minify, no_slots
from metal.msl.paged_decode import MAX_THREADGROUP_MEMORY, MetalLaunch
from metal.msl.paged_decode import run as _run
from metal.records import RECORD_FIELDS, output_shapes

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_TILE_SIZES = (64, 128)
DEFAULT_ROWS = 8  # rows a thread: 512 threads a threadgroup at G = W = 128
MAX_THREADS = 1024
INPUTS = ["keys", "values", "bits", "slots"]


# ---- the Metal source: a shared header and the kernel body, as ``mx.fast.metal_kernel`` takes them.
# A port of the CUDA kernel (``metal/cuda/commit.py``): the same thread layout, the same operations in
# the same order (every sum added as MLX's CUDA reduce adds it: runs of 4 from 0, then a butterfly over
# lanes; strided sums in order, then a butterfly over 32 partials), so the same bytes wherever the
# elementwise operations round the same way. The algorithm and the reduction orders are described in
# ``metal/cuda/commit.py`` and docs/kernels.md.
#
# What differs from the CUDA kernel, and why:
#
# - Threadgroup memory. Apple GPUs give a threadgroup at most 32 KB; the CUDA layout needs 52 KB at
#   G = W = 128, 33 KB of it the float16 copy of the matrix. Here the matrix is not staged: a
#   thread reads its own ROWS x 4 values from device memory when it needs them (every iterate, and
#   the end), and the first stds of a K tile quantized on its own (``SPECIAL``) read the values
#   they need from device memory too. Left in threadgroup memory: the 32 x (CM + 1) column partials
#   (later the codes, one byte each: R x C <= 32 x (CM + 1) x 4 bytes) and five vectors of CM
#   floats, 19,072 bytes at CM = max(G, W) = 128 (``static_assert``: at most 32 KB).
# - Threads. ROWS = 8 rows a thread by default: 512 threads a threadgroup at G = W = 128 (ROWS = 4
#   would be 1,024, the most a threadgroup may have, and only if the compiled kernel's register use
#   allows it: ``maxTotalThreadsPerThreadgroup``, which only an Apple GPU can tell).
# - Butterflies: ``simd_shuffle_xor`` over the 32 lanes of a simdgroup (Apple GPUs' simdgroups are
#   32 wide); the threadgroup is one-dimensional, so simdgroup k holds threads 32k .. 32k+31, CUDA's
#   warp layout.
# - No contraction into fused multiply-adds. MLX compiles custom Metal kernels in its "safe" math
#   mode by default (MLX >= 0.32: ``MTLMathModeSafe``; before, ``fastMathEnabled = false``), which
#   is meant to forbid result-changing transformations; on top of that, every product that feeds an
#   addition goes through ``kc_mul``, which ORs its bits with a zero the compiler cannot see
#   (``bits[2]``, a kernel input): the sum's operand is no longer a multiplication, so no compiler
#   can fuse the two. ``exp`` / ``log`` / ``sqrt`` are ``metal::precise::`` (what MLX's own Exp, Log
#   and Sqrt ops call); divisions are ``/`` as in MLX's Divide op.
# - Byte identity with the pure-MLX quantizer *on Metal* is not claimed: MLX's Metal reductions add
#   in their own orders (``simd_sum`` among them) and Apple's ``exp`` / ``log`` are not glibc's; codes
#   move only where a value sits within float noise of a rounding boundary, which the self-check
#   (>= 99% of code words equal) and the tests' rules allow.
HEADER = r"""
// float32 constants as MLX makes them from kvarn/quantize.py's Python floats (double -> float)
#define KC_STD_MIN 1e-3f
#define KC_STD_MAX 1e3f
#define KC_LOG_MIN -0.3f
#define KC_LOG_MAX 10.0f
#define KC_FLOOR 1e-8f
#define KC_STEP_MIN 1e-10f

// a product no compiler can fuse into a following add: its bits ORed with an opaque zero (z)
inline float kc_mul(float a, float b, uint z) { return as_type<float>(as_type<uint>(a * b) | z); }

// MLX's maximum / minimum (no NaN can arise here)
inline float kc_max(float a, float b) { return a > b ? a : b; }
inline float kc_min(float a, float b) { return a < b ? a : b; }
inline float kc_clip(float x, float lo, float hi) { return kc_min(kc_max(x, lo), hi); }

// the log-domain step: clip(l + log(clip(std, 1e-3, 1e3)), -0.3, 10)
inline float kc_step(float l, float sd) {
  return kc_clip(l + metal::precise::log(kc_clip(sd, KC_STD_MIN, KC_STD_MAX)), KC_LOG_MIN, KC_LOG_MAX);
}

// butterfly over the lanes of a group of L (a power of two): MLX's CUDA cg::reduce order
template <int L>
inline float kc_bsum(float v) {
  for (int m = L / 2; m > 0; m >>= 1) v = v + simd_shuffle_xor(v, (ushort)m);
  return v;
}
template <int L>
inline float kc_bmax(float v) {
  for (int m = L / 2; m > 0; m >>= 1) v = kc_max(v, simd_shuffle_xor(v, (ushort)m));
  return v;
}
template <int L>
inline float kc_bmin(float v) {
  for (int m = L / 2; m > 0; m >>= 1) v = kc_min(v, simd_shuffle_xor(v, (ushort)m));
  return v;
}

// MLX's row reduce of a run: each thread sums 4 consecutive values from 0, in order
inline float kc_sum4(float a, float b, float c, float d) { return (((0.0f + a) + b) + c) + d; }

// sample std (ddof = 1) of a row of C values held 4 per lane by the row's C/4 lanes
template <int C>
inline float kc_row_std(thread const float* a, uint z) {
  constexpr int LPR = C / 4;
  const float mean = kc_mul(kc_bsum<LPR>(kc_sum4(a[0], a[1], a[2], a[3])), 1.0f / C, z);
  float d[4];
  for (int i = 0; i < 4; ++i) d[i] = a[i] - mean;
  const float ss = kc_bsum<LPR>(kc_sum4(kc_mul(d[0], d[0], z), kc_mul(d[1], d[1], z), kc_mul(d[2], d[2], z),
                                        kc_mul(d[3], d[3], z)));
  return metal::precise::sqrt(ss / (float)(C - 1));
}

// element (r, c) of the matrix: K tiles are read transposed (M[r][c] = src[c][r])
template <bool KEYS>
inline float kc_at(const device half* src, int stride, int r, int c) {
  return static_cast<float>(KEYS ? src[c * stride + r] : src[r * stride + c]);
}

// the imbalance of the current iterate (every thread computes the same value):
// max/min of the column stds + max/min of the row stds (min floored at 1e-8)
template <int R, int C>
inline float kc_imbalance(threadgroup const float* cstd, threadgroup const float* rstd, int lane) {
  float cmax = cstd[lane], cmin = cstd[lane], rmax = rstd[lane], rmin = rstd[lane];
  for (int c = lane + 32; c < C; c += 32) { cmax = kc_max(cmax, cstd[c]); cmin = kc_min(cmin, cstd[c]); }
  for (int r = lane + 32; r < R; r += 32) { rmax = kc_max(rmax, rstd[r]); rmin = kc_min(rmin, rstd[r]); }
  cmax = kc_bmax<32>(cmax); cmin = kc_bmin<32>(cmin); rmax = kc_bmax<32>(rmax); rmin = kc_bmin<32>(rmin);
  return cmax / kc_max(cmin, KC_FLOOR) + rmax / kc_max(rmin, KC_FLOOR);
}

// column stds of b into cst: per thread the sums of its rows t*KR + k (k in order), per column the
// 32 partials by a butterfly (threadgroup collective; cst valid after its last barrier)
template <int R, int C, int TPU, int KR, int NW>
inline void kc_col_std(thread const float* b, threadgroup float* P, threadgroup float* cst, int u, int c0, int warp,
                       int lane, uint z) {
  constexpr int PS = C + 1;
  float p[4];
  for (int t = 0; t < TPU; ++t) {
    for (int i = 0; i < 4; ++i) p[i] = 0.0f;
    for (int k = 0; k < KR; ++k)
      for (int i = 0; i < 4; ++i) p[i] = p[i] + b[(t * KR + k) * 4 + i];
    for (int i = 0; i < 4; ++i) P[(u * TPU + t) * PS + c0 + i] = p[i];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int c = warp; c < C; c += NW) {
    const float s = kc_bsum<32>(P[lane * PS + c]);
    if (lane == 0) cst[c] = kc_mul(s, 1.0f / R, z);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float mean[4];
  for (int i = 0; i < 4; ++i) mean[i] = cst[c0 + i];
  for (int t = 0; t < TPU; ++t) {
    for (int i = 0; i < 4; ++i) p[i] = 0.0f;
    for (int k = 0; k < KR; ++k)
      for (int i = 0; i < 4; ++i) {
        const float d = b[(t * KR + k) * 4 + i] - mean[i];
        p[i] = p[i] + kc_mul(d, d, z);
      }
    for (int i = 0; i < 4; ++i) P[(u * TPU + t) * PS + c0 + i] = p[i];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int c = warp; c < C; c += NW) {
    const float s = kc_bsum<32>(P[lane * PS + c]);
    if (lane == 0) cst[c] = metal::precise::sqrt(s / (float)(R - 1));
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Quantize the R x C matrix of one threadgroup. src: the tile slice (G tokens x W channels, row
// stride src_stride halves); KEYS: M[r][c] = src[c][r], else M[r][c] = src[r][c]. SPECIAL: the
// first column and row stds are summed in the orders MLX uses for the transposed view of a K tile
// quantized on its own (kvarn.quantize.quantize_keys, G != W): column means by runs of 4 rows,
// column squares by rows r = lane + 32 k; row means by columns c = lane + 32 k, row squares by runs.
// P: 32 x (max(R, C) + 1) floats (the column partials, later the codes); V: 5 x max(R, C) floats.
template <int R, int C, int ITERS, int ROWS, bool KEYS, bool SPECIAL>
inline void kc_matrix(const device half* src, int src_stride, threadgroup float* P, threadgroup float* V, int B,
                      device uint* codes, int code_stride, device half* alpha, device half* beta, int fstride,
                      device half* colf, int tid, int lane, int warp, uint z) {
  constexpr int CM = R > C ? R : C;
  constexpr int LPR = C / 4;             // lanes per row
  constexpr int RPP = 32 / LPR;          // rows per simdgroup at once
  constexpr int NU = R / ROWS;           // row units
  constexpr int NW = NU / RPP;           // simdgroups
  constexpr int NT = NW * 32;
  constexpr int TPU = 32 / NU;           // column-partial indices per unit
  constexpr int KR = R / 32;             // rows per partial index
  constexpr int NR = TPU * KR;           // rows per thread (= ROWS)
  static_assert(NR == ROWS && NW * 32 * 4 * ROWS == R * C, "thread layout");
  static_assert(R * C <= 4 * 32 * (CM + 1), "the codes fit over the partials");
  const float LEVELS = (float)((1 << B) - 1);

  threadgroup uchar* Q = (threadgroup uchar*)P;  // the codes, over P once P is free
  threadgroup float* lc = V;
  threadgroup float* ec = V + CM;
  threadgroup float* blc = V + 2 * CM;
  threadgroup float* cst = V + 3 * CM;   // column means, then column stds
  threadgroup float* rst = V + 4 * CM;   // row stds

  const int u = warp * RPP + lane / LPR; // row unit
  const int cl = lane % LPR;             // columns 4cl .. 4cl+3
  const int c0 = 4 * cl;

  if (tid < C) { lc[tid] = 0.0f; blc[tid] = 0.0f; }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  float b[NR * 4];
  float lr[NR], blr[NR];
  for (int j = 0; j < NR; ++j) { lr[j] = 0.0f; blr[j] = 0.0f; }

  // the start (lr = lc = 0, balanced = M): its row and column stds
  for (int j = 0; j < NR; ++j) {
    const int r = u * TPU + j / KR + 32 * (j % KR);
    for (int i = 0; i < 4; ++i) b[j * 4 + i] = kc_at<KEYS>(src, src_stride, r, c0 + i);
  }
  if (SPECIAL) {
    for (int c = warp; c < C; c += NW) {
      float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (4 * lane < R)
        for (int i = 0; i < 4; ++i) a[i] = kc_at<KEYS>(src, src_stride, 4 * lane + i, c);
      const float mean = kc_mul(kc_bsum<32>(kc_sum4(a[0], a[1], a[2], a[3])), 1.0f / R, z);
      float q = 0.0f;
      for (int k = 0; k < KR; ++k) {
        const float d = kc_at<KEYS>(src, src_stride, lane + 32 * k, c) - mean;
        q = q + kc_mul(d, d, z);
      }
      q = kc_bsum<32>(q);
      if (lane == 0) cst[c] = metal::precise::sqrt(q / (float)(R - 1));
    }
    for (int r = warp; r < R; r += NW) {
      float s = 0.0f;
      for (int k = 0; k < C / 32; ++k) s = s + kc_at<KEYS>(src, src_stride, r, lane + 32 * k);
      const float mean = kc_mul(kc_bsum<32>(s), 1.0f / C, z);
      float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (4 * lane < C)
        for (int i = 0; i < 4; ++i) d[i] = kc_at<KEYS>(src, src_stride, r, 4 * lane + i) - mean;
      const float q = kc_bsum<32>(kc_sum4(kc_mul(d[0], d[0], z), kc_mul(d[1], d[1], z), kc_mul(d[2], d[2], z),
                                          kc_mul(d[3], d[3], z)));  // lanes past the row add zeros, as MLX
      if (lane == 0) rst[r] = metal::precise::sqrt(q / (float)(C - 1));
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    for (int j = 0; j < NR; ++j) {
      const float sd = kc_row_std<C>(b + j * 4, z);
      if (cl == 0) rst[u * TPU + j / KR + 32 * (j % KR)] = sd;
    }
    kc_col_std<R, C, TPU, KR, NW>(b, P, cst, u, c0, warp, lane, z);
  }
  float best = kc_imbalance<R, C>(cst, rst, lane);

  for (int it = 0; it < ITERS; ++it) {
    if (tid < C) {
      const float l = kc_step(lc[tid], cst[tid]);
      lc[tid] = l;
      ec[tid] = metal::precise::exp(l);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float e[4];
    for (int i = 0; i < 4; ++i) e[i] = ec[c0 + i];
    for (int j = 0; j < NR; ++j) {
      const int r = u * TPU + j / KR + 32 * (j % KR);
      float t[4], b1[4];
      const float er0 = metal::precise::exp(lr[j]);
      for (int i = 0; i < 4; ++i) {
        t[i] = kc_at<KEYS>(src, src_stride, r, c0 + i) / e[i];
        b1[i] = t[i] / er0;
      }
      lr[j] = kc_step(lr[j], kc_row_std<C>(b1, z));
      const float er1 = metal::precise::exp(lr[j]);
      for (int i = 0; i < 4; ++i) b[j * 4 + i] = t[i] / er1;
      const float sd = kc_row_std<C>(b + j * 4, z);
      if (cl == 0) rst[r] = sd;
    }
    kc_col_std<R, C, TPU, KR, NW>(b, P, cst, u, c0, warp, lane, z);
    const float imb = kc_imbalance<R, C>(cst, rst, lane);
    if (imb <= best) {  // ties go to the later iterate
      best = imb;
      for (int j = 0; j < NR; ++j) blr[j] = lr[j];
      if (tid < C) blc[tid] = lc[tid];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // round the best iterate's balanced rows (min/max RTN), absorb, then pack
  float e[4];
  for (int i = 0; i < 4; ++i) e[i] = metal::precise::exp(blc[c0 + i]);
  for (int j = 0; j < NR; ++j) {
    const int r = u * TPU + j / KR + 32 * (j % KR);
    const float er = metal::precise::exp(blr[j]);
    float lo = 0.0f, hi = 0.0f;
    for (int i = 0; i < 4; ++i) {
      const float v = (kc_at<KEYS>(src, src_stride, r, c0 + i) / e[i]) / er;
      b[j * 4 + i] = v;
      lo = i ? kc_min(lo, v) : v;
      hi = i ? kc_max(hi, v) : v;
    }
    lo = kc_bmin<LPR>(lo);
    hi = kc_bmax<LPR>(hi);
    const float step = kc_max((hi - lo) / LEVELS, KC_STEP_MIN);
    for (int i = 0; i < 4; ++i) b[j * 4 + i] = kc_clip(metal::rint((b[j * 4 + i] - lo) / step), 0.0f, LEVELS);
    if (cl == 0) {
      alpha[r * fstride] = static_cast<half>(er * step);
      beta[r * fstride] = static_cast<half>(er * lo);
    }
  }
  if (tid < C) colf[tid] = static_cast<half>(metal::precise::exp(blc[tid]));
  for (int j = 0; j < NR; ++j) {
    const int r = u * TPU + j / KR + 32 * (j % KR);
    for (int i = 0; i < 4; ++i) Q[r * C + c0 + i] = (uchar)b[j * 4 + i];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // a row's codes as a little-endian stream of B-bit values, C * B / 32 words
  const int RW = C * B / 32;
  for (int e2 = tid; e2 < R * RW; e2 += NT) {
    const int r = e2 / RW, w = e2 % RW, bit0 = 32 * w;
    uint word = 0;
    for (int jc = bit0 / B; jc <= (bit0 + 31) / B && jc < C; ++jc) {
      const int sh = jc * B - bit0;
      const uint q = Q[r * C + jc];
      word |= sh >= 0 ? (q << sh) : (q >> -sh);
    }
    codes[r * code_stride + w] = word;
  }
}
"""

# Template arguments: G (tile), D (head_dim), ITERS, ROWS (rows per thread), WIN and NH; the bits
# are an input (bits = [key_bits, value_bits, 0], int32: the third is kc_mul's opaque zero), so one
# compile serves every width. WIN = 0: inputs keys/values [n, H, G, D] float16 (NH = 1, ``slots``
# unread). WIN = 1: keys/values are a pool's window buffers [Nw, NH, 2G, D] float16 and tile t is
# the tail (positions G .. 2G-1) of window slots[t], read in place. Outputs the record fields of
# kvarn/pool.py. Grid: (matrices x threads, 2) threads; threadgroup y = 0 -> K, 1 -> V.
SOURCE = r"""
  constexpr int W = D > 128 ? 128 : D;
  constexpr int S = D / W;
  constexpr int CM = G > W ? G : W;
  static_assert((32 * (CM + 1) + 5 * CM) * 4 <= 32768, "threadgroup memory past 32 KB");
  threadgroup float kc_p[32 * (CM + 1)];
  threadgroup float kc_v[5 * CM];
  const int mat = (int)threadgroup_position_in_grid.x;  // (tile * H + head) * S + slice
  const int th = mat / S, s = mat % S;
  const long base = WIN ? ((long)(slots[th / NH] * NH + th % NH) * (2 * G) + G) * D + s * W
                        : (long)th * G * D + s * W;
  const int KB = bits[0], VB = bits[1];
  const uint z = (uint)bits[2];
  const int tid = (int)thread_index_in_threadgroup;
  const int lane = (int)thread_index_in_simdgroup, warp = (int)simdgroup_index_in_threadgroup;
  if (threadgroup_position_in_grid.y == 0) {
    kc_matrix<W, G, ITERS, ROWS, true, (G != W)>(
        keys + base, D, kc_p, kc_v, KB, k_codes + (long)mat * W * (G * KB / 32), G * KB / 32,
        k_alpha + (long)mat * W, k_beta + (long)mat * W, 1, k_r + (long)mat * G, tid, lane, warp, z);
  } else {
    kc_matrix<G, W, ITERS, ROWS, false, false>(
        values + base, D, kc_p, kc_v, VB, v_codes + (long)th * G * (D * VB / 32) + s * (W * VB / 32), D * VB / 32,
        v_alpha + (long)th * G * S + s, v_beta + (long)th * G * S + s, S, v_c + (long)th * D + s * W, tid, lane,
        warp, z);
  }
"""

KERNEL_TEXT = (minify(HEADER), minify(SOURCE))


def threadgroup_bytes(head_dim: int, tile_size: int) -> int:
    """Threadgroup memory of one threadgroup (``kc_p`` and ``kc_v`` in the source)."""
    cm = max(tile_size, min(head_dim, 128))
    return 4 * (32 * (cm + 1) + 5 * cm)


def threads(head_dim: int, tile_size: int, rows: int) -> int:
    return tile_size * min(head_dim, 128) // (4 * rows)


def is_supported(*, head_dim: int, tile_size: int, key_bits: int, value_bits: int, rows: int = DEFAULT_ROWS) -> bool:
    """Whether the Metal kernel has a template for this layout (else callers use the reference)."""
    return (head_dim in SUPPORTED_HEAD_DIMS and tile_size in SUPPORTED_TILE_SIZES and key_bits in SUPPORTED_BITS
            and value_bits in SUPPORTED_BITS and rows in (4, 8)
            and threads(head_dim, tile_size, rows) <= MAX_THREADS
            and threadgroup_bytes(head_dim, tile_size) <= MAX_THREADGROUP_MEMORY)


@lru_cache(maxsize=64)
def _bits(key_bits: int, value_bits: int) -> mx.array:
    """The kernel's bits input: [key_bits, value_bits, 0]; the 0 is the opaque zero of ``kc_mul``
    (it must come from outside the kernel, where no compiler can see it)."""
    return mx.array([key_bits, value_bits, 0], dtype=mx.int32)


@lru_cache(maxsize=256)
def _launch_shape(n: int, H: int, G: int, D: int, key_bits: int, value_bits: int, iters: int, rows: int,
                  window: bool) -> tuple:
    template = (("G", G), ("D", D), ("ITERS", iters), ("ROWS", rows), ("WIN", int(window)), ("NH", H if window else 1))
    W = min(D, 128)
    tg = threads(D, G, rows)
    shapes = output_shapes(n, H, G, D, key_bits, value_bits)
    dtypes = tuple(mx.uint32 if name.endswith("codes") else mx.float16 for name in RECORD_FIELDS)
    return (template, (n * H * (D // W) * tg, 2, 1), (tg, 1, 1), tuple(shapes[name] for name in RECORD_FIELDS), dtypes)


def commit_launch(keys: mx.array, values: mx.array, key_bits: int, value_bits: int, iters: int,
                  rows: int = DEFAULT_ROWS, slots: mx.array | None = None) -> MetalLaunch:
    """The launch for tiles ``keys``/``values`` [n, H, G, D], or, with ``slots`` ([n] int32), for
    the tails of those windows of window buffers ``keys``/``values`` [Nw, H, 2G, D] (WIN = 1)."""
    if slots is None:
        n, H, G, D = keys.shape
    else:
        (n,), (_, H, G2, D) = slots.shape, keys.shape
        G = G2 // 2
    template, grid, tg, shapes, dtypes = _launch_shape(n, H, G, D, key_bits, value_bits, iters, rows,
                                                       slots is not None)
    return MetalLaunch(name="kvarn_commit", header=KERNEL_TEXT[0], source=KERNEL_TEXT[1], input_names=INPUTS,
                       output_names=list(RECORD_FIELDS),
                       inputs=[keys.astype(mx.float16), values.astype(mx.float16), _bits(key_bits, value_bits),
                               no_slots() if slots is None else slots.astype(mx.int32)],
                       template=list(template), grid=grid, threadgroup=tg, output_shapes=list(shapes),
                       output_dtypes=list(dtypes))


def _check(D: int, G: int, key_bits: int, value_bits: int, rows: int) -> None:
    if not is_supported(head_dim=D, tile_size=G, key_bits=key_bits, value_bits=value_bits, rows=rows):
        raise ValueError(f"no Metal commit kernel for head_dim {D}, tile {G}, bits k{key_bits}v{value_bits}, "
                         f"{rows} rows a thread")


def quantize_tiles(*, keys: mx.array, values: mx.array, key_bits: int, value_bits: int, iters: int = 8,
                   rows: int = DEFAULT_ROWS) -> dict[str, mx.array]:
    """``metal.cuda.commit.quantize_tiles`` on an Apple GPU: rotated float16 tiles [n, H, G, D] -> n
    blocks of record fields. ``rows``: 8 or 4 rows a thread (512 or 1,024 threads at G = W = 128)."""
    n, H, G, D = keys.shape
    if values.shape != keys.shape:
        raise ValueError(f"keys {keys.shape} and values {values.shape} differ")
    _check(D, G, key_bits, value_bits, rows)
    if n == 0:
        return {name: mx.zeros(shape, mx.uint32 if name.endswith("codes") else mx.float16)
                for name, shape in output_shapes(0, H, G, D, key_bits, value_bits).items()}
    return dict(zip(RECORD_FIELDS, _run(commit_launch(keys, values, key_bits, value_bits, iters, rows))))


def quantize_window_tails(*, win_k: mx.array, win_v: mx.array, slots: mx.array, key_bits: int, value_bits: int,
                          iters: int = 8, rows: int = DEFAULT_ROWS) -> dict[str, mx.array]:
    """``metal.cuda.commit.quantize_window_tails`` on an Apple GPU: ``quantize_tiles`` of the tails of
    windows ``slots`` ([n] int32) of float16 window buffers [Nw, H, 2G, D], read in place."""
    _, H, G2, D = win_k.shape
    G = G2 // 2
    if win_v.shape != win_k.shape or win_k.dtype != mx.float16 or win_v.dtype != mx.float16:
        raise ValueError(f"window buffers {win_k.shape} {win_k.dtype} / {win_v.shape} {win_v.dtype}: "
                         "need two float16 [Nw, H, 2G, D]")
    _check(D, G, key_bits, value_bits, rows)
    return dict(zip(RECORD_FIELDS, _run(commit_launch(win_k, win_v, key_bits, value_bits, iters, rows,
                                                      slots=slots))))
