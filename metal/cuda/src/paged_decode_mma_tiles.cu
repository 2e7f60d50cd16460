
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
