#include "actors/gateway/tool_calls.hpp"

#include <algorithm>
#include <utility>

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
  // The forced start opens the section (no content comes of it) and, named, the call:
  // its opening delta goes out with the first step.
  Step opened;
  buf_ = std::move(forced);
  drain(opened);
  pending_ = std::move(opened.deltas);
}

std::optional<ToolCallParser::Head> ToolCallParser::head_of(std::string_view body, bool final) {
  Head h;
  const auto sep = body.find(mk::tool_sep);
  if (sep == std::string_view::npos) {  // a name alone (the call cut short)
    if (!final) return std::nullopt;
    h.name = std::string(trim(body));
    h.args_at = body.size();
    return h;
  }
  const std::string_view head = trim(body.substr(0, sep));
  const size_t rest_at = sep + mk::tool_sep.size();
  const std::string_view rest = body.substr(rest_at);
  // The arguments begin at `at` (in rest): fenced when the json fence comes first there.
  // Undecided while what follows could still become the fence.
  auto args_from = [&](size_t at) -> bool {
    const std::string_view r = rest.substr(std::min(at, rest.size()));
    const auto b = r.find_first_not_of(" \t\r\n");
    const std::string_view lead = b == std::string_view::npos ? std::string_view{} : r.substr(b);
    if (starts_with(lead, kFence)) {
      h.fenced = true;
      h.args_at = rest_at + at + b + kFence.size();
      return true;
    }
    if (!final && starts_with(kFence, lead)) return false;
    h.args_at = rest_at + std::min(at, rest.size());
    return true;
  };
  if (head != "function") {  // the later form: NAME<sep>ARGUMENTS (or a fence before them)
    h.name = std::string(head);
    return args_from(0) ? std::optional<Head>(h) : std::nullopt;
  }
  // The V3 form: function<sep>NAME, a newline or the fence, the arguments.
  const auto name_at = rest.find_first_not_of(" \t\r\n");
  const auto fence = rest.find(kFence);
  const auto eol = name_at == std::string_view::npos ? std::string_view::npos : rest.find('\n', name_at);
  if (fence != std::string_view::npos && (eol == std::string_view::npos || fence < eol)) {
    h.name = std::string(trim(rest.substr(0, fence)));
    h.fenced = true;
    h.args_at = rest_at + fence + kFence.size();
    return h;
  }
  if (eol == std::string_view::npos) {
    if (!final) return std::nullopt;
    h.name = std::string(trim(rest));
    h.args_at = body.size();
    return h;
  }
  h.name = std::string(trim(rest.substr(0, eol)));
  return args_from(eol + 1) ? std::optional<Head>(h) : std::nullopt;
}

void ToolCallParser::stream_call(std::string_view body, bool final, Step& out) {
  if (!head_) {
    head_ = head_of(body, final);
    if (!head_) return;
    out.deltas.push_back({calls_, true, head_->type, head_->name, {}});
    sent_ = 0;
  }
  // The arguments: trimmed; fenced ones without the fence's close. What is sure before the
  // end: all but trailing blanks (and backquotes, fenced), which may yet be the close.
  std::string_view args = body.substr(std::min(head_->args_at, body.size()));
  args = trim(args);
  if (final) {
    if (head_->fenced) {
      while (!args.empty() && args.back() == '`') args.remove_suffix(1);
      args = trim(args);
    }
  } else {
    const auto last = args.find_last_not_of(head_->fenced ? " \t\r\n`" : " \t\r\n");
    args = last == std::string_view::npos ? std::string_view{} : args.substr(0, last + 1);
  }
  if (args.size() > sent_) {
    if (out.deltas.empty() || out.deltas.back().index != calls_) out.deltas.push_back({calls_, false, {}, {}, {}});
    out.deltas.back().arguments += args.substr(sent_);
    sent_ = args.size();
  }
  if (!final) return;
  out.calls.push_back({head_->type, head_->name, std::string(args)});
  head_.reset();
  ++calls_;
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
        if (end == std::string::npos) {  // the call so far, a possible end marker held back
          stream_call(std::string_view(buf_).substr(0, buf_.size() - partial_suffix(buf_, mk::tool_call_end)), false, out);
          return;
        }
        const std::string body = buf_.substr(0, end);
        buf_.erase(0, end + mk::tool_call_end.size());
        state_ = State::between;
        stream_call(body, true, out);
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
  out.deltas = std::exchange(pending_, {});
  buf_ += text;
  drain(out);
  return out;
}

ToolCallParser::Step ToolCallParser::finish() {
  Step out;
  out.deltas = std::exchange(pending_, {});
  if (state_ == State::content) {
    out.content = std::move(buf_);
  } else if (state_ == State::in_call) {
    std::string_view body = buf_;
    body.remove_suffix(partial_suffix(body, mk::tool_call_end));
    if (head_ || !trim(body).empty()) stream_call(body, true, out);
  }
  buf_.clear();
  state_ = State::done;
  return out;
}

}  // namespace troupe::gateway
