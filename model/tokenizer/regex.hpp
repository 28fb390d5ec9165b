// A PCRE2 regex compiled from a Hugging Face tokenizer.json pattern.
//
// tokenizer.json patterns are written for Oniguruma (what the `tokenizers`
// library runs). PCRE2 reads the same syntax for everything these tokenizers
// use, with two differences that change ids, both rewritten away here:
//  - PCRE2's \s also matches U+180E (MONGOLIAN VOWEL SEPARATOR), Oniguruma's
//    does not: \s and \S become Oniguruma's set (Unicode White_Space);
//  - Oniguruma 6.9.10 knows Unicode 16.0, Debian 12's PCRE2 Unicode 14.0:
//    \p{L} \p{M} \p{N} \p{P} \p{S} get the code points assigned since
//    (unicode_additions.inc, made by tools/make_unicode_tables.py).
// Escapes whose meaning differs between the engines (\h, \w, \b, ...) are
// refused rather than guessed.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

struct pcre2_real_code_8;

namespace troupe::tokenizer {

struct Match {
  size_t begin = 0, end = 0;
};

class Regex {
 public:
  // `pattern` in Oniguruma syntax; `literal` treats it as a plain string.
  // Throws troupe::Error(unsupported / invalid_file) naming the pattern.
  Regex(std::string_view pattern, bool literal);
  ~Regex();
  Regex(Regex&&) noexcept;
  Regex& operator=(Regex&&) = delete;
  Regex(const Regex&) = delete;

  // The first match in `subject` at or after byte `start`, if any. `subject`
  // must be valid UTF-8 (the caller checked it once). Thread-safe.
  std::optional<Match> find(std::string_view subject, size_t start) const;

  const std::string& pattern() const { return source_; }

 private:
  std::string source_;
  pcre2_real_code_8* code_ = nullptr;
};

// Oniguruma pattern -> PCRE2 pattern (exposed for tests).
std::string translate_oniguruma(std::string_view pattern);

}  // namespace troupe::tokenizer
