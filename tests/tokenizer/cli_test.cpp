// The `troupe tokenize` contract, run on the built binary.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>

#include "tests/support/process.hpp"
#include "tests/tokenizer/support.hpp"

namespace troupe::tokenizer {
namespace {

using namespace testing;

struct Outcome {
  int status = -1;
  std::string out, err;
};

// Per process (ctest runs the cases of this file in parallel processes), in a temporary folder removed at
// its exit.
std::string temp(const std::string& name) {
  static const troupe::testing::TempDir dir;
  return dir.path() + "/" + name;
}

void write(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

// Runs `troupe <args>` through the shell; stdin from `input` when given.
Outcome troupe(const std::string& args, const std::string* input = nullptr) {
  const std::string out = temp("stdout"), err = temp("stderr"), in = temp("stdin");
  std::string cmd = std::string(TROUPE_BINARY_DIR) + "/bin/troupe " + args + " >" + out + " 2>" + err;
  if (input) {
    write(in, *input);
    cmd += " <" + in;
  } else {
    cmd += " </dev/null";
  }
  Outcome r;
  const int raw = std::system(cmd.c_str());
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128;
  r.out = read_file(out);
  r.err = read_file(err);
  return r;
}

std::string tok_arg() { return "--tokenizer " + shipped_dir(); }

void expect_one_line_error(const Outcome& r, const std::string& needle) {
  EXPECT_NE(r.status, 0);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err.rfind("troupe: error: ", 0), 0u) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
}

TEST(TokenizerCli, encodes_the_corpus_to_hugging_face_ids) {
  const Outcome r = troupe("tokenize " + tok_arg() + " --text-file " + fixture_path("corpus.txt"));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, read_file(fixture_path("corpus.ids")));
}

TEST(TokenizerCli, accepts_the_tokenizer_json_file_itself) {
  write(temp("two.txt"), "Hello world\n你好\n");
  const Outcome r = troupe("tokenize --tokenizer " + shipped_dir() + "/tokenizer.json --text-file " + temp("two.txt"));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "19923 2058\n30594\n");
}

TEST(TokenizerCli, one_output_line_per_input_line_and_empty_stays_empty) {
  write(temp("blank.txt"), "a\n\n\nb\n");
  Outcome r = troupe("tokenize " + tok_arg() + " --text-file " + temp("blank.txt"));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "67\n\n\n68\n");
  write(temp("noeol.txt"), "a\nb");  // no final newline: still two lines
  r = troupe("tokenize " + tok_arg() + " --text-file " + temp("noeol.txt"));
  EXPECT_EQ(r.out, "67\n68\n");
  write(temp("newline.txt"), "\n");
  r = troupe("tokenize " + tok_arg() + " --text-file " + temp("newline.txt"));
  EXPECT_EQ(r.out, "\n");
  write(temp("empty.txt"), "");
  r = troupe("tokenize " + tok_arg() + " --text-file " + temp("empty.txt"));
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(r.out, "");
}

TEST(TokenizerCli, special_tokens_are_text_unless_asked) {
  write(temp("special.txt"), "<｜User｜>\n");
  Outcome r = troupe("tokenize " + tok_arg() + " --text-file " + temp("special.txt"));
  ASSERT_EQ(r.status, 0);
  EXPECT_NE(r.out, "128803\n");
  r = troupe("tokenize --special " + tok_arg() + " --text-file " + temp("special.txt"));
  EXPECT_EQ(r.out, "128803\n");
}

TEST(TokenizerCli, decode_round_trips_the_corpus_from_a_file_and_from_stdin) {
  Outcome r = troupe("tokenize --decode " + tok_arg() + " --text-file " + fixture_path("corpus.ids"));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, read_file(fixture_path("corpus.txt")));
  const std::string ids = "19923 2058\n\n0 30594 1\n";
  r = troupe("tokenize --decode " + tok_arg(), &ids);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "Hello world\n\n<｜begin▁of▁sentence｜>你好<｜end▁of▁sentence｜>\n");
  r = troupe("tokenize --decode --skip-special " + tok_arg(), &ids);
  EXPECT_EQ(r.out, "Hello world\n\n你好\n");
}

TEST(TokenizerCli, reads_text_from_stdin_and_uses_the_shipped_tokenizer_by_default) {
  const std::string text = "Hello world\n";
  const Outcome r = troupe("tokenize", &text);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "19923 2058\n");
}

TEST(TokenizerCli, bad_input_gets_a_one_line_error_and_a_failing_exit) {
  expect_one_line_error(troupe("tokenize " + tok_arg() + " --text-file /nonexistent/input.txt"),
                        "/nonexistent/input.txt");
  write(temp("ok.txt"), "fine\n");
  expect_one_line_error(troupe("tokenize --tokenizer /nonexistent/dir --text-file " + temp("ok.txt")),
                        "/nonexistent/dir");
  expect_one_line_error(troupe("tokenize --tokenizer " + temp("ok.txt") + " --text-file " + temp("ok.txt")),
                        "tokenizer.json");
  write(temp("bad_utf8.txt"), "good line\nbad \xFF line\n");
  expect_one_line_error(troupe("tokenize " + tok_arg() + " --text-file " + temp("bad_utf8.txt")),
                        ":2: not valid UTF-8");
  write(temp("bad_ids.txt"), "1 2 3\n12 abc\n");
  expect_one_line_error(troupe("tokenize --decode " + tok_arg() + " --text-file " + temp("bad_ids.txt")),
                        ":2: 'abc' is not a token id");
  write(temp("big_ids.txt"), "999999\n");
  expect_one_line_error(troupe("tokenize --decode " + tok_arg() + " --text-file " + temp("big_ids.txt")),
                        "out of range");
  write(temp("neg_ids.txt"), "-5\n");
  expect_one_line_error(troupe("tokenize --decode " + tok_arg() + " --text-file " + temp("neg_ids.txt")),
                        "is not a token id");
}

}  // namespace
}  // namespace troupe::tokenizer
