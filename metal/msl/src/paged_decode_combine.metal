
  constexpr int W = D > 128 ? 128 : D;
  threadgroup float s_v[D];
  const int d = (int)thread_position_in_threadgroup.x;
  const int qh = (int)threadgroup_position_in_grid.y, b = (int)threadgroup_position_in_grid.z;
  const int NQ = (int)threadgroups_per_grid.y;
  const int H = NQ / NR, h = qh / NR, r = qh % NR;
  const int w0 = row_work[b], w1 = row_work[b + 1];
  float mx_ = -INFINITY;
  for (int w = w0; w < w1; ++w) mx_ = metal::fmax(mx_, part_ml[(((ulong)w * H + h) * NR + r) * 2]);
  float acc = 0.0f, den = 0.0f;
  for (int w = w0; w < w1; ++w) {
    const ulong i = ((ulong)w * H + h) * NR + r;
    const float mw = part_ml[i * 2];
    const float e = mw == -INFINITY ? 0.0f : metal::exp2(mw - mx_);
    acc += e * part_o[i * D + d];
    den += e * part_ml[i * 2 + 1];
  }
  s_v[d] = den > 0.0f ? acc / den : 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int len = 1; len < W; len <<= 1) {
    if (d < D / 2) {
      const int i = (d / len) * 2 * len + (d % len), j = i + len;
      const float a = s_v[i], c = s_v[j];
      s_v[i] = a + c;
      s_v[j] = a - c;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[((ulong)b * NQ + qh) * D + d] = static_cast<QT>(s_v[d] * (1.0f / metal::precise::sqrt((float)W)));
