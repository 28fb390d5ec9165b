// Loading: the shipped files are found from the binary, and tokenizer.json
// features that would change ids but are not implemented are refused by name.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "base/error.hpp"
#include "model/tokenizer/default_tokenizer.hpp"
#include "tests/support/process.hpp"
#include "tests/tokenizer/support.hpp"

namespace troupe::tokenizer {
namespace {

using namespace testing;
namespace fs = std::filesystem;

// This process's temporary folder, removed at its exit.
fs::path temp_dir() {
  static const troupe::testing::TempDir dir;
  return dir.path();
}

std::string load_error(const std::string& tokenizer_json) {
  const fs::path dir = temp_dir();
  std::ofstream(dir / "tokenizer.json") << tokenizer_json;
  try {
    Tokenizer::load(dir.string());
    return "(loaded)";
  } catch (const Error& e) {
    return e.what();
  }
}

// A tiny byte-level BPE tokenizer.json with `extra` spliced into its object.
std::string tiny(const std::string& extra, const std::string& added_tokens = "[]") {
  return R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]},
             "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
             "decoder": {"type": "ByteLevel"}, "added_tokens": )" +
         added_tokens + extra + "}";
}

TEST(TokenizerLoad, shipped_tokenizer_is_found_from_the_build) {
  const std::string dir = default_tokenizer_dir();
  EXPECT_TRUE(fs::exists(fs::path(dir) / "tokenizer.json")) << dir;
  EXPECT_TRUE(fs::exists(fs::path(dir) / "NOTICE")) << dir;
  auto tok = Tokenizer::load(dir);
  EXPECT_EQ(tok->encode("Hello world"), (std::vector<int32_t>{19923, 2058}));
}

TEST(TokenizerLoad, environment_override_must_hold_a_tokenizer) {
  ::setenv("TROUPE_TOKENIZER_DIR", "/nonexistent", 1);
  EXPECT_THROW(default_tokenizer_dir(), Error);
  ::setenv("TROUPE_TOKENIZER_DIR", shipped_dir().c_str(), 1);
  EXPECT_EQ(default_tokenizer_dir(), shipped_dir());
  ::unsetenv("TROUPE_TOKENIZER_DIR");
}

TEST(TokenizerLoad, a_minimal_byte_level_bpe_loads_and_merges) { EXPECT_EQ(load_error(tiny("")), "(loaded)"); }

TEST(TokenizerLoad, unimplemented_features_are_refused_by_name) {
  EXPECT_NE(load_error(tiny(R"(, "normalizer": {"type": "NFC"})")).find("normalizer"), std::string::npos);
  EXPECT_NE(load_error(R"({"model": {"type": "WordPiece", "vocab": {}}})").find("WordPiece"), std::string::npos);
  std::string fallback = tiny("");
  fallback.replace(fallback.find("\"merges\""), 0, "\"byte_fallback\": true, ");
  EXPECT_NE(load_error(fallback).find("byte_fallback"), std::string::npos);
  EXPECT_NE(load_error(tiny("", R"([{"id": 3, "content": "<x>", "lstrip": true}])")).find("lstrip"), std::string::npos);
  EXPECT_NE(load_error("{not json").find("not a tokenizer.json"), std::string::npos);
  std::string bad_merge = tiny("");
  bad_merge.replace(bad_merge.find("\"a b\""), 5, "\"a c\"");
  EXPECT_NE(load_error(bad_merge).find("not in the vocabulary"), std::string::npos);
}

TEST(TokenizerLoad, missing_paths_name_the_path) {
  try {
    Tokenizer::load("/nonexistent/tokenizer");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::not_found);
    EXPECT_NE(std::string(e.what()).find("/nonexistent/tokenizer"), std::string::npos);
  }
}

}  // namespace
}  // namespace troupe::tokenizer
