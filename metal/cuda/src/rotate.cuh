// the rotation's loads and stores: any float input read as float32, the output rounded once
__device__ __forceinline__ float rt_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float rt_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float rt_f(float x) { return x; }
__device__ __forceinline__ void rt_store(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void rt_store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void rt_store(float* p, float x) { *p = x; }
