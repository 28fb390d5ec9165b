#include "base/dtype.hpp"

#include <cmath>
#include <limits>

#include "base/check.hpp"

namespace troupe {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::i64: return 8;
    case DType::i32: return 4;
    case DType::u8: return 1;
    case DType::i8: return 1;
    case DType::f8_e4m3: return 1;
    case DType::f8_e8m0: return 1;
  }
  return 0;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::i64: return "I64";
    case DType::i32: return "I32";
    case DType::u8: return "U8";
    case DType::i8: return "I8";
    case DType::f8_e4m3: return "F8_E4M3";
    case DType::f8_e8m0: return "F8_E8M0";
  }
  return "?";
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400) == 0);
      mant &= 0x3ff;
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t absx = x & 0x7fffffffu;
  if (absx > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u); // overflow -> inf
  if (absx < 0x38800000u) {  // subnormal or zero in half
    float a;
    std::memcpy(&a, &absx, 4);
    // 2^-24 is the smallest half subnormal; nearbyint rounds half to even.
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
  }
  uint32_t mant_odd = (absx >> 13) & 1u;
  absx += 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round to nearest even
  return static_cast<uint16_t>(sign | (absx >> 13));
}

float e4m3_to_f32(uint8_t v) {
  const uint32_t exp = (v >> 3) & 0xf, mant = v & 0x7;
  const float sign = (v & 0x80) ? -1.0f : 1.0f;
  if (exp == 0xf && mant == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -9);  // subnormal: mant/8 * 2^-6
  return sign * std::ldexp(static_cast<float>(8 + mant), static_cast<int>(exp) - 10);
}

float e8m0_to_f32(uint8_t v) {
  if (v == 0xff) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(v) - 127);
}

float e2m1_to_f32(uint8_t v) {
  static constexpr float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float m = kMagnitude[v & 0x7];
  return (v & 0x8) ? -m : m;
}

namespace {

// dst[i] = f(element i of src), the elements of type T.
template <class T, class F>
void map_to_f32(const void* src, float* dst, size_t n, F f) {
  const auto* s = static_cast<const T*>(src);
  for (size_t i = 0; i < n; ++i) dst[i] = f(s[i]);
}

}  // namespace

void convert_to_f32(DType from, const void* src, float* dst, size_t n) {
  switch (from) {
    case DType::f32: std::memcpy(dst, src, n * 4); return;
    case DType::bf16: return map_to_f32<uint16_t>(src, dst, n, bf16_to_f32);
    case DType::f16: return map_to_f32<uint16_t>(src, dst, n, f16_to_f32);
    case DType::f8_e4m3: return map_to_f32<uint8_t>(src, dst, n, e4m3_to_f32);
    case DType::f8_e8m0: return map_to_f32<uint8_t>(src, dst, n, e8m0_to_f32);
    default: TROUPE_CHECK(false, "convert_to_f32: not a floating type");
  }
}

}  // namespace troupe
