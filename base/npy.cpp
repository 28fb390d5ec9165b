#include "base/npy.hpp"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <regex>

#include "base/error.hpp"
#include "base/mapped_file.hpp"

namespace troupe {
namespace {

void write_npy(const std::string& path, const char* descr, const void* data, size_t elem,
               const std::vector<int64_t>& shape) {
  std::string dims;
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    dims += std::to_string(shape[i]);
    dims += (shape.size() == 1 || i + 1 < shape.size()) ? "," : "";
    if (i + 1 < shape.size()) dims += " ";
    n *= shape[i];
  }
  std::string header = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': ({}), }}", descr, dims);
  // magic(6) + version(2) + len(2) + header + '\n' padded to a multiple of 64.
  size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) raise(ErrorCode::invalid_argument, "cannot write {}", path);
  const char magic[] = "\x93NUMPY\x01\x00";
  out.write(magic, 8);
  uint16_t hlen = static_cast<uint16_t>(header.size());
  out.write(reinterpret_cast<const char*>(&hlen), 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(n * elem));
  if (!out) raise(ErrorCode::invalid_argument, "failed writing {}", path);
}

}  // namespace

int64_t NpyArray::size() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::vector<float> NpyArray::as_f32() const {
  if (descr != "<f4") raise(ErrorCode::invalid_file, "npy: expected float32, got {}", descr);
  std::vector<float> out(static_cast<size_t>(size()));
  std::memcpy(out.data(), data.data(), out.size() * 4);
  return out;
}

std::vector<int64_t> NpyArray::as_i64() const {
  std::vector<int64_t> out(static_cast<size_t>(size()));
  if (descr == "<i8") {
    std::memcpy(out.data(), data.data(), out.size() * 8);
  } else if (descr == "<i4") {
    for (size_t i = 0; i < out.size(); ++i) {
      int32_t v;
      std::memcpy(&v, data.data() + 4 * i, 4);
      out[i] = v;
    }
  } else {
    raise(ErrorCode::invalid_file, "npy: expected an integer array, got {}", descr);
  }
  return out;
}

void write_npy_f32(const std::string& path, const float* data, const std::vector<int64_t>& shape) {
  write_npy(path, "<f4", data, 4, shape);
}

void write_npy_i64(const std::string& path, const int64_t* data, const std::vector<int64_t>& shape) {
  write_npy(path, "<i8", data, 8, shape);
}

NpyArray read_npy(const std::string& path) {
  MappedFile file(path);
  auto bytes = file.bytes();
  if (bytes.size() < 10 || std::memcmp(bytes.data(), "\x93NUMPY", 6) != 0) {
    raise(ErrorCode::invalid_file, "{} is not a .npy file", path);
  }
  uint8_t major = static_cast<uint8_t>(bytes[6]);
  size_t hlen, hstart;
  if (major == 1) {
    uint16_t h;
    std::memcpy(&h, bytes.data() + 8, 2);
    hlen = h;
    hstart = 10;
  } else {
    uint32_t h;
    std::memcpy(&h, bytes.data() + 8, 4);
    hlen = h;
    hstart = 12;
  }
  if (hstart + hlen > bytes.size()) raise(ErrorCode::invalid_file, "{}: truncated header", path);
  std::string header(reinterpret_cast<const char*>(bytes.data() + hstart), hlen);
  std::smatch m;
  NpyArray arr;
  if (!std::regex_search(header, m, std::regex("'descr':\\s*'([^']+)'"))) {
    raise(ErrorCode::invalid_file, "{}: no descr in header", path);
  }
  arr.descr = m[1];
  if (header.find("'fortran_order': True") != std::string::npos) {
    raise(ErrorCode::invalid_file, "{}: Fortran order is not supported", path);
  }
  if (!std::regex_search(header, m, std::regex("'shape':\\s*\\(([^)]*)\\)"))) {
    raise(ErrorCode::invalid_file, "{}: no shape in header", path);
  }
  std::string dims = m[1];
  std::regex num("\\d+");
  for (auto it = std::sregex_iterator(dims.begin(), dims.end(), num); it != std::sregex_iterator(); ++it) {
    arr.shape.push_back(std::stoll(it->str()));
  }
  size_t elem = arr.descr == "<f4" || arr.descr == "<i4" ? 4 : arr.descr == "<i8" || arr.descr == "<f8" ? 8 : 0;
  if (elem == 0) raise(ErrorCode::invalid_file, "{}: unsupported dtype {}", path, arr.descr);
  size_t nbytes = static_cast<size_t>(arr.size()) * elem;
  if (hstart + hlen + nbytes > bytes.size()) raise(ErrorCode::invalid_file, "{}: truncated data", path);
  arr.data.assign(reinterpret_cast<const char*>(bytes.data() + hstart + hlen),
                  reinterpret_cast<const char*>(bytes.data() + hstart + hlen + nbytes));
  return arr;
}

}  // namespace troupe
