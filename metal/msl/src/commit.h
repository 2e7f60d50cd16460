
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
