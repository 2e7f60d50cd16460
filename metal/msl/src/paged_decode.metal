
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
  constexpr int RS = NR * (1 + S);          // reduction slots per simdgroup
  constexpr float LOG2E = 1.4426950408889634f;

  // threadgroup memory, floats (Apple GPUs: at most 32 KB a threadgroup)
  constexpr int O_QA = D * NR;              // s_q [D][NR] rotated queries
  constexpr int O_KR = O_QA + D * NR;       // s_qa [D][NR] q * k_alpha; s_o [NR][D] scratch (before / after the tiles)
  constexpr int O_VA = O_KR + S * G;        // s_kr [S][G] k_r
  constexpr int O_VB = O_VA + G * S;        // s_va [G][S] v_alpha
  constexpr int O_CV = O_VB + G * S;        // s_vb [G][S] v_beta
  constexpr int O_PA = O_CV + D;            // s_cv [D] v_c
  constexpr int O_QB = O_PA + S * G * NR;   // s_pa [S][G][NR] p * v_alpha (p for window tiles)
  constexpr int O_RED = O_QB + 4 * S * NR;  // s_qb [4][S][NR] per-simdgroup partial q . k_beta
  constexpr int TG = O_RED + 4 * RS;        // s_red [4][RS] per-simdgroup max / sums
  static_assert(TG * 4 <= 32768, "threadgroup memory past 32 KB");
  threadgroup float tg[TG];
  threadgroup float* s_q = tg;
  threadgroup float* s_qa = tg + O_QA;
  threadgroup float* s_o = tg + O_QA;
  threadgroup float* s_kr = tg + O_KR;
  threadgroup float* s_va = tg + O_VA;
  threadgroup float* s_vb = tg + O_VB;
  threadgroup float* s_cv = tg + O_CV;
  threadgroup float* s_pa = tg + O_PA;
  threadgroup float* s_qb = tg + O_QB;
  threadgroup float* s_red = tg + O_RED;

  const int t = (int)thread_index_in_threadgroup;
  const int lane = (int)thread_index_in_simdgroup, warp = (int)simdgroup_index_in_threadgroup;
  const int wi = (int)threadgroup_position_in_grid.x, h = (int)threadgroup_position_in_grid.y;
  const int H = (int)threadgroups_per_grid.y;
  const int b = work[wi * 3], t0 = work[wi * 3 + 1], t1 = work[wi * 3 + 2];
  const int slot = rows[b * 4], sink_len = rows[b * 4 + 1], tail_len = rows[b * 4 + 2], nt = rows[b * 4 + 3];
  const int nb = meta[0];
  const float sl2 = meta_f[0] * LOG2E;

  // queries of this KV head -> s_o [NR][D], rotated (Hadamard per W-slice), rounded to half
  for (int i = t; i < NR * D; i += KV_THREADS)
    s_o[i] = static_cast<float>(queries[((ulong)b * H * NR + (ulong)h * NR) * D + i]);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int len = 1; len < W; len <<= 1) {
    for (int k = t; k < NR * D / 2; k += KV_THREADS) {
      const int r = k / (D / 2), kk = k % (D / 2);
      const int i = r * D + (kk / len) * 2 * len + (kk % len), j = i + len;
      const float a = s_o[i], c = s_o[j];
      s_o[i] = a + c;
      s_o[j] = a - c;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  const float inv_w = 1.0f / metal::precise::sqrt((float)W);
  for (int i = t; i < NR * D; i += KV_THREADS) {
    const int r = i / D, d = i % D;
    const float qr = s_o[i] * inv_w;  // rounded to half as the reference rounds it (half windows)
    s_q[d * NR + r] = sizeof(WT) == 2 ? static_cast<float>(static_cast<half>(qr)) : qr;
  }

  float m[NR], l[NR], o[NCH][NR];
  for (int r = 0; r < NR; ++r) { m[r] = -INFINITY; l[r] = 0.0f; }
  for (int j = 0; j < NCH; ++j) for (int r = 0; r < NR; ++r) o[j][r] = 0.0f;

  const int g = t / TPT, sub = t % TPT;      // QK: this thread's token and channel subset
  const int pc = t % CT, pp = t / CT;        // PV: channel and token partition
  const device uint32_t* kc = k_codes;       // this tile's codes (records only)
  const device uint32_t* vc = v_codes;

  for (int ti = t0; ti < t1; ++ti) {
    const bool is_rec = ti >= 1 && ti <= nt;
    const int len = is_rec ? G : (ti == 0 ? sink_len : tail_len);
    const int base = ti == 0 ? 0 : G;        // window part (tail tiles only; records ignore it)
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous tile (or the queries' scratch) is done
    if (is_rec) {
      const ulong nh = (ulong)table[b * nb + ti - 1] * H + h;
      kc = k_codes + nh * KCW;
      vc = v_codes + nh * VCW;
      for (int i = t; i < S * G; i += KV_THREADS) s_kr[i] = static_cast<float>(k_r[nh * S * G + i]);
      for (int i = t; i < G * S; i += KV_THREADS) {
        s_va[i] = static_cast<float>(v_alpha[nh * G * S + i]);
        s_vb[i] = static_cast<float>(v_beta[nh * G * S + i]);
      }
      for (int i = t; i < D; i += KV_THREADS) s_cv[i] = static_cast<float>(v_c[nh * D + i]);
      for (int j = 0; j < (D + KV_THREADS - 1) / KV_THREADS; ++j) {
        const int d = t + j * KV_THREADS;
        const int s = (j * KV_THREADS) / W;  // one slice per pass
        float pq[NR];
        if (d < D) {
          const float al = static_cast<float>(k_alpha[nh * D + d]), be = static_cast<float>(k_beta[nh * D + d]);
          for (int r = 0; r < NR; ++r) {
            const float qv = s_q[d * NR + r];
            s_qa[d * NR + r] = qv * al;
            pq[r] = qv * be;
          }
        } else {
          for (int r = 0; r < NR; ++r) pq[r] = 0.0f;
        }
        for (int r = 0; r < NR; ++r) {
          const float v = simd_sum(pq[r]);
          if (lane == 0) s_qb[(warp * S + s) * NR + r] = v;
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // ---- scores of this thread's token, all NR heads (log2 domain) ----
    float x[NR];
    {
      float part[NR];
      for (int r = 0; r < NR; ++r) part[r] = 0.0f;
      if (is_rec) {
        for (int s = 0; s < S; ++s) {
          float acc[NR];
          for (int r = 0; r < NR; ++r) acc[r] = 0.0f;
          for (int c = 0; c < W / TPT; ++c) {
            const int d = s * W + c * TPT + sub;
            const float code = (float)kv_code<KB>(kc + d * KGW, g * KB);
            for (int r = 0; r < NR; ++r) acc[r] += s_qa[d * NR + r] * code;
          }
          const float kr = s_kr[s * G + g];
          for (int r = 0; r < NR; ++r) part[r] += kr * acc[r];
        }
      } else if (g < len) {
        const device WT* row = win_k + (((ulong)slot * H + h) * 2 * G + base + g) * D;
        for (int c = 0; c < D / 8 / TPT; ++c) {
          const int d0 = (c * TPT + sub) * 8;
          for (int e = 0; e < 8; ++e) {
            const float kv = static_cast<float>(row[d0 + e]);
            for (int r = 0; r < NR; ++r) part[r] += s_q[(d0 + e) * NR + r] * kv;
          }
        }
      }
      if (TPT == 2)
        for (int r = 0; r < NR; ++r) part[r] += simd_shuffle_xor(part[r], (ushort)1);
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
      const float v = simd_max(x[r]);
      if (lane == 0) s_red[warp * RS + r] = v;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float corr[NR], mu[NR];
    for (int r = 0; r < NR; ++r) {
      const float mt = metal::fmax(metal::fmax(s_red[r], s_red[RS + r]), metal::fmax(s_red[2 * RS + r], s_red[3 * RS + r]));
      const float mn = metal::fmax(m[r], mt);
      corr[r] = m[r] == -INFINITY ? 0.0f : metal::exp2(m[r] - mn);
      mu[r] = mn == -INFINITY ? 0.0f : mn;
      m[r] = mn;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // s_red is read; it is reused below
    float p[NR];
    const float own = sub == 0 ? 1.0f : 0.0f;  // TPT == 2: both lanes hold the token; count it once
    for (int r = 0; r < NR; ++r) p[r] = metal::exp2(x[r] - mu[r]);
    for (int r = 0; r < NR; ++r) {
      const float v = simd_sum(p[r] * own);
      if (lane == 0) s_red[warp * RS + r] = v;
    }
    if (is_rec) {
      for (int s = 0; s < S; ++s)
        for (int r = 0; r < NR; ++r) {
          const float v = simd_sum(p[r] * own * s_vb[g * S + s]);
          if (lane == 0) s_red[warp * RS + NR + s * NR + r] = v;
        }
    }
    if (sub == 0)
      for (int s = 0; s < S; ++s)
        for (int r = 0; r < NR; ++r) s_pa[(s * G + g) * NR + r] = is_rec ? p[r] * s_va[g * S + s] : p[r];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int r = 0; r < NR; ++r)
      l[r] = l[r] * corr[r] + (s_red[r] + s_red[RS + r] + s_red[2 * RS + r] + s_red[3 * RS + r]);

    // ---- values: this thread's channels, its token partition ----
    for (int j = 0; j < NCH; ++j) {
      const int d = pc + j * CT;
      const int s = d / W;
      float acc[NR];
      for (int r = 0; r < NR; ++r) acc[r] = 0.0f;
      if (is_rec) {
        for (int gi = pp; gi < G; gi += TPC) {
          const float code = (float)kv_code<VB>(vc + gi * VDW, d * VB);
          for (int r = 0; r < NR; ++r) acc[r] += s_pa[(s * G + gi) * NR + r] * code;
        }
        const float cv = s_cv[d];
        for (int r = 0; r < NR; ++r) {
          const float pb = pp == 0 ? (s_red[NR + s * NR + r] + s_red[RS + NR + s * NR + r] +
                                      s_red[2 * RS + NR + s * NR + r] + s_red[3 * RS + NR + s * NR + r]) : 0.0f;
          o[j][r] = o[j][r] * corr[r] + cv * (acc[r] + pb);
        }
      } else {
        const device WT* col = win_v + (((ulong)slot * H + h) * 2 * G + base) * D + d;
        for (int gi = pp; gi < len; gi += TPC) {
          const float v = static_cast<float>(col[(ulong)gi * D]);
          for (int r = 0; r < NR; ++r) acc[r] += s_pa[gi * NR + r] * v;
        }
        for (int r = 0; r < NR; ++r) o[j][r] = o[j][r] * corr[r] + acc[r];
      }
    }
  }

  // ---- this split's partial output: unnormalized o, running max m and sum l ----
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (TPC == 2) {
    if (pp == 1)
      for (int j = 0; j < NCH; ++j) for (int r = 0; r < NR; ++r) s_o[r * D + pc + j * CT] = o[j][r];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (pp == 0)
      for (int j = 0; j < NCH; ++j) for (int r = 0; r < NR; ++r) o[j][r] += s_o[r * D + pc + j * CT];
  }
  if (pp == 0)
    for (int j = 0; j < NCH; ++j)
      for (int r = 0; r < NR; ++r) part_o[(((ulong)wi * H + h) * NR + r) * D + pc + j * CT] = o[j][r];
  if (t == 0)
    for (int r = 0; r < NR; ++r) {
      part_ml[(((ulong)wi * H + h) * NR + r) * 2] = m[r];
      part_ml[(((ulong)wi * H + h) * NR + r) * 2 + 1] = l[r];
    }
