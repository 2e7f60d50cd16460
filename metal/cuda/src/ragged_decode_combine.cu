
  // one thread per (row, query head, channel): the row's splits merged, normalized, cast
  const int d = threadIdx.x, qh = blockIdx.y, b = blockIdx.z, NQ = gridDim.y;
  const int H = NQ / NR, h = qh / NR, r = qh % NR;
  const int w0 = row_work[b], w1 = row_work[b + 1];
  float mx_ = -INFINITY;
#pragma unroll 8
  for (int w = w0; w < w1; ++w) mx_ = fmaxf(mx_, part_ml[(((size_t)w * H + h) * NR + r) * 2]);
  const float mu = mx_ == -INFINITY ? 0.f : mx_;
  float acc = 0.f, den = 0.f;
#pragma unroll 8
  for (int w = w0; w < w1; ++w) {
    const size_t i = ((size_t)w * H + h) * NR + r;
    const float e = exp2f(part_ml[i * 2] - mu);
    acc += e * part_o[i * D + d];
    den += e * part_ml[i * 2 + 1];
  }
  rd_store(out + ((size_t)b * NQ + qh) * D + d, den > 0.f ? acc / den : 0.f);
