// Memory-mapped safetensors checkpoints: one `model.safetensors`, or shards
// listed by `model.safetensors.index.json`.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "base/dtype.hpp"
#include "base/mapped_file.hpp"

namespace troupe::model {

// A tensor inside a mapped file: valid while its Checkpoint lives.
struct TensorView {
  std::string name;
  std::string file;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t bytes = 0;

  int64_t numel() const;
  std::string shape_string() const;
};

class Checkpoint {
 public:
  // Opens every safetensors file of `dir`. Throws troupe::Error naming the
  // directory or file for a missing directory, a missing shard, a truncated
  // file or a malformed header.
  static Checkpoint open(const std::string& dir);

  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::string& dir() const { return dir_; }

 private:
  void add_file(const std::string& path);

  std::string dir_;
  std::vector<std::unique_ptr<MappedFile>> files_;
  std::map<std::string, TensorView> tensors_;
};

// Writes tensors (all fp32, bf16 or i64 data in host memory) to one safetensors file.
struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const void* data;
};
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors);

}  // namespace troupe::model
