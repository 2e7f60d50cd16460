"""The tensor-core (``mma.sync.m16n8k16``, f16 x f16 -> f32) body of the fused paged decode
attention (``metal.cuda.paged_decode``), for D = 128, key bits 2/4/8 with G * key_bits >= 256, value bits
2/4/8 and up to 8 query heads per KV head; other shapes run the scalar body
(``metal.cuda.paged_decode``'s ``ATTENTION_SOURCE``). Design: docs/kernels.md.

Fragments come straight from the packed codes. One 32-bit word holds 32/b codes of one channel
(keys: consecutive tokens) or one token (values: consecutive channels); ``(w & mask) | 0x6400_6400``
turns the codes i and i + 16/b (same bit offset o in the word's two 16-bit halves) into the half2
(1024 + 2^o c_i, 1024 + 2^o c_{i+16/b}), and one ``fma.f16x2`` makes it the exact codes (FOLD = 1
keeps the 1024 offset and takes it out of the float32 product instead). The two halves belong to
two *slots*: for QK, two tokens of one channel; for PV, two channels of one token. The B operand
puts each slot's query heads in its own four columns (the other slot's entries zero), so one
m16n8k16 computes 16 rows x 2 slots x 4 heads over 8 channels (QK) or 8 tokens (PV):

    QK  A[m, 2kk+s] = code[chan kk, token(m, s)]      B[2kk+s, n] = (n/4 == s) q'[chan kk, head n%4]
        C[m, n] = sum_c q'[c, head] code[c, token(m, n/4)]              (q' = q * k_alpha)
    PV  A[m, 2kk+s] = code[token kk, chan(m, s)]       B[2kk+s, n] = (n/4 == s) p'[token kk, head n%4]
        C[m, n] = sum_g p'[g, head] code[g, chan(m, n/4)]               (p' = p * v_alpha)

Each lane reads whole words (one per channel and lane for K, b/2 per token and lane for V) from a
shared-memory stage filled by ``cp.async`` (16-byte chunks; 8-word groups of a row XOR-swizzled so
that the four rows a load instruction touches fall in distinct banks), NST stages deep. The
block's 4 warps split each tile's tokens (WG = G*kb/256 warps a tile, TPS = 4/WG tiles a step);
every warp keeps its own online-softmax state (m, l, o) and the block merges the four at the end.
The float16 sink and tail tiles (if the work item has them) are split across the 4 warps by tokens
and run scalar (lane = token for QK; the o layout of the record path for PV).

The module owns the body's CUDA text, a header (``MMA_HEADER``) and the body in two halves, the
setup and sink/tail (``MMA_SETUP``) and the record tiles with the warps' merge (``MMA_TILES``), with
its shape rule and its shared-memory size; ``metal.cuda.paged_decode`` launches it.
"""


MMA_HEADER = r"""
#ifndef KV_EMU
__device__ __forceinline__ void kv_mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                       uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t kv_hfma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ uint32_t kv_hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t kv_pack2(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ float kv_hf(unsigned short u) { return __half2float(__ushort_as_half(u)); }
__device__ __forceinline__ unsigned short kv_fh(float x) { return __half_as_ushort(__float2half_rn(x)); }
__device__ __forceinline__ void kv_cp16(void* dst, const void* src) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(src) : "memory");
}
__device__ __forceinline__ void kv_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void kv_cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
#endif
__device__ __forceinline__ float kv_lo(uint32_t u) { return kv_hf((unsigned short)(u & 0xffffu)); }
__device__ __forceinline__ float kv_hi(uint32_t u) { return kv_hf((unsigned short)(u >> 16)); }

// 8-word group swizzle of a row (rows of NWD 8-word groups): the four rows r..r+3 that one load
// instruction touches (r = 0 mod 4 apart from the lane's t) land in distinct banks
template <int NWD>
__device__ __forceinline__ int kv_sw(int row) { return ((row & 3) * NWD) >> 2; }

// the code pair (i, i + 16/B) of word w as half2 (1024 + 2^o c) each (FOLD), else the exact codes
template <int B, int FOLD>
__device__ __forceinline__ uint32_t kv_pair(uint32_t w, int i) {
  const int o = (i * B) & 7;
  const uint32_t m = ((1u << B) - 1u) << o;
  const uint32_t v = (i * B >= 8) ? (w >> 8) : w;
  const uint32_t x = (v & (m | (m << 16))) | 0x64006400u;
  if (FOLD) return x;
  const uint32_t s = (uint32_t)(15 - o) << 10, c = 0x8000u | ((uint32_t)(25 - o) << 10);
  return kv_hfma2(x, s | (s << 16), c | (c << 16));
}

// N consecutive window values (N = 2, 4, 8; one vector load)
template <int N>
__device__ __forceinline__ void kv_loadn(const __half* p, float* out) {
  if (N == 8) {
    kv_load8(p, out);
  } else if (N == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    out[0] = kv_lo(u.x); out[1 % N] = kv_hi(u.x); out[2 % N] = kv_lo(u.y); out[3 % N] = kv_hi(u.y);
  } else {
    const uint32_t u = *reinterpret_cast<const uint32_t*>(p);
    out[0] = kv_lo(u); out[1 % N] = kv_hi(u);
  }
}
template <int N>
__device__ __forceinline__ void kv_loadn(const float* p, float* out) {
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = p[i];
}

// B fragment of one slot-split operand: the pair u = (x for kk = t, x for kk = t + 4) of head
// column g % 4; slot g / 4 gets the value, the other slot 0
__device__ __forceinline__ void kv_bfrag(uint32_t u, int g, uint32_t& b0, uint32_t& b1) {
  b0 = __byte_perm(u, 0u, g < 4 ? 0x4410u : 0x1044u);
  b1 = __byte_perm(u, 0u, g < 4 ? 0x4432u : 0x3244u);
}
"""

MMA_SETUP = r"""
  constexpr int NWARP = KV_THREADS / 32;
  constexpr int HG = (NR + 3) / 4, NRP = 4 * HG;   // head groups of 4 (the B operand's columns per slot)
  constexpr int KRW = G * KB / 32;                 // K words per channel row
  constexpr int KNW = KRW / 8;                     // 8-word groups per K row = warps per tile
  constexpr int WG = KNW, TPS = NWARP / WG;        // warps per tile, tiles per step
  constexpr int TW = G / WG;                       // tokens per warp and tile
  constexpr int KMT = TW / 32;                     // QK M-tiles per warp
  constexpr int KPW = 16 / KB;                     // code pairs per K word
  constexpr int VRW = D * VB / 32;                 // V words per token row
  constexpr int VNW = VRW / 8;                     // V words per lane and token
  constexpr int VPW = 16 / VB;                     // code pairs per V word
  constexpr int VMT = D / 32;                      // PV M-tiles (channels)
  constexpr int PKS = TW / 8;                      // PV k-steps per warp
  constexpr int QKS = D / 8;                       // QK k-steps
  constexpr int QPS = D / 2 + 4;                   // q pair row stride (words; padded against bank conflicts)
  constexpr int PBS = TW / 2 + 4;                  // p' pair row stride (words)
  constexpr int WTW = G / NWARP;                   // window tokens per warp
  constexpr int SCRW = (NRP * PBS > NR * WTW ? NRP * PBS : NR * WTW);  // per-warp scratch (words)
  constexpr int SCR = (NWARP * SCRW > NR * D ? NWARP * SCRW : NR * D);
  constexpr int OFF_V = 4 * D * KRW, OFF_KA = OFF_V + 4 * G * VRW, OFF_KB = OFF_KA + 2 * D;
  constexpr int OFF_VC = OFF_KB + 2 * D, OFF_KR = OFF_VC + 2 * D, OFF_VA = OFF_KR + 2 * G;
  constexpr int OFF_VB = OFF_VA + 2 * G, TILE = OFF_VB + 2 * G, STAGE = TPS * TILE;
  constexpr float LOG2E = 1.4426950408889634f;
  static_assert(D == 128 && KNW >= 1 && KNW <= NWARP && NR <= 8 && NST >= 2, "unsupported template");
  static_assert(NST * STAGE >= 4 * NWARP * NRP * (D + 2), "the merge buffer aliases the stages");
  static_assert(SCR >= NWARP * SCRW && SCR >= NR * D, "scratch: per-warp parts and the query rotation");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* s_stage = smem_raw;                                    // [NST][TPS][TILE]
  uint32_t* s_qp = reinterpret_cast<uint32_t*>(smem_raw + NST * STAGE); // [NRP][QPS] (q[8ks+t], q[8ks+t+4])
  float* s_scr = reinterpret_cast<float*>(s_qp + NRP * QPS);            // [SCR]: rotation, then per warp
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int wi = blockIdx.x, h = blockIdx.y, H = gridDim.y;
  const int b = work[wi * 3], t0 = work[wi * 3 + 1], t1 = work[wi * 3 + 2];
  const int slot = rows[b * 4], sink_len = rows[b * 4 + 1], tail_len = rows[b * 4 + 2], nt = rows[b * 4 + 3];
  const int nb = meta[0];
  const float sl2 = meta_f[0] * LOG2E;
  const int r0 = t0 > 1 ? t0 : 1, r1 = t1 < nt + 1 ? t1 : nt + 1;  // record tiles [r0, r1)
  const int nsteps = r1 > r0 ? (r1 - r0 + TPS - 1) / TPS : 0;

  // ---- cp.async of one step's record tiles (all threads) ----
  auto issue = [&](int s) {
    unsigned char* st = s_stage + (s % NST) * STAGE;
#pragma unroll
    for (int j = 0; j < TPS; ++j) {
      const int ti = r0 + s * TPS + j;
      if (ti >= r1) break;
      const size_t nh = (size_t)table[b * nb + ti - 1] * H + h;
      unsigned char* dst = st + j * TILE;
      const unsigned char* gk = reinterpret_cast<const unsigned char*>(k_codes + nh * D * KRW);
      const unsigned char* gv = reinterpret_cast<const unsigned char*>(v_codes + nh * G * VRW);
#pragma unroll
      for (int x = 0; x < D * KRW / 4 / KV_THREADS; ++x) {
        const int i = tid + x * KV_THREADS, r = i / (KRW / 4), q = i % (KRW / 4);
        kv_cp16(dst + 4 * (r * KRW + 8 * ((q >> 1) ^ kv_sw<KNW>(r)) + 4 * (q & 1)), gk + 16 * i);
      }
#pragma unroll
      for (int x = 0; x < G * VRW / 4 / KV_THREADS; ++x) {
        const int i = tid + x * KV_THREADS, r = i / (VRW / 4), q = i % (VRW / 4);
        kv_cp16(dst + OFF_V + 4 * (r * VRW + 8 * ((q >> 1) ^ kv_sw<VNW>(r)) + 4 * (q & 1)), gv + 16 * i);
      }
      // factors: 16-byte chunks of k_alpha, k_beta, v_c (D halves each), k_r, v_alpha, v_beta (G each)
      if (tid < 3 * D / 8) {
        const int f = tid / (D / 8), i = tid % (D / 8);
        const void* src = f == 0 ? (const void*)k_alpha : (f == 1 ? (const void*)k_beta : (const void*)v_c);
        kv_cp16(dst + OFF_KA + f * 2 * D + 16 * i, reinterpret_cast<const unsigned char*>(src) + 2 * (nh * D) + 16 * i);
      } else if (tid < 3 * D / 8 + 3 * G / 8) {
        const int k = tid - 3 * D / 8, f = k / (G / 8), i = k % (G / 8);
        const void* src = f == 0 ? (const void*)k_r : (f == 1 ? (const void*)v_alpha : (const void*)v_beta);
        kv_cp16(dst + OFF_KR + f * 2 * G + 16 * i, reinterpret_cast<const unsigned char*>(src) + 2 * (nh * G) + 16 * i);
      }
    }
  };
#pragma unroll
  for (int s = 0; s < NST - 1; ++s) {
    if (s < nsteps) issue(s);
    kv_cp_commit();
  }

  // ---- queries of this KV head: rotated (Hadamard), half pairs in s_qp; padded heads 0 ----
  for (int i = tid; i < NR * D; i += KV_THREADS)
    s_scr[i] = kv_f(queries[((size_t)b * H * NR + (size_t)h * NR) * D + i]);
  __syncthreads();
  for (int len = 1; len < D; len <<= 1) {
    for (int k = tid; k < NR * D / 2; k += KV_THREADS) {
      const int r = k / (D / 2), kk = k % (D / 2);
      const int i = r * D + (kk / len) * 2 * len + (kk % len), j = i + len;
      const float a = s_scr[i], c = s_scr[j];
      s_scr[i] = a + c;
      s_scr[j] = a - c;
    }
    __syncthreads();
  }
  const float inv_w = 1.0f / sqrtf((float)D);
  for (int i = tid; i < NRP * (D / 2); i += KV_THREADS) {
    const int r = i / (D / 2), k = i % (D / 2), c0 = 8 * (k >> 2) + (k & 3);
    s_qp[r * QPS + k] = r < NR ? kv_pack2(s_scr[r * D + c0] * inv_w, s_scr[r * D + c0 + 4] * inv_w) : 0u;
  }
  __syncthreads();
  // this lane's channels 4*lane..4*lane+3 of every head (for q . k_beta)
  float qreg[NRP][4];
#pragma unroll
  for (int r = 0; r < NRP; ++r)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t u = s_qp[r * QPS + (lane >> 1) * 4 + j];
      qreg[r][j] = (lane & 1) ? kv_hi(u) : kv_lo(u);
    }

  // ---- this warp's state, o in the PV accumulator layout: lane (g, t) holds heads
  //      hg*4 + 2(t&1) + {0,1} of the channels (g*VNW + q/VPW)*(32/VB) + q%VPW + (t>>1)*VPW, q = 2mt + row half
  float mrun[HG][2], lrun[HG][2], oacc[HG][VMT][4];
#pragma unroll
  for (int hg = 0; hg < HG; ++hg)
#pragma unroll
    for (int e = 0; e < 2; ++e) { mrun[hg][e] = -INFINITY; lrun[hg][e] = 0.f; }
#pragma unroll
  for (int hg = 0; hg < HG; ++hg)
#pragma unroll
    for (int mt = 0; mt < VMT; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) oacc[hg][mt][e] = 0.f;
  float* wscr = s_scr + warp * SCRW;
  const uint32_t own = (g == 0 && t < 2) ? 1u : 0u;  // the lane that counts a window's sums (per head pair)

  // ---- window tiles (float16 sink / tail): warp w takes tokens [w*WTW, (w+1)*WTW) ----
  auto window = [&](int base, int len) {
    const int wlo = warp * WTW, ntok = len - wlo < WTW ? len - wlo : WTW;
    const bool valid = lane < ntok;
    float x[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) x[r] = 0.f;
    if (valid) {                                    // QK: lane = token; 4 row chunks in flight
      const WT* row = win_k + (((size_t)slot * H + h) * 2 * G + base + wlo + lane) * D;
#pragma unroll
      for (int k0 = 0; k0 < QKS; k0 += 4) {
        float kv[4][8];
#pragma unroll
        for (int u = 0; u < 4; ++u) kv_load8(row + 8 * (k0 + u), kv[u]);
#pragma unroll
        for (int u = 0; u < 4; ++u)
#pragma unroll
          for (int r = 0; r < NR; ++r)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const uint32_t q2 = s_qp[r * QPS + (k0 + u) * 4 + j];
              x[r] += kv_lo(q2) * kv[u][j] + kv_hi(q2) * kv[u][j + 4];
            }
      }
    }
    float mnew[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      x[r] = valid ? x[r] * sl2 : -INFINITY;
      const float mold = __shfl_sync(KV_FULL, mrun[r / 4][r & 1], (r & 3) >> 1);
      mnew[r] = fmaxf(mold, kv_warp_max(x[r]));
      const float mu = mnew[r] == -INFINITY ? 0.f : mnew[r];
      const float p = valid ? exp2f(x[r] - mu) : 0.f;
      if (lane < WTW) wscr[r * WTW + lane] = p;
      x[r] = kv_warp_sum(p);  // the window's sum of p for head r
    }
#pragma unroll
    for (int hg = 0; hg < HG; ++hg)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int hd = hg * 4 + 2 * (t & 1) + e;
        float mn = -INFINITY, ls = 0.f;
#pragma unroll
        for (int r = 0; r < NR; ++r)
          if (r == hd) { mn = mnew[r]; ls = x[r]; }
        if (hd < NR) {
          const float corr = mrun[hg][e] == -INFINITY ? 0.f : exp2f(mrun[hg][e] - mn);
          mrun[hg][e] = mn;
          lrun[hg][e] = lrun[hg][e] * corr + (own ? ls : 0.f);
#pragma unroll
          for (int mt = 0; mt < VMT; ++mt) { oacc[hg][mt][e] *= corr; oacc[hg][mt][2 + e] *= corr; }
        }
      }
    __syncwarp();
    // PV: this lane's 2*VMT channels (VNW runs of VPW) of 8 tokens at a time, loads first
    const WT* vbase = win_v + (((size_t)slot * H + h) * 2 * G + base + wlo) * D;
    for (int k0 = 0; k0 < ntok; k0 += 8) {
      float vv[8][2 * VMT];
#pragma unroll
      for (int u = 0; u < 8; ++u)
#pragma unroll
        for (int jj = 0; jj < VNW; ++jj) {
          const int k = k0 + u < ntok ? k0 + u : ntok - 1;
          kv_loadn<VPW>(vbase + (size_t)k * D + (g * VNW + jj) * (32 / VB) + (t >> 1) * VPW, vv[u] + jj * VPW);
        }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        if (k0 + u >= ntok) break;
#pragma unroll
        for (int hg = 0; hg < HG; ++hg)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int hd = hg * 4 + 2 * (t & 1) + e;
            const float p = hd < NR ? wscr[hd * WTW + k0 + u] : 0.f;
#pragma unroll
            for (int mt = 0; mt < VMT; ++mt) {
              oacc[hg][mt][e] += p * vv[u][2 * mt];
              oacc[hg][mt][2 + e] += p * vv[u][2 * mt + 1];
            }
          }
      }
    }
    __syncwarp();
  };
  if (t0 == 0) window(0, sink_len);
  if (tail_len > 0 && t1 == nt + 2) window(G, tail_len);

"""

# The second half of the tensor-core body: the record tiles (cp.async stages, QK and PV on m16n8k16
# fragments built from the packed codes, online softmax) and the merge of the block's four warps
# (per-split partials, or the row's output when it is the only work item). It continues MMA_SETUP's
# scope: its names (lane, g, t, warp, the stage layout constants, the state mrun / lrun / oacc,
# issue, s_qp, qreg, wscr) are defined there.
MMA_TILES = r"""
  // ---- record tiles: step s holds tiles r0 + s*TPS + j; warp w takes tile j = w / WG, tokens
  //      [wg*TW, (wg+1)*TW) ----
  const int wj = warp / WG, wg = warp % WG;
  uint32_t* pb = reinterpret_cast<uint32_t*>(wscr);   // [NRP][PBS] p' pairs (p'[8ks+t], p'[8ks+t+4])
  unsigned short* pbh = reinterpret_cast<unsigned short*>(pb);
  const int ksw = kv_sw<KNW>(t), vsw = kv_sw<VNW>(t);   // rows used by this lane are t mod 4
  for (int s = 0; s < nsteps; ++s) {
    kv_cp_wait<NST - 2>();
    __syncthreads();                                  // step s is in; step s-1's buffers are free
    if (s + NST - 1 < nsteps) issue(s + NST - 1);
    kv_cp_commit();
    if (r0 + s * TPS + wj >= r1) continue;
    const unsigned char* T = s_stage + (s % NST) * STAGE + wj * TILE;
    const uint32_t* Kst = reinterpret_cast<const uint32_t*>(T);
    const uint32_t* Vst = reinterpret_cast<const uint32_t*>(T + OFF_V);
    const unsigned short* kal = reinterpret_cast<const unsigned short*>(T + OFF_KA);
    const unsigned short* kbe = reinterpret_cast<const unsigned short*>(T + OFF_KB);
    const unsigned short* vcc = reinterpret_cast<const unsigned short*>(T + OFF_VC);
    const unsigned short* kr = reinterpret_cast<const unsigned short*>(T + OFF_KR) + wg * TW;
    const unsigned short* va = reinterpret_cast<const unsigned short*>(T + OFF_VA) + wg * TW;
    const unsigned short* vb = reinterpret_cast<const unsigned short*>(T + OFF_VB) + wg * TW;

    // q . k_beta per head (all lanes), then this lane's heads
    float qb[HG][2];
    {
      const uint2 bw = *reinterpret_cast<const uint2*>(kbe + 4 * lane);
      const float be[4] = {kv_lo(bw.x), kv_hi(bw.x), kv_lo(bw.y), kv_hi(bw.y)};
      float qbr[NRP];
#pragma unroll
      for (int r = 0; r < NRP; ++r)
        qbr[r] = kv_warp_sum(qreg[r][0] * be[0] + qreg[r][1] * be[1] + qreg[r][2] * be[2] + qreg[r][3] * be[3]);
#pragma unroll
      for (int hg = 0; hg < HG; ++hg)
#pragma unroll
        for (int e = 0; e < 2; ++e) qb[hg][e] = (t & 1) ? qbr[hg * 4 + 2 + e] : qbr[hg * 4 + e];
    }

    // ---- QK: sc[hg][mt] = C of M-tile mt (rows: code pairs 2mt, 2mt+1 of this lane's word) ----
    float sc[HG][KMT][4], sq[HG];
#pragma unroll
    for (int hg = 0; hg < HG; ++hg) {
      sq[hg] = 0.f;
#pragma unroll
      for (int mt = 0; mt < KMT; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[hg][mt][e] = 0.f;
    }
#pragma unroll
    for (int ks = 0; ks < QKS; ++ks) {
      const int c0 = 8 * ks + t, c1 = c0 + 4;
      const uint32_t w0 = Kst[c0 * KRW + 8 * (wg ^ ksw) + g], w1 = Kst[c1 * KRW + 8 * (wg ^ ksw) + g];
      const uint32_t al = (uint32_t)kal[c0] | ((uint32_t)kal[c1] << 16);
      uint32_t bf0[HG], bf1[HG];
#pragma unroll
      for (int hg = 0; hg < HG; ++hg) {
        const uint32_t qa = kv_hmul2(s_qp[(hg * 4 + (g & 3)) * QPS + ks * 4 + t], al);
        if (FK) sq[hg] += kv_lo(qa) + kv_hi(qa);
        kv_bfrag(qa, g, bf0[hg], bf1[hg]);
      }
#pragma unroll
      for (int mt = 0; mt < KMT; ++mt) {
        const uint32_t a0 = kv_pair<KB, FK>(w0, 2 * mt), a1 = kv_pair<KB, FK>(w0, 2 * mt + 1);
        const uint32_t a2 = kv_pair<KB, FK>(w1, 2 * mt), a3 = kv_pair<KB, FK>(w1, 2 * mt + 1);
#pragma unroll
        for (int hg = 0; hg < HG; ++hg) kv_mma(sc[hg][mt], a0, a1, a2, a3, bf0[hg], bf1[hg]);
      }
    }
    float sqh[HG][2];                                 // FK: sum_c q'[c, head] of this lane's heads
#pragma unroll
    for (int hg = 0; hg < HG; ++hg) {
      float v = sq[hg];
      if (FK) {                                       // lanes g and g+4 hold the same q': sum over t only
        v += __shfl_xor_sync(KV_FULL, v, 1);
        v += __shfl_xor_sync(KV_FULL, v, 2);
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) sqh[hg][e] = FK ? __shfl_sync(KV_FULL, v, (2 * (t & 1) + e) * 4) : 0.f;
    }

    // ---- scores (log2 domain), tile max, p, p' -> shared, sums ----
    float pbs[HG][2], sps[HG][2], corr[HG][2];
#pragma unroll
    for (int hg = 0; hg < HG; ++hg)
#pragma unroll
      for (int e = 0; e < 2; ++e) { pbs[hg][e] = 0.f; sps[hg][e] = 0.f; }
#pragma unroll
    for (int mt = 0; mt < KMT; ++mt)
#pragma unroll
      for (int eh = 0; eh < 2; ++eh) {
        const int q = 2 * mt + eh, tok = g * (32 / KB) + q + (t >> 1) * KPW;
        const float rr = kv_hf(kr[tok]) * sl2, osc = 1.0f / (float)(1 << ((q * KB) & 7));
#pragma unroll
        for (int hg = 0; hg < HG; ++hg)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float v = sc[hg][mt][2 * eh + e];
            if (FK) v = (v - 1024.f * sqh[hg][e]) * osc;
            sc[hg][mt][2 * eh + e] = rr * (v + qb[hg][e]);
          }
      }
#pragma unroll
    for (int hg = 0; hg < HG; ++hg)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float mx = -INFINITY;
#pragma unroll
        for (int mt = 0; mt < KMT; ++mt) mx = fmaxf(mx, fmaxf(sc[hg][mt][e], sc[hg][mt][2 + e]));
#pragma unroll
        for (int msk = 2; msk < 32; msk <<= 1) mx = fmaxf(mx, __shfl_xor_sync(KV_FULL, mx, msk));
        const float mn = fmaxf(mrun[hg][e], mx);
        corr[hg][e] = mrun[hg][e] == -INFINITY ? 0.f : exp2f(mrun[hg][e] - mn);
        mrun[hg][e] = mn;
        lrun[hg][e] *= corr[hg][e];
      }
#pragma unroll
    for (int mt = 0; mt < KMT; ++mt)
#pragma unroll
      for (int eh = 0; eh < 2; ++eh) {
        const int q = 2 * mt + eh, tok = g * (32 / KB) + q + (t >> 1) * KPW;
        const float fa = kv_hf(va[tok]), fb = kv_hf(vb[tok]);
        const int at = 8 * (tok >> 3) + 2 * (tok & 3) + ((tok >> 2) & 1);  // half index of (p'[8ks+t], p'[8ks+t+4])
#pragma unroll
        for (int hg = 0; hg < HG; ++hg)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = exp2f(sc[hg][mt][2 * eh + e] - mrun[hg][e]);
            lrun[hg][e] += p;
            pbs[hg][e] += p * fb;
            const unsigned short ph = kv_fh(p * fa);
            if (FV) sps[hg][e] += kv_hf(ph);
            pbh[2 * (hg * 4 + 2 * (t & 1) + e) * PBS + at] = ph;
          }
      }
#pragma unroll
    for (int hg = 0; hg < HG; ++hg)
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int msk = 2; msk < 32; msk <<= 1) {
          pbs[hg][e] += __shfl_xor_sync(KV_FULL, pbs[hg][e], msk);
          if (FV) sps[hg][e] += __shfl_xor_sync(KV_FULL, sps[hg][e], msk);
        }
    __syncwarp();

    // ---- PV: ct[hg][mt] = C of M-tile mt (rows: channel pairs 2mt, 2mt+1 of this lane's words) ----
    float ct[HG][VMT][4];
#pragma unroll
    for (int hg = 0; hg < HG; ++hg)
#pragma unroll
      for (int mt = 0; mt < VMT; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) ct[hg][mt][e] = 0.f;
    const int voff = 8 * (((g * VNW) >> 3) ^ vsw) + ((g * VNW) & 7);
#pragma unroll
    for (int ks = 0; ks < PKS; ++ks) {
      const int tau0 = wg * TW + 8 * ks + t, tau1 = tau0 + 4;
      uint32_t v0[VNW], v1[VNW];
      if (VNW == 1) {
        v0[0] = Vst[tau0 * VRW + voff];
        v1[0] = Vst[tau1 * VRW + voff];
      } else if (VNW == 2) {
        const uint2 x0 = *reinterpret_cast<const uint2*>(Vst + tau0 * VRW + voff);
        const uint2 x1 = *reinterpret_cast<const uint2*>(Vst + tau1 * VRW + voff);
        v0[0] = x0.x; v0[1 % VNW] = x0.y; v1[0] = x1.x; v1[1 % VNW] = x1.y;
      } else {
        const uint4 x0 = *reinterpret_cast<const uint4*>(Vst + tau0 * VRW + voff);
        const uint4 x1 = *reinterpret_cast<const uint4*>(Vst + tau1 * VRW + voff);
        v0[0] = x0.x; v0[1 % VNW] = x0.y; v0[2 % VNW] = x0.z; v0[3 % VNW] = x0.w;
        v1[0] = x1.x; v1[1 % VNW] = x1.y; v1[2 % VNW] = x1.z; v1[3 % VNW] = x1.w;
      }
      uint32_t bf0[HG], bf1[HG];
#pragma unroll
      for (int hg = 0; hg < HG; ++hg) kv_bfrag(pb[(hg * 4 + (g & 3)) * PBS + ks * 4 + t], g, bf0[hg], bf1[hg]);
#pragma unroll
      for (int mt = 0; mt < VMT; ++mt) {
        const int q0 = 2 * mt, q1 = 2 * mt + 1;
        const uint32_t a0 = kv_pair<VB, FV>(v0[q0 / VPW], q0 % VPW), a1 = kv_pair<VB, FV>(v0[q1 / VPW], q1 % VPW);
        const uint32_t a2 = kv_pair<VB, FV>(v1[q0 / VPW], q0 % VPW), a3 = kv_pair<VB, FV>(v1[q1 / VPW], q1 % VPW);
#pragma unroll
        for (int hg = 0; hg < HG; ++hg) kv_mma(ct[hg][mt], a0, a1, a2, a3, bf0[hg], bf1[hg]);
      }
    }
#pragma unroll
    for (int mt = 0; mt < VMT; ++mt)
#pragma unroll
      for (int eh = 0; eh < 2; ++eh) {
        const int q = 2 * mt + eh;
        const float cv = kv_hf(vcc[(g * VNW + q / VPW) * (32 / VB) + q % VPW + (t >> 1) * VPW]);
        const float osc = 1.0f / (float)(1 << (((q % VPW) * VB) & 7));
#pragma unroll
        for (int hg = 0; hg < HG; ++hg)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float v = ct[hg][mt][2 * eh + e];
            if (FV) v = (v - 1024.f * sps[hg][e]) * osc;
            oacc[hg][mt][2 * eh + e] = oacc[hg][mt][2 * eh + e] * corr[hg][e] + cv * (v + pbs[hg][e]);
          }
      }
    __syncwarp();                                     // p' pairs are read
  }

  // ---- merge the 4 warps' states; write this item's unnormalized o, m and l ----
  kv_cp_wait<0>();
  __syncthreads();
  float* s_o = reinterpret_cast<float*>(s_stage);     // [NWARP][NRP][D]
  float* s_ml = s_o + NWARP * NRP * D;                // [NWARP][NRP][2]
#pragma unroll
  for (int hg = 0; hg < HG; ++hg)
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int msk = 2; msk < 32; msk <<= 1) lrun[hg][e] += __shfl_xor_sync(KV_FULL, lrun[hg][e], msk);
#pragma unroll
  for (int hg = 0; hg < HG; ++hg)
#pragma unroll
    for (int mt = 0; mt < VMT; ++mt)
#pragma unroll
      for (int eh = 0; eh < 2; ++eh) {
        const int q = 2 * mt + eh, ch = (g * VNW + q / VPW) * (32 / VB) + q % VPW + (t >> 1) * VPW;
#pragma unroll
        for (int e = 0; e < 2; ++e)
          s_o[(warp * NRP + hg * 4 + 2 * (t & 1) + e) * D + ch] = oacc[hg][mt][2 * eh + e];
      }
  if (own)
#pragma unroll
    for (int hg = 0; hg < HG; ++hg)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        s_ml[(warp * NRP + hg * 4 + 2 * t + e) * 2] = mrun[hg][e];
        s_ml[(warp * NRP + hg * 4 + 2 * t + e) * 2 + 1] = lrun[hg][e];
      }
  __syncthreads();
  for (int i = tid; i < NR * D; i += KV_THREADS) {
    const int r = i / D, d = i % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < NWARP; ++w) mx = fmaxf(mx, s_ml[(w * NRP + r) * 2]);
    float o = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < NWARP; ++w) {
      const float mw = s_ml[(w * NRP + r) * 2];
      const float f = mw == -INFINITY ? 0.f : exp2f(mw - mx);
      o += f * s_o[(w * NRP + r) * D + d];
      l += f * s_ml[(w * NRP + r) * 2 + 1];
    }
    if (FINAL) {
      s_scr[i] = l > 0.f ? o / l : 0.f;
    } else {
      kv_store(part_o + (((size_t)wi * H + h) * NR + r) * D + d, o);
      if (d == 0) {
        part_ml[(((size_t)wi * H + h) * NR + r) * 2] = mx;
        part_ml[(((size_t)wi * H + h) * NR + r) * 2 + 1] = l;
      }
    }
  }
  if (FINAL) {  // the row's only work item: normalized, rotated back (Hadamard), in the queries' dtype
    __syncthreads();
    for (int len = 1; len < D; len <<= 1) {
      for (int k = tid; k < NR * D / 2; k += KV_THREADS) {
        const int r = k / (D / 2), kk = k % (D / 2);
        const int i = r * D + (kk / len) * 2 * len + (kk % len), j = i + len;
        const float a = s_scr[i], c = s_scr[j];
        s_scr[i] = a + c;
        s_scr[j] = a - c;
      }
      __syncthreads();
    }
    for (int i = tid; i < NR * D; i += KV_THREADS)
      kv_store(part_o + ((size_t)b * H * NR + (size_t)h * NR) * D + i, s_scr[i] * inv_w);
  }
"""

MMA_SOURCE = MMA_SETUP + MMA_TILES



def mma_supported(*, head_dim: int, tile_size: int, key_bits: int, value_bits: int, n_rep: int) -> bool:
    """Whether the tensor-core body has this shape (one K word per lane and channel: G * kb >= 256)."""
    return (head_dim == 128 and key_bits in (2, 4, 8) and value_bits in (2, 4, 8) and tile_size in (64, 128)
            and tile_size * key_bits >= 256 and 1 <= n_rep <= 8)


def mma_shared_bytes(*, head_dim: int, tile_size: int, key_bits: int, value_bits: int, n_rep: int,
                     stages: int) -> int:
    """Dynamic shared memory of MMA_SOURCE (its layout: stages, q pairs, scratch)."""
    D, G, NR = head_dim, tile_size, n_rep
    nrp = 4 * ((NR + 3) // 4)
    wg = G * key_bits // 256
    tile = 4 * D * G * key_bits // 32 + 4 * G * D * value_bits // 32 + 6 * D + 6 * G
    stage = (4 // wg) * tile
    pbs = G // wg // 2 + 4
    scrw = max(nrp * pbs, NR * G // 4)
    scr = max(4 * scrw, NR * D)
    return stages * stage + 4 * nrp * (D // 2 + 4) + 4 * scr
