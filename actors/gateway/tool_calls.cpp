#include "actors/gateway/tool_calls.hpp"

#include <algorithm>

namespace troupe::gateway {
namespace mk = tokenizer::marker;
namespace {

constexpr std::string_view kFence = "```json";

std::string_view trim(std::string_view s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

// The length of the longest end of `s` that begins `m` (a marker that may be on its way).
size_t partial_suffix(std::string_view s, std::string_view m) {
  for (size_t n = std::min(s.size(), m.size() - 1); n > 0; --n) {
    if (s.substr(s.size() - n) == m.substr(0, n)) return n;
  }
  return 0;
}

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

}  // namespace

std::vector<tokenizer::ChatPart> tools_prompt(const std::vector<ToolSpec>& tools) {
  std::vector<tokenizer::ChatPart> p;
  auto text = [&](std::string t) { p.push_back({std::move(t), false}); };
  auto marker = [&](std::string_view m) { p.push_back({std::string(m), true}); };
  std::string defs = "## Tools\n\nYou can call these functions:\n";
  for (const auto& t : tools) defs += "\n```json\n" + t.function.dump() + "\n```\n";
  defs += "\nTo call functions, answer with the calls alone, in this form, the arguments valid JSON that follows the "
          "function's parameters:\n";
  text(std::move(defs));
  marker(mk::tool_calls_begin);
  marker(mk::tool_call_begin);
  text("function");
  marker(mk::tool_sep);
  text("FUNCTION_NAME\n```json\n{\"parameter\": \"value\"}\n```");
  marker(mk::tool_call_end);
  marker(mk::tool_calls_end);
  text("\nFurther calls follow the first one, each on a line of its own, before ");
  marker(mk::tool_calls_end);
  text(".");
  return p;
}

std::vector<tokenizer::ChatPart> forced_call_start(const ToolChoice& choice) {
  if (!choice.forces_call()) return {};
  std::vector<tokenizer::ChatPart> p{{std::string(mk::tool_calls_begin), true},
                                     {std::string(mk::tool_call_begin), true},
                                     {"function", false},
                                     {std::string(mk::tool_sep), true}};
  if (choice.mode == ToolChoice::named) p.push_back({choice.name + "\n" + std::string(kFence) + "\n", false});
  return p;
}

ToolCallParser::ToolCallParser(std::string forced, bool parallel) : parallel_(parallel) {
  Step ignored;  // (the forced start opens the section: no content comes of it)
  buf_ = std::move(forced);
  drain(ignored);
}

void ToolCallParser::take_call(std::string_view body, Step& out) {
  ToolCall call;
  const auto sep = body.find(mk::tool_sep);
  if (sep == std::string_view::npos) {
    call.name = std::string(trim(body));
  } else {
    const std::string_view head = trim(body.substr(0, sep)), rest = body.substr(sep + mk::tool_sep.size());
    if (const auto fence = rest.find(kFence); fence != std::string_view::npos) {  // type, name, fenced arguments
      if (!head.empty()) call.type = std::string(head);
      call.name = std::string(trim(rest.substr(0, fence)));
      std::string_view args = rest.substr(fence + kFence.size());
      args = trim(args);
      while (!args.empty() && args.back() == '`') args.remove_suffix(1);  // the closing fence (or part of it)
      call.arguments = std::string(trim(args));
    } else if (head == "function") {  // type, then the name's line and arguments without their fence
      const std::string_view r = trim(rest);
      const auto eol = r.find('\n');
      call.name = std::string(trim(r.substr(0, eol)));
      if (eol != std::string_view::npos) call.arguments = std::string(trim(r.substr(eol + 1)));
    } else {  // name, arguments
      call.name = std::string(head);
      call.arguments = std::string(trim(rest));
    }
  }
  ++calls_;
  out.calls.push_back(std::move(call));
  if (!parallel_) state_ = State::done;
}

void ToolCallParser::drain(Step& out) {
  for (;;) {
    switch (state_) {
      case State::content: {
        const auto at = buf_.find(mk::tool_calls_begin);
        if (at == std::string::npos) {
          const size_t keep = partial_suffix(buf_, mk::tool_calls_begin);
          out.content += buf_.substr(0, buf_.size() - keep);
          buf_.erase(0, buf_.size() - keep);
          return;
        }
        out.content += buf_.substr(0, at);
        buf_.erase(0, at + mk::tool_calls_begin.size());
        state_ = State::between;
        break;
      }
      case State::between: {
        const auto b = buf_.find_first_not_of(" \t\r\n");
        buf_.erase(0, b == std::string::npos ? buf_.size() : b);
        if (buf_.empty()) return;
        if (starts_with(buf_, mk::tool_call_begin)) {
          buf_.erase(0, mk::tool_call_begin.size());
          state_ = State::in_call;
        } else if (starts_with(buf_, mk::tool_calls_end)) {
          buf_.clear();
          state_ = State::done;
        } else if (starts_with(mk::tool_call_begin, buf_) || starts_with(mk::tool_calls_end, buf_)) {
          return;  // a marker on its way
        } else {
          // Something else between calls: skipped up to the next possible marker.
          const auto next = buf_.find('<', 1);
          buf_.erase(0, next == std::string::npos ? buf_.size() : next);
        }
        break;
      }
      case State::in_call: {
        const auto end = buf_.find(mk::tool_call_end);
        if (end == std::string::npos) return;
        const std::string body = buf_.substr(0, end);
        buf_.erase(0, end + mk::tool_call_end.size());
        state_ = State::between;
        take_call(body, out);
        break;
      }
      case State::done:
        buf_.clear();
        return;
    }
  }
}

ToolCallParser::Step ToolCallParser::push(std::string_view text) {
  Step out;
  buf_ += text;
  drain(out);
  return out;
}

ToolCallParser::Step ToolCallParser::finish() {
  Step out;
  if (state_ == State::content) {
    out.content = std::move(buf_);
  } else if (state_ == State::in_call) {
    std::string_view body = buf_;
    body.remove_suffix(partial_suffix(body, mk::tool_call_end));
    if (!trim(body).empty()) take_call(body, out);
  }
  buf_.clear();
  state_ = State::done;
  return out;
}

}  // namespace troupe::gateway
