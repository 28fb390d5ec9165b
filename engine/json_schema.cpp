#include "engine/json_schema.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>

#include "base/error.hpp"
#include "base/json_depth.hpp"
#include "base/utf8_lead.hpp"
#include "engine/regex.hpp"
#include "engine/request.hpp"

namespace troupe::engine {

namespace {

constexpr uint16_t kMaxWhitespace = 64;  // consecutive whitespace bytes
constexpr uint32_t kMaxNumberBytes = 32;
constexpr size_t kMaxDepth = 32;         // frames on a stack
constexpr size_t kMaxNames = 64;         // properties of an object (a 64-bit set of those seen)
constexpr size_t kMaxMasks = 512;        // cached masks a grammar (16 KB each at a 129K vocabulary: 8 MB)
constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();

bool is_ws(uint8_t c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }
bool is_digit(uint8_t c) { return c >= '0' && c <= '9'; }
bool is_hex(uint8_t c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

// UTF-8: for a lead byte, how many continuation bytes follow and the range of the
// first of them (the rest are 0x80-0xBF); false for a byte that cannot lead one.
bool utf8_lead(uint8_t c, uint32_t& more, uint8_t& lo, uint8_t& hi) {
  const Utf8Lead lead = troupe::utf8_lead(c);
  if (lead.length < 2) return false;
  more = lead.length - 1;
  lo = lead.second_lo;
  hi = lead.second_hi;
  return true;
}

}  // namespace

// ---- vocabulary -----------------------------------------------------------------------

TokenVocabulary::TokenVocabulary(std::vector<std::string> bytes) : bytes_(std::move(bytes)) {
  const auto n = bytes_.size();
  plain_chars_.assign(n, -1);
  std::vector<uint32_t> count(257, 0);
  for (size_t id = 0; id < n; ++id) {
    const std::string& b = bytes_[id];
    if (b.empty()) continue;
    ++count[static_cast<uint8_t>(b[0]) + 1];
    int32_t chars = 0;
    bool plain = true;
    for (size_t i = 0; i < b.size() && plain;) {
      const auto c = static_cast<uint8_t>(b[i]);
      if (c < 0x20 || c == '"' || c == '\\') {
        plain = false;
      } else if (c < 0x80) {
        ++i;
      } else {
        uint32_t more = 0;
        uint8_t lo = 0, hi = 0;
        plain = utf8_lead(c, more, lo, hi) && i + more < b.size();
        for (uint32_t j = 1; plain && j <= more; ++j) {
          const auto d = static_cast<uint8_t>(b[i + j]);
          plain = d >= (j == 1 ? lo : 0x80) && d <= (j == 1 ? hi : 0xBF);
        }
        i += more + 1;
      }
      ++chars;
    }
    if (plain) plain_chars_[id] = chars;
  }
  first_begin_.assign(257, 0);
  for (size_t b = 1; b <= 256; ++b) first_begin_[b] = first_begin_[b - 1] + count[b];
  by_first_.assign(first_begin_[256], 0);
  std::vector<uint32_t> at(first_begin_.begin(), first_begin_.end() - 1);
  for (size_t id = 0; id < n; ++id) {
    if (!bytes_[id].empty()) by_first_[at[static_cast<uint8_t>(bytes_[id][0])]++] = static_cast<int32_t>(id);
  }
}

std::span<const int32_t> TokenVocabulary::starting_with(uint8_t b) const {
  return std::span(by_first_).subspan(first_begin_[b], first_begin_[b + 1u] - first_begin_[b]);
}

// ---- the compiled schema --------------------------------------------------------------

enum class Kind : uint8_t { object, array, string, number, integer, literal, any_of };

struct JsonGrammar::Node {
  Kind kind = Kind::any_of;
  // object: property names as they are written after the opening quote (closing
  // quote included), sorted, and each one's value; names required; the value of
  // any key when there are no names (kNone: no keys at all).
  std::vector<std::string> names;
  std::vector<uint32_t> values;
  uint64_t required = 0;
  uint32_t extra = kNone;
  uint32_t items = kNone;                     // array: items past prefix_items (kNone: none)
  std::vector<uint32_t> prefix_items;         // array: the first items' own schemas
  int64_t min_count = 0, max_count = -1;      // array items, string characters (-1: no bound)
  // number / integer: the value's range (JSON Schema's minimum / maximum and their
  // exclusive forms, as doubles: the value a reader parses from the text is compared).
  bool bounded = false;
  double lo = -std::numeric_limits<double>::infinity(), hi = std::numeric_limits<double>::infinity();
  bool lo_open = false, hi_open = false;
  std::shared_ptr<const ByteDfa> pattern;     // string: what its text must match (pattern, format); a regex_grammar()'s text
  std::vector<std::string> texts;             // literal: the values as JSON, compact, sorted
  std::vector<uint32_t> options;              // any_of
};

// One open value. Frames are plain bytes so that a state can be a cache key.
// kRaw: a regex_grammar()'s text, its bytes straight into the pattern.
enum FrameKind : uint8_t { kValue, kObject, kArray, kString, kNumber, kLiteral, kKey, kRaw };
// kObject subs
enum : uint8_t { kObjOpen, kObjKeyNext, kObjInKey, kObjColon, kObjInValue, kObjAfterValue };
// kArray subs
enum : uint8_t { kArrOpen, kArrNext, kArrInValue, kArrAfterValue };
// kString subs
enum : uint8_t { kStrText, kStrEscape, kStrHex, kStrUtf8 };
// kNumber subs (the digits of JSON's number grammar; `whole` ones may end the number)
enum : uint8_t { kNumStart, kNumMinus, kNumZero, kNumInt, kNumDot, kNumFrac, kNumExp, kNumExpSign, kNumExpDigits };
bool number_whole(uint8_t sub) { return sub == kNumZero || sub == kNumInt || sub == kNumFrac || sub == kNumExpDigits; }

// A value interval [a, b] (an end open where its flag says) meets the node's range.
static bool meets(const JsonGrammar::Node& n, double a, bool a_open, double b, bool b_open);
// Whether some number that begins with `t` (no exponent) lies in the node's range,
// and whether `t` itself does.
static bool reachable(const JsonGrammar::Node& n, std::string_view t);
static bool in_range(const JsonGrammar::Node& n, std::string_view t);

struct JsonGrammar::Frame {
  uint32_t node = 0;
  uint8_t kind = kValue;
  uint8_t sub = 0;
  uint16_t ws = 0;  // whitespace bytes in a row
  // kObject: the key being read or just read (kNone: a free key); kArray: items so
  // far; kString: characters so far (only where the node bounds them); kNumber:
  // bytes so far; kLiteral / kKey: the first text still possible.
  uint32_t a = 0;
  // kLiteral / kKey: one past the last text still possible; kString: in an escape,
  // hex digits read; in a character, continuation bytes still due; kNumber: exponent digits.
  // A bounded number keeps its text, 4 bits a byte, in c, d and seen.
  uint32_t b = 0;
  // kLiteral / kKey: bytes matched; kString in a character: the next byte's range;
  // in a \u escape of a string with a pattern: the hex digits' value so far.
  uint32_t c = 0;
  uint32_t d = 0;       // kString with a pattern, kRaw: the pattern's state (else zero: frames compare as bytes)

  uint64_t seen = 0;    // kObject: the names read
};
static_assert(sizeof(JsonGrammar::Frame) == 32);

namespace {

// A bounded number's text in the frame: '0'-'9' as 0-9, '-' as 10, '.' as 11.
void put_number_byte(JsonGrammar::Frame& f, uint32_t i, uint8_t c) {
  const uint64_t code = c == '-' ? 10 : c == '.' ? 11 : c - '0';
  if (i < 8) {
    f.c |= static_cast<uint32_t>(code) << (4 * i);
  } else if (i < 16) {
    f.d |= static_cast<uint32_t>(code) << (4 * (i - 8));
  } else {
    f.seen |= code << (4 * (i - 16));
  }
}

std::string number_text(const JsonGrammar::Frame& f) {
  std::string t;
  for (uint32_t i = 0; i < f.a; ++i) {
    const uint64_t code = i < 8 ? f.c >> (4 * i) : i < 16 ? f.d >> (4 * (i - 8)) : f.seen >> (4 * (i - 16));
    const auto d = static_cast<uint8_t>(code & 0xF);
    t.push_back(d == 10 ? '-' : d == 11 ? '.' : static_cast<char>('0' + d));
  }
  return t;
}

}  // namespace

static bool meets(const JsonGrammar::Node& n, double a, bool a_open, double b, bool b_open) {
  double lo = a, hi = b;
  bool lo_open = a_open, hi_open = b_open;
  if (n.lo > lo || (n.lo == lo && n.lo_open)) {
    lo = n.lo;
    lo_open = n.lo_open || (n.lo == a && a_open);
  }
  if (n.hi < hi || (n.hi == hi && n.hi_open)) {
    hi = n.hi;
    hi_open = n.hi_open || (n.hi == b && b_open);
  }
  return lo < hi || (lo == hi && !lo_open && !hi_open);
}

static bool reachable(const JsonGrammar::Node& n, std::string_view t) {
  const bool neg = !t.empty() && t[0] == '-';
  const std::string body(neg ? t.substr(1) : t);
  const bool integer = n.kind == Kind::integer;
  // Magnitudes [m0, m1) (closed at m1 for an integer's last value), as signed values.
  auto span = [&](double m0, double m1, bool closed) {
    return neg ? meets(n, -m1, !closed, -m0, false) : meets(n, m0, false, m1, !closed);
  };
  const double inf = std::numeric_limits<double>::infinity();
  if (body.empty()) return span(0, inf, false);
  if (const auto dot = body.find('.'); dot != std::string::npos) {
    const double m0 = std::strtod(body.c_str(), nullptr);
    return span(m0, m0 + std::pow(10.0, -static_cast<double>(body.size() - dot - 1)), false);
  }
  if (body == "0") return integer ? span(0, 0, true) : span(0, 1, false);
  const double v = std::strtod(body.c_str(), nullptr);
  double p = 1;
  for (size_t more = 0; t.size() + more <= kMaxNumberBytes; ++more, p *= 10) {  // more digits to come
    if (integer ? span(v * p, (v + 1) * p - 1, true) : span(v * p, (v + 1) * p, false)) return true;
  }
  return false;
}

static bool in_range(const JsonGrammar::Node& n, std::string_view t) {
  const double v = std::strtod(std::string(t).c_str(), nullptr);
  return meets(n, v, false, v, false);
}

struct JsonGrammar::State {
  std::vector<Frame> frames;  // the stacks one after another
  std::vector<uint32_t> ends; // each stack's end in frames
  void clear() {
    frames.clear();
    ends.clear();
  }
  void push(const std::vector<Frame>& s) {
    frames.insert(frames.end(), s.begin(), s.end());
    ends.push_back(static_cast<uint32_t>(frames.size()));
  }
  size_t stacks() const { return ends.size(); }
  std::span<const Frame> stack(size_t i) const {
    const uint32_t begin = i == 0 ? 0 : ends[i - 1];
    return std::span(frames).subspan(begin, ends[i] - begin);
  }
  std::string key() const {
    std::string k(reinterpret_cast<const char*>(frames.data()), frames.size() * sizeof(Frame));
    k.append(reinterpret_cast<const char*>(ends.data()), ends.size() * sizeof(uint32_t));
    return k;
  }
  // Drops stacks equal to an earlier one.
  void dedup() {
    if (ends.size() < 2) return;
    State out;
    for (size_t i = 0; i < ends.size(); ++i) {
      const auto s = stack(i);
      bool twin = false;
      for (size_t j = 0; j < out.ends.size() && !twin; ++j) {
        const auto t = out.stack(j);
        twin = t.size() == s.size() && (s.empty() || std::memcmp(t.data(), s.data(), s.size() * sizeof(Frame)) == 0);
      }
      if (!twin) {
        out.frames.insert(out.frames.end(), s.begin(), s.end());
        out.ends.push_back(static_cast<uint32_t>(out.frames.size()));
      }
    }
    *this = std::move(out);
  }
};

namespace {

using Json = nlohmann::json;
using Node = JsonGrammar::Node;

// Schema keywords read past: annotations and metadata (JSON Schema 2020-12's, OpenAPI's, OpenAI's).
bool annotation(const std::string& k) {
  static const char* const kAnnotations[] = {"title", "description", "default", "examples", "format", "$schema",
                                             "$id", "$comment", "deprecated", "readOnly", "writeOnly", "strict",
                                             "contentMediaType", "contentEncoding", "$anchor", "example",
                                             "discriminator", "xml", "externalDocs"};
  for (const char* a : kAnnotations) {
    if (k == a) return true;
  }
  return false;
}

// Compiles schema documents into nodes. Node 0 is any value.
class Compiler {
 public:
  explicit Compiler(const Json& doc) : doc_(doc) {
    nodes_.resize(6);
    // 0 any value: one of 1-5
    nodes_[0].kind = Kind::any_of;
    nodes_[0].options = {1, 2, 3, 4, 5};
    nodes_[1].kind = Kind::object;  // any object
    nodes_[1].extra = 0;
    nodes_[2].kind = Kind::array;   // any array
    nodes_[2].items = 0;
    nodes_[3].kind = Kind::string;
    nodes_[4].kind = Kind::number;
    nodes_[5].kind = Kind::literal;
    nodes_[5].texts = {"false", "null", "true"};
  }
  std::vector<Node> take() { return std::move(nodes_); }

  uint32_t compile(const Json& s, const std::string& at) {
    if (s.is_boolean()) {
      if (s.get<bool>()) return 0;
      fail(at, "the schema false matches nothing");
    }
    if (!s.is_object()) fail(at, "a schema must be an object or a boolean");
    if (s.contains("$ref")) return ref(s, at);
    if (s.contains("nullable") && s["nullable"] == true) {
      Json rest = s;
      rest.erase("nullable");
      return add_any_of({compile(rest, at), literal({Json(nullptr)})});
    }
    for (const char* k : {"anyOf", "oneOf"}) {
      if (!s.contains(k)) continue;
      only(s, at, {k, "$defs", "definitions", "nullable"});
      const Json& list = s[k];
      if (!list.is_array() || list.empty()) fail(at + "/" + k, "must be a non-empty array of schemas");
      std::vector<uint32_t> options;
      for (size_t i = 0; i < list.size(); ++i) options.push_back(compile(list[i], fmt::format("{}/{}/{}", at, k, i)));
      return add_any_of(std::move(options));
    }
    if (s.contains("allOf")) {
      only(s, at, {"allOf", "$defs", "definitions"});
      const Json& list = s["allOf"];
      if (!list.is_array() || list.size() != 1) fail(at + "/allOf", "only an allOf of one schema is held");
      return compile(list[0], at + "/allOf/0");
    }
    if (s.contains("const")) {
      only(s, at, {"const", "type", "$defs", "definitions"});
      return literal({s["const"]});
    }
    if (s.contains("enum")) {
      only(s, at, {"enum", "type", "$defs", "definitions"});
      const Json& list = s["enum"];
      if (!list.is_array() || list.empty()) fail(at + "/enum", "must be a non-empty array");
      return literal(std::vector<Json>(list.begin(), list.end()));
    }
    std::vector<std::string> types;
    if (s.contains("type")) {
      const Json& t = s["type"];
      if (t.is_string()) {
        types.push_back(t.get<std::string>());
      } else if (t.is_array() && !t.empty()) {
        for (const auto& x : t) {
          if (!x.is_string()) fail(at + "/type", "must be a type name or a list of them");
          types.push_back(x.get<std::string>());
        }
      } else {
        fail(at + "/type", "must be a type name or a list of them");
      }
    } else if (s.contains("properties") || s.contains("required") || s.contains("additionalProperties")) {
      types = {"object"};
    } else if (s.contains("items") || s.contains("prefixItems") || s.contains("minItems") || s.contains("maxItems")) {
      types = {"array"};
    } else if (s.contains("minLength") || s.contains("maxLength") || s.contains("pattern")) {
      types = {"string"};
    }
    for (const char* k : {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}) {
      const bool numeric = std::any_of(types.begin(), types.end(), [](const auto& t) { return t == "number" || t == "integer"; });
      if (s.contains(k) && !numeric) fail(at + "/" + k, fmt::format("'{}' is held only beside type number or integer", k));
    }
    for (const auto& [k, v] : s.items()) {
      static const char* const kHeld[] = {"type", "properties", "required", "additionalProperties", "items",
                                          "prefixItems", "minItems", "maxItems", "minLength", "maxLength",
                                          "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "$defs",
                                          "definitions", "pattern"};
      bool held = annotation(k);
      for (const char* h : kHeld) held = held || k == h;
      if (!held) fail(at + "/" + k, fmt::format("the keyword '{}' is not supported", k));
    }
    if (types.empty()) return 0;
    if (types.size() == 1) return typed(s, types[0], at);
    std::vector<uint32_t> options;
    for (const auto& t : types) options.push_back(typed(s, t, at));
    return add_any_of(std::move(options));
  }

 private:
  [[noreturn]] static void fail(const std::string& at, const std::string& why) {
    raise(ErrorCode::invalid_argument, "json schema at '#{}': {}", at, why);
  }
  static void only(const Json& s, const std::string& at, std::initializer_list<const char*> allowed) {
    for (const auto& [k, v] : s.items()) {
      bool ok = annotation(k);
      for (const char* a : allowed) ok = ok || k == a;
      if (!ok) fail(at + "/" + k, fmt::format("the keyword '{}' is not supported beside {}", k, *allowed.begin()));
    }
  }
  static int64_t count(const Json& s, const char* k, const std::string& at, int64_t none) {
    if (!s.contains(k)) return none;
    const Json& v = s[k];
    if (!v.is_number_integer() || v.get<int64_t>() < 0) fail(at + "/" + k, "must be a non-negative integer");
    return v.get<int64_t>();
  }

  uint32_t add(Node n) {
    nodes_.push_back(std::move(n));
    return static_cast<uint32_t>(nodes_.size() - 1);
  }
  uint32_t add_any_of(std::vector<uint32_t> options) {
    if (options.size() == 1) return options[0];
    Node n;
    n.kind = Kind::any_of;
    n.options = std::move(options);
    return add(std::move(n));
  }
  uint32_t literal(const std::vector<Json>& values) {
    Node n;
    n.kind = Kind::literal;
    for (const auto& v : values) n.texts.push_back(v.dump());
    std::sort(n.texts.begin(), n.texts.end());
    n.texts.erase(std::unique(n.texts.begin(), n.texts.end()), n.texts.end());
    return add(std::move(n));
  }

  uint32_t typed(const Json& s, const std::string& type, const std::string& at) {
    Node n;
    if (type == "object") {
      n.kind = Kind::object;
      const bool has_names = s.contains("properties") && s["properties"].is_object() && !s["properties"].empty();
      if (s.contains("properties") && !s["properties"].is_object()) fail(at + "/properties", "must be an object");
      // Properties named (even none, a tool without parameters): no others unless said.
      const Json extra = s.value("additionalProperties", Json(!s.contains("properties")));
      if (has_names) {
        if (!(extra.is_boolean() && !extra.get<bool>()) && s.contains("additionalProperties")) {
          fail(at + "/additionalProperties", "additional properties beside named ones are not supported");
        }
        const Json& props = s["properties"];
        if (props.size() > kMaxNames) fail(at + "/properties", fmt::format("more than {} properties", kMaxNames));
        std::vector<std::pair<std::string, std::string>> names;  // (written form, name)
        for (const auto& [name, v] : props.items()) names.emplace_back(Json(name).dump().substr(1), name);
        std::sort(names.begin(), names.end());
        const uint32_t self = add(Node{});  // reserved: the values may refer back through $ref
        for (size_t i = 0; i < names.size(); ++i) {
          n.names.push_back(names[i].first);
          n.values.push_back(compile(props[names[i].second], at + "/properties/" + names[i].second));
        }
        if (s.contains("required")) {
          const Json& req = s["required"];
          if (!req.is_array()) fail(at + "/required", "must be an array of property names");
          for (const auto& r : req) {
            const auto it = std::find_if(names.begin(), names.end(), [&](const auto& p) { return r.is_string() && p.second == r; });
            if (it == names.end()) fail(at + "/required", fmt::format("{} is not one of the properties", r.dump()));
            n.required |= uint64_t{1} << (it - names.begin());
          }
        }
        nodes_[self] = std::move(n);
        return self;
      }
      if (s.contains("required") && !s["required"].empty()) fail(at + "/required", "names properties the schema does not define");
      if (extra.is_boolean()) {
        n.extra = extra.get<bool>() ? 0 : kNone;
      } else {
        const uint32_t self = add(Node{});
        n.extra = compile(extra, at + "/additionalProperties");
        nodes_[self] = std::move(n);
        return self;
      }
      return add(std::move(n));
    }
    if (type == "array") {
      n.kind = Kind::array;
      n.min_count = count(s, "minItems", at, 0);
      n.max_count = count(s, "maxItems", at, -1);
      if (n.max_count >= 0 && n.max_count < n.min_count) fail(at, "maxItems is below minItems");
      const uint32_t self = add(Node{});
      if (s.contains("prefixItems")) {
        const Json& list = s["prefixItems"];
        if (!list.is_array()) fail(at + "/prefixItems", "must be an array of schemas");
        for (size_t i = 0; i < list.size(); ++i) n.prefix_items.push_back(compile(list[i], fmt::format("{}/prefixItems/{}", at, i)));
      }
      if (!s.contains("items") || s["items"] == true) {
        n.items = 0;
      } else if (s["items"] == false) {
        n.items = kNone;  // nothing past prefixItems
      } else {
        n.items = compile(s["items"], at + "/items");
      }
      nodes_[self] = std::move(n);
      return self;
    }
    if (type == "string") {
      n.kind = Kind::string;
      n.min_count = count(s, "minLength", at, 0);
      n.max_count = count(s, "maxLength", at, -1);
      if (n.max_count >= 0 && n.max_count < n.min_count) fail(at, "maxLength is below minLength");
      if (s.contains("pattern")) {  // JSON Schema's pattern: some part of the text matches (^ and $ anchor it)
        if (!s["pattern"].is_string()) fail(at + "/pattern", "must be a string (a regular expression)");
        try {
          n.pattern = ByteDfa::compile(s["pattern"].get<std::string>(), ByteDfa::Mode::search);
        } catch (const Error& e) {
          fail(at + "/pattern", e.what());
        }
      } else if (s.contains("format") && s["format"].is_string()) {
        n.pattern = format_pattern(s["format"].get<std::string>());
      }
      if (n.pattern && n.max_count >= 0 && n.pattern->min_chars(n.pattern->start()) > static_cast<uint64_t>(n.max_count)) {
        fail(at, fmt::format("no text of at most {} characters (maxLength) matches its {}", n.max_count,
                             s.contains("pattern") ? "pattern" : "format"));
      }
      return add(std::move(n));
    }
    if (type == "number" || type == "integer") {
      n.kind = type == "number" ? Kind::number : Kind::integer;
      auto bound = [&](const char* k) -> std::optional<double> {
        if (!s.contains(k)) return std::nullopt;
        if (!s[k].is_number()) fail(at + "/" + k, "must be a number");
        return s[k].get<double>();
      };
      for (const char* k : {"exclusiveMinimum", "exclusiveMaximum"}) {  // draft 4's form: a flag on minimum / maximum
        if (s.contains(k) && s[k].is_boolean()) fail(at + "/" + k, "must be a number (draft 4's boolean form is not held)");
      }
      if (auto v = bound("minimum")) n.lo = *v;
      if (auto v = bound("maximum")) n.hi = *v;
      if (auto v = bound("exclusiveMinimum"); v && *v >= n.lo) {
        n.lo = *v;
        n.lo_open = true;
      }
      if (auto v = bound("exclusiveMaximum"); v && *v <= n.hi) {
        n.hi = *v;
        n.hi_open = true;
      }
      n.bounded = std::isfinite(n.lo) || std::isfinite(n.hi);
      if (n.lo > n.hi || (n.lo == n.hi && (n.lo_open || n.hi_open))) fail(at, "the range of values is empty");
      const double first = n.lo_open ? std::floor(n.lo) + 1 : std::ceil(n.lo);
      const double last = n.hi_open ? std::ceil(n.hi) - 1 : std::floor(n.hi);
      if (n.kind == Kind::integer && first > last) fail(at, "no integer lies in the range");
      return add(std::move(n));
    }
    if (type == "boolean") return literal({Json(false), Json(true)});
    if (type == "null") return literal({Json(nullptr)});
    fail(at + "/type", fmt::format("unknown type '{}'", type));
  }

  // The formats held (the text is one of them whole); others are annotations. Beside a
  // pattern, the pattern is held and the format read past.
  static std::shared_ptr<const ByteDfa> format_pattern(const std::string& format) {
    // Dates are calendar dates Python's datetime (pydantic) reads: years 0001-9999, the
    // month's days, 29 February in leap years; no leap second; at most 6 fraction digits.
    const std::string date =
        "(([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|"
        "(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))|"
        "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)-02-29)";
    const std::string time = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])";
    const std::pair<const char*, std::string> formats[] = {
        {"date", date},
        {"time", time},
        {"date-time", date + "[Tt]" + time},
        {"uuid", "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"},
        {"ipv4", "((25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\\.){3}(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"},
        {"email", "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(\\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*@"
                  "([A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?\\.)+[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"},
    };
    for (const auto& [name, re] : formats) {
      if (format == name) return ByteDfa::compile(re, ByteDfa::Mode::whole);  // tens of microseconds; grammars are cached
    }
    return nullptr;
  }

  uint32_t ref(const Json& s, const std::string& at) {
    only(s, at, {"$ref", "$defs", "definitions"});
    const Json& r = s["$ref"];
    if (!r.is_string()) fail(at + "/$ref", "must be a string");
    const std::string path = r.get<std::string>();
    if (path.empty() || path[0] != '#') fail(at + "/$ref", fmt::format("'{}': only references into this document (#...) are held", path));
    if (auto it = refs_.find(path); it != refs_.end()) return it->second;
    const Json* target = nullptr;
    try {
      target = &doc_.at(Json::json_pointer(path.substr(1)));
    } catch (const std::exception&) {
      fail(at + "/$ref", fmt::format("'{}' names nothing in the document", path));
    }
    // A node for the reference first, so that a schema referring to itself ends.
    const uint32_t self = add_any_of({0, 0});
    refs_[path] = self;
    const uint32_t body = compile(*target, path.substr(1));
    nodes_[self].options = {body};
    return self;
  }

  const Json& doc_;
  std::vector<Node> nodes_;
  std::unordered_map<std::string, uint32_t> refs_;
};

}  // namespace

JsonGrammar::JsonGrammar() = default;
JsonGrammar::~JsonGrammar() = default;

namespace {
constexpr size_t kMaxChoices = 1024;
}  // namespace

std::shared_ptr<JsonGrammar> JsonGrammar::compile(std::string_view schema) {
  if (schema.starts_with(kRegexTag)) {
    Node n;
    n.kind = Kind::string;
    n.pattern = ByteDfa::compile(schema.substr(kRegexTag.size()), ByteDfa::Mode::whole);
    std::shared_ptr<JsonGrammar> g(new JsonGrammar());
    g->nodes_.push_back(std::move(n));
    g->raw_ = true;
    for (auto& s : g->scratch_) s = std::make_unique<State>();
    return g;
  }
  if (schema.starts_with(kChoiceTag)) {
    Json list;
    try {
      list = Json::parse(schema.substr(kChoiceTag.size()));
    } catch (const std::exception& e) {
      raise(ErrorCode::invalid_argument, "the choices are not JSON: {}", e.what());
    }
    if (!list.is_array() || list.empty() || list.size() > kMaxChoices) {
      raise(ErrorCode::invalid_argument, "the choices must be a list of 1 to {} texts", kMaxChoices);
    }
    Node n;
    n.kind = Kind::literal;
    for (const auto& t : list) {
      if (!t.is_string() || t.get<std::string>().empty()) raise(ErrorCode::invalid_argument, "every choice must be non-empty text");
      n.texts.push_back(t.get<std::string>());
    }
    std::sort(n.texts.begin(), n.texts.end());
    n.texts.erase(std::unique(n.texts.begin(), n.texts.end()), n.texts.end());
    std::shared_ptr<JsonGrammar> g(new JsonGrammar());
    g->nodes_.push_back(std::move(n));
    g->raw_ = true;
    for (auto& s : g->scratch_) s = std::make_unique<State>();
    return g;
  }
  Json doc;
  try {
    doc = Json::parse(schema);
  } catch (const std::exception& e) {
    raise(ErrorCode::invalid_argument, "the json schema is not JSON: {}", e.what());
  }
  if (nests_deeper_than(doc, kMaxSchemaNesting)) {
    raise(ErrorCode::invalid_argument, "the json schema nests deeper than {} levels", kMaxSchemaNesting);
  }
  Compiler c(doc);
  const uint32_t root = c.compile(doc, "");
  std::shared_ptr<JsonGrammar> g(new JsonGrammar());
  g->nodes_ = c.take();
  g->root_ = root;
  // anyOf of anyOf (references among them) as one anyOf of values of other kinds:
  // stepping then never expands an option into more options, and a schema that
  // refers to itself without a value between ({"$ref": "#"}) is one of nothing.
  auto& nodes = g->nodes_;
  std::vector<std::vector<uint32_t>> flat(nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (nodes[i].kind != Kind::any_of) continue;
    std::vector<uint32_t> todo = nodes[i].options;
    std::vector<bool> seen(nodes.size(), false);
    seen[i] = true;
    while (!todo.empty()) {
      const uint32_t o = todo.back();
      todo.pop_back();
      if (seen[o]) continue;
      seen[o] = true;
      if (nodes[o].kind == Kind::any_of) {
        todo.insert(todo.end(), nodes[o].options.begin(), nodes[o].options.end());
      } else {
        flat[i].push_back(o);
      }
    }
    std::sort(flat[i].begin(), flat[i].end());
  }
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (nodes[i].kind == Kind::any_of) nodes[i].options = std::move(flat[i]);
  }
  if (nodes[root].kind == Kind::any_of && nodes[root].options.empty()) {
    raise(ErrorCode::invalid_argument, "json schema at '#': matches nothing (it refers to itself without a value between)");
  }
  for (auto& s : g->scratch_) s = std::make_unique<State>();
  return g;
}

// ---- stepping -------------------------------------------------------------------------

// The top frame is whole: pop it and tell its parent.
void JsonGrammar::finish_child(std::vector<Frame>& s) const {
  const Frame child = s.back();
  s.pop_back();
  if (s.empty()) return;
  Frame& p = s.back();
  p.ws = 0;
  if (p.kind == kObject) {
    if (p.sub == kObjInKey) {
      p.sub = kObjColon;
      p.a = child.kind == kKey ? child.a : kNone;
    } else {
      if (p.a != kNone) p.seen |= uint64_t{1} << p.a;
      p.sub = kObjAfterValue;
    }
  } else if (p.kind == kArray) {
    ++p.a;
    p.sub = kArrAfterValue;
  }
}

// Applies byte c to stack s (which it may change), adding every stack it leads to.
void JsonGrammar::step(std::vector<Frame>& s, uint8_t c, State& out) const {
  if (s.empty()) return;  // the value is whole: nothing may follow
  Frame& f = s.back();
  const Node& n = nodes_[f.node];
  auto whitespace = [&]() {
    if (f.ws < kMaxWhitespace) {
      ++f.ws;
      out.push(s);
    }
  };
  auto push_value = [&](uint32_t node) -> bool {
    if (s.size() >= kMaxDepth) return false;
    Frame v;
    v.node = node;
    s.push_back(v);
    return true;
  };
  switch (f.kind) {
    case kValue: {
      if (is_ws(c)) return whitespace();
      const uint16_t ws = f.ws;
      switch (n.kind) {
        case Kind::any_of: {  // its options are values of other kinds (compile flattens them)
          // Only the options a value can start with c: usually one, stepped in place.
          auto starts = [&](uint32_t o) {
            const Node& x = nodes_[o];
            switch (x.kind) {
              case Kind::object: return c == '{';
              case Kind::array: return c == '[';
              case Kind::string: return c == '"';
              case Kind::number:
              case Kind::integer: return c == '-' || is_digit(c);
              case Kind::literal:
                return std::any_of(x.texts.begin(), x.texts.end(), [&](const std::string& t) { return static_cast<uint8_t>(t[0]) == c; });
              case Kind::any_of: return true;
            }
            return true;
          };
          uint32_t last = kNone;
          for (uint32_t o : n.options) {
            if (!starts(o)) continue;
            if (last != kNone) {
              std::vector<Frame> t = s;
              t.back() = Frame{};
              t.back().node = last;
              t.back().ws = ws;
              step(t, c, out);
            }
            last = o;
          }
          if (last == kNone) return;
          f = Frame{};
          f.node = last;
          f.ws = ws;
          return step(s, c, out);
        }
        case Kind::object:
          if (c != '{') return;
          f.kind = kObject;
          f.sub = kObjOpen;
          f.ws = 0;
          f.a = kNone;
          return out.push(s);
        case Kind::array:
          if (c != '[') return;
          f.kind = kArray;
          f.sub = kArrOpen;
          f.ws = 0;
          return out.push(s);
        case Kind::string:
          if (c != '"') return;
          f.kind = kString;
          f.sub = kStrText;
          f.ws = 0;
          if (n.pattern) f.d = n.pattern->start();
          return out.push(s);
        case Kind::number:
        case Kind::integer:
          f.kind = kNumber;
          f.sub = kNumStart;
          f.ws = 0;
          return step(s, c, out);
        case Kind::literal:
          f.kind = kLiteral;
          f.a = 0;
          f.b = static_cast<uint32_t>(n.texts.size());
          f.c = 0;
          f.ws = 0;
          return step(s, c, out);
      }
      return;
    }
    case kObject: {
      const bool closed = n.extra == kNone;
      const bool more_names = closed ? (n.names.size() > static_cast<size_t>(__builtin_popcountll(f.seen))) : true;
      const bool may_close = (f.seen & n.required) == n.required;
      switch (f.sub) {
        case kObjOpen:
        case kObjKeyNext:
          if (is_ws(c)) return whitespace();
          if (c == '}' && f.sub == kObjOpen && may_close) {
            finish_child(s);
            return out.push(s);
          }
          if (c != '"' || !more_names || s.size() >= kMaxDepth) return;
          f.sub = kObjInKey;
          f.ws = 0;
          {
            Frame k;
            k.node = f.node;
            if (closed) {
              k.kind = kKey;
              k.a = 0;
              k.b = static_cast<uint32_t>(n.names.size());
              k.c = 0;
            } else {
              k.node = 3;  // a free key is any string
              k.kind = kString;
              k.sub = kStrText;
            }
            s.push_back(k);
          }
          return out.push(s);
        case kObjColon:
          if (is_ws(c)) return whitespace();
          if (c != ':') return;
          f.sub = kObjInValue;
          f.ws = 0;
          if (!push_value(f.a != kNone ? n.values[f.a] : n.extra)) return;
          return out.push(s);
        case kObjAfterValue:
          if (is_ws(c)) return whitespace();
          if (c == ',' && more_names) {
            f.sub = kObjKeyNext;
            f.ws = 0;
            f.a = kNone;
            return out.push(s);
          }
          if (c == '}' && may_close) {
            finish_child(s);
            return out.push(s);
          }
          return;
      }
      return;
    }
    case kArray: {
      // The schema of item i (kNone: no item i), whether maxItems allows it or not.
      auto item = [&](uint64_t i) -> uint32_t {
        if (n.max_count >= 0 && i >= static_cast<uint64_t>(n.max_count)) return kNone;
        return i < n.prefix_items.size() ? n.prefix_items[i] : n.items;
      };
      switch (f.sub) {
        case kArrOpen:
        case kArrNext:
          if (is_ws(c)) return whitespace();
          if (c == ']' && f.sub == kArrOpen && n.min_count == 0) {
            finish_child(s);
            return out.push(s);
          }
          if (item(f.a) == kNone) return;
          f.sub = kArrInValue;
          f.ws = 0;
          if (!push_value(item(f.a))) return;
          return step(s, c, out);
        case kArrAfterValue:
          if (is_ws(c)) return whitespace();
          if (c == ',' && item(f.a) != kNone) {
            f.sub = kArrNext;
            f.ws = 0;
            return out.push(s);
          }
          if (c == ']' && f.a >= static_cast<uint64_t>(n.min_count)) {
            finish_child(s);
            return out.push(s);
          }
          return;
      }
      return;
    }
    case kString: {
      const bool counted = n.min_count > 0 || n.max_count >= 0;
      auto one_char = [&]() -> bool {  // a character starts: within maxLength?
        if (!counted) return true;
        if (n.max_count >= 0 && f.a >= static_cast<uint64_t>(n.max_count)) return false;
        ++f.a;
        return true;
      };
      // A byte of the string's value (escapes decoded) into its pattern: false where it
      // breaks the pattern, or leaves it wanting more characters than maxLength allows.
      const ByteDfa* dfa = n.pattern.get();
      auto after = [&](uint8_t b) -> uint32_t {
        const uint32_t d = dfa->next(f.d, b);
        if (d == ByteDfa::kDead || (n.max_count >= 0 && f.a + dfa->min_chars(d) > static_cast<uint64_t>(n.max_count))) {
          return ByteDfa::kDead;
        }
        return d;
      };
      auto text = [&](uint8_t b) -> bool {
        if (!dfa) return true;
        const uint32_t d = after(b);
        if (d == ByteDfa::kDead) return false;
        f.d = d;
        return true;
      };
      // Whether one of the characters lo..hi (ASCII) may come next: with a pattern an
      // escape starts only where one of those it can still stand for does, so that no
      // answer is left inside an escape the pattern refuses whichever way it ends. (Under
      // a pattern, \u writes only control characters, which have no other form.)
      auto some = [&](uint8_t lo, uint8_t hi) {
        for (uint32_t b = lo; b <= hi; ++b) {
          if (after(static_cast<uint8_t>(b)) != ByteDfa::kDead) return true;
        }
        return false;
      };
      switch (f.sub) {
        case kStrText:
          if (c == '"') {
            if (f.a < static_cast<uint64_t>(n.min_count) || (dfa && !dfa->accepting(f.d))) return;
            finish_child(s);
            return out.push(s);
          }
          if (c == '\\') {
            if (!one_char()) return;
            if (dfa && !some(0x00, 0x1F) && !some('"', '"') && !some('\\', '\\') && !some('/', '/')) return;
            f.sub = kStrEscape;
            return out.push(s);
          }
          if (c < 0x20) return;
          if (c < 0x80) {
            if (!one_char() || !text(c)) return;
            return out.push(s);
          }
          {
            uint32_t more = 0;
            uint8_t lo = 0, hi = 0;
            if (!utf8_lead(c, more, lo, hi) || !one_char() || !text(c)) return;
            f.sub = kStrUtf8;
            f.b = more;
            f.c = static_cast<uint32_t>(lo) << 8 | hi;
          }
          return out.push(s);
        case kStrEscape: {
          if (c == 'u') {
            if (dfa && !some(0x00, 0x1F)) return;
            f.sub = kStrHex;
            f.b = 0;
            f.c = 0;
            return out.push(s);
          }
          const uint8_t value = c == 'b' ? '\b' : c == 'f' ? '\f' : c == 'n' ? '\n' : c == 'r' ? '\r' : c == 't' ? '\t' : c;
          if (c != '"' && c != '\\' && c != '/' && c != 'b' && c != 'f' && c != 'n' && c != 'r' && c != 't') return;
          if (!text(value)) return;
          f.sub = kStrText;
          return out.push(s);
        }
        case kStrHex:
          if (!is_hex(c)) return;
          if (dfa) {  // \u00XX, a control character: 0, 0, then 0 or 1 where one of its 16 may come, then one that may
            const auto v = static_cast<uint32_t>(is_digit(c) ? c - '0' : (c | 0x20) - 'a' + 10);
            if (f.b < 2 ? v != 0 : f.b == 2 ? v > 1 || !some(static_cast<uint8_t>(v * 16), static_cast<uint8_t>(v * 16 + 15)) : false) {
              return;
            }
            f.c = f.c * 16 + v;
          }
          if (++f.b == 4) {
            if (dfa && !text(static_cast<uint8_t>(f.c))) return;
            f.sub = kStrText;
            f.b = 0;
            f.c = 0;
          }
          return out.push(s);
        case kStrUtf8:
          if (c < (f.c >> 8) || c > (f.c & 0xFF) || !text(c)) return;
          if (--f.b == 0) {
            f.sub = kStrText;
            f.c = 0;
          } else {
            f.c = 0x80BF;
          }
          return out.push(s);
      }
      return;
    }
    case kNumber: {
      const bool integer = n.kind == Kind::integer;
      uint8_t next = 0xFF;
      switch (f.sub) {
        case kNumStart: next = c == '-' ? kNumMinus : c == '0' ? kNumZero : is_digit(c) ? kNumInt : 0xFF; break;
        case kNumMinus: next = c == '0' ? kNumZero : is_digit(c) ? kNumInt : 0xFF; break;
        case kNumZero: next = integer ? 0xFF : c == '.' ? kNumDot : (c == 'e' || c == 'E') ? kNumExp : 0xFF; break;
        case kNumInt:
          next = is_digit(c) ? kNumInt : integer ? 0xFF : c == '.' ? kNumDot : (c == 'e' || c == 'E') ? kNumExp : 0xFF;
          break;
        case kNumDot: next = is_digit(c) ? kNumFrac : 0xFF; break;
        case kNumFrac: next = is_digit(c) ? kNumFrac : (c == 'e' || c == 'E') ? kNumExp : 0xFF; break;
        case kNumExp: next = (c == '+' || c == '-') ? kNumExpSign : is_digit(c) ? kNumExpDigits : 0xFF; break;
        case kNumExpSign: next = is_digit(c) ? kNumExpDigits : 0xFF; break;
        case kNumExpDigits: next = is_digit(c) && f.b < 2 ? kNumExpDigits : 0xFF; break;
      }
      if (n.bounded && next == kNumExp) next = 0xFF;  // a bounded number is written without an exponent
      if (next != 0xFF) {
        if (f.a + 1 > kMaxNumberBytes) return;
        if (n.bounded) {
          if (!reachable(n, number_text(f) + static_cast<char>(c))) return;
          put_number_byte(f, f.a, c);
        }
        ++f.a;
        if (next == kNumExpDigits) ++f.b;
        f.sub = next;
        return out.push(s);
      }
      if (!number_whole(f.sub) || (n.bounded && !in_range(n, number_text(f)))) return;
      finish_child(s);  // the byte is the parent's
      return step(s, c, out);
    }
    case kRaw: {  // a regex_grammar()'s text: whole once nothing can extend a match
      const ByteDfa& dfa = *n.pattern;
      const uint32_t d = dfa.next(f.d, c);
      if (d == ByteDfa::kDead) return;
      f.d = d;
      if (dfa.accepting(d) && !dfa.extends(d)) finish_child(s);
      return out.push(s);
    }
    case kLiteral:
    case kKey: {
      const auto& texts = f.kind == kKey ? n.names : n.texts;
      const uint32_t pos = f.c;
      // The texts in [a, b) share their first pos bytes (sorted: a whole one first);
      // those with byte c next are a run of them.
      const bool whole = pos > 0 && texts[f.a].size() == pos;
      uint32_t lo = f.a;
      while (lo < f.b && (texts[lo].size() <= pos || static_cast<uint8_t>(texts[lo][pos]) != c)) ++lo;
      uint32_t hi = lo;
      while (hi < f.b && texts[hi].size() > pos && static_cast<uint8_t>(texts[hi][pos]) == c) ++hi;
      if (f.kind == kKey) {
        // A name is written with its closing quote, so none is a prefix of another;
        // names already read cannot come again.
        const uint64_t seen = s[s.size() - 2].seen;
        uint32_t unseen = lo;
        while (unseen < hi && (seen >> unseen & 1)) ++unseen;
        if (unseen == hi) return;
        f.a = lo;
        f.b = hi;
        f.c = pos + 1;
        if (texts[lo].size() == pos + 1) finish_child(s);  // the closing quote: the key is read
        return out.push(s);
      }
      if (lo < hi) {  // the byte is the literal's
        std::vector<Frame> t = s;
        t.back().a = lo;
        t.back().b = hi;
        t.back().c = pos + 1;
        if (hi == lo + 1 && texts[lo].size() == pos + 1) finish_child(t);  // whole, and nothing longer
        out.push(t);
      }
      if (whole) {  // a literal that other ones extend (1 of [1, 10]) ends at a byte none of them has
        finish_child(s);
        step(s, c, out);
      }
      return;
    }
  }
}

void JsonGrammar::step_all(const State& in, uint8_t c, State& out) const {
  out.clear();
  thread_local std::vector<Frame> s;
  for (size_t i = 0; i < in.stacks(); ++i) {
    const auto st = in.stack(i);
    s.assign(st.begin(), st.end());
    step(s, c, out);
  }
  out.dedup();
}

bool JsonGrammar::accepting(const State& s) const {
  for (size_t i = 0; i < s.stacks(); ++i) {
    const auto st = s.stack(i);
    if (st.empty()) return true;
    if (st.size() != 1) continue;
    const Frame& f = st[0];
    if (f.kind == kNumber && number_whole(f.sub) && (!nodes_[f.node].bounded || in_range(nodes_[f.node], number_text(f)))) {
      return true;
    }
    if (f.kind == kLiteral && f.c > 0 && nodes_[f.node].texts[f.a].size() == f.c) return true;
    if (f.kind == kRaw && nodes_[f.node].pattern->accepting(f.d)) return true;
  }
  return false;
}

const TokenMask& JsonGrammar::mask(const State& state, const TokenVocabulary& vocab) {
  if (mask_vocab_ != &vocab) {
    masks_.clear();
    mask_vocab_ = &vocab;
  }
  std::string key = state.key();
  if (auto it = masks_.find(key); it != masks_.end()) return it->second;
  if (masks_.size() >= kMaxMasks) masks_.clear();
  TokenMask bits((static_cast<size_t>(vocab.size()) + 63) / 64, 0);
  auto allow = [&](int32_t id) { bits[static_cast<size_t>(id) >> 6] |= uint64_t{1} << (id & 63); };
  // Inside a string: plain text leaves the state as it is (but for the characters
  // maxLength counts, and the pattern's state), so those tokens are decided without
  // stepping the frames: a pattern runs them through its table.
  bool in_text = false;
  if (state.stacks() == 1 && !state.frames.empty()) {
    const Frame& top = state.frames.back();
    const Node& n = nodes_[top.node];
    if (top.kind == kRaw) {  // a regex_grammar(): every token through the pattern alone
      const ByteDfa& dfa = *n.pattern;
      for (int32_t id = 0; id < vocab.size(); ++id) {
        if (!vocab.bytes(id).empty() && dfa.run(top.d, vocab.bytes(id)) != ByteDfa::kDead) allow(id);
      }
      return masks_.emplace(std::move(key), std::move(bits)).first->second;
    }
    if (top.kind == kString && top.sub == kStrText) {
      in_text = true;
      const int64_t room = n.max_count >= 0 ? n.max_count - static_cast<int64_t>(top.a) : -1;  // characters left
      const ByteDfa* dfa = n.pattern.get();
      for (int32_t id = 0; id < vocab.size(); ++id) {
        const int32_t chars = vocab.plain_chars(id);
        if (chars < 0 || (room >= 0 && chars > room)) continue;
        if (dfa) {
          const uint32_t d = dfa->run(top.d, vocab.bytes(id));
          if (d == ByteDfa::kDead || (room >= 0 && chars + static_cast<int64_t>(dfa->min_chars(d)) > room)) continue;
        }
        allow(id);
      }
    }
  }
  State& first = *scratch_[0];
  State& a = *scratch_[1];
  State& b = *scratch_[2];
  for (int c0 = 0; c0 < 256; ++c0) {
    const auto ids = vocab.starting_with(static_cast<uint8_t>(c0));
    if (ids.empty()) continue;
    step_all(state, static_cast<uint8_t>(c0), first);
    if (first.stacks() == 0) continue;
    for (int32_t id : ids) {
      if (in_text && vocab.plain_chars(id) >= 0) continue;  // decided above
      const std::string_view t = vocab.bytes(id);
      bool ok = true;
      if (t.size() > 1) {
        a = first;
        for (size_t i = 1; i < t.size() && ok; ++i) {
          step_all(a, static_cast<uint8_t>(t[i]), b);
          std::swap(a, b);
          ok = a.stacks() > 0;
        }
      }
      if (ok) allow(id);
    }
  }
  return masks_.emplace(std::move(key), std::move(bits)).first->second;
}

// ---- matcher --------------------------------------------------------------------------

JsonMatcher::JsonMatcher(std::shared_ptr<JsonGrammar> grammar)
    : grammar_(std::move(grammar)), state_(std::make_unique<JsonGrammar::State>()), next_(std::make_unique<JsonGrammar::State>()) {
  JsonGrammar::Frame root;
  root.node = grammar_->root_;
  if (grammar_->raw_ && grammar_->nodes_[root.node].pattern) {  // a regex_grammar(): its text from the first byte
    root.kind = kRaw;
    root.d = grammar_->nodes_[root.node].pattern->start();
  } else if (grammar_->raw_) {  // a choice_grammar(): the texts from the first byte
    root.kind = kLiteral;
    root.b = static_cast<uint32_t>(grammar_->nodes_[root.node].texts.size());
  }
  state_->push({root});
}
JsonMatcher::~JsonMatcher() = default;
JsonMatcher::JsonMatcher(const JsonMatcher& other)
    : grammar_(other.grammar_),
      state_(std::make_unique<JsonGrammar::State>(*other.state_)),
      next_(std::make_unique<JsonGrammar::State>()) {}
JsonMatcher& JsonMatcher::operator=(const JsonMatcher& other) {
  if (this != &other) {
    grammar_ = other.grammar_;
    *state_ = *other.state_;
  }
  return *this;
}
JsonMatcher::JsonMatcher(JsonMatcher&&) noexcept = default;
JsonMatcher& JsonMatcher::operator=(JsonMatcher&&) noexcept = default;

bool JsonMatcher::feed(std::string_view bytes) {
  for (char c : bytes) {
    if (dead()) return false;
    grammar_->step_all(*state_, static_cast<uint8_t>(c), *next_);
    std::swap(state_, next_);
  }
  return !dead();
}

bool JsonMatcher::dead() const { return state_->stacks() == 0; }

bool JsonMatcher::may_end() const { return grammar_->accepting(*state_); }

bool JsonMatcher::complete() const {
  for (size_t i = 0; i < state_->stacks(); ++i) {
    if (!state_->stack(i).empty()) return false;
  }
  return !dead();
}

const TokenMask& JsonMatcher::allowed(const TokenVocabulary& vocab) { return grammar_->mask(*state_, vocab); }

// ---- cache ----------------------------------------------------------------------------

std::shared_ptr<JsonGrammar> GrammarCache::get(const std::string& schema) {
  constexpr size_t kMaxGrammars = 32;  // with their masks at most ~256 MB
  if (auto it = grammars_.find(schema); it != grammars_.end()) {
    it->second.first = ++uses_;
    return it->second.second;
  }
  auto g = JsonGrammar::compile(schema);
  if (grammars_.size() >= kMaxGrammars) {
    std::vector<uint64_t> uses;
    for (const auto& [k, v] : grammars_) uses.push_back(v.first);
    std::nth_element(uses.begin(), uses.begin() + static_cast<std::ptrdiff_t>(uses.size() / 2), uses.end());
    const uint64_t cut = uses[uses.size() / 2];
    std::erase_if(grammars_, [&](const auto& kv) { return kv.second.first < cut; });
  }
  grammars_.emplace(schema, std::make_pair(++uses_, g));
  return g;
}

}  // namespace troupe::engine
