// Every code point (but surrogates) in contexts that expose its regex classes
// (letter, mark, number, punctuation, symbol, space, CJK range): the ids must
// hash to what Hugging Face produced. This is what catches a Unicode-version or
// \s difference between PCRE2 and Oniguruma.
#include <gtest/gtest.h>

#include <cinttypes>
#include <sstream>

#include "tests/tokenizer/support.hpp"

namespace troupe::tokenizer {
namespace {

using namespace testing;

void append_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// tools/make_tokenizer_fixtures.py: sweep_text().
std::string sweep_text(uint32_t first) {
  std::string out;
  for (uint32_t cp = first; cp < first + 64; ++cp) {
    if (cp >= 0xD800 && cp <= 0xDFFF) continue;
    std::string c;
    append_utf8(cp, c);
    out += c + "a" + c + " " + c + "1" + c + "!" + c + c + "\n " + c;
  }
  return out;
}

uint64_t fnv1a64(const std::vector<int32_t>& ids) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (int32_t id : ids) {
    const auto u = static_cast<uint32_t>(id);
    for (int k = 0; k < 4; ++k) {
      h ^= (u >> (8 * k)) & 0xFF;
      h *= 0x100000001B3ull;
    }
  }
  return h;
}

TEST(TokenizerUnicodeSweep, every_code_point_tokenizes_like_hugging_face) {
  const auto lines = read_lines(fixture_path("unicode_sweep.txt"));
  ASSERT_EQ(lines.size(), (0x110000u - 0x800u) / 64);
  size_t wrong = 0;
  for (const auto& line : lines) {
    std::istringstream in(line);
    uint32_t first = 0;
    size_t count = 0;
    std::string hash;
    in >> std::hex >> first >> std::dec >> count >> hash;
    const auto ids = deepseek().encode(sweep_text(first));
    char mine[17];
    std::snprintf(mine, sizeof mine, "%016" PRIx64, fnv1a64(ids));
    if (ids.size() != count || hash != mine) {
      if (++wrong <= 10) ADD_FAILURE() << "code points U+" << std::hex << first << "..U+" << first + 63 << " differ";
    }
  }
  EXPECT_EQ(wrong, 0u);
}

}  // namespace
}  // namespace troupe::tokenizer
