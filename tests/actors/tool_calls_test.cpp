// The tool-call parser (actors/gateway/tool_calls): the DeepSeek call section
// into OpenAI tool calls, the same however the text is split as it streams.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "actors/gateway/tool_calls.hpp"

namespace troupe::gateway {
namespace {

namespace mk = tokenizer::marker;

std::string call_v3(const std::string& name, const std::string& args) {
  return std::string(mk::tool_call_begin) + "function" + std::string(mk::tool_sep) + name + "\n```json\n" + args +
         "\n```" + std::string(mk::tool_call_end);
}

std::string section(const std::vector<std::string>& calls) {
  std::string s(mk::tool_calls_begin);
  for (size_t i = 0; i < calls.size(); ++i) s += (i ? "\n" : "") + calls[i];
  return s + std::string(mk::tool_calls_end);
}

struct Outcome {
  std::string content;
  std::vector<ToolCall> calls;
};

Outcome run(const std::vector<std::string>& pieces, std::string forced = {}, bool parallel = true) {
  ToolCallParser p(std::move(forced), parallel);
  Outcome o;
  std::vector<ToolCall> streamed;  // the calls as their deltas build them
  auto take = [&](ToolCallParser::Step s) {
    o.content += s.content;
    for (auto& d : s.deltas) {
      if (d.opens) {
        EXPECT_EQ(d.index, streamed.size()) << "a call opens once, in order";
        streamed.push_back({d.type, d.name, {}});
      } else {
        EXPECT_EQ(d.index + 1, streamed.size()) << "arguments go to the open call";
      }
      if (d.index < streamed.size()) streamed[d.index].arguments += d.arguments;
    }
    for (auto& c : s.calls) {
      // A call completes after its deltas: they put together its name and arguments.
      EXPECT_LT(o.calls.size(), streamed.size());
      if (o.calls.size() < streamed.size()) {
        EXPECT_EQ(streamed[o.calls.size()].name, c.name);
        EXPECT_EQ(streamed[o.calls.size()].type, c.type);
        EXPECT_EQ(streamed[o.calls.size()].arguments, c.arguments);
      }
      o.calls.push_back(std::move(c));
    }
  };
  for (const auto& piece : pieces) take(p.push(piece));
  take(p.finish());
  EXPECT_EQ(streamed.size(), o.calls.size());
  return o;
}

// The text whole, byte by byte, and cut at every place into two.
std::vector<Outcome> every_split(const std::string& text, const std::string& forced = {}, bool parallel = true) {
  std::vector<Outcome> out{run({text}, forced, parallel)};
  std::vector<std::string> bytes;
  for (char c : text) bytes.emplace_back(1, c);
  out.push_back(run(bytes, forced, parallel));
  for (size_t cut = 1; cut < text.size(); ++cut) out.push_back(run({text.substr(0, cut), text.substr(cut)}, forced, parallel));
  return out;
}

void expect_calls(const Outcome& o, const std::vector<std::pair<std::string, std::string>>& want) {
  ASSERT_EQ(o.calls.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(o.calls[i].type, "function");
    EXPECT_EQ(o.calls[i].name, want[i].first);
    EXPECT_EQ(o.calls[i].arguments, want[i].second);
  }
}

TEST(ToolCalls, text_without_calls_is_all_content_however_it_streams) {
  const std::string text = "Plain <b>text</b> with a < and <｜tool▁calls nearly a marker, and an end <｜tool";
  for (const auto& o : every_split(text)) {
    EXPECT_EQ(o.content, text);
    EXPECT_TRUE(o.calls.empty());
  }
}

TEST(ToolCalls, content_then_two_calls_however_they_stream) {
  const std::string text = "Let me look that up." +
                           section({call_v3("get_weather", R"({"city": "Paris", "unit": "C"})"),
                                    call_v3("get_time", R"({"zone": "Europe/Paris"})")}) +
                           "<｜end▁of▁sentence｜> ignored";
  for (const auto& o : every_split(text)) {
    EXPECT_EQ(o.content, "Let me look that up.");
    expect_calls(o, {{"get_weather", R"({"city": "Paris", "unit": "C"})"}, {"get_time", R"({"zone": "Europe/Paris"})"}});
  }
}

TEST(ToolCalls, the_later_form_without_type_and_fence) {
  const std::string text = std::string(mk::tool_calls_begin) + std::string(mk::tool_call_begin) + "search" +
                           std::string(mk::tool_sep) + R"({"q": "troupe"})" + std::string(mk::tool_call_end) +
                           std::string(mk::tool_calls_end);
  for (const auto& o : every_split(text)) {
    EXPECT_EQ(o.content, "");
    expect_calls(o, {{"search", R"({"q": "troupe"})"}});
  }
}

TEST(ToolCalls, parallel_false_keeps_the_first_call) {
  const std::string text = section({call_v3("a", "{}"), call_v3("b", "{}")});
  for (const auto& o : every_split(text, {}, false)) expect_calls(o, {{"a", "{}"}});
}

TEST(ToolCalls, a_forced_start_names_the_function) {
  ToolChoice named{ToolChoice::named, "get_weather"};
  std::string forced;
  for (const auto& p : forced_call_start(named)) forced += p.text;
  const std::string answer = R"({"city": "Oslo"})" "\n```" + std::string(mk::tool_call_end) + std::string(mk::tool_calls_end);
  for (const auto& o : every_split(answer, forced)) {
    EXPECT_EQ(o.content, "");
    expect_calls(o, {{"get_weather", R"({"city": "Oslo"})"}});
  }
  // required: the model names the function.
  forced.clear();
  for (const auto& p : forced_call_start(ToolChoice{ToolChoice::required, ""})) forced += p.text;
  for (const auto& o : every_split("lookup\n```json\n{}\n```" + std::string(mk::tool_call_end), forced)) {
    expect_calls(o, {{"lookup", "{}"}});
  }
  // (and names it without the fence: the rest of the call is its arguments)
  for (const auto& o : every_split("lookup\n{\"k\": 1}" + std::string(mk::tool_call_end), forced)) {
    expect_calls(o, {{"lookup", "{\"k\": 1}"}});
  }
  EXPECT_TRUE(forced_call_start(ToolChoice{ToolChoice::auto_, ""}).empty());
  EXPECT_TRUE(forced_call_start(ToolChoice{ToolChoice::none, ""}).empty());
}

TEST(ToolCalls, an_answer_cut_inside_a_call_gives_its_arguments_so_far) {
  const std::string text = std::string(mk::tool_calls_begin) + std::string(mk::tool_call_begin) + "function" +
                           std::string(mk::tool_sep) + "f\n```json\n{\"x\": [1, 2";
  for (const auto& o : every_split(text)) expect_calls(o, {{"f", "{\"x\": [1, 2"}});
  // Cut in the closing fence, or in the end marker.
  for (const auto& o : every_split(text + "]}\n``")) expect_calls(o, {{"f", "{\"x\": [1, 2]}"}});
  for (const auto& o : every_split(text + "]}\n```<｜tool▁call")) expect_calls(o, {{"f", "{\"x\": [1, 2]}"}});
}

TEST(ToolCalls, arguments_stream_before_the_call_ends) {
  ToolCallParser p;
  std::string args;
  auto push = [&](const std::string& text) {
    auto s = p.push(text);
    for (const auto& d : s.deltas) args += d.arguments;
    return s;
  };
  auto s = push("Sure." + std::string(mk::tool_calls_begin) + std::string(mk::tool_call_begin) + "function" +
                std::string(mk::tool_sep) + "get_weather\n");
  EXPECT_EQ(s.content, "Sure.");
  EXPECT_TRUE(s.deltas.empty()) << "the fence may follow the name's line";
  s = push("```json\n{\"city\": ");
  ASSERT_EQ(s.deltas.size(), 1u);
  EXPECT_TRUE(s.deltas[0].opens);
  EXPECT_EQ(s.deltas[0].name, "get_weather");
  EXPECT_EQ(args, "{\"city\":");  // the blank after the colon held back
  push("\"Pa");
  EXPECT_EQ(args, "{\"city\": \"Pa");
  push("ris\"}\n``");  // the close of the fence held back
  EXPECT_EQ(args, "{\"city\": \"Paris\"}");
  s = push("`" + std::string(mk::tool_call_end));
  ASSERT_EQ(s.calls.size(), 1u);
  EXPECT_EQ(s.calls[0].arguments, args);
  // The later form: the arguments follow the separator.
  ToolCallParser later;
  std::string largs;
  const std::vector<std::string> pieces{
      std::string(mk::tool_calls_begin) + std::string(mk::tool_call_begin) + "search", std::string(mk::tool_sep),
      "{\"q\"", ": 1}", std::string(mk::tool_call_end)};
  for (const auto& piece : pieces) {
    for (const auto& d : later.push(piece).deltas) {
      if (d.opens) {
        EXPECT_EQ(d.name, "search");
      }
      largs += d.arguments;
    }
    if (piece == "{\"q\"") {
      EXPECT_EQ(largs, "{\"q\"");
    }
  }
  EXPECT_EQ(largs, "{\"q\": 1}");
}

TEST(ToolCalls, the_prompt_defines_the_tools_with_the_templates_markers) {
  std::vector<ToolSpec> tools{{"get_weather", {{"name", "get_weather"}, {"parameters", {{"type", "object"}}}}}};
  const auto parts = tools_prompt(tools);
  std::string text;
  int markers = 0;
  for (const auto& p : parts) {
    text += p.text;
    markers += p.marker;
    if (p.marker) {
      EXPECT_EQ(p.text.rfind("<｜tool", 0), 0u) << p.text;
    }
  }
  EXPECT_NE(text.find(R"({"name":"get_weather","parameters":{"type":"object"}})"), std::string::npos) << text;
  EXPECT_GE(markers, 5);
  // The format it shows is the one the parser reads.
  const auto start = text.find(mk::tool_calls_begin);
  const auto end = text.find(mk::tool_calls_end, start);
  const auto o = run({text.substr(start, end - start + mk::tool_calls_end.size())});
  expect_calls(o, {{"FUNCTION_NAME", R"({"parameter": "value"})"}});
}

}  // namespace
}  // namespace troupe::gateway
