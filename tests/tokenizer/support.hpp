// Shared by the tokenizer tests: the shipped tokenizer (loaded once) and the
// fixtures that tools/make_tokenizer_fixtures.py wrote from Hugging Face.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/tokenizer/tokenizer.hpp"

namespace troupe::tokenizer::testing {

const Tokenizer& deepseek();
std::string shipped_dir();
std::string fixture_path(const std::string& name);
std::string read_file(const std::string& path);
// Lines split on '\n' (a final '\n' ends the last line).
std::vector<std::string> read_lines(const std::string& path);
std::vector<nlohmann::json> read_jsonl(const std::string& name);
std::vector<int32_t> parse_ids(const std::string& line);
std::string hex(std::string_view bytes);  // for readable failure messages

}  // namespace troupe::tokenizer::testing
