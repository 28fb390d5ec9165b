#include "model/tokenizer/pre_tokenizer.hpp"

#include <nlohmann/json.hpp>

#include "base/error.hpp"

namespace troupe::tokenizer {
namespace {

using json = nlohmann::json;

// The regex ByteLevel applies when use_regex is true (GPT-2's).
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

bool flag(const json& j, const char* key, bool fallback) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? fallback : it->get<bool>();
}

}  // namespace

PreTokenizer PreTokenizer::from_json(const json& j) {
  PreTokenizer pt;
  if (j.is_null()) return pt;
  std::vector<const json*> parts;
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    for (const auto& p : j.at("pretokenizers")) parts.push_back(&p);
  } else {
    parts.push_back(&j);
  }
  for (const json* p : parts) {
    const std::string t = p->value("type", "");
    if (t == "Split") {
      const json& pattern = p->at("pattern");
      const bool literal = pattern.contains("String");
      const std::string source =
          literal ? pattern.at("String").get<std::string>() : pattern.at("Regex").get<std::string>();
      const std::string behavior = p->value("behavior", "");
      if (flag(*p, "invert", false)) {
        raise(ErrorCode::unsupported, "tokenizer.json: Split with invert=true is not supported");
      }
      Behavior b;
      if (behavior == "Isolated") {
        b = Behavior::isolated;
      } else if (behavior == "Removed") {
        b = Behavior::removed;
      } else {
        raise(ErrorCode::unsupported, "tokenizer.json: Split behavior '{}' is not supported (Isolated, Removed)",
              behavior);
      }
      pt.steps_.push_back(Step{Regex(source, literal), b});
    } else if (t == "ByteLevel") {
      if (flag(*p, "add_prefix_space", false)) {
        raise(ErrorCode::unsupported, "tokenizer.json: ByteLevel with add_prefix_space=true is not supported");
      }
      if (flag(*p, "use_regex", true)) pt.steps_.push_back(Step{Regex(kGpt2Pattern, false), Behavior::isolated});
      pt.byte_level_ = true;
    } else {
      raise(ErrorCode::unsupported, "tokenizer.json: pre-tokenizer '{}' is not supported", t);
    }
  }
  return pt;
}

std::vector<Span> PreTokenizer::split(std::string_view text) const {
  std::vector<Span> pieces, next;
  if (!text.empty()) pieces.push_back({0, text.size()});
  for (const Step& step : steps_) {
    next.clear();
    next.reserve(pieces.size() * 2);
    for (const Span& piece : pieces) {
      const std::string_view subject = text.substr(piece.begin, piece.end - piece.begin);
      size_t at = 0, gap = 0;  // [gap, match) is text between matches
      while (at < subject.size()) {
        auto m = step.regex.find(subject, at);
        if (!m) break;
        if (m->end == m->begin) {  // an empty match splits nothing
          at = m->end + 1;
          while (at < subject.size() && (static_cast<unsigned char>(subject[at]) & 0xC0) == 0x80) ++at;
          continue;
        }
        if (m->begin > gap) next.push_back({piece.begin + gap, piece.begin + m->begin});
        if (step.behavior == Behavior::isolated) next.push_back({piece.begin + m->begin, piece.begin + m->end});
        at = gap = m->end;
      }
      if (gap < subject.size()) next.push_back({piece.begin + gap, piece.end});
    }
    pieces.swap(next);
  }
  return pieces;
}

}  // namespace troupe::tokenizer
