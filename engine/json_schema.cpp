#include "engine/json_schema.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <optional>

#include "base/error.hpp"
#include "base/json_depth.hpp"
#include "engine/grammar_parts.hpp"
#include "engine/regex.hpp"
#include "engine/request.hpp"

namespace troupe::engine {

using namespace grammar;

// ---- vocabulary -----------------------------------------------------------------------

TokenVocabulary::TokenVocabulary(std::vector<std::string> bytes) : bytes_(std::move(bytes)) {
  const auto n = bytes_.size();
  plain_chars_.assign(n, -1);
  for (size_t id = 0; id < n; ++id) {
    const std::string& b = bytes_[id];
    if (b.empty()) continue;
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
  std::vector<int32_t> ids;
  for (size_t id = 0; id < n; ++id) {
    if (!bytes_[id].empty()) ids.push_back(static_cast<int32_t>(id));
  }
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t x, int32_t y) { return bytes_[x] < bytes_[y]; });
  auto add = [&](Sorted& to, int32_t id) {
    uint32_t l = 0;
    if (!to.ids.empty()) {
      const std::string& a = bytes_[to.ids.back()];
      const std::string& b = bytes_[id];
      while (l < a.size() && l < b.size() && a[l] == b[l]) ++l;
    }
    to.ids.push_back(id);
    to.lcp.push_back(l);
  };
  for (int32_t id : ids) {
    add(sorted_, id);
    if (plain_chars_[id] < 0) add(not_plain_, id);
  }
}

// ---- compiling ------------------------------------------------------------------------

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

// A regular expression (engine/regex.hpp, matched whole) for exactly the texts `names`
// (UTF-8), every character escaped; nullopt where one is not UTF-8.
std::optional<std::string> names_regex(const std::vector<std::string>& names) {
  std::string out = "(?:";
  for (size_t k = 0; k < names.size(); ++k) {
    if (k > 0) out += "|";
    for (size_t i = 0; i < names[k].size();) {
      const auto c = next_code_point(names[k], i);
      if (!c) return std::nullopt;
      out += fmt::format("\\u{{{:X}}}", *c);
    }
  }
  return out + ")";
}

// Every text (valid UTF-8).
const ByteDfa& any_text() {
  static const auto dfa = ByteDfa::compile("[\\s\\S]*", ByteDfa::Mode::whole);
  return *dfa;
}

// Compiles schema documents into nodes. Node 0 is any value.
class Compiler {
 public:
  explicit Compiler(const Json& doc) : doc_(doc) {
    nodes_.resize(7);
    // 0 any value: one of 1-5
    nodes_[0].kind = Kind::any_of;
    nodes_[0].options = {1, 2, 3, 4, 5};
    nodes_[1].kind = Kind::object;  // any object: any key (6), any value
    nodes_[1].keys = {6};
    nodes_[6].kind = Kind::string;
    nodes_[6].value = 0;
    nodes_[2].kind = Kind::array;   // any array
    nodes_[2].items = 0;
    nodes_[3].kind = Kind::string;
    nodes_[4].kind = Kind::number;
    nodes_[5].kind = Kind::literal;
    nodes_[5].texts = {"false", "null", "true"};
  }
  std::vector<Node> take() { return std::move(nodes_); }
  // Arrays with uniqueItems, and where: their items are checked once references resolve.
  const std::vector<std::pair<uint32_t, std::string>>& unique_arrays() const { return unique_arrays_; }

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
    } else if (s.contains("properties") || s.contains("required") || s.contains("additionalProperties") ||
               s.contains("propertyNames") || s.contains("minProperties") || s.contains("maxProperties") ||
               s.contains("patternProperties")) {
      types = {"object"};
    } else if (s.contains("items") || s.contains("prefixItems") || s.contains("minItems") || s.contains("maxItems") ||
               s.contains("uniqueItems")) {
      types = {"array"};
    } else if (s.contains("minLength") || s.contains("maxLength") || s.contains("pattern")) {
      types = {"string"};
    }
    for (const char* k : {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}) {
      const bool numeric = std::any_of(types.begin(), types.end(), [](const auto& t) { return t == "number" || t == "integer"; });
      if (s.contains(k) && !numeric) fail(at + "/" + k, fmt::format("'{}' is held only beside type number or integer", k));
    }
    for (const auto& [k, v] : s.items()) {
      static const char* const kHeld[] = {"type", "properties", "required", "additionalProperties", "items",
                                          "prefixItems", "minItems", "maxItems", "minLength", "maxLength",
                                          "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "$defs",
                                          "definitions", "pattern", "uniqueItems", "propertyNames", "minProperties",
                                          "maxProperties", "patternProperties", "multipleOf"};
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

  // An object node: its named properties (sorted by their written form, each with its value
  // and whether it is required) and its other keys, as string nodes whose Node::value is
  // the value their keys take: for each patternProperties pattern the keys it alone
  // matches, and where additionalProperties allows, the keys no pattern matches; a key
  // that is a name is never an other key. propertyNames (without names or patterns): a
  // string schema for the other keys, or an enum of names. minProperties and
  // maxProperties are typed()'s.
  uint32_t object(const Json& s, const std::string& at) {
    Node n;
    n.kind = Kind::object;
    if (s.contains("properties") && !s["properties"].is_object()) fail(at + "/properties", "must be an object");
    const Json props = s.value("properties", Json::object());
    const Json patterns = s.value("patternProperties", Json::object());
    if (!patterns.is_object()) fail(at + "/patternProperties", "must be an object of patterns and schemas");
    // Properties named (even none, a tool without parameters): no others unless said.
    const Json extra = s.value("additionalProperties", Json(!s.contains("properties")));
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
    const bool others_allowed = !(extra.is_boolean() && !extra.get<bool>());
    const uint32_t other_value = !others_allowed ? kNone : extra.is_boolean() ? 0 : compile(extra, at + "/additionalProperties");
    if (s.contains("propertyNames")) {
      if (!names.empty() || !patterns.empty()) {
        fail(at + "/propertyNames", "propertyNames beside properties or patternProperties is not supported");
      }
      property_names(n, s["propertyNames"], other_value, at + "/propertyNames");
      nodes_[self] = std::move(n);
      return self;
    }
    // The parts every other key's automaton is made of: any text, the names, the patterns.
    std::vector<std::string> plain;
    for (const auto& [written, name] : names) plain.push_back(name);
    std::shared_ptr<const ByteDfa> named;
    if (!plain.empty()) {
      const auto re = names_regex(plain);
      if (!re) fail(at + "/properties", "a name is not UTF-8");
      named = ByteDfa::compile(*re, ByteDfa::Mode::whole);
    }
    std::vector<std::shared_ptr<const ByteDfa>> dfas;
    std::vector<uint32_t> pattern_values;
    for (const auto& [p, v] : patterns.items()) {
      const std::string where = at + "/patternProperties/" + p;
      try {
        dfas.push_back(ByteDfa::compile(p, ByteDfa::Mode::search));
      } catch (const Error& e) {
        fail(where, e.what());
      }
      for (const auto& name : plain) {
        const uint32_t st = dfas.back()->run(dfas.back()->start(), name);
        if (st != ByteDfa::kDead && dfas.back()->accepting(st)) {
          fail(where, fmt::format("the property '{}' matches it too: a value under both schemas is not supported", name));
        }
      }
      pattern_values.push_back(compile(v, where));
    }
    std::vector<const ByteDfa*> parts = {&any_text()};
    if (named) parts.push_back(named.get());
    const size_t first = parts.size();  // the patterns' parts from here
    for (const auto& d : dfas) parts.push_back(d.get());
    // A key's automaton: any text, not a name, matched by pattern `only` alone (kNone: by none).
    auto keys_of = [&](uint32_t only) {
      return ByteDfa::combine(parts, [&](const std::vector<bool>& acc) {
        if (!acc[0] || (named && acc[1])) return false;
        for (size_t i = first; i < acc.size(); ++i) {
          if (acc[i] != (i - first == only)) return false;
        }
        return true;
      });
    };
    for (size_t i = 0; i < dfas.size(); ++i) {
      if (auto d = keys_of(static_cast<uint32_t>(i))) n.keys.push_back(key_node(std::move(d), pattern_values[i]));  // (none: always with another)
    }
    if (others_allowed) {
      if (!named && dfas.empty()) {
        n.keys.push_back(key_node(nullptr, other_value));  // any key
      } else if (auto d = keys_of(kNone)) {
        n.keys.push_back(key_node(std::move(d), other_value));
      }
    }
    nodes_[self] = std::move(n);
    return self;
  }

  // A string node for other keys of an object: texts `keys` takes (null: any), each one's value `value`.
  uint32_t key_node(std::shared_ptr<const ByteDfa> keys, uint32_t value) {
    Node k;
    k.kind = Kind::string;
    k.pattern = std::move(keys);
    k.value = value;
    return add(std::move(k));
  }

  // propertyNames (no names or patterns beside it) into object `n` whose other keys' value
  // is `value` (kNone: no other key): a string schema for the keys, or an enum of names.
  void property_names(Node& n, const Json& schema, uint32_t value, const std::string& at) {
    if (schema == false || value == kNone) return;  // no key at all
    const uint32_t keys = compile(schema, at);
    const Node& k = nodes_[keys];
    if (keys == 0) {  // true, {}: any key
      n.keys.push_back(key_node(nullptr, value));
    } else if (k.kind == Kind::string) {
      Node copy = k;  // (the node may be shared)
      copy.value = value;
      n.keys.push_back(add(std::move(copy)));
    } else if (k.kind == Kind::literal && k.texts.size() <= kMaxNames &&
               std::all_of(k.texts.begin(), k.texts.end(), [](const std::string& t) { return t[0] == '"'; })) {
      for (const std::string& t : k.texts) {  // compact JSON strings, sorted: as properties' written forms
        n.names.push_back(t.substr(1));
        n.values.push_back(value);
      }
    } else {
      fail(at, fmt::format("must be a string schema, or an enum of at most {} names", kMaxNames));
    }
  }

  uint32_t typed(const Json& s, const std::string& type, const std::string& at) {
    if (type == "object") {
      const uint32_t id = object(s, at);
      Node& o = nodes_[id];
      o.min_count = count(s, "minProperties", at, 0);
      o.max_count = count(s, "maxProperties", at, -1);
      const auto required = static_cast<int64_t>(__builtin_popcountll(o.required));
      if (o.max_count >= 0 && o.max_count < std::max(o.min_count, required)) {
        fail(at, o.max_count < o.min_count ? "maxProperties is below minProperties"
                                           : fmt::format("maxProperties is below the {} required properties", required));
      }
      if (o.keys.empty() && static_cast<int64_t>(o.names.size()) < o.min_count) {
        fail(at, fmt::format("minProperties is above the {} properties the object may have", o.names.size()));
      }
      return id;
    }
    Node n;
    if (type == "array") {
      n.kind = Kind::array;
      n.min_count = count(s, "minItems", at, 0);
      n.max_count = count(s, "maxItems", at, -1);
      if (n.max_count >= 0 && n.max_count < n.min_count) fail(at, "maxItems is below minItems");
      const uint32_t self = add(Node{});
      if (s.contains("uniqueItems")) {
        if (!s["uniqueItems"].is_boolean()) fail(at + "/uniqueItems", "must be true or false");
        if (s["uniqueItems"].get<bool>()) {
          if (s.contains("prefixItems")) fail(at + "/uniqueItems", "uniqueItems beside prefixItems is not supported");
          n.unique = true;
          unique_arrays_.emplace_back(self, at + "/uniqueItems");
        }
      }
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
      if (s.contains("multipleOf")) {  // whole numbers: an integer's digits, its remainder checked as they come
        const Json& m = s["multipleOf"];
        if (!m.is_number() || m.get<double>() <= 0) fail(at + "/multipleOf", "must be a number above 0");
        const double v = m.get<double>();
        if (v != std::floor(v) || v > 1e9) {
          fail(at + "/multipleOf", fmt::format("multipleOf {} is held only as a whole number up to 10^9", m.dump()));
        }
        n.multiple = static_cast<uint64_t>(v);
        n.kind = Kind::integer;  // (a number's multiples of a whole number, written as integers)
        n.bounded = true;
        if (!reachable(n, "")) fail(at + "/multipleOf", fmt::format("no multiple of {} lies in the range", n.multiple));
      }
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
  std::vector<std::pair<uint32_t, std::string>> unique_arrays_;
};

}  // namespace

JsonGrammar::JsonGrammar() = default;
JsonGrammar::~JsonGrammar() = default;

namespace {

constexpr size_t kMaxChoices = 1024;

// Node::depth and Node::deepest of every JSON node: the least fixed point from kNoFit down
// (references make the nodes a graph; a value that needs itself inside never fits).
void set_depths(std::vector<Node>& nodes) {
  for (auto& n : nodes) n.depth = n.kind == Kind::object || n.kind == Kind::array || n.kind == Kind::any_of ? kNoFit : 1;
  auto inside = [](uint32_t d) { return std::min(kNoFit, d + 1); };
  for (bool changed = true; changed;) {
    changed = false;
    for (auto& n : nodes) {
      uint32_t d = n.depth;
      if (n.kind == Kind::object) {
        d = 1;
        std::vector<uint32_t> optional;  // the others' depths, for minProperties past the required ones
        for (size_t i = 0; i < n.names.size(); ++i) {
          if (n.required >> i & 1) {
            d = std::max(d, inside(nodes[n.values[i]].depth));
          } else {
            optional.push_back(nodes[n.values[i]].depth);
          }
        }
        const auto more = n.min_count - static_cast<int64_t>(n.names.size() - optional.size());
        if (more > 0) {  // the cheapest `more` of the optional ones, or other keys' values (any number of them)
          uint32_t other = kNoFit;
          for (uint32_t k : n.keys) other = std::min(other, nodes[nodes[k].value].depth);
          std::sort(optional.begin(), optional.end());
          const uint32_t kth = static_cast<size_t>(more) <= optional.size() ? optional[static_cast<size_t>(more) - 1] : kNoFit;
          d = std::max(d, inside(std::min(kth, other)));
        }
      } else if (n.kind == Kind::array) {
        d = 1;
        for (int64_t i = 0; i < n.min_count; ++i) {
          const uint32_t item = static_cast<size_t>(i) < n.prefix_items.size() ? n.prefix_items[static_cast<size_t>(i)] : n.items;
          d = std::max(d, item != kNone ? inside(nodes[item].depth) : kNoFit);  // (no item i: no such array)
          if (static_cast<size_t>(i) >= n.prefix_items.size()) break;  // the rest are the same items
        }
      } else if (n.kind == Kind::any_of) {
        d = kNoFit;
        for (uint32_t o : n.options) d = std::min(d, nodes[o].depth);
      }
      if (d < n.depth) {
        n.depth = d;
        changed = true;
      }
    }
  }
  for (auto& n : nodes) {
    if (n.kind != Kind::object) continue;
    n.deepest = 0;
    for (uint32_t v : n.values) n.deepest = std::max(n.deepest, nodes[v].depth);
    for (uint32_t k : n.keys) n.deepest = std::max(n.deepest, nodes[nodes[k].value].depth);
  }
}

}  // namespace

std::shared_ptr<JsonGrammar> JsonGrammar::compile(std::string_view schema) {
  if (schema.starts_with(kEbnfTag)) {
    std::shared_ptr<JsonGrammar> g(new JsonGrammar());
    g->root_ = compile_ebnf(schema.substr(kEbnfTag.size()), g->nodes_);
    g->raw_ = true;
    return g;
  }
  if (schema.starts_with(kRegexTag)) {
    Node n;
    n.kind = Kind::string;
    n.pattern = ByteDfa::compile(schema.substr(kRegexTag.size()), ByteDfa::Mode::whole);
    std::shared_ptr<JsonGrammar> g(new JsonGrammar());
    g->nodes_.push_back(std::move(n));
    g->raw_ = true;
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
  // uniqueItems is held where an item is one of at most 64 values (enum, const, boolean):
  // the array's frame keeps a bit for each one used.
  for (const auto& [id, at] : c.unique_arrays()) {
    uint32_t& items = nodes[id].items;
    if (items != kNone && nodes[items].kind == Kind::any_of && nodes[items].options.size() == 1) items = nodes[items].options[0];
    if (items == kNone) continue;
    if (nodes[items].kind != Kind::literal || nodes[items].texts.size() > kMaxNames) {
      raise(ErrorCode::invalid_argument, "json schema at '#{}': uniqueItems is held only for items that are one of at most {} "
                                         "values (enum, const, boolean)", at, kMaxNames);
    }
    if (nodes[id].min_count > static_cast<int64_t>(nodes[items].texts.size())) {
      raise(ErrorCode::invalid_argument, "json schema at '#{}': minItems is above the {} distinct values the items may take", at,
            nodes[items].texts.size());
    }
  }
  if (nodes[root].kind == Kind::any_of && nodes[root].options.empty()) {
    raise(ErrorCode::invalid_argument, "json schema at '#': matches nothing (it refers to itself without a value between)");
  }
  set_depths(nodes);
  if (nodes[root].depth > kMaxDepth) {
    raise(ErrorCode::invalid_argument, "json schema at '#': no value of it nests within {} levels (required properties or "
                                       "minItems that need themselves inside, or more items than it allows?)", kMaxDepth);
  }
  return g;
}

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
