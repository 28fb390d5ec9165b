#include "actors/gateway/responses.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <iterator>

namespace troupe::gateway {

using json = nlohmann::json;

namespace {

// o[key] where it is a string (o an object), else `otherwise`.
std::string string_at(const json& o, const char* key, const std::string& otherwise = "") {
  return o.is_object() && o.contains(key) && o[key].is_string() ? o[key].get<std::string>() : otherwise;
}

// The text of a message's content: a string, or a list of text parts.
std::variant<std::string, ApiError> content_text(const json& content, const std::string& at) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) return bad_request(at, "'" + at + "' must be a string or a list of content parts");
  std::string text;
  for (size_t i = 0; i < content.size(); ++i) {
    const json& part = content[i];
    const std::string where = fmt::format("{}[{}]", at, i);
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string()) {
      return bad_request(at, "'" + where + "' must be a content part with a 'type'");
    }
    const std::string type = part["type"];
    if (type == "refusal") continue;
    if (type != "input_text" && type != "output_text" && type != "text") {
      return bad_request(at, "'" + where + "' has type '" + type + "'; only text parts are supported");
    }
    if (!part.contains("text") || !part["text"].is_string()) return bad_request(at, "'" + where + ".text' must be a string");
    text += part["text"].get<std::string>();
  }
  return text;
}

// A response's input items as chat messages.
std::variant<json, ApiError> messages_of(const json& input) {
  json messages = json::array();
  if (input.is_string()) {
    messages.push_back({{"role", "user"}, {"content", input}});
    return messages;
  }
  if (!input.is_array() || input.empty()) return bad_request("input", "'input' must be a string or a non-empty list of items");
  for (size_t i = 0; i < input.size(); ++i) {
    const json& item = input[i];
    const std::string at = fmt::format("input[{}]", i);
    if (!item.is_object()) return bad_request("input", "'" + at + "' must be an object");
    const std::string type = item.contains("type") && item["type"].is_string() ? item["type"].get<std::string>() : "message";
    if (type == "message") {
      if (!item.contains("role") || !item["role"].is_string()) return bad_request("input", "'" + at + ".role' must be a string");
      const std::string role = item["role"];
      if (role != "user" && role != "assistant" && role != "system" && role != "developer") {
        return bad_request("input", "'" + at + ".role' is '" + role + "'; it must be user, assistant, system or developer");
      }
      if (!item.contains("content")) return bad_request("input", "'" + at + ".content' is required");
      auto text = content_text(item["content"], at + ".content");
      if (auto* e = std::get_if<ApiError>(&text)) {
        e->param = "input";
        return *e;
      }
      messages.push_back({{"role", role}, {"content", std::get<std::string>(text)}});
    } else if (type == "function_call") {
      for (const char* k : {"call_id", "name", "arguments"}) {
        if (!item.contains(k) || !item[k].is_string()) return bad_request("input", fmt::format("'{}.{}' must be a string", at, k));
      }
      json call = {{"id", item["call_id"]}, {"type", "function"},
                   {"function", {{"name", item["name"]}, {"arguments", item["arguments"]}}}};
      // Calls of one turn go on the assistant message before them (its text, or its other calls).
      if (messages.empty() || messages.back()["role"] != "assistant") {
        messages.push_back({{"role", "assistant"}, {"content", ""}, {"tool_calls", json::array()}});
      }
      if (!messages.back().contains("tool_calls")) messages.back()["tool_calls"] = json::array();
      messages.back()["tool_calls"].push_back(std::move(call));
    } else if (type == "function_call_output") {
      if (!item.contains("call_id") || !item["call_id"].is_string()) return bad_request("input", "'" + at + ".call_id' must be a string");
      if (!item.contains("output")) return bad_request("input", "'" + at + ".output' is required");
      auto text = content_text(item["output"], at + ".output");
      if (auto* e = std::get_if<ApiError>(&text)) {
        e->param = "input";
        return *e;
      }
      messages.push_back({{"role", "tool"}, {"tool_call_id", item["call_id"]}, {"content", std::get<std::string>(text)}});
    } else if (type == "reasoning") {
      continue;  // a reasoning model's summary of an earlier turn: not part of the prompt
    } else if (type == "item_reference") {
      return bad_request("input", "'" + at + "' refers to a stored item; this server stores none: send the item itself");
    } else {
      return bad_request("input", "'" + at + "' has type '" + type + "'; the items read are message, function_call, "
                          "function_call_output and reasoning");
    }
  }
  if (messages.empty()) return bad_request("input", "'input' has no message");
  return messages;
}

// The chat's name of a parameter -> the Responses API's.
std::string response_param(const std::string& p) {
  if (p == "max_tokens") return "max_output_tokens";
  if (p == "response_format") return "text.format";
  if (p == "messages") return "input";
  return p;
}

std::string message_id(const ApiResult& r) { return "msg_" + id_number(r.id); }
std::string call_item_id(const ApiResult& r, size_t index) { return fmt::format("fc_{}_{}", id_number(r.id), index); }

// A message's output_text part.
json text_part(const std::string& text, json logprobs) {
  return {{"type", "output_text"}, {"text", text}, {"annotations", json::array()}, {"logprobs", std::move(logprobs)}};
}

// The message item: begun (no content yet), or done (its text, r.text, and logprobs).
json message_item(const ApiResult& r, bool done) {
  json content = json::array();
  if (done) content.push_back(text_part(r.text, logprob_entries_json(r.logprobs)));
  // (a message cut at max_output_tokens is incomplete, as its response is)
  const char* status = !done ? "in_progress" : r.finish_reason == "length" ? "incomplete" : "completed";
  return {{"type", "message"}, {"id", message_id(r)}, {"status", status}, {"role", "assistant"}, {"content", std::move(content)}};
}

json call_item(const ApiResult& r, size_t index, const std::string& name, const std::string& arguments, bool done) {
  return {{"type", "function_call"}, {"id", call_item_id(r, index)},
          {"call_id", tool_call_id(r, index)}, {"name", name}, {"arguments", arguments},
          {"status", done ? "completed" : "in_progress"}};
}

}  // namespace

std::variant<json, ApiError> chat_body_of_response(const json& j) {
  // What a stored response or a hosted tool would need.
  for (const char* k : {"previous_response_id", "conversation", "prompt"}) {
    if (j.contains(k) && !j[k].is_null()) {
      return bad_request(k, fmt::format("'{}' needs a stored response or prompt; this server stores none: send the whole "
                                "conversation in 'input'", k));
    }
  }
  if (j.contains("background") && j["background"] == true) return bad_request("background", "background responses are not supported");
  // Chat completions' own names, which the Responses API spells otherwise.
  static const std::pair<const char*, const char*> kChatNames[] = {
      {"messages", "input"}, {"max_tokens", "max_output_tokens"}, {"max_completion_tokens", "max_output_tokens"},
      {"response_format", "text.format"}, {"n", ""}, {"logprobs", "top_logprobs"}, {"functions", "tools"}};
  for (const auto& [chat, ours] : kChatNames) {
    if (!j.contains(chat)) continue;
    return bad_request(chat, *ours ? fmt::format("'{}' is a chat completions parameter; the Responses API takes '{}'", chat, ours)
                           : fmt::format("'{}' is a chat completions parameter, not the Responses API's", chat));
  }
  // Logprobs: asked with include's "message.output_text.logprobs" (alternatives: top_logprobs).
  bool logprobs = false;
  if (j.contains("include") && !j["include"].is_null()) {
    if (!j["include"].is_array()) return bad_request("include", "'include' must be a list of strings");
    for (const auto& x : j["include"]) {
      if (!x.is_string()) return bad_request("include", "'include' must be a list of strings");
      logprobs = logprobs || x == "message.output_text.logprobs";
    }
  }
  if (!j.contains("input")) return bad_request("input", "'input' is required");
  auto messages = messages_of(j["input"]);
  if (auto* e = std::get_if<ApiError>(&messages)) return *e;
  json chat = json::object();
  // Everything else passes on as the chat reads it (sampling, vLLM's extensions, ...).
  static const char* const kOwn[] = {"input", "instructions", "max_output_tokens", "tools", "tool_choice", "text",
                                     "store", "metadata", "reasoning", "truncation", "include", "background",
                                     "previous_response_id", "conversation", "prompt", "top_logprobs",
                                     "max_tool_calls", "service_tier", "user", "stream_options", "prompt_cache_key",
                                     "safety_identifier"};
  for (const auto& [k, v] : j.items()) {
    if (std::find(std::begin(kOwn), std::end(kOwn), k) == std::end(kOwn)) chat[k] = v;
  }
  json& msgs = std::get<json>(messages);
  if (j.contains("instructions") && !j["instructions"].is_null()) {
    if (!j["instructions"].is_string()) return bad_request("instructions", "'instructions' must be a string");
    msgs.insert(msgs.begin(), json{{"role", "system"}, {"content", j["instructions"]}});
  }
  chat["messages"] = std::move(msgs);
  if (j.contains("max_output_tokens") && !j["max_output_tokens"].is_null()) chat["max_tokens"] = j["max_output_tokens"];
  if (j.contains("top_logprobs") && !j["top_logprobs"].is_null()) {
    chat["top_logprobs"] = j["top_logprobs"];  // (the chat checks it: 0 to 20)
    logprobs = logprobs || !(j["top_logprobs"].is_number_integer() && j["top_logprobs"] == 0);
  }
  if (logprobs) {
    chat["logprobs"] = true;
    if (!chat.contains("top_logprobs")) chat["top_logprobs"] = 0;
  }
  if (j.contains("tools") && !j["tools"].is_null()) {
    if (!j["tools"].is_array()) return bad_request("tools", "'tools' must be a list");
    json tools = json::array();
    for (size_t i = 0; i < j["tools"].size(); ++i) {
      const json& t = j["tools"][i];
      if (string_at(t, "type") != "function") {
        return bad_request("tools", fmt::format("'tools[{}]' is not a function tool; hosted tools (web search, files, "
                                        "computer use) are not supported", i));
      }
      json fn = json::object();
      for (const char* k : {"name", "description", "parameters", "strict"}) {
        if (t.contains(k) && !t[k].is_null()) fn[k] = t[k];
      }
      tools.push_back({{"type", "function"}, {"function", std::move(fn)}});
    }
    chat["tools"] = std::move(tools);
  }
  if (j.contains("tool_choice") && !j["tool_choice"].is_null()) {
    const json& c = j["tool_choice"];
    if (string_at(c, "type") == "function" && c.contains("name")) {
      chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", c["name"]}}}};
    } else {
      chat["tool_choice"] = c;  // "auto", "none", "required"; the chat refuses the rest by name
    }
  }
  if (j.contains("text") && !j["text"].is_null()) {
    const json& t = j["text"];
    if (!t.is_object()) return bad_request("text", "'text' must be an object");
    if (t.contains("format") && !t["format"].is_null()) {
      const json& f = t["format"];
      if (!f.is_object() || !f.contains("type") || !f["type"].is_string()) {
        return bad_request("text.format", "'text.format' must be an object with a 'type'");
      }
      const std::string type = f["type"];
      if (type == "json_object") {
        chat["response_format"] = {{"type", "json_object"}};
      } else if (type == "json_schema") {
        if (!f.contains("schema")) return bad_request("text.format", "'text.format.schema' is required");
        json js = {{"name", string_at(f, "name", "response")}, {"schema", f["schema"]}};
        if (f.contains("strict")) js["strict"] = f["strict"];
        chat["response_format"] = {{"type", "json_schema"}, {"json_schema", std::move(js)}};
      } else if (type != "text") {
        return bad_request("text.format", "'text.format.type' is '" + type + "'; it must be text, json_object or json_schema");
      }
    }
  }
  return chat;
}

std::variant<ApiRequest, ApiError> parse_response_request(const std::string& body) {
  auto object = parse_object(body);
  if (auto* e = std::get_if<ApiError>(&object)) return *e;
  const json& j = std::get<json>(object);
  auto chat = chat_body_of_response(j);
  if (auto* e = std::get_if<ApiError>(&chat)) return *e;
  auto parsed = parse_request(std::get<json>(chat), ApiKind::chat);
  if (auto* e = std::get_if<ApiError>(&parsed)) {
    e->param = response_param(e->param);
    return *e;
  }
  ApiRequest r = std::move(std::get<ApiRequest>(parsed));
  r.kind = ApiKind::responses;
  // What a response object repeats of its request.
  json echo = json::object();
  echo["instructions"] = j.contains("instructions") ? j["instructions"] : json(nullptr);
  echo["max_output_tokens"] = j.contains("max_output_tokens") ? j["max_output_tokens"] : json(nullptr);
  echo["metadata"] = j.contains("metadata") && j["metadata"].is_object() ? j["metadata"] : json::object();
  echo["parallel_tool_calls"] = r.parallel_tool_calls;
  echo["temperature"] = r.sampling.temperature;
  echo["top_p"] = r.sampling.top_p;
  echo["tool_choice"] = j.contains("tool_choice") && !j["tool_choice"].is_null() ? j["tool_choice"] : json("auto");
  echo["tools"] = j.contains("tools") && j["tools"].is_array() ? j["tools"] : json::array();
  echo["text"] = j.contains("text") && j["text"].is_object() && j["text"].contains("format")
                     ? json{{"format", j["text"]["format"]}}
                     : json{{"format", {{"type", "text"}}}};
  echo["reasoning"] = {{"effort", nullptr}, {"summary", nullptr}};
  echo["user"] = j.contains("user") ? j["user"] : json(nullptr);
  r.response_echo = std::move(echo);
  return r;
}

json response_object(const ApiRequest& req, const ApiResult& r, bool finished) {
  json output = json::array();
  if (finished) {
    if (!r.text.empty() || r.tool_calls.empty()) output.push_back(message_item(r, true));
    for (size_t i = 0; i < r.tool_calls.size(); ++i) {
      output.push_back(call_item(r, i, r.tool_calls[i].name, r.tool_calls[i].arguments, true));
    }
  }
  std::string status = "in_progress";
  json incomplete = nullptr;
  if (finished) {
    status = r.finish_reason == "length" ? "incomplete" : r.finish_reason == "abort" ? "cancelled" : "completed";
    if (r.finish_reason == "length") incomplete = {{"reason", "max_output_tokens"}};
  }
  json j = {{"id", r.id},
            {"object", "response"},
            {"created_at", r.created},
            {"status", status},
            {"error", nullptr},
            {"incomplete_details", incomplete},
            {"model", r.model},
            {"output", std::move(output)},
            {"previous_response_id", nullptr},
            {"store", false},
            {"truncation", "disabled"}};
  for (const auto& [k, v] : req.response_echo.items()) j[k] = v;
  if (finished) {
    const auto p = static_cast<int64_t>(r.prompt_ids.size()), c = static_cast<int64_t>(r.token_ids.size());
    j["usage"] = {{"input_tokens", p},
                  {"input_tokens_details", {{"cached_tokens", r.cached_tokens}}},
                  {"output_tokens", c},
                  {"output_tokens_details", {{"reasoning_tokens", 0}}},
                  {"total_tokens", p + c}};
  } else {
    j["usage"] = nullptr;
  }
  return j;
}

std::string response_body_of(const ApiRequest& req, const ApiResult& r) { return dump_json(response_object(req, r, true)); }

std::string ResponseStream::event(json j) {
  j["sequence_number"] = sequence_++;
  return "event: " + j["type"].get<std::string>() + "\ndata: " + dump_json(j) + "\n\n";
}

std::string ResponseStream::start(const ApiRequest& req, const ApiResult& r) {
  const json head = response_object(req, r, false);
  std::string out = event({{"type", "response.created"}, {"response", head}});
  out += event({{"type", "response.in_progress"}, {"response", head}});
  return out;
}

std::string ResponseStream::text(const ApiResult& r, const std::string& delta, const std::vector<LogprobEntry>& logprobs) {
  if (delta.empty()) return "";
  std::string out;
  if (message_index_ < 0) {
    message_index_ = next_index_++;
    out += event({{"type", "response.output_item.added"}, {"output_index", message_index_}, {"item", message_item(r, false)}});
    out += event({{"type", "response.content_part.added"},
                  {"item_id", message_id(r)},
                  {"output_index", message_index_},
                  {"content_index", 0},
                  {"part", text_part("", json::array())}});
  }
  out += event({{"type", "response.output_text.delta"},
                {"item_id", message_id(r)},
                {"output_index", message_index_},
                {"content_index", 0},
                {"delta", delta},
                {"logprobs", logprob_entries_json(logprobs)}});
  return out;
}

std::string ResponseStream::tool_calls(const ApiResult& r, const std::vector<ToolCallDelta>& deltas) {
  std::string out;
  for (const auto& d : deltas) {
    if (d.opens || !call_index_.contains(d.index)) {
      call_index_[d.index] = next_index_++;
      out += event({{"type", "response.output_item.added"},
                    {"output_index", call_index_[d.index]},
                    {"item", call_item(r, d.index, d.name, "", false)}});
    }
    if (d.arguments.empty()) continue;
    out += event({{"type", "response.function_call_arguments.delta"},
                  {"item_id", call_item_id(r, d.index)},
                  {"output_index", call_index_[d.index]},
                  {"delta", d.arguments}});
  }
  return out;
}

std::string ResponseStream::finish(const ApiRequest& req, const ApiResult& r) {
  std::string out;
  std::map<int, json> done;  // the finished items by output index: the final response lists them so
  if (message_index_ >= 0) {  // (r.text is what the deltas added up to)
    const json logprobs = logprob_entries_json(r.logprobs);
    out += event({{"type", "response.output_text.done"},
                  {"item_id", message_id(r)},
                  {"output_index", message_index_},
                  {"content_index", 0},
                  {"text", r.text},
                  {"logprobs", logprobs}});
    out += event({{"type", "response.content_part.done"},
                  {"item_id", message_id(r)},
                  {"output_index", message_index_},
                  {"content_index", 0},
                  {"part", text_part(r.text, logprobs)}});
    done[message_index_] = message_item(r, true);
    out += event({{"type", "response.output_item.done"}, {"output_index", message_index_}, {"item", done[message_index_]}});
  }
  for (size_t i = 0; i < r.tool_calls.size(); ++i) {
    const auto& c = r.tool_calls[i];
    if (!call_index_.contains(i)) call_index_[i] = next_index_++;  // (every call streams its opening; a guard)
    const int at = call_index_[i];
    out += event({{"type", "response.function_call_arguments.done"},
                  {"item_id", call_item_id(r, i)},
                  {"output_index", at},
                  {"arguments", c.arguments}});
    done[at] = call_item(r, i, c.name, c.arguments, true);
    out += event({{"type", "response.output_item.done"}, {"output_index", at}, {"item", done[at]}});
  }
  json full = response_object(req, r, true);
  full["output"] = json::array();
  for (auto& [at, item] : done) full["output"].push_back(std::move(item));
  const std::string type = full["status"] == "completed" ? "response.completed"
                           : full["status"] == "incomplete" ? "response.incomplete"
                                                            : "response.failed";
  out += event({{"type", type}, {"response", std::move(full)}});
  return out;
}

std::string ResponseStream::error(const ApiError& e) {
  return event({{"type", "error"},
                {"code", e.code.empty() ? json(e.type) : json(e.code)},
                {"message", e.message},
                {"param", e.param.empty() ? json(nullptr) : json(e.param)}});
}

}  // namespace troupe::gateway
