// OpenAI's Responses API (POST /v1/responses) over the chat path: a request's input
// items, instructions, tools and text format become a chat completion's body (read by
// parse_request, so every check and limit is the chat's), and the chat's result is
// written back as a response object, or as the Responses stream's typed events.
// Stateless: nothing is stored, so what needs a stored response (previous_response_id,
// background, conversation, item references) is refused by name. No I/O here.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <variant>
#include <vector>

#include "actors/gateway/openai.hpp"

namespace troupe::gateway {

// The chat completions body a Responses body (a JSON object) means, or the 400 naming its parameter.
std::variant<nlohmann::json, ApiError> chat_body_of_response(const nlohmann::json& body);
// A /v1/responses body as a chat ApiRequest (kind responses): chat_body_of_response,
// then parse_request, its errors naming the Responses parameters.
std::variant<ApiRequest, ApiError> parse_response_request(const std::string& body);

// The response object of a finished request (stream or not: response.completed carries it).
nlohmann::json response_object(const ApiRequest& req, const ApiResult& r, bool finished);
std::string response_body_of(const ApiRequest& req, const ApiResult& r);

// The events of one streamed response, in order: start() once, then text() and
// tool_calls() as the answer comes, then finish() or error().
class ResponseStream {
 public:
  std::string start(const ApiRequest& req, const ApiResult& r);
  // `logprobs`: the entries of the delta's tokens (when the request asked).
  std::string text(const ApiResult& r, const std::string& delta, const std::vector<LogprobEntry>& logprobs = {});
  std::string tool_calls(const ApiResult& r, const std::vector<ToolCallDelta>& deltas);
  std::string finish(const ApiRequest& req, const ApiResult& r);
  std::string error(const ApiError& e);

 private:
  std::string event(nlohmann::json j);
  int64_t sequence_ = 0;
  int message_index_ = -1;            // the message item's output index once it opened
  std::map<size_t, int> call_index_;  // a tool call's index -> its item's output index
  int next_index_ = 0;
};

}  // namespace troupe::gateway
