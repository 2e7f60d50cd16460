
#ifndef KV_EMU
__device__ __forceinline__ void kv_mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                       uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t kv_hfma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ uint32_t kv_hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t kv_pack2(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ float kv_hf(unsigned short u) { return __half2float(__ushort_as_half(u)); }
__device__ __forceinline__ unsigned short kv_fh(float x) { return __half_as_ushort(__float2half_rn(x)); }
__device__ __forceinline__ void kv_cp16(void* dst, const void* src) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(src) : "memory");
}
__device__ __forceinline__ void kv_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void kv_cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
#endif
__device__ __forceinline__ float kv_lo(uint32_t u) { return kv_hf((unsigned short)(u & 0xffffu)); }
__device__ __forceinline__ float kv_hi(uint32_t u) { return kv_hf((unsigned short)(u >> 16)); }

// 8-word group swizzle of a row (rows of NWD 8-word groups): the four rows r..r+3 that one load
// instruction touches (r = 0 mod 4 apart from the lane's t) land in distinct banks
template <int NWD>
__device__ __forceinline__ int kv_sw(int row) { return ((row & 3) * NWD) >> 2; }

// the code pair (i, i + 16/B) of word w as half2 (1024 + 2^o c) each (FOLD), else the exact codes
template <int B, int FOLD>
__device__ __forceinline__ uint32_t kv_pair(uint32_t w, int i) {
  const int o = (i * B) & 7;
  const uint32_t m = ((1u << B) - 1u) << o;
  const uint32_t v = (i * B >= 8) ? (w >> 8) : w;
  const uint32_t x = (v & (m | (m << 16))) | 0x64006400u;
  if (FOLD) return x;
  const uint32_t s = (uint32_t)(15 - o) << 10, c = 0x8000u | ((uint32_t)(25 - o) << 10);
  return kv_hfma2(x, s | (s << 16), c | (c << 16));
}

// N consecutive window values (N = 2, 4, 8; one vector load)
template <int N>
__device__ __forceinline__ void kv_loadn(const __half* p, float* out) {
  if (N == 8) {
    kv_load8(p, out);
  } else if (N == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    out[0] = kv_lo(u.x); out[1 % N] = kv_hi(u.x); out[2 % N] = kv_lo(u.y); out[3 % N] = kv_hi(u.y);
  } else {
    const uint32_t u = *reinterpret_cast<const uint32_t*>(p);
    out[0] = kv_lo(u); out[1 % N] = kv_hi(u);
  }
}
template <int N>
__device__ __forceinline__ void kv_loadn(const float* p, float* out) {
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = p[i];
}

// B fragment of one slot-split operand: the pair u = (x for kk = t, x for kk = t + 4) of head
// column g % 4; slot g / 4 gets the value, the other slot 0
__device__ __forceinline__ void kv_bfrag(uint32_t u, int g, uint32_t& b0, uint32_t& b1) {
  b0 = __byte_perm(u, 0u, g < 4 ? 0x4410u : 0x1044u);
  b1 = __byte_perm(u, 0u, g < 4 ? 0x4432u : 0x3244u);
}
