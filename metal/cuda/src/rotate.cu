  // One W-wide slice per LPV = W / 4 lanes of a warp, four consecutive values a lane; the butterfly
  // stages h = 1, 2 inside a lane, h = 4 .. W / 2 between lanes (xor h / 4), in that order.
  // x, y: [n0, n1, n2, D] (D = slices * W) read through their strides (views in place); the
  // vectors of x first, then (PAIR = 2) those of y; out row-contiguous.
  constexpr int LPV = W / 4;
  const long n1 = x_shape[1], n2 = x_shape[2];
  const int slices = x_shape[3] / W;
  const long per = x_shape[0] * n1 * n2 * slices;
  const long gid = (long)blockIdx.x * blockDim.x + threadIdx.x;
  const long v = gid / LPV;
  const int l = (int)(gid % LPV);
  const bool live = v < PAIR * per;
  const bool second = live && v >= per;
  const long vv = !live ? 0 : (second ? v - per : v);
  const long row = vv / slices;
  const long c0 = (long)(vv % slices) * W + 4 * l;
  const long i2 = row % n2, i1 = (row / n2) % n1, i0 = row / (n2 * n1);
  float a[4];
  if (second) {
    const long off = i0 * y_strides[0] + i1 * y_strides[1] + i2 * y_strides[2];
    for (int j = 0; j < 4; ++j) a[j] = kv_f(y[off + (c0 + j) * y_strides[3]]);
  } else {
    const long off = i0 * x_strides[0] + i1 * x_strides[1] + i2 * x_strides[2];
    for (int j = 0; j < 4; ++j) a[j] = live ? kv_f(x[off + (c0 + j) * x_strides[3]]) : 0.0f;
  }
  float p = a[0], q = a[1];
  a[0] = p + q; a[1] = p - q;
  p = a[2]; q = a[3];
  a[2] = p + q; a[3] = p - q;
  p = a[0]; q = a[2];
  a[0] = p + q; a[2] = p - q;
  p = a[1]; q = a[3];
  a[1] = p + q; a[3] = p - q;
  for (int m = 1; m < LPV; m <<= 1) {
    const bool upper = (l & m) != 0;
    for (int j = 0; j < 4; ++j) {
      const float o = __shfl_xor_sync(0xffffffffu, a[j], m);
      a[j] = upper ? o - a[j] : a[j] + o;
    }
  }
  if (live) {
    const float sc = scale[0];
    for (int j = 0; j < 4; ++j) kv_store(out + v * W + 4 * l + j, a[j] * sc);
  }
