#include "model/tokenizer/default_tokenizer.hpp"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <vector>

#include "base/error.hpp"

#ifndef TROUPE_TOKENIZER_SOURCE_DATA
#error "TROUPE_TOKENIZER_SOURCE_DATA (model/tokenizer/data in the source tree) must be defined by CMake"
#endif

namespace troupe::tokenizer {
namespace {

namespace fs = std::filesystem;

constexpr const char* kName = "deepseek-v4";

fs::path executable_dir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? fs::path() : exe.parent_path();
}

}  // namespace

std::string default_tokenizer_dir() {
  std::vector<fs::path> candidates;
  if (const char* env = std::getenv("TROUPE_TOKENIZER_DIR"); env && *env) {
    const fs::path dir(env);
    std::error_code ec;
    if (!fs::exists(dir / "tokenizer.json", ec)) {
      raise(ErrorCode::not_found, "TROUPE_TOKENIZER_DIR={} holds no tokenizer.json", env);
    }
    return dir.string();
  }
  if (const fs::path exe = executable_dir(); !exe.empty()) {
    candidates.push_back(exe / ".." / "share" / "troupe" / "tokenizer" / kName);
    candidates.push_back(exe / "tokenizer" / kName);
  }
  candidates.push_back(fs::path(TROUPE_TOKENIZER_SOURCE_DATA) / kName);
  std::string looked;
  for (const auto& dir : candidates) {
    std::error_code ec;
    if (fs::exists(dir / "tokenizer.json", ec)) return fs::weakly_canonical(dir, ec).string();
    looked += (looked.empty() ? "" : ", ") + dir.string();
  }
  raise(ErrorCode::not_found,
        "the shipped DeepSeek-V4 tokenizer was not found (looked in {}); set TROUPE_TOKENIZER_DIR", looked);
}

std::string tokenizer_dir_for(const std::string& model_dir) {
  std::error_code ec;
  if (fs::exists(fs::path(model_dir) / "tokenizer.json", ec)) return model_dir;
  return default_tokenizer_dir();
}

}  // namespace troupe::tokenizer
