
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
