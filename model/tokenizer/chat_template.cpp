#include "model/tokenizer/chat_template.hpp"

#include "base/error.hpp"

namespace troupe::tokenizer {
namespace {

// DeepSeek-V3's chat_template, byte for byte as tokenizer_config.json carries
// it. render_parts() below is its translation; a template that differs in any
// byte is not assumed to behave the same.
constexpr std::string_view kDeepSeekV3Template =
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% end"
    "if %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_pro"
    "mpt='', is_first_sp=true) %}{%- for message in messages %}{%- if message['role'] == 'syste"
    "m' %}{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content"
    "'] %}{% set ns.is_first_sp = false %}{%- else %}{% set ns.system_prompt = ns.system_prompt"
    " + '\n\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor %}{{bos_token}}{{ns.syst"
    "em_prompt}}{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_"
    "tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}{%- if message['role'] == '"
    "assistant' and message['content'] is none %}{%- set ns.is_tool = false -%}{%- for tool in "
    "message['tool_calls']%}{%- if not ns.is_first %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool"
    "▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json"
    "' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- set ns.is"
    "_first = true -%}{%- else %}{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' "
    "+ tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' +"
    " '```' + '<｜tool▁call▁end｜>'}}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- e"
    "ndfor %}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is not no"
    "ne %}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentenc"
    "e｜>'}}{%- set ns.is_tool = false -%}{%- else %}{{'<｜Assistant｜>' + message['content'] + '<"
    "｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}{%- if message['role'] == 'tool' %}{%- set ns"
    ".is_tool = true -%}{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begi"
    "n｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}{%"
    "- else %}{{'\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endi"
    "f %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}{% i"
    "f add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}";

class Renderer {
 public:
  void marker(std::string_view m) { parts_.push_back({std::string(m), true}); }
  void text(std::string_view t) {
    if (t.empty()) return;
    if (!parts_.empty() && !parts_.back().marker) {
      parts_.back().text += t;
    } else {
      parts_.push_back({std::string(t), false});
    }
  }
  std::vector<ChatPart> take() { return std::move(parts_); }

 private:
  std::vector<ChatPart> parts_;
};

[[noreturn]] void bad_message(size_t i, const Message& m, std::string_view what) {
  raise(ErrorCode::invalid_argument, "messages[{}] (role '{}'): {}", i, m.role, what);
}

// Refuses what the template cannot render faithfully, before rendering anything.
void check(std::span<const Message> messages) {
  for (size_t i = 0; i < messages.size(); ++i) {
    const Message& m = messages[i];
    if (m.role == "system" || m.role == "user" || m.role == "tool") {
      if (!m.content) bad_message(i, m, "content is missing");
      if (!m.tool_calls.empty()) bad_message(i, m, "only assistant messages carry tool_calls");
    } else if (m.role == "assistant") {
      if (!m.content && m.tool_calls.empty()) bad_message(i, m, "has neither content nor tool_calls");
    } else {
      bad_message(i, m, "the DeepSeek template renders only the roles system, user, assistant and tool");
    }
  }
}

}  // namespace

std::optional<ChatTemplate> ChatTemplate::recognize(std::string_view source, std::string bos_token) {
  if (source != kDeepSeekV3Template) return std::nullopt;
  return ChatTemplate(std::move(bos_token));
}

std::vector<ChatPart> ChatTemplate::render_parts(std::span<const Message> messages, const ChatOptions& options) const {
  check(messages);
  Renderer r;
  // System messages are gathered (joined by a blank line) ahead of the turns.
  std::string system_prompt;
  bool first_system = true;
  for (const Message& m : messages) {
    if (m.role != "system") continue;
    if (!first_system) system_prompt += "\n\n";
    system_prompt += *m.content;
    first_system = false;
  }
  if (!bos_token_.empty()) r.marker(bos_token_);
  r.text(system_prompt);
  if (!options.system_suffix.empty() && !system_prompt.empty()) r.text("\n\n");
  for (const ChatPart& p : options.system_suffix) p.marker ? r.marker(p.text) : r.text(p.text);

  // The template's namespace: is_first is set by the first tool call and never
  // cleared; is_output_first is cleared by the first tool output, ever.
  bool is_first = false, is_tool = false, is_output_first = true;
  auto tool_call_body = [&](const ToolCall& call) {
    r.marker(marker::tool_call_begin);
    r.text(call.type);
    r.marker(marker::tool_sep);
    r.text(call.name + "\n```json\n" + call.arguments + "\n```");
    r.marker(marker::tool_call_end);
  };
  // Content of only white space next to tool calls (what OpenAI clients send back) counts as none.
  auto blank = [](const std::optional<std::string>& c) {
    return !c || c->find_first_not_of(" \t\r\n") == std::string::npos;
  };
  for (const Message& m : messages) {
    if (m.role == "user") {
      is_tool = false;
      r.marker(marker::user);
      r.text(*m.content);
    } else if (m.role == "assistant" && !m.tool_calls.empty() && blank(m.content)) {
      is_tool = false;
      for (const ToolCall& call : m.tool_calls) {
        if (!is_first) {
          r.marker(marker::assistant);
          r.marker(marker::tool_calls_begin);
          tool_call_body(call);
          is_first = true;
        } else {
          r.text("\n");
          tool_call_body(call);
          r.marker(marker::tool_calls_end);
          r.marker(marker::end_of_sentence);
        }
      }
    } else if (m.role == "assistant") {
      if (is_tool) {
        r.marker(marker::tool_outputs_end);
        is_tool = false;
      } else {
        r.marker(marker::assistant);
      }
      r.text(*m.content);
      if (!m.tool_calls.empty()) {
        // Text, then calls: what the model wrote (the gateway returns it as content and tool_calls, and
        // clients send it back). transformers' template would render the text alone and drop the calls.
        r.marker(marker::tool_calls_begin);
        for (size_t c = 0; c < m.tool_calls.size(); ++c) {
          if (c > 0) r.text("\n");
          tool_call_body(m.tool_calls[c]);
        }
        r.marker(marker::tool_calls_end);
        is_first = true;
      }
      r.marker(marker::end_of_sentence);
    } else if (m.role == "tool") {
      is_tool = true;
      if (is_output_first) {
        r.marker(marker::tool_outputs_begin);
        is_output_first = false;
      } else {
        r.text("\n");
      }
      r.marker(marker::tool_output_begin);
      r.text(*m.content);
      r.marker(marker::tool_output_end);
    }
  }
  if (is_tool) r.marker(marker::tool_outputs_end);
  if (options.add_generation_prompt) {  // (after tool outputs the answer follows them directly)
    if (!is_tool) r.marker(marker::assistant);
    for (const ChatPart& p : options.answer_prefix) p.marker ? r.marker(p.text) : r.text(p.text);
  }
  return r.take();
}

std::string ChatTemplate::render(std::span<const Message> messages, const ChatOptions& options) const {
  std::string out;
  for (const ChatPart& p : render_parts(messages, options)) out += p.text;
  return out;
}

}  // namespace troupe::tokenizer
