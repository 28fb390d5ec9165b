// Tool calling for the DeepSeek chat format: the tool definitions a request
// offers, as the system prompt's suffix; an answer's forced start when
// tool_choice requires a call; and the parser that turns the model's
// "<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>" section into OpenAI tool_calls,
// all at once or as the text streams. No I/O here.
//
// A call as the DeepSeek-V3 template renders one (and as the model is asked
// to write it):
//   <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGUMENTS\n```<｜tool▁call▁end｜>
// The parser also takes the later DeepSeek form without the type and fence:
//   <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "model/tokenizer/chat_template.hpp"

namespace troupe::gateway {

// A function the client offers ("tools": [{"type": "function", "function": {...}}]).
struct ToolSpec {
  std::string name;
  nlohmann::json function;  // the client's "function" object, rendered into the prompt as JSON
};

// What the request lets the model do with its tools.
struct ToolChoice {
  enum Mode { none, auto_, required, named } mode = auto_;
  std::string name;  // named
  // required and named: the answer starts inside a call (forced_call_start).
  bool forces_call() const { return mode == required || mode == named; }
};

struct ToolCall {
  std::string type = "function";
  std::string name;
  std::string arguments;  // the model's JSON text, verbatim (not checked: OpenAI does not either)
};

// The system prompt's suffix that defines `tools` and the format of a call.
std::vector<tokenizer::ChatPart> tools_prompt(const std::vector<ToolSpec>& tools);

// The answer's forced start: the call section opened (required), and the
// function named (named); empty for none and auto.
std::vector<tokenizer::ChatPart> forced_call_start(const ToolChoice& choice);

// A piece of a call as it streams (OpenAI's delta.tool_calls[i]): the first of
// a call opens it (type and name, arguments so far); later ones add to its
// arguments. A call's pieces' arguments put together are its ToolCall's.
struct ToolCallDelta {
  size_t index = 0;  // the call's, from 0 in the answer
  bool opens = false;
  std::string type, name;  // when it opens
  std::string arguments;
};

// Splits a generated text into content and tool calls; text is pushed as it
// streams and comes back as the content that is surely not part of a call
// (a possible start of the call section is held back), the calls' pieces as
// far as they are sure (a possible closing fence or marker is held back) and
// the calls that completed. Text after the call section is dropped.
class ToolCallParser {
 public:
  // `forced`: the text of forced_call_start (the answer begins inside it).
  explicit ToolCallParser(std::string forced = {}, bool parallel = true);

  struct Step {
    std::string content;
    std::vector<ToolCallDelta> deltas;
    std::vector<ToolCall> calls;
  };
  Step push(std::string_view text);
  // The held-back text, and an unfinished call (its arguments so far: an
  // answer cut by max_tokens).
  Step finish();
  size_t calls() const { return calls_; }

  // Where a call's head (type and name) ends and its arguments begin, once the
  // call's text so far (`body`, after the call's begin marker) tells; `final`:
  // no more text comes. Public for the tests.
  struct Head {
    std::string type = "function", name;
    size_t args_at = 0;  // in body
    bool fenced = false;  // the arguments end with the json fence's close
  };
  static std::optional<Head> head_of(std::string_view body, bool final);

 private:
  enum class State { content, between, in_call, done };
  void drain(Step& out);
  // The open call's arguments from its text so far (`body`): the pieces not yet
  // sent, up to what is sure (`final`: all of them), then the call when final.
  void stream_call(std::string_view body, bool final, Step& out);
  State state_ = State::content;
  std::string buf_;
  size_t calls_ = 0;
  bool parallel_ = true;
  std::optional<Head> head_;  // the open call's, once known
  size_t sent_ = 0;           // bytes of its arguments sent in deltas
  std::vector<ToolCallDelta> pending_;  // the forced start's, for the first step
};

}  // namespace troupe::gateway
