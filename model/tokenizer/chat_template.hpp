// Chat prompts for the DeepSeek template family (DeepSeek-V3's chat_template,
// which the DeepSeek-V4 tokenizer ships), rendered in C++ exactly as
// transformers' Jinja renders it, quirks included: the first tool call ever
// rendered opens "<｜tool▁calls▁begin｜>", later ones in the same conversation
// only add "\n<｜tool▁call▁begin｜>...", and "<｜tool▁calls▁end｜>" follows only
// those later ones.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace troupe::tokenizer {

struct ToolCall {
  std::string id;  // not rendered by this template
  std::string type = "function";
  std::string name;
  std::string arguments;  // JSON text, rendered verbatim
};

struct Message {
  std::string role;                    // system, user, assistant or tool
  std::optional<std::string> content;  // assistant: absent when it made tool calls
  std::vector<ToolCall> tool_calls;    // assistant only
  std::string tool_call_id;            // tool only; not rendered by this template
};

// One run of a rendered prompt: a marker of the template ("<｜User｜>") or text
// (message content, and literals such as "\n```json\n").
struct ChatPart {
  std::string text;
  bool marker = false;
};

struct ChatOptions {
  bool add_generation_prompt = false;  // end with the assistant's turn marker
  // Not the template's: what a server adds. `system_suffix` follows the system
  // prompt (after a blank line when there is one): tool definitions, their
  // markers as the template's tokens. `answer_prefix` follows the assistant's
  // turn marker, or the tool outputs the answer follows (add_generation_prompt
  // only): an answer's forced start.
  std::vector<ChatPart> system_suffix;
  std::vector<ChatPart> answer_prefix;
};

class ChatTemplate {
 public:
  // Recognizes the family of the Jinja `source` from tokenizer_config.json;
  // nullopt when troupe does not render it. `bos_token` fills {{bos_token}}.
  static std::optional<ChatTemplate> recognize(std::string_view source, std::string bos_token);

  // Throws troupe::Error(invalid_argument) naming the message, for what the
  // template cannot render: an unknown role, a missing content, an assistant
  // message with both content and tool calls (the template would drop the calls).
  std::vector<ChatPart> render_parts(std::span<const Message> messages, const ChatOptions& options) const;
  std::string render(std::span<const Message> messages, const ChatOptions& options) const;

  const char* family() const { return "deepseek-v3"; }

 private:
  explicit ChatTemplate(std::string bos_token) : bos_token_(std::move(bos_token)) {}
  std::string bos_token_;
};

// The markers the template writes, for tests and for callers that stop on them.
namespace marker {
inline constexpr std::string_view user = "<｜User｜>";
inline constexpr std::string_view assistant = "<｜Assistant｜>";
inline constexpr std::string_view end_of_sentence = "<｜end▁of▁sentence｜>";
inline constexpr std::string_view tool_calls_begin = "<｜tool▁calls▁begin｜>";
inline constexpr std::string_view tool_calls_end = "<｜tool▁calls▁end｜>";
inline constexpr std::string_view tool_call_begin = "<｜tool▁call▁begin｜>";
inline constexpr std::string_view tool_call_end = "<｜tool▁call▁end｜>";
inline constexpr std::string_view tool_sep = "<｜tool▁sep｜>";
inline constexpr std::string_view tool_outputs_begin = "<｜tool▁outputs▁begin｜>";
inline constexpr std::string_view tool_outputs_end = "<｜tool▁outputs▁end｜>";
inline constexpr std::string_view tool_output_begin = "<｜tool▁output▁begin｜>";
inline constexpr std::string_view tool_output_end = "<｜tool▁output▁end｜>";
}  // namespace marker

}  // namespace troupe::tokenizer
