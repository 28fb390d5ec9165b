// Encoding speed of troupe's tokenizer on the tokenizer corpus, in MB/s of
// UTF-8 input. bench/tokenizer.sh runs it next to Hugging Face `tokenizers`
// on the same text and records both in docs/benchmarks.md.
//
//   tokenizer_bench TOKENIZER_DIR CORPUS_FILE [PASSES]
// Prints one line per mode: "<mode> first_pass_mb_s=<x> best_mb_s=<y> ids=<n>".
//   lines: each line encoded by its own call (as `troupe tokenize` does)
//   text:  the whole file as one call
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "base/error.hpp"
#include "base/mapped_file.hpp"
#include "model/tokenizer/tokenizer.hpp"

namespace {

using Clock = std::chrono::steady_clock;
namespace tk = troupe::tokenizer;

struct Result {
  double first = 0, best = 0;
  size_t ids = 0;
};

template <class F>
Result measure(size_t bytes, int passes, F&& pass) {
  Result r;
  for (int p = 0; p < passes; ++p) {
    const auto t0 = Clock::now();
    r.ids = pass();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    const double mb_s = static_cast<double>(bytes) / 1e6 / s;
    if (p == 0) r.first = mb_s;
    r.best = std::max(r.best, mb_s);
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: tokenizer_bench TOKENIZER_DIR CORPUS_FILE [PASSES]\n");
    return 2;
  }
  try {
    const int passes = argc > 3 ? std::stoi(argv[3]) : 5;
    const auto load0 = Clock::now();
    auto tok = tk::Tokenizer::load(argv[1]);
    const double load_s = std::chrono::duration<double>(Clock::now() - load0).count();
    const std::string text = troupe::read_text_file(argv[2]);
    std::vector<std::string_view> lines;
    for (size_t start = 0; start < text.size();) {
      size_t nl = text.find('\n', start);
      if (nl == std::string::npos) nl = text.size();
      lines.push_back(std::string_view(text).substr(start, nl - start));
      start = nl + 1;
    }
    size_t line_bytes = 0;
    for (auto l : lines) line_bytes += l.size();
    // Each mode gets a fresh tokenizer so its first pass starts with a cold cache.
    const Result by_line = measure(line_bytes, passes, [&] {
      size_t n = 0;
      for (auto l : lines) n += tok->encode(l).size();
      return n;
    });
    tok = tk::Tokenizer::load(argv[1]);
    const Result whole = measure(text.size(), passes, [&] { return tok->encode(text).size(); });
    std::printf("load seconds=%.3f\n", load_s);
    std::printf("lines first_pass_mb_s=%.2f best_mb_s=%.2f ids=%zu bytes=%zu calls=%zu\n", by_line.first, by_line.best,
                by_line.ids, line_bytes, lines.size());
    std::printf("text first_pass_mb_s=%.2f best_mb_s=%.2f ids=%zu bytes=%zu calls=1\n", whole.first, whole.best,
                whole.ids, text.size());
  } catch (const troupe::Error& e) {
    std::fprintf(stderr, "tokenizer_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
