"""The CUDA source of the fused ragged fp16/bf16 decode attention (``metal.cuda.ragged_decode``): a small
header, the split-K attention kernel body and the combine kernel body, as ``mx.fast.cuda_kernel``
takes them (bodies only: MLX writes the signature from the input and output names and the template
arguments QT, KT, D, NR, FINAL). The layout and the algorithm are described in
``metal/cuda/ragged_decode.py`` and docs/kernels.md.

Thread layout of one block (one work item x one KV head, 128 threads = 4 warps)::

    LPR = D / 8 lanes read one key row, 16 bytes (8 elements) each: D = 64 / 128 / 256 -> 8 / 16 / 32
    RPW = 32 / LPR key rows per warp-wide load (a group of LPR lanes per row): 4 / 2 / 1
    U   = 8 (NR <= 4) or 4 rows a lane loads, K and V, before any math: CH = RPW * U tokens a warp pass
    warp w takes the item's tokens [t0 + (4 i + w) CH, t0 + (4 i + w + 1) CH), i = 0, 1, ...
    lane (group g, sub s) reads channels [8 s, 8 s + 8) of tokens base + u RPW + g, u < U

Each group keeps its own online-softmax state (m, l, o over its 8 channels) for the NR heads; at the
end of the item the groups of a warp are merged through shuffles, the 4 warps through shared memory.
"""

HEADER = r"""
#define RD_THREADS 128
#define RD_FULL 0xffffffffu

__device__ __forceinline__ void rd_store(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void rd_store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void rd_store(float* p, float x) { *p = x; }

// one 16-byte load through the read-only path (8 halves or bfloat16s; the address is 16-byte aligned)
__device__ __forceinline__ uint4 rd_ld16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// 8 stored elements -> float32; the pointer argument only selects the storage type
__device__ __forceinline__ void rd_unpack(const uint4& u, float* f, const __half*) {
  const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}
__device__ __forceinline__ void rd_unpack(const uint4& u, float* f, const __nv_bfloat16*) {
  const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);          // bfloat16 -> float32 is exact: the high half
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
"""

ATTENTION_SOURCE = r"""
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
"""

COMBINE_SOURCE = r"""
  // one thread per (row, query head, channel): the row's splits merged, normalized, cast
  const int d = threadIdx.x, qh = blockIdx.y, b = blockIdx.z, NQ = gridDim.y;
  const int H = NQ / NR, h = qh / NR, r = qh % NR;
  const int w0 = row_work[b], w1 = row_work[b + 1];
  float mx_ = -INFINITY;
  for (int w = w0; w < w1; ++w) mx_ = fmaxf(mx_, part_ml[(((size_t)w * H + h) * NR + r) * 2]);
  const float mu = mx_ == -INFINITY ? 0.f : mx_;
  float acc = 0.f, den = 0.f;
  for (int w = w0; w < w1; ++w) {
    const size_t i = ((size_t)w * H + h) * NR + r;
    const float e = exp2f(part_ml[i * 2] - mu);
    acc += e * part_o[i * D + d];
    den += e * part_ml[i * 2 + 1];
  }
  rd_store(out + ((size_t)b * NQ + qh) * D + d, den > 0.f ? acc / den : 0.f);
"""
