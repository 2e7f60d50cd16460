
#define KV_THREADS 128

// b-bit code at stream bit `bit` of a little-endian bit stream (3-bit codes straddle words)
template <int B, typename P>
inline uint kv_code(P s, int bit) {
  const int w = bit >> 5, o = bit & 31;
  uint v = s[w] >> o;
  if (32 % B != 0) {
    if (o > 32 - B) v |= s[w + 1] << (32 - o);
  }
  return v & ((1u << B) - 1u);
}
