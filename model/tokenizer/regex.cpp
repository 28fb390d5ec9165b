#include "model/tokenizer/regex.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cstdint>

#include "base/check.hpp"
#include "base/error.hpp"

namespace troupe::tokenizer {
namespace {

#include "model/tokenizer/unicode_additions.inc"

// The code points Oniguruma's Unicode 16 tables put in a general category
// that PCRE2's older tables leave unassigned (see unicode_additions.inc).
std::string_view additions(char category) {
  switch (category) {
    case 'L': return kAddedL;
    case 'M': return kAddedM;
    case 'N': return kAddedN;
    case 'P': return kAddedP;
    case 'S': return kAddedS;
    default: return {};
  }
}

// Unicode White_Space, which is what Oniguruma's \s matches.
constexpr std::string_view kSpaceSet =
    "\\t\\n\\x{0B}\\f\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";

// Per-thread match state: PCRE2 match data must not be shared between threads,
// and the JIT stack is grown past its 32 KiB default for long pieces.
struct MatchState {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  MatchState() {
    TROUPE_CHECK(data && stack && context, "PCRE2 could not allocate its match state");
    pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~MatchState() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(stack);
    pcre2_match_data_free(data);
  }
};

MatchState& match_state() {
  thread_local MatchState state;
  return state;
}

// A pattern as one printable line for error messages (patterns hold raw \r\n).
std::string printable(std::string_view pattern) {
  std::string out;
  for (char c : pattern) {
    if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
    } else {
      out += c;
    }
  }
  return out;
}

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof buf);
  return reinterpret_cast<const char*>(buf);
}

}  // namespace

std::string translate_oniguruma(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 64);
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[++i];
      switch (e) {
        case 's': out += in_class ? std::string(kSpaceSet) : "[" + std::string(kSpaceSet) + "]"; continue;
        case 'S':
          if (in_class) {
            raise(ErrorCode::unsupported, "regex '{}': \\S inside a character class is not supported", printable(p));
          }
          out += "[^" + std::string(kSpaceSet) + "]";
          continue;
        case 'p':
        case 'P': {
          // \p{X} or \pX for a one-letter general category gets Unicode 16's
          // newer members; other properties pass through unchanged.
          char category = 0;
          size_t len = 0;  // characters after the 'p'
          if (i + 3 < p.size() && p[i + 1] == '{' && p[i + 3] == '}') {
            category = p[i + 2];
            len = 3;
          } else if (i + 1 < p.size() && p[i + 1] != '{') {
            category = p[i + 1];
            len = 1;
          }
          const std::string_view extra = additions(category);
          if (extra.empty()) {
            out += c;
            out += e;
            continue;
          }
          const std::string member = "\\p{" + std::string(1, category) + "}" + std::string(extra);
          if (e == 'P') {
            if (in_class) {
              raise(ErrorCode::unsupported, "regex '{}': \\P inside a character class is not supported", printable(p));
            }
            out += "[^" + member + "]";
          } else {
            out += in_class ? member : "[" + member + "]";
          }
          i += len;
          continue;
        }
        case 'h':
        case 'H':
        case 'w':
        case 'W':
        case 'b':
        case 'B':
        case 'R':
        case 'X':
        case 'K':
        case 'G':
          raise(ErrorCode::unsupported, "regex '{}': \\{} means different things to Oniguruma and PCRE2", printable(p),
                e);
        default:
          out += c;
          out += e;
          continue;
      }
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal member, not the end.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      continue;
    }
    if (in_class && c == '[') {
      raise(ErrorCode::unsupported, "regex '{}': nested character classes are not supported", printable(p));
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

Regex::Regex(std::string_view pattern, bool literal) : source_(pattern) {
  const std::string translated = literal ? std::string(pattern) : translate_oniguruma(pattern);
  int err = 0;
  PCRE2_SIZE where = 0;
  uint32_t options = PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK;
  if (literal) options |= PCRE2_LITERAL;
  code_ =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(), options, &err, &where, nullptr);
  if (!code_) {
    raise(ErrorCode::invalid_file, "regex '{}' does not compile (offset {}): {}", printable(source_), where,
          pcre2_message(err));
  }
  // Without JIT (an unusual PCRE2 build) matching still works, only slower.
  pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);
}

Regex::~Regex() { pcre2_code_free(code_); }

Regex::Regex(Regex&& other) noexcept : source_(std::move(other.source_)), code_(other.code_) { other.code_ = nullptr; }

std::optional<Match> Regex::find(std::string_view subject, size_t start) const {
  auto& state = match_state();
  // PCRE2's default match limit (10M backtracking steps) is hit by a
  // whitespace run of a few MB (\s*[\r\n]+ backtracks over it once); the
  // tokenizer patterns are linear in the piece, so the limit grows with it.
  const size_t limit = std::min<size_t>(UINT32_MAX, std::max<size_t>(10'000'000, 64 * subject.size()));
  pcre2_set_match_limit(state.context, static_cast<uint32_t>(limit));
  const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(), start,
                             PCRE2_NO_UTF_CHECK, state.data, state.context);
  if (rc == PCRE2_ERROR_NOMATCH) return std::nullopt;
  if (rc < 0) {
    raise(ErrorCode::resource_exhausted, "a pre-tokenizer regex failed on a piece of {} bytes: {}", subject.size(),
          pcre2_message(rc));
  }
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(state.data);
  return Match{ov[0], ov[1]};
}

}  // namespace troupe::tokenizer
