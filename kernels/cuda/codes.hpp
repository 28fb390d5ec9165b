// FP8 / FP4 weight codes to fp32 as the CUDA backend's kernels read them (dense.cu's WLoad), without conversion
// instructions (they issue at a fraction of the integer rate, and a 16-byte chunk of FP4 holds 32 values). A
// code's bits are placed into an fp32 word that reads as the value times a power of two, whatever the code (the
// formats' subnormals land on fp32's: their exponent fields are zero alike), then one multiply by its inverse.
// Exact: both steps are powers of two away from the value. The host compiler reads this header too, so
// tests/kernels/cpu_quantized_test.cpp checks these functions against base/dtype's on every code.
#pragma once

#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define TROUPE_CODES_FN __host__ __device__ __forceinline__
#else
#define TROUPE_CODES_FN inline
#endif

namespace troupe::kernels::cuda {

TROUPE_CODES_FN float bits_as_f32(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// FP8 (e4m3fn) code j of w (byte j: sign, four exponent bits, three mantissa bits): exponent and mantissa bits
// to bits 26..20, the sign to bit 31; the word reads as the value times 2^-120 (exponent 0: m 2^-129, the subnormal
// m 2^-9 times 2^-120). NaN codes (0x7f, 0xff) read as finite (480, -480). j is a constant after unrolling.
TROUPE_CODES_FN float e4m3_at(uint32_t w, int j) {
  const uint32_t em = (j <= 2 ? w << (20 - 8 * j) : w >> (8 * j - 20)) & 0x07f00000u;
  const uint32_t sign = (w << (24 - 8 * j)) & 0x80000000u;
  return bits_as_f32(em | sign) * 0x1p120f;
}

// FP4 (e2m1) code j of w (bits 4j .. 4j + 3: sign, two exponent bits, one mantissa bit; -0 for code 8): exponent
// and mantissa bits to bits 24..22, the sign to bit 31; the word reads as the value times 2^-126 (exponent 0:
// m 2^-127, the subnormal m / 2 times 2^-126). j is a constant after unrolling.
TROUPE_CODES_FN float e2m1_at(uint32_t w, int j) {
  const uint32_t em = (j <= 5 ? w << (22 - 4 * j) : w >> (4 * j - 22)) & 0x01c00000u;
  const uint32_t sign = (w << (28 - 4 * j)) & 0x80000000u;
  return bits_as_f32(em | sign) * 0x1p126f;
}

}  // namespace troupe::kernels::cuda
