// Element types of tensors in files and pools, and conversions to fp32.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

namespace troupe {

// f8_e4m3: OCP e4m3fn (no infinities); f8_e8m0: an exponent byte, 2^(b - 127) (0xff: NaN), the ue8m0
// scales of quantized checkpoints; i8 also holds packed FP4 (e2m1) pairs.
enum class DType : uint8_t { f32, bf16, f16, i64, i32, u8, i8, f8_e4m3, f8_e8m0 };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);

inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as torch does.
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float f16_to_f32(uint16_t v);
float e4m3_to_f32(uint8_t v);
float e8m0_to_f32(uint8_t v);
// One e2m1 (FP4) code, the low four bits of v: sign, two exponent bits, one mantissa bit.
float e2m1_to_f32(uint8_t v);
uint16_t f32_to_f16(float f);

// Converts n elements of type `from` at src into fp32 at dst (the float types: f32, bf16, f16,
// f8_e4m3, f8_e8m0).
void convert_to_f32(DType from, const void* src, float* dst, size_t n);

}  // namespace troupe
