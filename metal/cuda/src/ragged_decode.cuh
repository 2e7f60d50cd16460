
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
