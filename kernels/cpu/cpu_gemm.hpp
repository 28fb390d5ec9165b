// The CPU backend's matrix products, batch-invariant by construction.
//
// y[r, j] = dot(x[r, :], w[j, :]) is summed in one fixed order that depends on
// nothing but k: lane l of a vector accumulator adds the products at columns
// l, l + L, l + 2L, ... with fused multiply-adds, then the lanes are reduced in
// a fixed tree. So a row's result is the same bits whether it is computed alone
// (a decode step), in a batch of 64 (batched decode), inside a 5,000-row prefill
// chunk, or after a preemption recomputes it: the engine's exactness promises
// (batched == alone, resume == uninterrupted, failover == no failure) rest on
// this. OpenBLAS sgemm does not give it (its small-matrix and GEMV paths sum in
// other orders at different m), which is why these products are not BLAS calls.
//
// The vector width is chosen once per process from the CPU (AVX-512, AVX2+FMA,
// or scalar); results are reproducible on one machine, not across ISAs.
#pragma once

#include <cstdint>

#include "kernels/backend.hpp"

namespace troupe::kernels::cpu {

// y[m, n] (row stride ldy) = x[m, k] (ldx) @ w[n, k]^T (ldw); with accumulate,
// y += that product (the product first, then one add per element).
void gemm_xwt(const float* x, int64_t m, int64_t ldx, const float* w, int64_t n, int64_t ldw, int64_t k, float* y,
              int64_t ldy, bool accumulate);

// The same product with w a quantized matrix (e4m3 / e2m1 codes and block scales,
// kernels/backend.hpp): each block of weight rows is dequantized into fp32 (code *
// scale, one fp32 multiply) and multiplied as gemm_xwt would multiply that fp32
// matrix, so y has the same bits as gemm_xwt over the dequantized weights.
void gemm_xwt_quantized(const float* x, int64_t m, int64_t ldx, const Weight& w, float* y, int64_t ldy,
                        bool accumulate);

// y[m, w.rows] (ldy) = x[m, w.cols] (ldx) @ w^T for a backend weight: fp32 (gemm_xwt) or
// quantized (gemm_xwt_quantized); any other type is refused (std::invalid_argument).
void gemm_weight(const float* x, int64_t m, int64_t ldx, const Weight& w, float* y, int64_t ldy, bool accumulate);

// Rows [r0, r1) of a quantized matrix in fp32, (r1 - r0) * w.cols floats at out.
void dequantize_rows(const Weight& w, int64_t r0, int64_t r1, float* out);

// Which kernel gemm_xwt uses here: "avx512", "avx2" or "scalar".
const char* gemm_isa();

}  // namespace troupe::kernels::cpu
