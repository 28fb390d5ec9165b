// Helpers shared by the CUDA kernels: error checks, RAII handles, small device
// utilities. Plain CUDA and the standard library only (no capnp/CAF here).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace troupe::kernels::cuda {

[[noreturn]] inline void fail(const char* what, const char* file, int line, const char* detail) {
  throw std::runtime_error(std::string("CUDA: ") + what + " failed at " + file + ":" + std::to_string(line) + ": " +
                           detail);
}

#define TROUPE_CUDA(call)                                                                       \
  do {                                                                                          \
    cudaError_t troupe_err_ = (call);                                                           \
    if (troupe_err_ != cudaSuccess)                                                             \
      ::troupe::kernels::cuda::fail(#call, __FILE__, __LINE__, cudaGetErrorString(troupe_err_)); \
  } while (0)

// After every launch: configuration errors surface here, faults at the next sync.
#define TROUPE_LAUNCHED() TROUPE_CUDA(cudaGetLastError())

#define TROUPE_REQUIRE(cond, msg)                                                      \
  do {                                                                                 \
    if (!(cond)) throw std::invalid_argument(std::string("cuda kernels: ") + (msg));   \
  } while (0)

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- device utilities ---------------------------------------------------------
template <class T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block; every thread gets the result. `scratch` holds >= 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may be in use from a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < nwarps ? scratch[lane] : 0.f;
  return warp_sum(t);
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < nwarps ? scratch[lane] : -INFINITY;
  return warp_max(t);
}

// Streaming 16-byte load that does not allocate in L1 (weights read once).
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__device__ __forceinline__ float2 bf16x2_to_f32(uint32_t v) {
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}
__device__ __forceinline__ float2 f16x2_to_f32(uint32_t v) {
  __half2 h = *reinterpret_cast<__half2*>(&v);
  return __half22float2(h);
}
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// RoPE turn of one pair at `angle` (precise sincos: angles reach 1e6 rad).
__device__ __forceinline__ void rope_pair(float& a, float& b, float angle, float scale, bool inverse) {
  float s, c;
  sincosf(angle, &s, &c);
  c *= scale;
  s = (inverse ? -s : s) * scale;
  const float x = a, y = b;
  a = x * c - y * s;
  b = y * c + x * s;
}

}  // namespace troupe::kernels::cuda
