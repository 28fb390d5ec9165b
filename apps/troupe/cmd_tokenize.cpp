// troupe tokenize [--tokenizer PATH] [--text-file F] [--special]
//   Encodes each line of F (or stdin): lines are split on '\n', the newline is
//   not part of the line (a '\r' before it is), and nothing is added around
//   the text (no BOS). Prints the ids of each line separated by single spaces,
//   one output line per input line; an empty line gives an empty line.
//   Added tokens written in the text ("<｜User｜>") stay plain text unless
//   --special is given. Input that is not UTF-8 is refused (line and column).
// troupe tokenize --decode [--tokenizer PATH] [--text-file F] [--skip-special]
//   Reads lines of ids (separated by spaces or tabs) and prints each line's text.
// PATH is a tokenizer.json or a directory holding one; default: the shipped
// DeepSeek-V4 tokenizer.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <string_view>

#include "apps/troupe/commands.hpp"
#include "base/error.hpp"
#include "base/mapped_file.hpp"
#include "model/tokenizer/default_tokenizer.hpp"
#include "model/tokenizer/tokenizer.hpp"
#include "model/tokenizer/utf8.hpp"

namespace troupe::app {
namespace {

namespace tk = troupe::tokenizer;

std::string read_input(const std::string& file) {
  if (!file.empty()) return read_text_file(file);
  std::string all((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  if (std::cin.bad()) raise(ErrorCode::invalid_argument, "could not read standard input");
  return all;
}

// Lines split on '\n'; a final '\n' ends the last line rather than starting an empty one.
std::vector<std::string_view> split_lines(std::string_view all) {
  std::vector<std::string_view> lines;
  size_t start = 0;
  while (start < all.size()) {
    size_t nl = all.find('\n', start);
    if (nl == std::string_view::npos) nl = all.size();
    lines.push_back(all.substr(start, nl - start));
    start = nl + 1;
  }
  return lines;
}

std::string encode_lines(const tk::Tokenizer& tok, const std::vector<std::string_view>& lines,
                         const std::string& source, bool special) {
  // Check every line first, so bad input produces an error and no partial output.
  for (size_t i = 0; i < lines.size(); ++i) {
    if (auto bad = tk::find_invalid_utf8(lines[i])) {
      raise(ErrorCode::invalid_argument, "{}:{}: not valid UTF-8 (byte 0x{:02x} at byte column {})", source, i + 1,
            static_cast<unsigned char>(lines[i][*bad]), *bad + 1);
    }
  }
  std::string out;
  tk::EncodeOptions options;
  options.parse_special = special;
  for (std::string_view line : lines) {
    const auto ids = tok.encode(line, options);
    for (size_t k = 0; k < ids.size(); ++k) {
      if (k) out += ' ';
      out += std::to_string(ids[k]);
    }
    out += '\n';
  }
  return out;
}

std::string decode_lines(const tk::Tokenizer& tok, const std::vector<std::string_view>& lines,
                         const std::string& source, bool skip_special) {
  std::string out;
  tk::DecodeOptions options;
  options.skip_special = skip_special;
  std::vector<int32_t> ids;
  for (size_t i = 0; i < lines.size(); ++i) {
    ids.clear();
    const std::string_view line = lines[i];
    size_t at = 0;
    while (at < line.size()) {
      if (line[at] == ' ' || line[at] == '\t' || line[at] == '\r') {
        ++at;
        continue;
      }
      size_t end = at;
      while (end < line.size() && line[end] != ' ' && line[end] != '\t' && line[end] != '\r') ++end;
      const std::string_view item = line.substr(at, end - at);
      int64_t v = 0;
      bool ok = item.size() <= 10;
      for (char c : item) {
        if (c < '0' || c > '9') ok = false;
        if (ok) v = v * 10 + (c - '0');
      }
      if (!ok) raise(ErrorCode::invalid_argument, "{}:{}: '{}' is not a token id", source, i + 1, item);
      if (v >= tok.vocab_size()) {
        raise(ErrorCode::invalid_argument, "{}:{}: token id {} is out of range (vocabulary of {})", source, i + 1, v,
              tok.vocab_size());
      }
      ids.push_back(static_cast<int32_t>(v));
      at = end;
    }
    try {
      out += tok.decode(ids, options);
    } catch (const Error& e) {
      raise(e.code(), "{}:{}: {}", source, i + 1, e.what());
    }
    out += '\n';
  }
  return out;
}

}  // namespace

Command add_tokenize(CLI::App& app) {
  struct Opts {
    std::string tokenizer, text_file;
    bool decode = false, special = false, skip_special = false;
  };
  auto o = std::make_shared<Opts>();
  auto* cmd = app.add_subcommand("tokenize", "encode lines of text to token ids, or decode lines of ids (--decode)");
  cmd->add_option("--tokenizer", o->tokenizer,
                  "tokenizer.json or a directory holding one (default: shipped DeepSeek-V4)");
  cmd->add_option("--text-file", o->text_file, "input file (default: standard input)");
  cmd->add_flag("--decode", o->decode, "read lines of token ids and print their text");
  cmd->add_flag("--special", o->special, "encode: added tokens written in the text (<｜User｜>) become their ids");
  cmd->add_flag("--skip-special", o->skip_special, "decode: drop special tokens (BOS, EOS, ...)");
  return [o] {
    const std::string path = o->tokenizer.empty() ? tk::default_tokenizer_dir() : o->tokenizer;
    const std::string input = read_input(o->text_file);
    const std::string source = o->text_file.empty() ? "<stdin>" : o->text_file;
    const auto lines = split_lines(input);
    auto tok = tk::Tokenizer::load(path);
    const std::string out =
        o->decode ? decode_lines(*tok, lines, source, o->skip_special) : encode_lines(*tok, lines, source, o->special);
    if (std::fwrite(out.data(), 1, out.size(), stdout) != out.size() || std::fflush(stdout) != 0) {
      raise(ErrorCode::unavailable, "could not write the output");
    }
    return 0;
  };
}

}  // namespace troupe::app
