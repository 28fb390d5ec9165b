#include "actors/gateway/openai.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>

#include "base/json_depth.hpp"
#include "engine/json_schema.hpp"
#include "engine/request.hpp"

namespace troupe::gateway {
namespace {

using json = nlohmann::json;

// Reads optional typed fields, recording the first error.
class Fields {
 public:
  explicit Fields(const json& j) : j_(j) {}
  std::optional<ApiError> error;

  bool has(const char* k) const { return j_.contains(k) && !j_.at(k).is_null(); }

  template <class F>
  void number(const char* k, F&& set, double lo, double hi) {
    if (error || !has(k)) return;
    const auto& v = j_.at(k);
    if (!v.is_number() || v.is_boolean()) {
      error = bad_request(k, std::string("'") + k + "' must be a number");
      return;
    }
    const double d = v.get<double>();
    if (!(d >= lo && d <= hi)) {
      error = bad_request(k, fmt::format("'{}' must be between {} and {}, got {}", k, lo, hi, d));
      return;
    }
    set(d);
  }
  template <class F>
  void integer(const char* k, F&& set, int64_t lo, int64_t hi) {
    if (error || !has(k)) return;
    const auto& v = j_.at(k);
    // A whole number written as a float (256.0, as some clients serialize) is taken, as vLLM does.
    const bool whole_float = v.is_number_float() && std::isfinite(v.get<double>()) &&
                             v.get<double>() == std::floor(v.get<double>());
    if (!v.is_number_integer() && !whole_float) {
      error = bad_request(k, std::string("'") + k + "' must be an integer");
      return;
    }
    // Out of int64's range (an unsigned past 2^63 - 1, or a float past it) would wrap: refused as out of range.
    const bool fits = v.is_number_unsigned() ? v.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX)
                      : whole_float ? std::fabs(v.get<double>()) < 9.2e18
                                    : true;
    const auto d = fits ? (whole_float ? static_cast<int64_t>(v.get<double>()) : v.get<int64_t>()) : int64_t{0};
    if (!fits || d < lo || d > hi) {
      error = bad_request(k, fmt::format("'{}' must be an integer between {} and {}, got {}", k, lo, hi, v.dump()));
      return;
    }
    set(d);
  }
  void boolean(const char* k, bool& out) {
    if (error || !has(k)) return;
    if (!j_.at(k).is_boolean()) {
      error = bad_request(k, std::string("'") + k + "' must be true or false");
      return;
    }
    out = j_.at(k).get<bool>();
  }
  void token_ids(const char* k, std::vector<int32_t>& out) {
    if (error || !has(k)) return;
    const auto& v = j_.at(k);
    if (!v.is_array()) {
      error = bad_request(k, std::string("'") + k + "' must be a list of token ids");
      return;
    }
    for (const auto& e : v) {
      if (!e.is_number_integer() || e.get<int64_t>() < 0 || e.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
        error = bad_request(k, std::string("'") + k + "' must hold non-negative integer token ids");
        return;
      }
      out.push_back(static_cast<int32_t>(e.get<int64_t>()));
    }
  }

 private:
  const json& j_;
};

std::string escape_for_error(const std::string& s) { return s.size() > 200 ? s.substr(0, 200) + "..." : s; }

}  // namespace

std::string dump_json(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string error_body(const ApiError& e) {
  json j = {{"error",
             {{"message", e.message},
              {"type", e.type},
              {"param", e.param.empty() ? json(nullptr) : json(e.param)},
              {"code", e.code.empty() ? json(nullptr) : json(e.code)}}}};
  return dump_json(j);  // the message may quote the request's bytes
}

ApiError to_api_error(const Error& e) {
  switch (e.code()) {
    case ErrorCode::invalid_argument: return {400, e.what(), "invalid_request_error", "", ""};
    case ErrorCode::not_found: return {404, e.what(), "invalid_request_error", "", "model_not_found"};
    case ErrorCode::resource_exhausted: return {429, e.what(), "rate_limit_error", "", ""};
    case ErrorCode::unavailable: return {503, e.what(), "service_unavailable", "", ""};
    case ErrorCode::deadline_exceeded: return {504, e.what(), "timeout", "", ""};
    case ErrorCode::cancelled: return {499, e.what(), "cancelled", "", ""};
    default: return {500, e.what(), "internal_error", "", ""};
  }
}

ApiError bad_request(const std::string& param, const std::string& message) {
  return ApiError{400, message, "invalid_request_error", param, ""};
}

ApiError to_request_error(const Error& e, std::string param) {
  ApiError ae = to_api_error(e);
  if (ae.status >= 500) {
    ae.status = 400;
    ae.type = "invalid_request_error";
  }
  if (ae.status == 400 && ae.param.empty()) ae.param = std::move(param);
  return ae;
}

// "tools", "tool_choice" and "parallel_tool_calls" of a chat request. The legacy
// "functions" / "function_call" are refused (their answers have another shape).
std::optional<ApiError> parse_tools(const json& j, ApiRequest& r) {
  for (const char* k : {"functions", "function_call"}) {
    if (j.contains(k) && !j[k].is_null()) {
      return bad_request(k, fmt::format("'{}' (the legacy function calling) is not supported; use 'tools' and 'tool_choice'", k));
    }
  }
  if (j.contains("tools") && !j["tools"].is_null()) {
    const auto& tools = j["tools"];
    if (!tools.is_array()) return bad_request("tools", "'tools' must be a list of tools");
    for (size_t i = 0; i < tools.size(); ++i) {
      const auto& t = tools[i];
      const std::string where = fmt::format("tools[{}]", i);
      if (!t.is_object() || !t.contains("type") || t["type"] != "function") {
        return bad_request("tools", where + " must be an object with \"type\": \"function\" (the only kind served)");
      }
      if (!t.contains("function") || !t["function"].is_object()) return bad_request("tools", where + ".function must be an object");
      const auto& fn = t["function"];
      if (!fn.contains("name") || !fn["name"].is_string() || fn["name"].get<std::string>().empty()) {
        return bad_request("tools", where + ".function.name must be a non-empty string");
      }
      if (fn.contains("description") && !fn["description"].is_null() && !fn["description"].is_string()) {
        return bad_request("tools", where + ".function.description must be a string");
      }
      if (fn.contains("parameters") && !fn["parameters"].is_null() && !fn["parameters"].is_object()) {
        return bad_request("tools", where + ".function.parameters must be a JSON Schema object");
      }
      if (nests_deeper_than(fn, engine::kMaxSchemaNesting)) {  // it is written into the prompt (recursively)
        return bad_request("tools", fmt::format("{}.function nests deeper than {} levels", where, engine::kMaxSchemaNesting));
      }
      const std::string name = fn["name"];
      // The model writes a call as NAME, a newline, then the arguments: a name holding white space or control
      // characters (or longer than OpenAI's 64) could not be told from what follows it.
      const bool plain = name.size() <= 64 && std::none_of(name.begin(), name.end(), [](char c) {
                           const auto u = static_cast<unsigned char>(c);
                           return u <= 0x20 || u == 0x7f || c == '`' || c == '<';
                         });
      if (!plain) {
        return bad_request("tools", where + ".function.name '" + escape_for_error(name) +
                                        "' must be at most 64 characters without white space, control characters, "
                                        "'`' or '<'");
      }
      for (const auto& other : r.tools) {
        if (other.name == name) return bad_request("tools", "two tools are named '" + escape_for_error(name) + "'");
      }
      r.tools.push_back(ToolSpec{name, fn});
    }
  }
  if (j.contains("tool_choice") && !j["tool_choice"].is_null()) {
    const auto& c = j["tool_choice"];
    auto& choice = r.tool_choice;
    if (c == "none") {
      choice.mode = ToolChoice::none;
    } else if (c == "auto") {
      choice.mode = ToolChoice::auto_;
    } else if (c == "required") {
      choice.mode = ToolChoice::required;
    } else if (c.is_object() && c.contains("type") && c["type"] == "function" && c.contains("function") &&
               c["function"].is_object() && c["function"].contains("name") && c["function"]["name"].is_string()) {
      choice.mode = ToolChoice::named;
      choice.name = c["function"]["name"];
    } else {
      return bad_request("tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                                "{\"type\": \"function\", \"function\": {\"name\": ...}}");
    }
    if (r.tools.empty() && choice.forces_call()) {
      return bad_request("tool_choice", "'tool_choice' asks for a tool call but the request offers no 'tools'");
    }
    if (choice.mode == ToolChoice::named &&
        std::none_of(r.tools.begin(), r.tools.end(), [&](const ToolSpec& t) { return t.name == choice.name; })) {
      return bad_request("tool_choice", "'tool_choice' names '" + escape_for_error(choice.name) + "', which is not in 'tools'");
    }
    if (choice.mode == ToolChoice::required && r.tools.size() == 1) {  // the one function it may call, named
      choice = ToolChoice{ToolChoice::named, r.tools.front().name};
    }
  }
  if (j.contains("parallel_tool_calls") && !j["parallel_tool_calls"].is_null()) {
    if (!j["parallel_tool_calls"].is_boolean()) return bad_request("parallel_tool_calls", "'parallel_tool_calls' must be true or false");
    r.parallel_tool_calls = j["parallel_tool_calls"].get<bool>();
  }
  return std::nullopt;
}

std::variant<json, ApiError> parse_object(const std::string& body) {
  json j;
  try {
    j = json::parse(body);
  } catch (const json::parse_error& e) {
    return bad_request("", std::string("request body is not valid JSON: ") + e.what());
  }
  if (!j.is_object()) return bad_request("", "request body must be a JSON object");
  return j;
}

std::variant<ApiRequest, ApiError> parse_request(const std::string& body, ApiKind kind) {
  auto parsed = parse_object(body);
  if (auto* e = std::get_if<ApiError>(&parsed)) return *e;
  return parse_request(std::get<json>(parsed), kind);
}

// vLLM / SGLang extensions that change what is generated or returned and that troupe does not implement:
// refused when set to anything but their default, rather than silently ignored.
std::optional<ApiError> refuse_unsupported_extensions(const json& j, ApiKind kind) {
  auto set = [&](const char* k) {
    if (!j.contains(k) || j[k].is_null()) return false;
    const json& v = j[k];
    return !(v == false || (v.is_array() && v.empty()) || (v.is_object() && v.empty()));
  };
  for (const char* k : {"include_stop_str_in_output", "allowed_token_ids", "bad_words", "prompt_logprobs",
                        "continue_final_message", "chat_template_kwargs", "chat_template"}) {
    if (set(k)) return bad_request(k, fmt::format("'{}' is not supported by this server", k));
  }
  if (chat_like(kind) && set("echo")) return bad_request("echo", "'echo' is supported on /v1/completions only");
  return std::nullopt;
}

std::variant<ApiRequest, ApiError> parse_request(const json& j, ApiKind kind) {
  ApiRequest r;
  r.kind = kind;
  if (auto e = refuse_unsupported_extensions(j, kind)) return *e;
  // Left out, null or "": the served model (as vLLM does; admission fills it in).
  if (j.contains("model") && !j["model"].is_null()) {
    if (!j["model"].is_string()) return bad_request("model", "'model' must be a string");
    r.model = j["model"].get<std::string>();
  }

  Fields f(j);
  if (kind == ApiKind::completion) {
    if (!j.contains("prompt")) return bad_request("prompt", "'prompt' is required");
    const auto& p = j["prompt"];
    if (p.is_string()) {
      r.prompt_text = p.get<std::string>();
    } else if (p.is_array() && !p.empty() && p[0].is_number_integer()) {
      std::vector<int32_t> ids;
      f.token_ids("prompt", ids);
      r.prompt_ids = std::move(ids);
    } else if (p.is_array() && p.size() == 1 && p[0].is_string()) {
      r.prompt_text = p[0].get<std::string>();
    } else if (p.is_array() && p.size() == 1 && p[0].is_array()) {
      json inner = {{"prompt", p[0]}};
      Fields fi(inner);
      std::vector<int32_t> ids;
      fi.token_ids("prompt", ids);
      if (fi.error) return *fi.error;
      r.prompt_ids = std::move(ids);
    } else if (p.is_array() && p.size() > 1 && (p[0].is_string() || p[0].is_array())) {
      // a batch: every element a string, or every element a list of token ids
      for (size_t i = 0; i < p.size(); ++i) {
        ApiRequest::Prompt one;
        if (p[0].is_string() && p[i].is_string()) {
          one.text = p[i].get<std::string>();
        } else if (p[0].is_array() && p[i].is_array()) {
          json inner = {{"prompt", p[i]}};
          Fields fi(inner);
          std::vector<int32_t> ids;
          fi.token_ids("prompt", ids);
          if (fi.error) return *fi.error;
          if (ids.empty()) return bad_request("prompt", "'prompt' must not hold an empty list of token ids");
          one.ids = std::move(ids);
        } else {
          return bad_request("prompt", "a batch of prompts must be all strings or all lists of token ids");
        }
        if (i == 0) {
          r.prompt_text = one.text;
          r.prompt_ids = one.ids;
        } else {
          r.more_prompts.push_back(std::move(one));
        }
      }
    } else {
      return bad_request("prompt", "'prompt' must be a string or a list of token ids");
    }
    if (r.prompt_ids && r.prompt_ids->empty()) return bad_request("prompt", "'prompt' must not be empty");
    f.boolean("echo", r.echo);
    const bool no_suffix =
        !j.contains("suffix") || j["suffix"].is_null() || (j["suffix"].is_string() && j["suffix"].get<std::string>().empty());
    if (!no_suffix) {
      return bad_request("suffix", "'suffix' (fill in the middle) is not supported");
    }
    if (j.contains("best_of") && !j["best_of"].is_null() && j["best_of"] != 1) {
      return bad_request("best_of", "only best_of = 1 is supported");
    }
  } else {
    if (!j.contains("messages") || !j["messages"].is_array() || j["messages"].empty()) {
      return bad_request("messages", "'messages' is required and must be a non-empty list");
    }
    for (const auto& m : j["messages"]) {
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
        return bad_request("messages", "each message must be an object with a string 'role'");
      }
      const std::string role = m["role"];
      if (role != "system" && role != "user" && role != "assistant" && role != "tool" && role != "developer") {
        return bad_request("messages", "unknown message role '" + escape_for_error(role) + "'");
      }
      if (m.contains("content") && !m["content"].is_null() && !m["content"].is_string() && !m["content"].is_array()) {
        return bad_request("messages", "message 'content' must be a string or a list of content parts");
      }
    }
    r.messages = j["messages"];
    if (auto e = parse_tools(j, r)) return *e;
    f.boolean("add_generation_prompt", r.add_generation_prompt);
  }

  auto& s = r.sampling;
  f.number("temperature", [&](double v) { s.temperature = static_cast<float>(v); }, 0.0, 2.0);
  f.number("top_p", [&](double v) { s.top_p = static_cast<float>(v); }, 0.0, 1.0);
  if (!f.error && s.top_p <= 0.0f && f.has("top_p")) f.error = bad_request("top_p", "'top_p' must be greater than 0");
  f.integer("top_k", [&](int64_t v) { s.top_k = static_cast<int32_t>(v); }, -1, 1 << 20);
  f.number("min_p", [&](double v) { s.min_p = static_cast<float>(v); }, 0.0, 1.0);
  f.integer("seed", [&](int64_t v) { s.seed = static_cast<uint64_t>(v); }, std::numeric_limits<int64_t>::min(),
            std::numeric_limits<int64_t>::max());
  const char* max_key = f.has("max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  f.integer(max_key, [&](int64_t v) { s.max_tokens = v; }, 0, int64_t{1} << 40);
  if (!f.error && s.max_tokens == 0 && !r.echo) {
    return bad_request(max_key, fmt::format("'{}' must be at least 1{}", max_key,
                                    kind == ApiKind::completion ? " (0 only with 'echo': the prompt and its logprobs alone)" : ""));
  }
  f.integer("min_tokens", [&](int64_t v) { s.min_tokens = v; }, 0, int64_t{1} << 40);
  f.boolean("ignore_eos", s.ignore_eos);
  f.boolean("skip_special_tokens", s.skip_special_tokens);
  constexpr double kPen = engine::kMaxAbsPenalty, kBias = engine::kMaxAbsLogitBias;
  f.number("frequency_penalty", [&](double v) { s.frequency_penalty = static_cast<float>(v); }, -kPen, kPen);
  f.number("presence_penalty", [&](double v) { s.presence_penalty = static_cast<float>(v); }, -kPen, kPen);
  f.number("repetition_penalty", [&](double v) { s.repetition_penalty = static_cast<float>(v); }, 0.0, 1e6);
  if (!f.error && f.has("repetition_penalty") && !(s.repetition_penalty > 0.0f)) {
    f.error = bad_request("repetition_penalty", "'repetition_penalty' must be greater than 0");
  }
  if (f.error) return *f.error;
  if (j.contains("logit_bias") && !j["logit_bias"].is_null()) {
    // OpenAI's form: {"token id": bias}; the token's range is checked against the vocabulary at admission.
    const auto& lb = j["logit_bias"];
    if (!lb.is_object()) return bad_request("logit_bias", "'logit_bias' must be an object of token ids to biases");
    if (lb.size() > engine::kMaxLogitBiasEntries) {
      return bad_request("logit_bias",
                 fmt::format("'logit_bias' has {} entries, at most {}", lb.size(), engine::kMaxLogitBiasEntries));
    }
    for (const auto& [key, v] : lb.items()) {
      int64_t id = -1;
      const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
      if (ec != std::errc{} || end != key.data() + key.size() || id < 0 || id > std::numeric_limits<int32_t>::max()) {
        return bad_request("logit_bias", "'logit_bias' keys must be token ids, got '" + escape_for_error(key) + "'");
      }
      if (!v.is_number()) return bad_request("logit_bias", "'logit_bias' values must be numbers");
      const double b = v.get<double>();
      if (!(std::fabs(b) <= kBias)) {
        return bad_request("logit_bias", fmt::format("'logit_bias' values must be between -{} and {}", kBias, kBias));
      }
      s.logit_bias.emplace_back(static_cast<int32_t>(id), static_cast<float>(b));
    }
  }
  f.boolean("stream", r.stream);
  f.integer("priority", [&](int64_t v) { r.priority = static_cast<int32_t>(v); }, std::numeric_limits<int32_t>::min(),
            std::numeric_limits<int32_t>::max());
  f.boolean("return_token_ids", r.return_token_ids);
  f.token_ids("stop_token_ids", s.stop_token_ids);
  f.integer("n", [&](int64_t v) { r.n = static_cast<int32_t>(v); }, 1, kMaxChoices);
  if (f.error) return *f.error;
  if (static_cast<int64_t>(r.n) * static_cast<int64_t>(1 + r.more_prompts.size()) > kMaxChoices) {
    return bad_request(r.more_prompts.empty() ? "n" : "prompt",
               fmt::format("a request may ask for at most {} choices (n x prompts), got {} x {}", kMaxChoices, r.n,
                           1 + r.more_prompts.size()));
  }
  if (s.max_tokens && s.min_tokens > *s.max_tokens) return bad_request("min_tokens", "'min_tokens' must not exceed 'max_tokens'");
  if (j.contains("stop") && !j["stop"].is_null()) {
    const auto& st = j["stop"];
    if (st.is_string()) {
      s.stop.push_back(st.get<std::string>());
    } else if (st.is_array()) {
      for (const auto& e : st) {
        if (!e.is_string()) return bad_request("stop", "'stop' must be a string or a list of strings");
        s.stop.push_back(e.get<std::string>());
      }
      if (s.stop.size() > 16) return bad_request("stop", "at most 16 stop strings");
    } else {
      return bad_request("stop", "'stop' must be a string or a list of strings");
    }
    for (const auto& x : s.stop) {
      if (x.empty()) return bad_request("stop", "stop strings must not be empty");
    }
  }
  if (j.contains("response_format") && !j["response_format"].is_null()) {
    const auto& rf = j["response_format"];
    if (!rf.is_object() || !rf.contains("type") || !rf["type"].is_string()) {
      return bad_request("response_format", "'response_format' must be an object with a string 'type'");
    }
    const std::string type = rf["type"];
    if (type == "json_object") {
      s.json_schema = R"({"type": "object"})";
    } else if (type == "json_schema") {
      if (!rf.contains("json_schema") || !rf["json_schema"].is_object()) {
        return bad_request("response_format", "response_format type 'json_schema' needs a 'json_schema' object");
      }
      const auto& js = rf["json_schema"];
      if (js.contains("schema") && !js["schema"].is_null() && !js["schema"].is_object() && !js["schema"].is_boolean()) {
        return bad_request("response_format", "'json_schema.schema' must be a JSON Schema (an object)");
      }
      if (js.contains("schema") && nests_deeper_than(js["schema"], engine::kMaxSchemaNesting)) {
        return bad_request("response_format", fmt::format("'json_schema.schema' nests deeper than {} levels", engine::kMaxSchemaNesting));
      }
      s.json_schema = js.contains("schema") && !js["schema"].is_null() ? js["schema"].dump() : "{}";
    } else if (type != "text") {
      return bad_request("response_format", "response_format 'type' must be 'text', 'json_object' or 'json_schema', got '" +
                                        escape_for_error(type) + "'");
    }
  }
  // vLLM's structured_outputs {json, regex, choice, grammar, json_object}: its guided_* fields by other names.
  json merged;
  const json* gp = &j;
  if (j.contains("structured_outputs") && !j["structured_outputs"].is_null()) {
    const auto& so = j["structured_outputs"];
    if (!so.is_object()) return bad_request("structured_outputs", "'structured_outputs' must be an object");
    merged = j;
    for (const auto& [k, v] : so.items()) {
      if (v.is_null()) continue;
      if (k == "json_object") {
        if (!v.is_boolean()) return bad_request("structured_outputs", "'structured_outputs.json_object' must be true or false");
        if (v.get<bool>()) {
          if (!s.json_schema.empty()) return bad_request("structured_outputs", "give either structured_outputs or a json 'response_format'");
          s.json_schema = R"({"type": "object"})";
        }
        continue;
      }
      static const std::pair<const char*, const char*> kNames[] = {
          {"json", "guided_json"}, {"regex", "guided_regex"}, {"choice", "guided_choice"}, {"grammar", "guided_grammar"}};
      const auto* name = std::find_if(std::begin(kNames), std::end(kNames), [&](const auto& n) { return k == n.first; });
      if (name == std::end(kNames)) {
        return bad_request("structured_outputs", "'structured_outputs." + escape_for_error(k) +
                                             "' is not supported (json, regex, choice, grammar and json_object are)");
      }
      if (j.contains(name->second) && !j[name->second].is_null()) {
        return bad_request("structured_outputs", fmt::format("give either structured_outputs.{} or {}, not both", k, name->second));
      }
      merged[name->second] = v;
    }
    gp = &merged;
  }
  const json& src = *gp;
  if (src.contains("guided_json") && !src["guided_json"].is_null()) {  // vLLM's
    if (!s.json_schema.empty()) return bad_request("guided_json", "give either 'guided_json' or a json 'response_format', not both");
    const auto& g = src["guided_json"];
    if (g.is_string()) {
      s.json_schema = g.get<std::string>();
      s.grammar_param = "guided_json";
    } else if (g.is_object() || g.is_boolean()) {
      if (nests_deeper_than(g, engine::kMaxSchemaNesting)) {
        return bad_request("guided_json", fmt::format("'guided_json' nests deeper than {} levels", engine::kMaxSchemaNesting));
      }
      s.json_schema = g.dump();
      s.grammar_param = "guided_json";
    } else {
      return bad_request("guided_json", "'guided_json' must be a JSON Schema (an object or its text)");
    }
  }
  if (src.contains("guided_choice") && !src["guided_choice"].is_null()) {  // vLLM's: the answer is one of these texts
    if (!s.json_schema.empty()) return bad_request("guided_choice", "give one of 'guided_choice', 'guided_json' or a json 'response_format'");
    const auto& g = src["guided_choice"];
    if (!g.is_array() || g.empty() || g.size() > 1024) return bad_request("guided_choice", "'guided_choice' must be a list of 1 to 1024 strings");
    std::vector<std::string> texts;
    for (const auto& t : g) {
      if (!t.is_string() || t.get<std::string>().empty()) return bad_request("guided_choice", "every 'guided_choice' entry must be a non-empty string");
      texts.push_back(t.get<std::string>());
    }
    s.json_schema = engine::choice_grammar(texts);
    s.grammar_param = "guided_choice";
  }
  // vLLM's guided_regex and guided_grammar, SGLang's regex and ebnf: the answer is a text
  // the pattern matches whole, or that the EBNF grammar derives from its rule root.
  for (const char* key : {"guided_regex", "regex", "guided_grammar", "ebnf"}) {
    if (!src.contains(key) || src[key].is_null()) continue;
    if (!s.json_schema.empty()) {
      return bad_request(key, "give one of 'guided_regex' (or 'regex'), 'guided_grammar' (or 'ebnf'), 'guided_choice', "
                      "'guided_json' or a json 'response_format'");
    }
    const bool regex = std::string_view(key).ends_with("regex");
    if (!src[key].is_string() || src[key].get<std::string>().empty()) {
      return bad_request(key, fmt::format("'{}' must be a non-empty string ({})", key, regex ? "a regular expression" : "an EBNF grammar"));
    }
    s.json_schema = regex ? engine::regex_grammar(src[key].get<std::string>()) : engine::ebnf_grammar(src[key].get<std::string>());
    s.grammar_param = key;
  }
  if (gp == &merged && !j.contains(s.grammar_param)) s.grammar_param = "structured_outputs";  // (compile errors name it)
  if (!s.json_schema.empty() && r.uses_tools() && r.tool_choice.mode == ToolChoice::required) {
    return bad_request("response_format", "a json response_format cannot be combined with tool_choice 'required' over several tools");
  }
  if (!s.json_schema.empty() && r.uses_tools() && r.tool_choice.mode == ToolChoice::named) {
    return bad_request("response_format", "a json response_format cannot be combined with a named tool_choice (the call's "
                                  "arguments already follow the tool's parameters)");
  }
  if (j.contains("stream_options") && j["stream_options"].is_object()) {
    const auto& so = j["stream_options"];
    if (so.contains("include_usage") && !so["include_usage"].is_null()) {
      if (!so["include_usage"].is_boolean()) return bad_request("stream_options", "'include_usage' must be true or false");
      r.include_usage = so["include_usage"].get<bool>();
    }
  }
  if (kind == ApiKind::completion) {
    // "logprobs": N alternatives (0..20), null: none.
    if (j.contains("logprobs") && !j["logprobs"].is_null()) {
      if (j["logprobs"].is_boolean()) return bad_request("logprobs", "'logprobs' must be an integer from 0 to 20 (alternatives per token)");
      f.integer("logprobs", [&](int64_t v) { r.logprobs = static_cast<int32_t>(v); }, 0, 20);
    }
  } else {
    bool want = false;
    f.boolean("logprobs", want);
    int64_t top = 0;
    f.integer("top_logprobs", [&](int64_t v) { top = v; }, 0, 20);
    if (!f.error && f.has("top_logprobs") && !j["top_logprobs"].is_null() && !want) {
      return bad_request("top_logprobs", "'top_logprobs' needs 'logprobs': true");
    }
    if (want) r.logprobs = static_cast<int32_t>(top);
  }
  if (f.error) return *f.error;
  return r;
}

namespace {

// The bytes as text (invalid UTF-8 replaced) and as the list of byte values OpenAI's "bytes" field carries.
json byte_list(const std::string& b) {
  json out = json::array();
  for (unsigned char c : b) out.push_back(static_cast<int>(c));
  return out;
}

// The "logprobs" of a choice for `entries`, which start at token `first` of the
// answer (`offset`: the text offset of that token, completions only).
json logprobs_json(const ApiRequest& req, const std::vector<LogprobEntry>& entries, size_t offset) {
  if (req.logprobs < 0) return nullptr;
  if (req.kind == ApiKind::chat) return {{"content", logprob_entries_json(entries)}};
  json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  for (const auto& e : entries) {
    tokens.push_back(e.bytes);
    lps.push_back(e.none ? json(nullptr) : json(e.logprob));
    json top = e.none ? json(nullptr) : json::object();
    for (const auto& [b, lp] : e.top) {
      if (!top.contains(b)) top[b] = lp;
    }
    tops.push_back(top);
    offsets.push_back(offset);
    offset += e.bytes.size();
  }
  return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}


// The fields every stream event of `r` starts with (its choices go under "choices").
json event_head(const ApiResult& r, ApiKind kind) {
  return {{"id", r.id}, {"created", r.created}, {"model", r.model},
          {"object", kind == ApiKind::chat ? "chat.completion.chunk" : "text_completion"}};
}

std::string sse(const json& event) { return "data: " + dump_json(event) + "\n\n"; }

// OpenAI's message "tool_calls" for r.tool_calls.
json tool_calls_json(const ApiResult& r) {
  json calls = json::array();
  for (size_t i = 0; i < r.tool_calls.size(); ++i) {
    const auto& c = r.tool_calls[i];
    calls.push_back({{"id", tool_call_id(r, i)}, {"type", c.type},
                     {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
  }
  return calls;
}

}  // namespace

std::string id_number(const std::string& id) {
  const auto at = id.find_last_of("-_");
  return at == std::string::npos ? id : id.substr(at + 1);
}

json logprob_entries_json(const std::vector<LogprobEntry>& entries) {
  json out = json::array();
  for (const auto& e : entries) {
    json top = json::array();
    for (const auto& [b, lp] : e.top) top.push_back({{"token", b}, {"logprob", lp}, {"bytes", byte_list(b)}});
    out.push_back({{"token", e.bytes}, {"logprob", e.logprob}, {"bytes", byte_list(e.bytes)}, {"top_logprobs", std::move(top)}});
  }
  return out;
}

std::string tool_call_id(const ApiResult& r, size_t index) {
  // Unique per request and call: the response id's number and the call's index.
  return fmt::format("call_{}_{}", id_number(r.id), index);
}

std::string stream_tool_calls(const ApiResult& r, const std::vector<ToolCallDelta>& deltas, bool first_event) {
  json calls = json::array();
  for (const auto& d : deltas) {
    if (!d.opens && !calls.empty() && calls.back()["index"] == d.index) {  // one entry a call and event
      calls.back()["function"]["arguments"] = calls.back()["function"]["arguments"].get<std::string>() + d.arguments;
      continue;
    }
    json c = {{"index", d.index}, {"function", {{"arguments", d.arguments}}}};
    if (d.opens) {
      c["id"] = tool_call_id(r, d.index);
      c["type"] = d.type;
      c["function"]["name"] = d.name;
    }
    calls.push_back(std::move(c));
  }
  json d = {{"tool_calls", std::move(calls)}};
  if (first_event) d["role"] = "assistant";
  json j = event_head(r, ApiKind::chat);
  j["choices"] = json::array({{{"index", 0}, {"finish_reason", nullptr}, {"logprobs", nullptr}, {"delta", d}}});
  return sse(j);
}

json usage_json(const ApiResult& r) {
  const auto p = static_cast<int64_t>(r.prompt_ids.size()), c = static_cast<int64_t>(r.token_ids.size());
  return {{"prompt_tokens", p},
          {"completion_tokens", c},
          {"total_tokens", p + c},
          {"prompt_tokens_details", {{"cached_tokens", r.cached_tokens}}}};
}

std::string response_body(const ApiRequest& req, const ApiResult& r) {
  json choice = {{"index", 0}, {"finish_reason", r.finish_reason}, {"logprobs", logprobs_json(req, r.logprobs, 0)}};
  json j = {{"id", r.id}, {"created", r.created}, {"model", r.model}, {"usage", usage_json(r)}};
  if (req.kind == ApiKind::chat) {
    j["object"] = "chat.completion";
    choice["message"] = {{"role", "assistant"}, {"content", r.text}};
    if (!r.tool_calls.empty()) {
      if (r.text.empty()) choice["message"]["content"] = nullptr;
      choice["message"]["tool_calls"] = tool_calls_json(r);
    }
  } else {
    j["object"] = "text_completion";
    choice["text"] = r.text;
  }
  if (req.return_token_ids) {
    choice["token_ids"] = r.token_ids;
    choice["prompt_token_ids"] = r.prompt_ids;
  }
  j["choices"] = json::array({choice});
  return dump_json(j);
}

std::string stream_delta(const ApiRequest& req, const ApiResult& r, const std::string& delta,
                         const std::vector<int32_t>& delta_ids, bool first,
                         const std::vector<LogprobEntry>& delta_logprobs) {
  size_t offset = 0;  // the text offset of the delta's first token: the bytes of the tokens before it
  for (size_t i = 0; i + delta_logprobs.size() < r.logprobs.size(); ++i) offset += r.logprobs[i].bytes.size();
  json choice = {{"index", 0}, {"finish_reason", nullptr}, {"logprobs", logprobs_json(req, delta_logprobs, offset)}};
  json j = event_head(r, req.kind);
  if (req.kind == ApiKind::chat) {
    json d = {{"content", delta}};
    if (first) d["role"] = "assistant";
    choice["delta"] = d;
  } else {
    choice["text"] = delta;
  }
  if (req.return_token_ids) {
    choice["token_ids"] = delta_ids;
    if (first) choice["prompt_token_ids"] = r.prompt_ids;
  }
  j["choices"] = json::array({choice});
  return sse(j);
}

std::string stream_finish(const ApiRequest& req, const ApiResult& r) {
  json choice = {{"index", 0}, {"finish_reason", r.finish_reason}, {"logprobs", nullptr}};
  json j = event_head(r, req.kind);
  if (req.kind == ApiKind::chat) {
    choice["delta"] = json::object();
  } else {
    choice["text"] = "";
  }
  if (req.return_token_ids) choice["token_ids"] = json::array();
  j["choices"] = json::array({choice});
  std::string out = sse(j);
  if (req.include_usage) {
    json u = event_head(r, req.kind);
    u["choices"] = json::array();
    u["usage"] = usage_json(r);
    out += sse(u);
  }
  return out + "data: [DONE]\n\n";
}

std::string stream_error(const ApiError& e) { return "data: " + error_body(e) + "\n\ndata: [DONE]\n\n"; }

std::vector<ApiRequest> fan_out(const ApiRequest& r) {
  std::vector<ApiRequest::Prompt> prompts{{r.prompt_text, r.prompt_ids}};
  prompts.insert(prompts.end(), r.more_prompts.begin(), r.more_prompts.end());
  std::vector<ApiRequest> out;
  for (const auto& p : prompts) {
    for (int32_t s = 0; s < r.n; ++s) {
      ApiRequest c = r;
      c.n = 1;
      c.more_prompts.clear();
      c.prompt_text = p.text;
      c.prompt_ids = p.ids;
      if (r.sampling.seed) c.sampling.seed = *r.sampling.seed + out.size();
      out.push_back(std::move(c));
    }
  }
  return out;
}

namespace {

// Adds a choice's usage into the merged one (its prompt's tokens once per prompt).
void add_usage(json& total, const json& u, bool count_prompt) {
  if (!u.is_object()) return;
  auto get = [](const json& o, const char* k) { return o.contains(k) && o[k].is_number_integer() ? o[k].get<int64_t>() : 0; };
  if (total.is_null()) {
    total = {{"prompt_tokens", 0}, {"completion_tokens", 0}, {"total_tokens", 0},
             {"prompt_tokens_details", {{"cached_tokens", 0}}}};
  }
  const int64_t p = count_prompt ? get(u, "prompt_tokens") : 0;
  const int64_t cached = count_prompt && u.contains("prompt_tokens_details") ? get(u["prompt_tokens_details"], "cached_tokens") : 0;
  total["prompt_tokens"] = total["prompt_tokens"].get<int64_t>() + p;
  total["completion_tokens"] = total["completion_tokens"].get<int64_t>() + get(u, "completion_tokens");
  total["total_tokens"] = total["prompt_tokens"].get<int64_t>() + total["completion_tokens"].get<int64_t>();
  total["prompt_tokens_details"]["cached_tokens"] = total["prompt_tokens_details"]["cached_tokens"].get<int64_t>() + cached;
}

}  // namespace

std::string merge_bodies(const std::vector<std::string>& bodies, int32_t n) {
  json merged, usage;
  json choices = json::array();
  for (size_t i = 0; i < bodies.size(); ++i) {
    json b = json::parse(bodies[i], nullptr, false);
    if (!b.is_object() || !b.contains("choices") || !b["choices"].is_array()) continue;  // (response_body's: never)
    if (merged.is_null()) merged = b;
    for (auto& c : b["choices"]) {
      c["index"] = static_cast<int64_t>(i);
      choices.push_back(std::move(c));
    }
    add_usage(usage, b["usage"], i % static_cast<size_t>(std::max(n, 1)) == 0);
  }
  merged["choices"] = std::move(choices);
  merged["usage"] = std::move(usage);
  return dump_json(merged);
}

std::string reindex_events(const std::string& chunk, int32_t index, const std::string& id, bool count_prompt,
                           json& usage, std::string& error) {
  std::string out;
  size_t at = 0;
  while (at < chunk.size()) {
    size_t end = chunk.find("\n\n", at);
    if (end == std::string::npos) end = chunk.size();
    const std::string event = chunk.substr(at, end - at);
    at = end + 2;
    if (event.rfind("data: ", 0) != 0) {
      if (!event.empty()) out += event + "\n\n";
      continue;
    }
    const std::string data = event.substr(6);
    if (data == "[DONE]") continue;
    json j = json::parse(data, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      out += event + "\n\n";
      continue;
    }
    if (j.contains("error")) {
      error = data;
      break;
    }
    if (j.contains("choices") && j["choices"].is_array() && j["choices"].empty() && j.contains("usage")) {
      add_usage(usage, j["usage"], count_prompt);
      continue;
    }
    if (j.contains("choices") && j["choices"].is_array()) {
      for (auto& c : j["choices"]) c["index"] = index;
    }
    if (!id.empty() && j.contains("id")) j["id"] = id;
    out += "data: " + dump_json(j) + "\n\n";
  }
  return out;
}

}  // namespace troupe::gateway
