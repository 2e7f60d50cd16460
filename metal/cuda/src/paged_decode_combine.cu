
  constexpr int W = D > 128 ? 128 : D;
  __shared__ float s_v[D];
  const int d = threadIdx.x, qh = blockIdx.y, b = blockIdx.z, NQ = gridDim.y;
  const int H = NQ / NR, h = qh / NR, r = qh % NR;
  const int w0 = row_work[b], w1 = row_work[b + 1];
  float mx_ = -INFINITY;
#pragma unroll 8
  for (int w = w0; w < w1; ++w) mx_ = fmaxf(mx_, part_ml[(((size_t)w * H + h) * NR + r) * 2]);
  float acc = 0.f, den = 0.f;
#pragma unroll 8
  for (int w = w0; w < w1; ++w) {
    const size_t i = ((size_t)w * H + h) * NR + r;
    const float mw = part_ml[i * 2];
    const float e = mw == -INFINITY ? 0.f : exp2f(mw - mx_);
    acc += e * part_o[i * D + d];
    den += e * part_ml[i * 2 + 1];
  }
  s_v[d] = den > 0.f ? acc / den : 0.f;
  __syncthreads();
  for (int len = 1; len < W; len <<= 1) {
    if (d < D / 2) {
      const int i = (d / len) * 2 * len + (d % len), j = i + len;
      const float a = s_v[i], c = s_v[j];
      s_v[i] = a + c;
      s_v[j] = a - c;
    }
    __syncthreads();
  }
  kv_store(out + ((size_t)b * NQ + qh) * D + d, s_v[d] * (1.0f / sqrtf((float)W)));
