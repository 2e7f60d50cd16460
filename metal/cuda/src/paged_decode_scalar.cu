
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
