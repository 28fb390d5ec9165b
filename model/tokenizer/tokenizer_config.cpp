#include "model/tokenizer/tokenizer_config.hpp"

#include <nlohmann/json.hpp>

#include "base/error.hpp"
#include "base/mapped_file.hpp"

namespace troupe::tokenizer {
namespace {

using json = nlohmann::json;

// A token field is either a string or an AddedToken object with "content".
std::string token_string(const json& j, const char* key, const std::string& path) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && it->at("content").is_string()) {
    return it->at("content").get<std::string>();
  }
  raise(ErrorCode::invalid_file, "{}: '{}' must be a string or an object with a 'content' string", path, key);
}

bool boolean(const json& j, const char* key, bool fallback, const std::string& path) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) raise(ErrorCode::invalid_file, "{}: '{}' must be true or false", path, key);
  return it->get<bool>();
}

}  // namespace

TokenizerConfig TokenizerConfig::from_file(const std::string& path) {
  const std::string text = read_text_file(path);
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) raise(ErrorCode::invalid_file, "{}: not a JSON object", path);
  TokenizerConfig c;
  c.bos_token = token_string(j, "bos_token", path);
  c.eos_token = token_string(j, "eos_token", path);
  c.add_bos_token = boolean(j, "add_bos_token", false, path);
  c.add_eos_token = boolean(j, "add_eos_token", false, path);
  if (auto it = j.find("chat_template"); it != j.end() && !it->is_null()) {
    if (it->is_string()) {
      c.chat_template = it->get<std::string>();
    } else if (it->is_array()) {  // named templates: transformers uses "default"
      for (const auto& t : *it) {
        if (t.value("name", "") == "default" && t.contains("template"))
          c.chat_template = t.at("template").get<std::string>();
      }
    } else {
      raise(ErrorCode::invalid_file, "{}: 'chat_template' must be a string or a list of named templates", path);
    }
  }
  return c;
}

}  // namespace troupe::tokenizer
