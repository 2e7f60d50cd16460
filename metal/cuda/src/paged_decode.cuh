
#define KV_THREADS 128
#define KV_FULL 0xffffffffu

template <int B>
__device__ __forceinline__ unsigned int kv_code(const unsigned int* s, int bit) {
  // b-bit code at stream bit `bit` of a little-endian bit stream (3-bit codes straddle words)
  const int w = bit >> 5, o = bit & 31;
  unsigned int v = s[w] >> o;
  if (32 % B != 0) {
    if (o > 32 - B) v |= s[w + 1] << (32 - o);
  }
  return v & ((1u << B) - 1u);
}

// NR per-head factors at p (16-byte loads when NR is a multiple of 4; p is then 16-byte aligned)
template <int NR>
__device__ __forceinline__ void kv_rep(const float* p, float* out) {
  if (NR % 4 == 0) {
    for (int i = 0; i < NR / 4; ++i) {
      const float4 v = reinterpret_cast<const float4*>(p)[i];
      out[4 * i] = v.x; out[4 * i + 1] = v.y; out[4 * i + 2] = v.z; out[4 * i + 3] = v.w;
    }
  } else {
    for (int i = 0; i < NR; ++i) out[i] = p[i];
  }
}

__device__ __forceinline__ float kv_warp_sum(float v) {
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(KV_FULL, v, m);
  return v;
}

__device__ __forceinline__ float kv_warp_max(float v) {
  for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(KV_FULL, v, m));
  return v;
}

__device__ __forceinline__ float kv_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float kv_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float kv_f(float x) { return x; }
__device__ __forceinline__ void kv_store(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void kv_store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void kv_store(float* p, float x) { *p = x; }

// eight consecutive window values (16-byte loads; float windows: two)
__device__ __forceinline__ void kv_load8(const __half* p, float* out) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const unsigned int w[4] = {u.x, u.y, u.z, u.w};
  for (int i = 0; i < 4; ++i) {
    __half2 h2 = *reinterpret_cast<const __half2*>(&w[i]);
    float2 f = __half22float2(h2);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void kv_load8(const float* p, float* out) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}
