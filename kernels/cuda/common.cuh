// Helpers shared by the CUDA kernels: error checks, RAII handles, small device
// utilities. Plain CUDA and the standard library only (no capnp/CAF here).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

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

// Streaming multiprocessors of the current device.
inline int sm_count() {
  int dev = 0, n = 0;
  TROUPE_CUDA(cudaGetDevice(&dev));
  TROUPE_CUDA(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

// A three-way A/B switch: 1 where the environment sets it to 1, -1 where to 0, 0 unset (or
// anything else).
inline int env_switch(const char* name) {
  const char* e = std::getenv(name);
  return e == nullptr ? 0 : e[0] == '1' ? 1 : e[0] == '0' ? -1 : 0;
}

// An A/B switch that is on unless the environment sets it to 0 (read it once, into a
// static: the environment is not re-read per call).
inline bool env_off(const char* name) { return env_switch(name) < 0; }

// ---- launches ------------------------------------------------------------------
// Every kernel of this library is launched by launch_kernel with programmatic
// dependent launch (PDL): the next kernel in the stream may be launched while this
// one still runs, and waits in pdl_entry() (griddepcontrol.wait) until every grid it
// depends on has finished and its writes are visible. So each kernel calls
// pdl_entry() before it reads anything an earlier kernel wrote and before it writes
// anything (an earlier kernel may still be reading it); work that touches only data
// no kernel writes (weights) may come first: the GEMV streams its first weights
// before it waits. Kernels without the attribute (cuBLAS) are ordered as usual.
// An earlier kernel's output is read with plain loads, never __ldg or through a
// `const T* __restrict__` (ld.global.nc assumes nothing writes the data while the
// kernel runs; under PDL the kernel starts before its producer ends: the GEMV's
// __ldg of x read stale rows, docs/kernels-notes.md).
// TROUPE_PDL=0 launches without the attribute (every kernel then waits for the last).
inline bool pdl_enabled() {
  static const bool on = !env_off("TROUPE_PDL");
  return on;
}

// Whether `kernel` gets the PDL attribute: pdl_enabled(), and its name matches none
// of the comma-separated substrings in TROUPE_PDL_EXCLUDE and (when set) one of
// TROUPE_PDL_ONLY (bisection switches for a race; names as cudaFuncGetName gives them).
inline bool pdl_for(const void* kernel) {
  if (!pdl_enabled()) return false;
  static const char* only = std::getenv("TROUPE_PDL_ONLY");
  static const char* exclude = std::getenv("TROUPE_PDL_EXCLUDE");
  if (only == nullptr && exclude == nullptr) return true;
  const char* name = nullptr;
  if (cudaFuncGetName(&name, kernel) != cudaSuccess || name == nullptr) {
    (void)cudaGetLastError();
    return false;
  }
  const auto any = [name](const char* list) {
    std::string l(list);
    for (size_t b = 0; b <= l.size();) {
      const size_t e = std::min(l.find(',', b), l.size());
      if (e > b && std::strstr(name, l.substr(b, e - b).c_str()) != nullptr) return true;
      b = e + 1;
    }
    return false;
  };
  if (exclude != nullptr && any(exclude)) return false;
  return only == nullptr || any(only);
}

// TROUPE_CARVEOUT (an A/B switch; unset: the driver's choice of each SM's split of its unified L1 /
// shared memory). N (0-100): every kernel launched by launch_kernel_ex prefers N % as shared memory
// (cudaFuncAttributePreferredSharedMemoryCarveout; 100 or 0: one split for every kernel, so that no SM
// changes it between a kernel of ~200 KB of shared memory, the GEMV ring, and the next). `auto`: each
// launch prefers what its own CTAs need (carveout_for), as a launch attribute.
constexpr int kCarveoutAuto = -2;
inline int carveout_setting() {
  static const int v = [] {
    const char* e = std::getenv("TROUPE_CARVEOUT");
    if (e == nullptr || *e == '\0') return -1;
    if (std::strcmp(e, "auto") == 0) return kCarveoutAuto;
    const int x = std::atoi(e);
    return x < 0 ? -1 : std::min(x, 100);
  }();
  return v;
}

// The share of an SM's unified L1 / shared memory (percent, rounded up; the driver rounds it up again to
// a split the SM has) that holds as many CTAs of `kernel` (`threads` a CTA, `dyn` bytes of dynamic shared
// memory) as the largest split would, so that the rest stays L1; 0 without shared memory, -1 where the
// runtime cannot say. Remembered per kernel, block size and dynamic size.
inline int carveout_for(const void* kernel, unsigned threads, size_t dyn) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, unsigned, size_t>, int> memo;
  const std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(kernel, threads, dyn);
  if (const auto it = memo.find(key); it != memo.end()) return it->second;
  int pct = -1, dev = 0, sm_bytes = 0, reserved = 0, blocks = 0;
  cudaFuncAttributes a{};
  if (cudaFuncGetAttributes(&a, kernel) == cudaSuccess && cudaGetDevice(&dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&sm_bytes, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev) == cudaSuccess &&
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, static_cast<int>(threads), dyn) == cudaSuccess &&
      sm_bytes > 0) {
    const size_t per = a.sharedSizeBytes + dyn;
    const size_t need = static_cast<size_t>(blocks) * (per + static_cast<size_t>(reserved)) * 100;
    pct = per == 0 ? 0 : static_cast<int>(std::min<size_t>(100, (need + sm_bytes - 1) / sm_bytes));
  } else {
    (void)cudaGetLastError();  // not left for an unrelated later check
  }
  memo[key] = pct;
  return pct;
}

// Launches `kernel` on `stream` with the PDL attribute (and `extra` attributes,
// e.g. a cluster shape) and checks the launch.
template <class... KArgs, class... Args>
void launch_kernel_ex(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                      const cudaLaunchAttribute* extra, int n_extra, Args&&... args) {
  TROUPE_REQUIRE(n_extra >= 0 && n_extra <= 3, "launch_kernel_ex: at most 3 extra launch attributes");
  cudaLaunchAttribute attrs[5];
  int n = 0;
  for (int i = 0; i < n_extra; ++i) attrs[n++] = extra[i];
  if (pdl_for(reinterpret_cast<const void*>(kernel))) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (const int c = carveout_setting(); c >= 0) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, c) != cudaSuccess) {
      (void)cudaGetLastError();  // a hint: the launch below runs either way
    }
  } else if (c == kCarveoutAuto) {
    const int pct = carveout_for(reinterpret_cast<const void*>(kernel), block.x * block.y * block.z, smem);
    if (pct >= 0) {
      attrs[n].id = cudaLaunchAttributePreferredSharedMemoryCarveout;
      attrs[n].val.sharedMemCarveout = static_cast<unsigned>(pct);
      ++n;
    }
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attrs;
  cfg.numAttrs = static_cast<unsigned>(n);
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // not left for an unrelated later check
    fail("cudaLaunchKernelEx", __FILE__, __LINE__, cudaGetErrorString(err));
  }
}

template <class... KArgs, class... Args>
void launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  launch_kernel_ex(kernel, grid, block, smem, stream, nullptr, 0, std::forward<Args>(args)...);
}

// Asynchronous 16-byte copies global -> shared (cp.async, Ampere on): `valid` false
// fills the 16 bytes with zeros and reads nothing. A thread reads back what it copied
// itself once cp_async_wait<N>() (at most N of its groups still pending) returns;
// copies of other threads need a barrier after their wait.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0));
}
// The same for 8 bytes (through L1).
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem, bool valid) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(s), "l"(gmem), "r"(valid ? 8 : 0));
}
// The same for 4 bytes (through L1: the 16-byte form alone may bypass it).
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(s), "l"(gmem), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// The first statement of every kernel (see launch_kernel): wait for the grids this
// one depends on, then let the next kernel in the stream be launched.
__device__ __forceinline__ void pdl_entry() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// ---- device utilities ---------------------------------------------------------
// D (16 x 8 fp32) += A (16 x 16, row-major fragments) * B (16 x 8): lane (g = lane / 4,
// c = lane % 4) holds a = {row g, k 2c..2c+1; row g + 8, the same; row g, k 2c + 8..9; row g + 8, the
// same}, b = {k 2c..2c+1, k 2c + 8..9 of column g}, d = {(g, 2c), (g, 2c + 1), (g + 8, 2c), (g + 8, 2c + 1)}.
// kBf16: bf16 operands, else f16.
template <bool kBf16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kBf16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

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

// sin and cos of a float angle of at least 105,615 rad, where sincosf leaves its fast path (a three-part
// Cody-Waite reduction) for a Payne-Hanek one through local memory: the double form's fast path reaches
// 2^31 rad, and its result rounded to float is at least as accurate. Out of line: rare at short context.
static __device__ __noinline__ void sincos_far(float angle, float* s, float* c) {
  double sd, cd;
  sincos(static_cast<double>(angle), &sd, &cd);
  *s = static_cast<float>(sd);
  *c = static_cast<float>(cd);
}

// RoPE turn of one pair at `angle` (precise sincos: angles reach 1e6 rad, positions at 1M context).
// kFar: angles from 105,615 rad through sincos_far (the rope kernel; the attention and compressor
// kernels, whose code and registers are tuned, keep sincosf whatever the angle).
template <bool kFar = false>
__device__ __forceinline__ void rope_pair(float& a, float& b, float angle, float scale, bool inverse) {
  float s, c;
  if (!kFar || fabsf(angle) < 105615.f) {
    sincosf(angle, &s, &c);
  } else {
    sincos_far(angle, &s, &c);
  }
  c *= scale;
  s = (inverse ? -s : s) * scale;
  const float x = a, y = b;
  a = x * c - y * s;
  b = y * c + x * s;
}

}  // namespace troupe::kernels::cuda
