
  constexpr int W = D > 128 ? 128 : D;
  constexpr int S = D / W;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int mat = blockIdx.x;            // (tile * H + head) * S + slice
  const int th = mat / S, s = mat % S;
  const long base = WIN ? ((long)(slots[th / NH] * NH + th % NH) * (2 * G) + G) * D + s * W
                        : (long)th * G * D + s * W;
  const int KB = bits[0], VB = bits[1];
  if (blockIdx.y == 0) {
    kc_matrix<W, G, ITERS, ROWS, true, (G != W), G, W, MK>(
        keys + base, D, smem_raw, KB, k_codes + mat * W * (G * KB / 32), G * KB / 32,
        k_alpha + mat * W, k_beta + mat * W, 1, k_r + mat * G);
  } else {
    kc_matrix<G, W, ITERS, ROWS, false, false, G, W, MK>(
        values + base, D, smem_raw, VB, v_codes + th * G * (D * VB / 32) + s * (W * VB / 32), D * VB / 32,
        v_alpha + th * G * S + s, v_beta + th * G * S + s, S, v_c + th * D + s * W);
  }
