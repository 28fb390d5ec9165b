// The element types of quantized checkpoints, decoded as torch decodes them.
#include <gtest/gtest.h>

#include <cmath>

#include "base/dtype.hpp"

namespace troupe {
namespace {

TEST(Dtype, e4m3_codes) {
  EXPECT_EQ(e4m3_to_f32(0x38), 1.0f);                  // exponent 7, mantissa 0
  EXPECT_EQ(e4m3_to_f32(0xb8), -1.0f);
  EXPECT_EQ(e4m3_to_f32(0x7e), 448.0f);                // the largest finite value
  EXPECT_EQ(e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // the smallest subnormal
  EXPECT_EQ(e4m3_to_f32(0x07), 7 * std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_f32(0x08), std::ldexp(1.0f, -6));  // the smallest normal
  EXPECT_EQ(e4m3_to_f32(0x3d), 1.625f);
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0xff)));
  EXPECT_EQ(e4m3_to_f32(0x80), 0.0f);
}

TEST(Dtype, e8m0_and_e2m1_codes) {
  EXPECT_EQ(e8m0_to_f32(127), 1.0f);
  EXPECT_EQ(e8m0_to_f32(130), 8.0f);
  EXPECT_EQ(e8m0_to_f32(0), std::ldexp(1.0f, -127));
  EXPECT_TRUE(std::isnan(e8m0_to_f32(0xff)));
  const float want[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (int c = 0; c < 16; ++c) EXPECT_EQ(e2m1_to_f32(static_cast<uint8_t>(c)), want[c]) << c;
  EXPECT_EQ(e2m1_to_f32(0x35), 3.0f);  // only the low nibble counts
  float out[2];
  const uint8_t bytes[2] = {0x38, 0xb8};
  convert_to_f32(DType::f8_e4m3, bytes, out, 2);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -1.0f);
  EXPECT_EQ(dtype_size(DType::f8_e4m3), 1u);
  EXPECT_EQ(dtype_name(DType::f8_e8m0), "F8_E8M0");
}

}  // namespace
}  // namespace troupe
