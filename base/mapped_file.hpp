// A read-only memory map of a whole file (RAII).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace troupe {

class MappedFile {
 public:
  // Throws troupe::Error (not_found / invalid_file) naming the path.
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&&) = delete;

  std::span<const std::byte> bytes() const { return {data_, size_}; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const std::byte* data_ = nullptr;
  size_t size_ = 0;
};

// Reads a whole small file (configs, manifests). Throws troupe::Error naming the path.
std::string read_text_file(const std::string& path);

}  // namespace troupe
