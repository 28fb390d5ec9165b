#include "model/tokenizer/openai_messages.hpp"

#include <nlohmann/json.hpp>

#include "base/error.hpp"

namespace troupe::tokenizer {
namespace {

using json = nlohmann::json;

const json* field(const json& j, const char* key) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

std::string string_field(const json& j, const char* key, const std::string& where, bool required) {
  const json* v = field(j, key);
  if (!v) {
    if (required) raise(ErrorCode::invalid_argument, "{}.{} is missing", where, key);
    return "";
  }
  if (!v->is_string()) raise(ErrorCode::invalid_argument, "{}.{} must be a string", where, key);
  return v->get<std::string>();
}

std::optional<std::string> content_of(const json& m, const std::string& where) {
  const json* c = field(m, "content");
  if (!c) return std::nullopt;
  if (c->is_string()) return c->get<std::string>();
  if (!c->is_array()) raise(ErrorCode::invalid_argument, "{}.content must be a string, null or a list of parts", where);
  std::string text;
  for (size_t k = 0; k < c->size(); ++k) {
    const json& part = (*c)[k];
    const std::string at = fmt::format("{}.content[{}]", where, k);
    if (!part.is_object()) raise(ErrorCode::invalid_argument, "{} must be an object", at);
    const std::string type = string_field(part, "type", at, true);
    if (type != "text") raise(ErrorCode::unsupported, "{} has type '{}'; only text parts are supported", at, type);
    if (k > 0) text += "\n";
    text += string_field(part, "text", at, true);
  }
  return text;
}

}  // namespace

std::vector<Message> messages_from_json(const json& messages) {
  if (!messages.is_array()) raise(ErrorCode::invalid_argument, "messages must be a list");
  std::vector<Message> out;
  out.reserve(messages.size());
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    const std::string where = fmt::format("messages[{}]", i);
    if (!m.is_object()) raise(ErrorCode::invalid_argument, "{} must be an object", where);
    Message msg;
    msg.role = string_field(m, "role", where, true);
    if (msg.role == "developer") msg.role = "system";
    msg.content = content_of(m, where);
    msg.tool_call_id = string_field(m, "tool_call_id", where, false);
    if (const json* calls = field(m, "tool_calls")) {
      if (!calls->is_array()) raise(ErrorCode::invalid_argument, "{}.tool_calls must be a list", where);
      for (size_t k = 0; k < calls->size(); ++k) {
        const json& c = (*calls)[k];
        const std::string at = fmt::format("{}.tool_calls[{}]", where, k);
        if (!c.is_object()) raise(ErrorCode::invalid_argument, "{} must be an object", at);
        ToolCall call;
        call.id = string_field(c, "id", at, false);
        if (field(c, "type")) call.type = string_field(c, "type", at, true);
        const json* fn = field(c, "function");
        if (!fn || !fn->is_object()) raise(ErrorCode::invalid_argument, "{}.function must be an object", at);
        call.name = string_field(*fn, "name", at + ".function", true);
        call.arguments = string_field(*fn, "arguments", at + ".function", true);
        msg.tool_calls.push_back(std::move(call));
      }
    }
    if (msg.role == "assistant" && !msg.tool_calls.empty() && msg.content && msg.content->empty()) {
      msg.content.reset();
    }
    out.push_back(std::move(msg));
  }
  return out;
}

}  // namespace troupe::tokenizer
