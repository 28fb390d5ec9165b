// Dense math of the CPU backend: memory, GEMMs, norms, RoPE, row moves.
#include <cblas.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <stdexcept>
#include <string>

#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cpu/cpu_gemm.hpp"

namespace troupe::kernels::cpu {

namespace {
const float* f32_data(const Weight& w) {
  if (w.type != WeightType::f32) throw std::invalid_argument("cpu backend: weights must be fp32");
  return static_cast<const float*>(w.data);
}
}  // namespace

void ensure_blas_kernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  const std::string core = openblas_get_corename();
  if (core != "Prescott" && core != "prescott" && core != "Unknown" && core != "unknown") return;
  const char* want = __builtin_cpu_supports("avx512f") ? "SkylakeX" : __builtin_cpu_supports("avx2") ? "Haswell" : nullptr;
  if (want == nullptr) return;
  ::setenv("OPENBLAS_CORETYPE", want, 1);
  ::execv("/proc/self/exe", argv);  // only returns on failure: carry on with the generic kernels
}

void* CpuBackend::alloc(size_t bytes) {
  void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  if (p == nullptr && bytes > 0) throw std::bad_alloc();
  return p;
}
void CpuBackend::free(void* p) { std::free(p); }
std::optional<Backend::MemoryInfo> CpuBackend::memory_info() const {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  uint64_t kib = 0;
  std::optional<uint64_t> available, total;
  while (in >> key >> kib) {
    std::getline(in, unit);
    if (key == "MemAvailable:") available = kib << 10;
    if (key == "MemTotal:") total = kib << 10;
  }
  if (!available || !total) return std::nullopt;
  return MemoryInfo{*available, *total};
}
void CpuBackend::to_device(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
void CpuBackend::to_host(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
void CpuBackend::copy(void* dst, const void* src, size_t bytes) { std::memmove(dst, src, bytes); }

void CpuBackend::linear(const float* x, int64_t m, const Weight& w, float* y, float beta) {
  gemm_weight(x, m, w.cols, w, y, w.rows, beta != 0.0f);
}

void CpuBackend::linear_grouped(const float* x, int64_t m, const Weight& w, int groups, float* y) {
  const int64_t out = w.rows / groups;
  for (int g = 0; g < groups; ++g) {
    gemm_weight(x + g * w.cols, m, groups * w.cols, weight_rows(w, g * out, out), y + g * out, groups * out, false);
  }
}

void CpuBackend::rmsnorm(const float* x, const float* weight, float* y, int64_t rows, int64_t dim, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    double ss = 0;
    for (int64_t i = 0; i < dim; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float inv = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(dim)) + eps);
    if (weight != nullptr) {
      for (int64_t i = 0; i < dim; ++i) yr[i] = weight[i] * (xr[i] * inv);
    } else {
      for (int64_t i = 0; i < dim; ++i) yr[i] = xr[i] * inv;
    }
  }
}

void rope_row(float* x, const RopeTable& rope, int64_t position, bool inverse) {
  // torch computes freqs = inv_freq * position in fp32, then cos/sin in fp32.
  for (int64_t i = 0; i < rope.rope_dim / 2; ++i) {
    const float angle = rope.inv_freq[i] * static_cast<float>(position);
    const float c = std::cos(angle) * rope.scale;
    const float s = (inverse ? -std::sin(angle) : std::sin(angle)) * rope.scale;
    const float a = x[2 * i];
    const float b = x[2 * i + 1];
    x[2 * i] = a * c - b * s;
    x[2 * i + 1] = b * c + a * s;
  }
}

void CpuBackend::rope(float* x, int64_t rows, int heads, int64_t head_dim, const RopeTable& rope,
                      const int64_t* positions, bool inverse) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int h = 0; h < heads; ++h) {
      float* slice = x + (r * heads + h) * head_dim + (head_dim - rope.rope_dim);
      rope_row(slice, rope, positions[r], inverse);
    }
  }
}

void CpuBackend::add_position_bias(float* x, int64_t rows, int64_t dim, const int64_t* positions,
                                   const float* bias, int64_t period) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* b = bias + (positions[r] % period) * dim;
    float* xr = x + r * dim;
    for (int64_t i = 0; i < dim; ++i) xr[i] += b[i];
  }
}

void CpuBackend::copy_rows(float* const* dst_rows, const float* const* src_rows, int64_t count, int64_t n) {
  for (int64_t i = 0; i < count; ++i) std::memmove(dst_rows[i], src_rows[i], static_cast<size_t>(n) * 4);
}

void CpuBackend::embed(const Weight& table, const int32_t* ids, int64_t rows, int copies, float* out) {
  if (is_quantized(table.type)) {
    for (int64_t r = 0; r < rows; ++r) {
      float* first = out + r * copies * table.cols;
      dequantize_rows(table, ids[r], ids[r] + 1, first);
      for (int c = 1; c < copies; ++c) std::memcpy(first + c * table.cols, first, static_cast<size_t>(table.cols) * 4);
    }
    return;
  }
  const float* t = f32_data(table);
  for (int64_t r = 0; r < rows; ++r) {
    for (int c = 0; c < copies; ++c) {
      std::memcpy(out + (r * copies + c) * table.cols, t + static_cast<int64_t>(ids[r]) * table.cols,
                  static_cast<size_t>(table.cols) * 4);
    }
  }
}

void CpuBackend::gather_rows(const float* x, int64_t dim, const int64_t* index, int64_t count, float* out) {
  for (int64_t i = 0; i < count; ++i) std::memcpy(out + i * dim, x + index[i] * dim, static_cast<size_t>(dim) * 4);
}

void CpuBackend::swiglu(const float* g, const float* u, float* y, int64_t n, float limit) {
  for (int64_t i = 0; i < n; ++i) {
    const float gv = std::min(g[i], limit);
    const float uv = std::min(std::max(u[i], -limit), limit);
    y[i] = gv / (1.0f + std::exp(-gv)) * uv;
  }
}

void CpuBackend::add(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

}  // namespace troupe::kernels::cpu

namespace troupe::kernels {
std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<cpu::CpuBackend>(); }
void dequantize_rows_host(const Weight& w, int64_t r0, int64_t r1, float* out) { cpu::dequantize_rows(w, r0, r1, out); }
}  // namespace troupe::kernels
