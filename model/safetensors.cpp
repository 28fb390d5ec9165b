#include "model/safetensors.hpp"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "base/error.hpp"

namespace troupe::model {
namespace fs = std::filesystem;
using json = nlohmann::json;

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::string TensorView::shape_string() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

namespace {

bool parse_dtype(const std::string& s, DType* out) {
  if (s == "F32") *out = DType::f32;
  else if (s == "BF16") *out = DType::bf16;
  else if (s == "F16") *out = DType::f16;
  else if (s == "I64") *out = DType::i64;
  else if (s == "I32") *out = DType::i32;
  else if (s == "U8") *out = DType::u8;
  else if (s == "I8") *out = DType::i8;
  else if (s == "F8_E4M3") *out = DType::f8_e4m3;
  else if (s == "F8_E8M0") *out = DType::f8_e8m0;
  else return false;
  return true;
}

}  // namespace

void Checkpoint::add_file(const std::string& path) {
  auto file = std::make_unique<MappedFile>(path);
  auto bytes = file->bytes();
  if (bytes.size() < 8) raise(ErrorCode::invalid_file, "{}: truncated safetensors file ({} bytes)", path, bytes.size());
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  if (header_len > bytes.size() - 8 || header_len > (100u << 20)) {
    raise(ErrorCode::invalid_file, "{}: truncated or corrupt safetensors header (length {})", path, header_len);
  }
  json header;
  try {
    header = json::parse(std::string(reinterpret_cast<const char*>(bytes.data() + 8), header_len));
  } catch (const json::parse_error& e) {
    raise(ErrorCode::invalid_file, "{}: safetensors header is not valid JSON: {}", path, e.what());
  }
  if (!header.is_object()) raise(ErrorCode::invalid_file, "{}: safetensors header is not an object", path);
  const size_t data_start = 8 + header_len;
  const size_t data_size = bytes.size() - data_start;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const auto& t = it.value();
    TensorView v;
    v.name = it.key();
    v.file = path;
    try {
      const std::string dt = t.at("dtype").get<std::string>();
      if (!parse_dtype(dt, &v.dtype)) {
        raise(ErrorCode::unsupported, "{}: tensor '{}' has dtype {}; troupe reads F32, BF16, F16, F8_E4M3, F8_E8M0, I64, I32, I8, U8", path,
              v.name, dt);
      }
      v.shape = t.at("shape").get<std::vector<int64_t>>();
      auto offs = t.at("data_offsets").get<std::vector<uint64_t>>();
      if (offs.size() != 2 || offs[0] > offs[1]) throw json::other_error::create(0, "bad data_offsets", nullptr);
      if (offs[1] > data_size) {
        raise(ErrorCode::invalid_file, "{}: tensor '{}' ends at byte {} but the file holds {} data bytes (truncated?)",
              path, v.name, offs[1], data_size);
      }
      v.data = bytes.data() + data_start + offs[0];
      v.bytes = offs[1] - offs[0];
    } catch (const json::exception& e) {
      raise(ErrorCode::invalid_file, "{}: malformed entry for tensor '{}': {}", path, v.name, e.what());
    }
    for (auto d : v.shape) {
      if (d < 0) raise(ErrorCode::invalid_file, "{}: tensor '{}' has a negative dimension", path, v.name);
    }
    if (static_cast<size_t>(v.numel()) * dtype_size(v.dtype) != v.bytes) {
      raise(ErrorCode::invalid_file, "{}: tensor '{}' of shape {} and dtype {} needs {} bytes, the file gives {}",
            path, v.name, v.shape_string(), dtype_name(v.dtype), v.numel() * dtype_size(v.dtype), v.bytes);
    }
    if (tensors_.count(v.name)) raise(ErrorCode::invalid_file, "{}: tensor '{}' appears twice in the checkpoint", path, v.name);
    tensors_.emplace(v.name, std::move(v));
  }
  files_.push_back(std::move(file));
}

Checkpoint Checkpoint::open(const std::string& dir) {
  if (!fs::exists(dir)) raise(ErrorCode::not_found, "model directory {} does not exist", dir);
  if (!fs::is_directory(dir)) raise(ErrorCode::invalid_argument, "{} is not a directory", dir);
  Checkpoint ck;
  ck.dir_ = dir;
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single = fs::path(dir) / "model.safetensors";
  if (fs::exists(index)) {
    json j;
    try {
      j = json::parse(read_text_file(index.string()));
    } catch (const json::parse_error& e) {
      raise(ErrorCode::invalid_file, "{}: not valid JSON: {}", index.string(), e.what());
    }
    if (!j.contains("weight_map") || !j["weight_map"].is_object()) {
      raise(ErrorCode::invalid_file, "{}: no weight_map object", index.string());
    }
    std::set<std::string> shards;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string()) raise(ErrorCode::invalid_file, "{}: weight_map['{}'] is not a file name", index.string(), it.key());
      shards.insert(it.value().get<std::string>());
    }
    for (const auto& s : shards) {
      if (s.find('/') != std::string::npos) raise(ErrorCode::invalid_file, "{}: shard name '{}' is not a plain file name", index.string(), s);
      const fs::path p = fs::path(dir) / s;
      if (!fs::exists(p)) raise(ErrorCode::not_found, "{}: shard {} listed in the index is missing", dir, s);
      ck.add_file(p.string());
    }
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!ck.tensors_.count(it.key())) {
        raise(ErrorCode::invalid_file, "{}: tensor '{}' is listed in the index but missing from {}", dir, it.key(),
              it.value().get<std::string>());
      }
    }
  } else if (fs::exists(single)) {
    ck.add_file(single.string());
  } else {
    raise(ErrorCode::not_found, "{} holds neither model.safetensors nor model.safetensors.index.json", dir);
  }
  return ck;
}

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors) {
  json header = json::object();
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    int64_t n = 1;
    for (auto d : t.shape) n *= d;
    const uint64_t bytes = static_cast<uint64_t>(n) * dtype_size(t.dtype);
    header[t.name] = {{"dtype", std::string(dtype_name(t.dtype))}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  header["__metadata__"] = {{"format", "pt"}};
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) raise(ErrorCode::invalid_argument, "cannot write {}", path);
  const uint64_t hl = h.size();
  out.write(reinterpret_cast<const char*>(&hl), 8);
  out.write(h.data(), static_cast<std::streamsize>(h.size()));
  for (const auto& t : tensors) {
    int64_t n = 1;
    for (auto d : t.shape) n *= d;
    out.write(static_cast<const char*>(t.data), static_cast<std::streamsize>(n * dtype_size(t.dtype)));
  }
  if (!out) raise(ErrorCode::invalid_argument, "failed writing {}", path);
}

}  // namespace troupe::model
