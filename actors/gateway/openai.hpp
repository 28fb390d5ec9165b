// The OpenAI-compatible API: request parsing and validation, and the JSON of
// responses, stream chunks and errors. No I/O here.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <variant>
#include <string>
#include <vector>

#include "actors/gateway/tool_calls.hpp"
#include "base/error.hpp"

namespace troupe::gateway {

// Sampling as OpenAI names it, with the vLLM/SGLang extensions.
struct SamplingSpec {
  float temperature = 1.0f;
  float top_p = 1.0f;
  int32_t top_k = -1;                 // -1 or 0: off
  float min_p = 0.0f;                 // vLLM / SGLang extension; 0: off
  std::optional<uint64_t> seed;
  std::optional<int64_t> max_tokens;  // unset: up to the context limit
  int64_t min_tokens = 0;
  std::vector<std::string> stop;      // stop strings (not included in the output)
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  // vLLM's: the answer's text leaves out special tokens (an EOS that ended it, BOS, padding;
  // not the chat and tool markers, which DeepSeek's tokenizer does not mark special).
  bool skip_special_tokens = true;
  float repetition_penalty = 1.0f;    // vLLM / SGLang extension; 1: off
  float frequency_penalty = 0.0f;     // OpenAI, [-2, 2]
  float presence_penalty = 0.0f;      // OpenAI, [-2, 2]
  std::vector<std::pair<int32_t, float>> logit_bias;  // OpenAI: (token, bias in [-100, 100])
  // The answer is JSON under this JSON Schema (engine::SamplingParams::json_schema):
  // response_format json_object ({"type": "object"}) or json_schema, vLLM's guided_json;
  // or one of vLLM's guided_choice texts (engine::choice_grammar), or a text vLLM's
  // guided_regex / SGLang's regex matches (engine::regex_grammar), or one vLLM's
  // guided_grammar / SGLang's ebnf derives (engine::ebnf_grammar). Empty: free text.
  // Compiled (and refused with a 400 naming grammar_param) at admission.
  std::string json_schema;
  std::string grammar_param = "response_format";
};

// responses: OpenAI's Responses API (gateway/responses.hpp), a chat underneath.
enum class ApiKind { completion, chat, responses };
inline bool chat_like(ApiKind k) { return k != ApiKind::completion; }
// The route each kind is served on.
inline const char* route_of(ApiKind k) {
  return k == ApiKind::chat ? "/v1/chat/completions" : k == ApiKind::responses ? "/v1/responses" : "/v1/completions";
}

struct ApiRequest {
  ApiKind kind = ApiKind::completion;
  std::string model;
  // completion: text or token ids; chat: messages (OpenAI format, rendered by the chat template)
  std::optional<std::string> prompt_text;
  std::optional<std::vector<int32_t>> prompt_ids;
  nlohmann::json messages;
  bool add_generation_prompt = true;
  SamplingSpec sampling;
  bool stream = false;
  bool include_usage = false;         // stream_options.include_usage
  bool return_token_ids = false;
  bool echo = false;                  // completions: prepend the prompt (and its logprobs when asked)
  // Alternatives per token to report with each token's logprob (0..20); -1:
  // no logprobs. Completions: "logprobs": N; chat: "logprobs": true with
  // "top_logprobs": N.
  int32_t logprobs = -1;
  int32_t priority = 0;               // vLLM's field, our order: larger is admitted first under pressure
  // Choices per prompt ("n"), and a completions batch's prompts after the first (each text
  // or token ids). A request with n > 1 or a batch runs as one request per choice
  // (fan_out), answered as one response (merge_bodies, reindex_events).
  int32_t n = 1;
  struct Prompt {
    std::optional<std::string> text;
    std::optional<std::vector<int32_t>> ids;
  };
  std::vector<Prompt> more_prompts;
  // Chat: the functions offered ("tools"), what the model may do with them
  // ("tool_choice"), and whether it may call several at once ("parallel_tool_calls").
  std::vector<ToolSpec> tools;
  ToolChoice tool_choice;
  bool parallel_tool_calls = true;
  // Responses API: the request's fields its response object repeats (instructions, tools, ...).
  nlohmann::json response_echo;
  // Whether the answer is parsed for tool calls (tools offered and not tool_choice none).
  bool uses_tools() const { return !tools.empty() && tool_choice.mode != ToolChoice::none; }
};

inline constexpr int32_t kMaxChoices = 128;  // n x prompts of one request

// The requests of a request's choices, in the API's order (prompt-major: choice
// index = prompt * n + sample), each with n = 1 and one prompt; with a seed, choice
// i samples with seed + i (the same seed would give every choice the same tokens).
std::vector<ApiRequest> fan_out(const ApiRequest& r);
// One response from the choices' own bodies (response_body of each, in index order):
// their choices renumbered, usage summed (a prompt's tokens counted once for its n choices).
std::string merge_bodies(const std::vector<std::string>& bodies, int32_t n);
// A choice's stream chunk (one or more SSE events) as the merged stream carries it:
// choice indices set to `index`, ids to `id` (when not empty); its usage event is
// added into `usage` (prompt tokens only when `count_prompt`) and dropped, and so is its
// "[DONE]". An error event (an object with "error") ends the scan: its JSON goes to
// `error` and what came before it is returned.
std::string reindex_events(const std::string& chunk, int32_t index, const std::string& id, bool count_prompt,
                           nlohmann::json& usage, std::string& error);

// An error as the API reports it: HTTP status + OpenAI error body.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // empty: null
  std::string code;   // empty: null
};

std::string error_body(const ApiError& e);
// JSON text of a response: bytes that are not UTF-8 (token pieces, echoed input) become U+FFFD
// instead of an exception.
std::string dump_json(const nlohmann::json& j);
ApiError to_api_error(const Error& e);
// A 400 of type invalid_request_error naming `param` (empty: none).
ApiError bad_request(const std::string& param, const std::string& message);
// The same for an error in reading the request's parameter `param` (its messages, its
// prompt): every one is the request's, a 400 of type invalid_request_error naming it.
ApiError to_request_error(const Error& e, std::string param);

// A request body as a JSON object, or the 400 that says why it is not one.
std::variant<nlohmann::json, ApiError> parse_object(const std::string& body);
// Parses and validates a /v1/completions or /v1/chat/completions body (text, or the
// JSON object already read from it). Never throws; malformed JSON, wrong types and
// out-of-range values give a 400 that names the parameter.
std::variant<ApiRequest, ApiError> parse_request(const std::string& body, ApiKind kind);
std::variant<ApiRequest, ApiError> parse_request(const nlohmann::json& body, ApiKind kind);
// A chat body's "tools", "tool_choice" and "parallel_tool_calls" into `r` (parse_request's; /tokenize's too).
std::optional<ApiError> parse_tools(const nlohmann::json& j, ApiRequest& r);

// One generated token's log-probability as the API reports it: the token's
// bytes (its text may be part of a UTF-8 sequence), its logprob, and the most
// likely alternatives (bytes, logprob), best first.
struct LogprobEntry {
  std::string bytes;
  float logprob = 0;
  bool none = false;  // no logprob (an echoed prompt's first token): null, as are its alternatives
  std::vector<std::pair<std::string, float>> top;
};

// What the gateway knows when it answers.
struct ApiResult {
  std::string id;          // "cmpl-..." or "chatcmpl-..."
  int64_t created = 0;
  std::string model;
  std::string text;
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> token_ids;
  std::string finish_reason;  // "stop", "length", "abort"
  int64_t cached_tokens = 0;
  std::vector<LogprobEntry> logprobs;  // one per token id when asked
  std::vector<ToolCall> tool_calls;    // chat with tools: the calls parsed from the answer (text holds the rest)
};

nlohmann::json usage_json(const ApiResult& r);
std::string response_body(const ApiRequest& req, const ApiResult& r);
// One SSE event ("data: {...}\n\n") carrying a text delta (and token ids when asked).
// `delta_logprobs`: the entries of the delta's tokens (when the request asked).
std::string stream_delta(const ApiRequest& req, const ApiResult& r, const std::string& delta,
                         const std::vector<int32_t>& delta_ids, bool first,
                         const std::vector<LogprobEntry>& delta_logprobs = {});
// A chat stream's event with tool-call pieces (delta.tool_calls: a call's first piece
// has its id, type and name; every piece adds to its arguments).
std::string stream_tool_calls(const ApiResult& r, const std::vector<ToolCallDelta>& deltas, bool first_event);
// The number of a response id ("chatcmpl-7", "resp_7": "7").
std::string id_number(const std::string& id);
// Logprob entries as chat's logprobs.content (and a Responses output_text part) list them.
nlohmann::json logprob_entries_json(const std::vector<LogprobEntry>& entries);
// The id of the request's `index`-th tool call.
std::string tool_call_id(const ApiResult& r, size_t index);
// The closing events: finish reason, optional usage, then "data: [DONE]".
std::string stream_finish(const ApiRequest& req, const ApiResult& r);
std::string stream_error(const ApiError& e);

}  // namespace troupe::gateway
