
  constexpr int LPR = D / 8;                 // lanes a key row
  constexpr int RPW = 32 / LPR;              // key rows a warp-wide load
  constexpr int U = NR <= 4 ? 8 : 4;         // K and V rows a lane has in flight before the math
  constexpr int CH = RPW * U;                // tokens a warp pass
  constexpr float LOG2E = 1.4426950408889634f;
  __shared__ float s_o[4 * NR * D];          // [warp][NR][D] merged o of each warp
  __shared__ float s_ml[4 * NR * 2];         // [warp][NR] (m, l)

  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int grp = lane / LPR, sub = lane % LPR;
  const int wi = blockIdx.x, h = blockIdx.y, H = gridDim.y;
  const int b = work[wi * 3], t0 = work[wi * 3 + 1], t1 = work[wi * 3 + 2];
  const int T_cap = meta[0];
  const float sl2 = meta_f[0] * LOG2E;       // scores in the log2 domain: exp2(q.k scale log2 e - m)

  // this lane's 8 channels of the NR query heads, scaled by scale * log2(e)
  float q[NR][8];
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    rd_unpack(rd_ld16(queries + ((size_t)b * H * NR + (size_t)h * NR + r) * D + sub * 8), q[r], queries);
#pragma unroll
    for (int c = 0; c < 8; ++c) q[r][c] *= sl2;
  }

  float m[NR], l[NR], o[NR][8];
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int c = 0; c < 8; ++c) o[r][c] = 0.f;
  }

  const size_t head = ((size_t)rows[b] * H + h) * T_cap;  // row b's slot, KV head h, token 0
  const KT* kp = keys + head * D + sub * 8;
  const KT* vp = values + head * D + sub * 8;
  for (int base = t0 + warp * CH; base < t1; base += 4 * CH) {  // warp-uniform
    // ---- loads first: U key rows and U value rows, 16 bytes a lane each (zeros past the item) ----
    uint4 kr[U], vr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int tok = base + u * RPW + grp;
      if (tok < t1) {
        kr[u] = rd_ld16(kp + (size_t)tok * D);
        vr[u] = rd_ld16(vp + (size_t)tok * D);
      } else {
        kr[u] = make_uint4(0u, 0u, 0u, 0u);
        vr[u] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    // ---- scores: 8-channel partial dots, summed over the row's LPR lanes ----
    float x[U][NR];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[8];
      rd_unpack(kr[u], kf, keys);
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        float acc = 0.f;
#pragma unroll
        for (int c = 0; c < 8; ++c) acc += q[r][c] * kf[c];
        x[u][r] = acc;
      }
    }
#pragma unroll
    for (int s = LPR / 2; s > 0; s >>= 1)
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < NR; ++r) x[u][r] += __shfl_xor_sync(RD_FULL, x[u][r], s);
    // ---- online softmax of this group's U tokens (x becomes p) ----
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      float mn = m[r];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (base + u * RPW + grp < t1) mn = fmaxf(mn, x[u][r]);
      const float mu = mn == -INFINITY ? 0.f : mn;
      const float corr = exp2f(m[r] - mu);   // 0 while the group has seen no token
      float ps = 0.f;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float p = base + u * RPW + grp < t1 ? exp2f(x[u][r] - mu) : 0.f;
        x[u][r] = p;
        ps += p;
      }
      m[r] = mn;
      l[r] = l[r] * corr + ps;
#pragma unroll
      for (int c = 0; c < 8; ++c) o[r][c] *= corr;
    }
    // ---- values ----
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float vf[8];
      rd_unpack(vr[u], vf, values);
#pragma unroll
      for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int c = 0; c < 8; ++c) o[r][c] += x[u][r] * vf[c];
    }
  }

  // ---- merge: the RPW groups of a warp (shuffles), then the 4 warps (shared memory) ----
#pragma unroll
  for (int s = LPR; s < 32; s <<= 1)
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const float mo = __shfl_xor_sync(RD_FULL, m[r], s), lo = __shfl_xor_sync(RD_FULL, l[r], s);
      const float mn = fmaxf(m[r], mo), mu = mn == -INFINITY ? 0.f : mn;
      const float a = exp2f(m[r] - mu), e = exp2f(mo - mu);
      l[r] = l[r] * a + lo * e;
#pragma unroll
      for (int c = 0; c < 8; ++c) o[r][c] = o[r][c] * a + __shfl_xor_sync(RD_FULL, o[r][c], s) * e;
      m[r] = mn;
    }
  if (grp == 0) {
#pragma unroll
    for (int r = 0; r < NR; ++r) {
#pragma unroll
      for (int c = 0; c < 8; ++c) s_o[(warp * NR + r) * D + sub * 8 + c] = o[r][c];
      if (sub == 0) {
        s_ml[(warp * NR + r) * 2] = m[r];
        s_ml[(warp * NR + r) * 2 + 1] = l[r];
      }
    }
  }
  __syncthreads();
  for (int i = t; i < NR * D; i += RD_THREADS) {
    const int r = i / D, d = i % D;
    float mx_ = -INFINITY;
#pragma unroll
    for (int w = 0; w < 4; ++w) mx_ = fmaxf(mx_, s_ml[(w * NR + r) * 2]);
    const float mu = mx_ == -INFINITY ? 0.f : mx_;
    float ov = 0.f, lv = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float f = exp2f(s_ml[(w * NR + r) * 2] - mu);
      ov += f * s_o[(w * NR + r) * D + d];
      lv += f * s_ml[(w * NR + r) * 2 + 1];
    }
    if (FINAL) {  // the row's only work item: normalized, in the queries' dtype, [B, n_q, D]
      rd_store(part_o + ((size_t)b * H * NR + (size_t)h * NR + r) * D + d, lv > 0.f ? ov / lv : 0.f);
    } else {      // this split's partial: unnormalized o, running max m (log2 domain) and sum l
      rd_store(part_o + (((size_t)wi * H + h) * NR + r) * D + d, ov);
      if (d == 0) {
        part_ml[(((size_t)wi * H + h) * NR + r) * 2] = mx_;
        part_ml[(((size_t)wi * H + h) * NR + r) * 2 + 1] = lv;
      }
    }
  }
  if (FINAL && wi == 0 && h == 0 && t == 0) part_ml[0] = 0.f;  // the unused (1,) placeholder
