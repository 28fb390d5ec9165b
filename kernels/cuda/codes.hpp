// FP8 / FP4 weight codes to fp32 as the CUDA backend's kernels read them (dense.cu's WLoad), without conversion
// instructions: Hopper issues F2F at a quarter of its integer rate, and a 16-byte chunk of FP4 holds 32 values. A
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

// A half (the low 16 bits of h) as fp32: sign to bit 31, exponent and mantissa to bits 27..13, which read as the
// half's value times 2^-112 (normal and subnormal halves alike; infinities and NaNs do not occur: the e4m3 codes
// come through cvt.f16x2.e4m3x2, and e4m3fn's NaN codes, 0x7f / 0xff, read as finite).
TROUPE_CODES_FN float half_bits_to_f32(uint32_t h) {
  return bits_as_f32(((h & 0x7fffu) << 13) | ((h & 0x8000u) << 16)) * 0x1p112f;
}

// FP4 (e2m1) code j of w (bits 4j .. 4j + 3: sign, two exponent bits, one mantissa bit; -0 for code 8): exponent
// and mantissa bits to bits 24..22, the sign to bit 31; the word reads as the value times 2^-126 (exponent 0: the
// subnormal m 2^-127 for m / 2). j is a constant after unrolling.
TROUPE_CODES_FN float e2m1_at(uint32_t w, int j) {
  const uint32_t em = (j <= 5 ? w << (22 - 4 * j) : w >> (4 * j - 22)) & 0x01c00000u;
  const uint32_t sign = (w << (28 - 4 * j)) & 0x80000000u;
  return bits_as_f32(em | sign) * 0x1p126f;
}

}  // namespace troupe::kernels::cuda
