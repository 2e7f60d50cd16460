
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

