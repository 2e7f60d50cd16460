
  constexpr int W = D > 128 ? 128 : D;
  constexpr int S = D / W;
  constexpr int CM = G > W ? G : W;
  static_assert((32 * (CM + 1) + 5 * CM) * 4 <= 32768, "threadgroup memory past 32 KB");
  threadgroup float kc_p[32 * (CM + 1)];
  threadgroup float kc_v[5 * CM];
  const int mat = (int)threadgroup_position_in_grid.x;  // (tile * H + head) * S + slice
  const int th = mat / S, s = mat % S;
  const long base = WIN ? ((long)(slots[th / NH] * NH + th % NH) * (2 * G) + G) * D + s * W
                        : (long)th * G * D + s * W;
  const int KB = bits[0], VB = bits[1];
  const uint z = (uint)bits[2];
  const int tid = (int)thread_index_in_threadgroup;
  const int lane = (int)thread_index_in_simdgroup, warp = (int)simdgroup_index_in_threadgroup;
  if (threadgroup_position_in_grid.y == 0) {
    kc_matrix<W, G, ITERS, ROWS, true, (G != W)>(
        keys + base, D, kc_p, kc_v, KB, k_codes + (long)mat * W * (G * KB / 32), G * KB / 32,
        k_alpha + (long)mat * W, k_beta + (long)mat * W, 1, k_r + (long)mat * G, tid, lane, warp, z);
  } else {
    kc_matrix<G, W, ITERS, ROWS, false, false>(
        values + base, D, kc_p, kc_v, VB, v_codes + (long)th * G * (D * VB / 32) + s * (W * VB / 32), D * VB / 32,
        v_alpha + (long)th * G * S + s, v_beta + (long)th * G * S + s, S, v_c + (long)th * D + s * W, tid, lane,
        warp, z);
  }
