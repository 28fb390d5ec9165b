// NumPy .npy files (format v1.0, little-endian, C order): the exchange format
// for logits and fixtures.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace troupe {

struct NpyArray {
  std::string descr;             // "<f4", "<i4", "<i8"
  std::vector<int64_t> shape;
  std::vector<char> data;        // raw little-endian bytes, C order

  int64_t size() const;
  std::vector<float> as_f32() const;     // only for "<f4"
  std::vector<int64_t> as_i64() const;   // "<i4" or "<i8"
};

void write_npy_f32(const std::string& path, const float* data, const std::vector<int64_t>& shape);
void write_npy_i64(const std::string& path, const int64_t* data, const std::vector<int64_t>& shape);
// Throws troupe::Error naming the path on a missing or malformed file.
NpyArray read_npy(const std::string& path);

}  // namespace troupe
