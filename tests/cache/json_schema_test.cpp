// Structured output (engine/json_schema.hpp): the matcher against hand-written
// documents, random walks through it checked by an independent validator, token
// masks against feeding each token, and the keywords it refuses.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "base/error.hpp"
#include "engine/json_schema.hpp"
#include "model/tokenizer/default_tokenizer.hpp"
#include "model/tokenizer/tokenizer.hpp"

namespace troupe::engine {
namespace {

using Json = nlohmann::json;

// Characters (code points) of UTF-8 text.
int64_t chars(const std::string& s) {
  int64_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

// An independent reading of the schema subset json_schema.hpp holds: whether
// `v` is valid under `s` (root `doc` for $ref).
bool valid(const Json& v, const Json& s, const Json& doc) {
  if (s.is_boolean()) return s.get<bool>();
  if (s.contains("$ref")) return valid(v, doc.at(Json::json_pointer(s["$ref"].get<std::string>().substr(1))), doc);
  if (s.value("nullable", false) && v.is_null()) return true;
  for (const char* k : {"anyOf", "oneOf"}) {
    if (!s.contains(k)) continue;
    for (const auto& o : s[k]) {
      if (valid(v, o, doc)) return true;
    }
    return false;
  }
  if (s.contains("allOf")) return valid(v, s["allOf"][0], doc);
  if (s.contains("const")) return v == s["const"];
  if (s.contains("enum")) return std::find(s["enum"].begin(), s["enum"].end(), v) != s["enum"].end();
  std::vector<std::string> types;
  if (s.contains("type")) {
    if (s["type"].is_string()) types.push_back(s["type"]);
    for (const auto& t : s["type"]) {
      if (t.is_string()) types.push_back(t);
    }
  }
  auto typed = [&](const std::string& t) {
    if (t == "object") {
      if (!v.is_object()) return false;
      // Strict (OpenAI's, xgrammar's): properties named, even none, and no others unless said.
      const Json props = s.value("properties", Json::object());
      const Json others = s.value("additionalProperties", Json(!s.contains("properties")));
      const Json patterns = s.value("patternProperties", Json::object());
      for (const auto& [k, x] : v.items()) {
        bool matched = false;  // patternProperties: every pattern the key matches holds its value
        for (const auto& [p, ps] : patterns.items()) {
          if (!std::regex_search(k, std::regex(p))) continue;
          matched = true;
          if (!valid(x, ps, doc)) return false;
        }
        if (!props.contains(k) && matched) continue;
        if (!valid(x, props.contains(k) ? props[k] : others, doc)) return false;
        if (s.contains("propertyNames") && !valid(Json(k), s["propertyNames"], doc)) return false;
      }
      for (const auto& r : s.value("required", Json::array())) {
        if (!v.contains(r.get<std::string>())) return false;
      }
      if (static_cast<int64_t>(v.size()) < s.value("minProperties", 0)) return false;
      return !s.contains("maxProperties") || static_cast<int64_t>(v.size()) <= s["maxProperties"].get<int64_t>();
    }
    if (t == "array") {
      if (!v.is_array()) return false;
      if (static_cast<int64_t>(v.size()) < s.value("minItems", 0)) return false;
      if (s.contains("maxItems") && static_cast<int64_t>(v.size()) > s["maxItems"].get<int64_t>()) return false;
      if (s.value("uniqueItems", false)) {
        for (size_t i = 0; i < v.size(); ++i) {
          for (size_t k = 0; k < i; ++k) {
            if (v[i] == v[k]) return false;
          }
        }
      }
      const Json prefix = s.value("prefixItems", Json::array());
      for (size_t i = 0; i < v.size(); ++i) {
        if (!valid(v[i], i < prefix.size() ? prefix[i] : s.value("items", Json(true)), doc)) return false;
      }
      return true;
    }
    if (t == "string") {
      if (!v.is_string()) return false;
      const int64_t n = chars(v.get<std::string>());
      // (the tests' patterns are ASCII: std::regex reads the UTF-8 bytes one by one)
      if (s.contains("pattern") && !std::regex_search(v.get<std::string>(), std::regex(s["pattern"].get<std::string>()))) return false;
      return n >= s.value("minLength", 0) && (!s.contains("maxLength") || n <= s["maxLength"].get<int64_t>());
    }
    if (t == "integer" || t == "number") {
      if (!v.is_number()) return false;
      const double x = v.get<double>();
      if (t == "integer" && std::floor(x) != x) return false;  // (JSON Schema's: 1.0 and 10^21 are integers)
      // (past 2^53 a double no longer holds the digits: the matcher's exactness there is tested on its own)
      if (s.contains("multipleOf") && std::fabs(x) < 9e15 && std::fmod(x, s["multipleOf"].get<double>()) != 0) return false;
      return (!s.contains("minimum") || x >= s["minimum"].get<double>()) &&
             (!s.contains("maximum") || x <= s["maximum"].get<double>()) &&
             (!s.contains("exclusiveMinimum") || x > s["exclusiveMinimum"].get<double>()) &&
             (!s.contains("exclusiveMaximum") || x < s["exclusiveMaximum"].get<double>());
    }
    if (t == "boolean") return v.is_boolean();
    if (t == "null") return v.is_null();
    return false;
  };
  if (types.empty()) {
    if (s.contains("properties") || s.contains("additionalProperties") || s.contains("propertyNames") ||
        s.contains("minProperties") || s.contains("maxProperties") || s.contains("patternProperties")) {
      return typed("object");
    }
    if (s.contains("items")) return typed("array");
    return true;
  }
  return std::any_of(types.begin(), types.end(), typed);
}

void expect_masks_exact(const std::string& schema, const TokenVocabulary& vocab, const std::vector<std::string>& prefixes);

// Whether the whole of `text` is an answer the matcher takes.
bool takes(const std::string& schema, const std::string& text) {
  JsonMatcher m(JsonGrammar::compile(schema));
  return m.feed(text) && m.may_end();
}

// The bytes the matcher takes next, and of them those in `among`.
std::pair<std::vector<uint8_t>, std::vector<uint8_t>> next_bytes(const JsonMatcher& m, std::string_view among) {
  std::vector<uint8_t> ok, liked;
  for (int c = 0; c < 256; ++c) {
    JsonMatcher t = m;
    if (!t.feed(std::string(1, static_cast<char>(c)))) continue;
    ok.push_back(static_cast<uint8_t>(c));
    if (among.find(static_cast<char>(c)) != std::string_view::npos) liked.push_back(static_cast<uint8_t>(c));
  }
  return {ok, liked};
}

const char* const kPerson = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 12},
    "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", 1, 10, null]}, "maxItems": 3},
    "home": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/place"}]},
    "score": {"type": ["number", "boolean"]}
  },
  "required": ["name", "age"],
  "$defs": {"place": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"const": "x\"y"}},
                      "required": ["city"], "additionalProperties": false}}
})";

TEST(JsonSchema, takes_valid_documents_and_nothing_else) {
  struct Case {
    const char* schema;
    const char* text;
    bool ok;
  };
  const Case cases[] = {
      {"{}", R"({"a": [1, 2.5e-3, true, null, "x\u00e9\n"], "b": {}})", true},
      {"{}", "-0.5E+10", true},
      {"{}", "[1,]", false},
      {"{}", "01", false},
      {"{}", R"("\x")", false},
      {"{}", "\"a\x01\"", false},
      {"{}", "\"\xC3\xA9\"", true},       // é
      {"{}", "\"\xC3\"", false},          // a lead byte alone
      {"{}", "\"\xE0\x80\x80\"", false},  // overlong
      {"{}", "\"\xED\xA0\x80\"", false},  // a surrogate
      {"{}", "{\"a\":1}{", false},
      {"{}", "  \n{ } ", false},          // nothing after the value, not even whitespace
      {"{}", "  \n{ }", true},
      {R"({"type": "object"})", "[]", false},
      {R"({"type": "object"})", R"({"x": {"y": [1]}})", true},
      {kPerson, R"({"name": "Ann", "age": 30})", true},
      {kPerson, R"({"age": 30, "name": "Ann", "tags": ["a", 10, null], "home": {"city": "Oslo", "zip": "x\"y"}, "score": false})", true},
      {kPerson, R"({"name": "Ann"})", false},                     // age required
      {kPerson, R"({"name": "", "age": 1})", false},              // minLength
      {kPerson, R"({"name": "abcdefghijklm", "age": 1})", false}, // maxLength 12
      {kPerson, R"({"name": "abcdefghijkl", "age": 1})", true},
      {kPerson, R"({"name": "Ann", "age": 1.5})", false},         // integer
      {kPerson, R"({"name": "Ann", "age": 1, "age": 2})", false}, // twice
      {kPerson, R"({"name": "Ann", "age": 1, "other": 2})", false},
      {kPerson, R"({"name": "Ann", "age": 1, "tags": ["a", "b", 1, 10]})", false},  // maxItems 3
      {kPerson, R"({"name": "Ann", "age": 1, "tags": [100]})", false},
      {kPerson, R"({"name": "Ann", "age": 1, "tags": [1, 10]})", true},
      {kPerson, R"({"name": "Ann", "age": 1, "home": {"zip": "x\"y"}})", false},  // city required
      {kPerson, R"({"name": "Ann", "age": 1, "home": null, "score": 3})", true},
      {kPerson, R"({"name": "Ann", "age": 1, "score": "3"})", false},
      {R"({"enum": [1, 10, 12.5]})", "1", true},
      {R"({"enum": [1, 10, 12.5]})", "12", false},
      {R"({"enum": [1, 10, 12.5]})", "12.5", true},
      {R"({"type": "array", "minItems": 2, "items": {"type": "boolean"}})", "[true]", false},
      {R"({"type": "array", "minItems": 2, "items": {"type": "boolean"}})", "[true, false]", true},
      {R"({"type": "object", "additionalProperties": {"type": "integer"}})", R"({"a": 1, "b": 2})", true},
      {R"({"type": "object", "additionalProperties": {"type": "integer"}})", R"({"a": "1"})", false},
      {R"({"type": "object", "additionalProperties": false})", "{}", true},
      {R"({"type": "object", "properties": {}})", "{ }", true},
      {R"({"type": "object", "properties": {}})", R"({"a": 1})", false},  // named none: no others
      {R"({"type": "object", "properties": {}, "additionalProperties": {"type": "null"}})", R"({"a": null})", true},
      {R"({"type": "object", "additionalProperties": false})", R"({"a": 1})", false},
      {R"({"$defs": {"t": {"type": "object", "properties": {"k": {"type": "array", "items": {"$ref": "#/$defs/t"}}}}}, "$ref": "#/$defs/t"})",
       R"({"k": [{"k": []}, {}]})", true},
      {R"({"type": "string", "nullable": true})", "null", true},
      {R"({"type": "integer"})", "123456789012345678901234567890123", false},  // 33 bytes
      {R"({"anyOf": [{"$ref": "#"}, {"$ref": "#"}, {"type": "null"}]})", "null", true},
      {R"({"type": "integer", "minimum": 3, "maximum": 12})", "3", true},
      {R"({"type": "integer", "minimum": 3, "maximum": 12})", "12", true},
      {R"({"type": "integer", "minimum": 3, "maximum": 12})", "1", false},   // could become 10-12, but ends out of range
      {R"({"type": "integer", "minimum": 3, "maximum": 12})", "13", false},
      {R"({"type": "integer", "minimum": 3, "maximum": 12})", "-4", false},
      {R"({"type": "integer", "exclusiveMinimum": 0})", "0", false},
      {R"({"type": "integer", "exclusiveMinimum": 0})", "-0", false},
      {R"({"type": "integer", "exclusiveMinimum": 0})", "7", true},
      {R"({"type": "integer", "maximum": -5})", "-5", true},
      {R"({"type": "integer", "maximum": -5})", "-4", false},
      {R"({"type": "number", "minimum": 0, "maximum": 1})", "0.5", true},
      {R"({"type": "number", "minimum": 0, "maximum": 1})", "1.0", true},
      {R"({"type": "number", "minimum": 0, "maximum": 1})", "1.01", false},
      {R"({"type": "number", "minimum": 0, "maximum": 1})", "1e0", false},  // bounded: no exponent
      {R"({"type": "number", "minimum": 0, "maximum": 1})", "-0.0", true},
      {R"({"type": "number", "minimum": 0, "maximum": 1})", "-0.1", false},
      {R"({"type": "number", "exclusiveMaximum": 0.3})", "0.29", true},
      {R"({"type": "number", "exclusiveMaximum": 0.3})", "0.30", false},
      {R"({"type": "number", "minimum": 0.3})", "0.3", true},
      {R"({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": false, "minItems": 2})",
       R"([1, "a"])", true},
      {R"({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": false, "minItems": 2})",
       "[1]", false},
      {R"({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": false, "minItems": 2})",
       R"([1, "a", 2])", false},
      {R"({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "boolean"}})", "[1, true, false]", true},
      {R"({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "boolean"}})", "[1, 2]", false},
      {R"({"oneOf": [{"type": "integer"}, {"type": "string"}], "discriminator": {"propertyName": "k"}})", "\"x\"", true},
      {R"({"anyOf": [{"$ref": "#"}, {"type": "null"}]})", "1", false},
      {R"({"type": "string", "pattern": "^[A-Z]{3}$"})", R"("ABC")", true},
      {R"({"type": "string", "pattern": "^[A-Z]{3}$"})", R"("ABCD")", false},
      {R"({"type": "string", "pattern": "^[A-Z]{3}$"})", R"("AB")", false},
      // Escapes are read as what they stand for; under a pattern \u writes control characters alone.
      {R"({"type": "string", "pattern": "^[A-Z]{3}$"})", R"("A\u0042C")", false},
      {R"({"type": "string", "pattern": "^a\\tb$"})", R"("a\tb")", true},
      {R"({"type": "string", "pattern": "^a\\tb$"})", R"("a\u0009b")", true},
      {R"({"type": "string", "pattern": "^a\\tb$"})", R"("a\u000Ab")", false},
      {R"({"type": "string", "pattern": "^a\\tb$"})", R"("a\nb")", false},
      {R"({"type": "string", "pattern": "^a\\nb$"})", R"("a\nb")", true},
      {R"({"type": "string", "pattern": "^a\\\\b\"$"})", R"("a\\b\"")", true},
      {R"({"type": "string", "pattern": "^\\u00e9$"})", "\"\xC3\xA9\"", true},
      {R"({"type": "string", "pattern": "^\\u00e9$"})", R"("\u00e9")", false},
      {R"({"type": "string", "pattern": "^.$"})", R"("\ud83d\ude00")", false},  // a surrogate escape is not written under a pattern
      {R"({"type": "string", "pattern": "^.$"})", "\"\xF0\x9F\x98\x80\"", true},
      {R"({"type": "string", "pattern": "b+"})", R"("abbc")", true},  // unanchored: some part matches
      {R"({"type": "string", "pattern": "b+"})", R"("ac")", false},
      {R"({"type": "string", "pattern": "[0-9]", "maxLength": 2})", R"("x1")", true},
      {R"({"type": "string", "pattern": "[0-9]", "maxLength": 2})", R"("xy")", false},
      {R"({"type": "string", "pattern": "[0-9]", "maxLength": 2})", R"("x12")", false},
      {R"({"type": "string", "format": "date"})", R"("2026-12-05")", true},
      {R"({"type": "string", "format": "date"})", R"("2026-13-05")", false},
      {R"({"type": "string", "format": "date-time"})", R"("2026-12-05T09:30:00.5+01:00")", true},
      {R"({"type": "string", "format": "date-time"})", R"("2026-12-05 09:30:00")", false},
      {R"({"type": "string", "format": "time"})", R"("23:59:59.123456Z")", true},
      {R"({"type": "string", "format": "time"})", R"("23:59:60Z")", false},  // no leap second (Python's time has none)
      {R"({"type": "string", "format": "time"})", R"("12:00:00")", false},   // RFC 3339: an offset
      {R"({"type": "string", "format": "uuid"})", R"("123e4567-e89b-12d3-a456-426614174000")", true},
      {R"({"type": "string", "format": "uuid"})", R"("123e4567e89b12d3a456426614174000")", false},
      {R"({"type": "string", "format": "ipv4"})", R"("192.168.0.255")", true},
      {R"({"type": "string", "format": "ipv4"})", R"("192.168.0.256")", false},
      {R"({"type": "string", "format": "email"})", R"("ann.lee+x@mail.example.org")", true},
      {R"({"type": "string", "format": "email"})", R"("ann@")", false},
      {R"({"type": "string", "format": "uri"})", R"("not checked")", true},  // other formats: annotations
      {R"({"type": "string", "format": "date", "pattern": "^x$"})", R"("x")", true},  // beside a pattern: the pattern
      {R"({"type": "object", "properties": {"code": {"pattern": "^[a-z]{2}-[0-9]+$"}}, "required": ["code"]})",
       R"({"code": "ab-12"})", true},
      {R"({"type": "object", "properties": {"code": {"pattern": "^[a-z]{2}-[0-9]+$"}}, "required": ["code"]})",
       R"({"code": "ab-"})", false},
      // uniqueItems over items of a few values (pydantic's set[Literal[...]], set[Enum])
      {R"({"type": "array", "items": {"enum": ["a", "b", 1, 10]}, "uniqueItems": true})", R"(["a", "b", 10, 1])", true},
      {R"({"type": "array", "items": {"enum": ["a", "b", 1, 10]}, "uniqueItems": true})", R"(["a", "a"])", false},
      {R"({"type": "array", "items": {"enum": ["a", "b", 1, 10]}, "uniqueItems": true})", R"([1, 10, 1])", false},
      {R"({"type": "array", "items": {"enum": ["a", "b", 1, 10]}, "uniqueItems": true})", R"([10, 1])", true},
      {R"({"type": "array", "items": {"type": "boolean"}, "uniqueItems": true})", "[true, false]", true},
      {R"({"type": "array", "items": {"type": "boolean"}, "uniqueItems": true})", "[false, false]", false},
      {R"({"type": "array", "items": {"type": "boolean"}, "uniqueItems": true})", "[true, false,", false},  // nothing is left
      {R"({"$defs": {"e": {"enum": ["x", "y"]}}, "type": "array", "items": {"$ref": "#/$defs/e"}, "uniqueItems": true})",
       R"(["y", "x"])", true},
      {R"({"type": "array", "items": {"type": "string"}, "uniqueItems": false})", R"(["a", "a"])", true},
  };
  for (const auto& c : cases) EXPECT_EQ(takes(c.schema, c.text), c.ok) << c.schema << "\n" << c.text;
}

TEST(JsonSchema, other_keys_beside_named_ones_and_property_names) {
  // Named keys follow their own schemas, every other key additionalProperties'.
  const char* mixed = R"({"properties": {"a": {"type": "integer"}, "ab": {"type": "string"}},
                          "required": ["a"], "additionalProperties": {"type": "boolean"}})";
  for (const char* t : {R"({"a": 1})", R"({"a": 1, "ab": "x", "b": true, "abc": false, "": true, "é": false})",
                        R"({"x\"": true, "a": 2})", R"({"a": 1, "\n": true})"}) {
    EXPECT_TRUE(takes(mixed, t)) << t;
  }
  // (Other keys are written as a pattern's strings are: \u only for a control character,
  // so no escaped form of a name can pass for another key.)
  for (const char* t : {R"({"a": true})", R"({"abc": 1, "a": 1})", R"({"a": 1, "a": 2})", R"({"ab": "x"})",
                        R"({"a": 1, "\u0061b": true})", R"({"a": 1, "\u0061": true})", R"({"a": 1, "\u00e9": true})"}) {
    EXPECT_FALSE(takes(mixed, t)) << t;
  }
  EXPECT_TRUE(takes(R"({"properties": {"a": {}}, "additionalProperties": true})", R"({"b": [1, {"c": null}], "a": 0})"));
  // propertyNames: a string schema for every key, or an enum of the names.
  const char* pattern = R"({"propertyNames": {"pattern": "^[a-c]+$"}, "additionalProperties": {"type": "integer"}})";
  EXPECT_TRUE(takes(pattern, R"({"abc": 1, "b": 2})"));
  EXPECT_FALSE(takes(pattern, R"({"abd": 1})"));
  EXPECT_FALSE(takes(pattern, R"({"": 1})"));
  const char* names = R"({"type": "object", "propertyNames": {"enum": ["a", "ab"]}, "additionalProperties": {"type": "integer"}})";
  EXPECT_TRUE(takes(names, R"({"ab": 2, "a": 1})"));
  EXPECT_TRUE(takes(names, "{}"));
  for (const char* t : {R"({"a": 1, "a": 2})", R"({"b": 1})", R"({"a": "x"})"}) EXPECT_FALSE(takes(names, t)) << t;
  EXPECT_TRUE(takes(R"({"propertyNames": {"maxLength": 1}, "additionalProperties": false})", "{}"));
  EXPECT_FALSE(takes(R"({"propertyNames": {"maxLength": 1}, "additionalProperties": false})", R"({"a": 1})"));
  EXPECT_FALSE(takes(R"({"propertyNames": {"maxLength": 1}})", R"({"ab": 1})"));
  EXPECT_TRUE(takes(R"({"propertyNames": true, "additionalProperties": {"type": "integer"}})", R"({"ab": 1})"));
  EXPECT_TRUE(takes(R"({"propertyNames": {}})", R"({"ab": [1]})"));
  EXPECT_TRUE(takes(R"({"propertyNames": false})", "{}"));
  EXPECT_FALSE(takes(R"({"propertyNames": false})", R"({"a": 1})"));
  // patternProperties: a key one pattern alone matches takes its schema's value; one that two
  // match is not written (a value under both schemas is not held); others additionalProperties'.
  const char* patterned = R"({"patternProperties": {"^x_": {"type": "integer"}, "^y_": {"type": "string"}, "b": {"type": "integer"}},
                             "additionalProperties": false})";
  for (const char* t : {R"({"x_a": 1, "y_c": "s"})", R"({"x_y_": 2, "ab": 3})", "{}"}) EXPECT_TRUE(takes(patterned, t)) << t;
  for (const char* t : {R"({"x_a": "s"})", R"({"z": 1})", R"({"x_b": 1})", R"({"y_b": "s"})", R"({"y_": 1})"}) EXPECT_FALSE(takes(patterned, t)) << t;
  const char* beside = R"({"properties": {"id": {"type": "integer"}}, "patternProperties": {"^m_": {"type": "string"}}, "required": ["id"]})";
  EXPECT_TRUE(takes(beside, R"({"m_a": "x", "id": 3, "m_": ""})"));
  for (const char* t : {R"({"id": 3, "n": "x"})", R"({"id": 3, "m_a": 1})", R"({"m_a": "x"})"}) EXPECT_FALSE(takes(beside, t)) << t;
  const char* open = R"({"patternProperties": {"^n": {"type": "null"}}})";  // other keys: any value (no properties)
  EXPECT_TRUE(takes(open, R"({"n1": null, "other": [1]})"));
  EXPECT_FALSE(takes(open, R"({"n1": 1})"));
  // multipleOf (a whole number): the integer's remainder as its digits come, within the range.
  for (const char* t : {"0", "5", "-15", "100", "-0"}) EXPECT_TRUE(takes(R"({"type": "integer", "multipleOf": 5})", t)) << t;
  for (const char* t : {"3", "-7", "51", "5.0"}) EXPECT_FALSE(takes(R"({"type": "integer", "multipleOf": 5})", t)) << t;
  const char* sevens = R"({"type": "integer", "multipleOf": 7, "minimum": 10, "exclusiveMaximum": 35})";
  for (const char* t : {"14", "21", "28"}) EXPECT_TRUE(takes(sevens, t)) << t;
  for (const char* t : {"7", "35", "15", "0", "-14"}) EXPECT_FALSE(takes(sevens, t)) << t;
  EXPECT_TRUE(takes(R"({"type": "number", "multipleOf": 2, "maximum": 1e40})", "12345678901234567890123456789012"));
  EXPECT_FALSE(takes(R"({"type": "number", "multipleOf": 2, "maximum": 1e40})", "12345678901234567890123456789013"));
  EXPECT_TRUE(takes(R"({"type": "integer", "multipleOf": 999999937})", "-9999999370000000000000000000000"));  // (32 bytes, the bound)
  // minProperties / maxProperties: keys of every kind counted.
  const char* counted = R"({"properties": {"a": {}, "b": {}}, "additionalProperties": true, "minProperties": 2, "maxProperties": 3})";
  for (const char* t : {R"({"a": 1, "x": 2})", R"({"x": 1, "y": 2, "b": 3})", R"({"b": 1, "a": 2})"}) EXPECT_TRUE(takes(counted, t)) << t;
  for (const char* t : {"{}", R"({"a": 1})", R"({"x": 1})", R"({"a": 1, "b": 2, "x": 3, "y": 4})"}) EXPECT_FALSE(takes(counted, t)) << t;
}

TEST(JsonSchema, a_choice_grammar_takes_exactly_its_texts) {
  const std::string g = choice_grammar({"yes", "no", "yes, but", "\xC3\xA9t\xC3\xA9", "{\"raw\": not json"});
  for (const char* t : {"yes", "no", "yes, but", "\xC3\xA9t\xC3\xA9", "{\"raw\": not json"}) EXPECT_TRUE(takes(g, t)) << t;
  for (const char* t : {"", " yes", "ye", "yes,", "yes, but ", "No", "\"yes\""}) EXPECT_FALSE(takes(g, t)) << t;
  JsonMatcher m(JsonGrammar::compile(g));
  ASSERT_TRUE(m.feed("yes"));
  EXPECT_TRUE(m.may_end() && !m.complete());  // "yes" or "yes, but"
  ASSERT_TRUE(m.feed(", but"));
  EXPECT_TRUE(m.complete());
  for (const auto& bad : {choice_grammar({}), choice_grammar({"a", ""})}) {
    EXPECT_THROW(JsonGrammar::compile(bad), Error);
  }
  std::vector<std::string> bytes = {"y", "ye", "yes", "es", "s", ",", " ", " b", "but", "u", "t", "n", "no", "o", "\xC3", "\xA9t"};
  const TokenVocabulary vocab(bytes);
  expect_masks_exact(g, vocab, {"", "y", "yes", "yes, b", "\xC3\xA9"});
}

TEST(JsonSchema, format_date_takes_calendar_dates_alone) {
  const auto g = JsonGrammar::compile(R"({"type": "string", "format": "date"})");
  auto leap = [](int y) { return (y % 4 == 0 && y % 100 != 0) || y % 400 == 0; };
  int dates = 0;
  for (int y : {0, 1, 4, 99, 100, 400, 1000, 1899, 1900, 1904, 1999, 2000, 2024, 2025, 2100, 2400, 9996, 9999}) {
    for (int m = 0; m <= 13; ++m) {
      for (int d = 0; d <= 32; ++d) {
        static const int kDays[] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
        const bool real = y >= 1 && m >= 1 && m <= 12 && d >= 1 && d <= kDays[m - 1] + (m == 2 && leap(y));
        const std::string text = fmt::format("\"{:04}-{:02}-{:02}\"", y, m, d);
        JsonMatcher t(g);
        ASSERT_EQ(t.feed(text) && t.may_end(), real) << text;
        dates += real;
      }
    }
  }
  EXPECT_EQ(dates, 17 * 365 + 7);  // year 0 is none; 4, 400, 1904, 2000, 2024, 2400 and 9996 are leap years
}

TEST(JsonSchema, a_pattern_never_strands_an_answer) {
  // Random bytes the matcher takes, escapes favoured: at every place some byte may
  // follow or the answer may end, and every answer that ends is valid.
  const char* const schemas[] = {
      R"({"type": "string", "pattern": "^[A-Z]{3}-\\d{2}$"})",
      R"({"type": "string", "pattern": "^[a-z\\t]{2,5}$", "maxLength": 4})",
      R"({"type": "string", "pattern": "q", "maxLength": 3})",
      R"({"type": "string", "pattern": "^[ -~]\\u0001?\"?$"})",
      R"({"type": "array", "items": {"type": "string", "format": "date-time"}, "maxItems": 2})",
  };
  std::mt19937_64 rng(3);
  const std::string favoured = "\\u0123456789abcdefABCDEF\"-T:Z";
  for (const char* schema : schemas) {
    const Json js = Json::parse(schema);
    const auto g = JsonGrammar::compile(schema);
    int ended = 0;
    for (int w = 0; w < 150; ++w) {
      JsonMatcher m(g);
      std::string text;
      while (!m.complete() && text.size() < 120) {
        const auto [ok, liked] = next_bytes(m, favoured);
        if (ok.empty()) {
          ASSERT_TRUE(m.may_end()) << schema << " stranded after " << text;
          break;
        }
        if (m.may_end() && rng() % 8 == 0) break;
        const auto& from = !liked.empty() && rng() % 2 == 0 ? liked : ok;
        text.push_back(static_cast<char>(from[rng() % from.size()]));
        ASSERT_TRUE(m.feed(text.substr(text.size() - 1)));
      }
      if (!m.may_end()) continue;  // ran past 120 bytes
      ++ended;
      Json v;
      ASSERT_NO_THROW(v = Json::parse(text)) << schema << "\n" << text;
      if (v.is_string()) {
        ASSERT_TRUE(valid(v, js, js)) << schema << "\n" << text;
      }
    }
    EXPECT_GT(ended, 50) << schema;
  }
}

TEST(JsonSchema, a_regex_grammar_takes_the_texts_it_matches_whole) {
  const std::string g = regex_grammar("[0-9]{3}-[a-z]+( \\(\\w+\\))?");
  for (const char* t : {"123-abc", "000-z (x_1)"}) EXPECT_TRUE(takes(g, t)) << t;
  for (const char* t : {"", "123-", "12-ab", " 123-a", "123-abc ", "123-abc (", "\"123-a\""}) EXPECT_FALSE(takes(g, t)) << t;
  JsonMatcher m(JsonGrammar::compile(regex_grammar("(yes|no)")));
  ASSERT_TRUE(m.feed("ye"));
  EXPECT_FALSE(m.may_end());
  ASSERT_TRUE(m.feed("s"));
  EXPECT_TRUE(m.complete());  // nothing can extend it: the answer is whole
  JsonMatcher open(JsonGrammar::compile(regex_grammar("a+")));
  ASSERT_TRUE(open.feed("aa"));
  EXPECT_TRUE(open.may_end() && !open.complete());
  EXPECT_THROW(JsonGrammar::compile(regex_grammar("(a")), Error);
  std::vector<std::string> bytes = {"1", "12", "123", "-", "3-", "-a", "abc", "a", " (", " ", "(", "x", "x)", ")", "\xC3", "\"", "9-z"};
  const TokenVocabulary vocab(bytes);
  expect_masks_exact(g, vocab, {"", "1", "123", "123-", "123-ab", "123-ab (", "123-ab (x"});
}

TEST(Ebnf, takes_what_the_grammar_derives) {
  const std::string arith = ebnf_grammar(R"G(
    # arithmetic, over two lines for the sum
    root ::= expr
    expr ::= term ([+-] term)*
    term ::= factor ("*" factor)*
    factor ::= [0-9]+ | "(" expr ")" | "-" factor
  )G");
  for (const char* t : {"1", "12+3", "2*(3+4)", "-(1)*2-3", "((((7))))"}) EXPECT_TRUE(takes(arith, t)) << t;
  for (const char* t : {"", "1+", "(1", "1)", "1 + 2", "+1", "2**3"}) EXPECT_FALSE(takes(arith, t)) << t;
  const std::string list = ebnf_grammar(
      "root ::= \"[\" (item (\", \" item){0,2})? \"]\"\nitem ::= '\"' [^\"\\\\]{1,3} '\"' | \"caf\\u00e9\" | .\n");
  for (const char* t : {"[]", "[\"a\"]", "[\"abc\", \"x\", caf\xC3\xA9]", "[\xE2\x82\xAC]", "[\"\xC3\xA9\"]"}) {
    EXPECT_TRUE(takes(list, t)) << t;
  }
  for (const char* t : {"[\"abcd\"]", "[\"\"]", "[\"a\", \"b\", \"c\", \"d\"]", "[ab]", "[\"a\\\"]"}) {
    EXPECT_FALSE(takes(list, t)) << t;
  }
  JsonMatcher m(JsonGrammar::compile(arith));
  ASSERT_TRUE(m.feed("(1"));
  EXPECT_FALSE(m.may_end());
  ASSERT_TRUE(m.feed(")"));
  EXPECT_TRUE(m.may_end());
  std::vector<std::string> bytes = {"1", "12", "+", "+(", "(", ")", ")*", "*", "-", "3)", " ", "a", "+1", "1+"};
  const TokenVocabulary vocab(bytes);
  expect_masks_exact(arith, vocab, {"", "1", "(", "((", "2*(3+", "-", "(7"});
}

// The same language written as a regular expression and as EBNF, from one random tree.
struct TwoWays {
  std::string regex, ebnf;
};
TwoWays random_language(std::mt19937_64& rng, int depth) {
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); };
  switch (depth <= 0 ? pick(2) : pick(7)) {
    case 0: {
      const char* const lit[] = {"a", "b", "ab", "c"};
      const std::string t = lit[pick(4)];
      return {"(?:" + t + ")", "\"" + t + "\""};
    }
    case 1: {
      const char* const cls[] = {"[ab]", "[^a]", "[a-c]"};
      const std::string t = cls[pick(3)];
      return {t, t};
    }
    case 2: {
      const auto x = random_language(rng, depth - 1), y = random_language(rng, depth - 1);
      return {"(?:" + x.regex + "|" + y.regex + ")", "(" + x.ebnf + " | " + y.ebnf + ")"};
    }
    case 3: {
      const auto x = random_language(rng, depth - 1), y = random_language(rng, depth - 1);
      return {x.regex + y.regex, x.ebnf + " " + y.ebnf};
    }
    default: {
      const char* const q[] = {"*", "+", "?", "{2}", "{0,2}", "{1,}"};
      const std::string k = q[pick(6)];
      const auto x = random_language(rng, depth - 1);
      return {"(?:" + x.regex + ")" + k, "(" + x.ebnf + ")" + k};
    }
  }
}

TEST(Ebnf, agrees_with_the_same_language_as_a_regular_expression) {
  std::mt19937_64 rng(9);
  std::vector<std::string> texts = {""};
  for (size_t from = 0, len = 0; len < 5; ++len) {  // every text of up to 5 bytes over a, b, c, d
    const size_t to = texts.size();
    for (size_t i = from; i < to; ++i) {
      for (char c : std::string("abcd")) texts.push_back(texts[i] + c);
    }
    from = to;
  }
  int grammars = 0;
  for (int i = 0; i < 120; ++i) {
    const auto l = random_language(rng, 3);
    std::shared_ptr<JsonGrammar> g;
    try {
      g = JsonGrammar::compile(ebnf_grammar("root ::= " + l.ebnf));
    } catch (const Error& e) {
      // (x?)* and the like: a repeat of something that can be empty
      ASSERT_NE(std::string(e.what()).find("can be empty"), std::string::npos) << l.ebnf << ": " << e.what();
      continue;
    }
    ++grammars;
    const std::regex re(l.regex);
    for (const auto& t : texts) {
      JsonMatcher m(g);
      ASSERT_EQ(m.feed(t) && m.may_end(), std::regex_match(t, re)) << l.ebnf << " on '" << t << "'";
    }
  }
  EXPECT_GT(grammars, 80);
}

TEST(Ebnf, a_grammar_that_no_regular_expression_holds) {
  const auto g = JsonGrammar::compile(ebnf_grammar("root ::= \"(\" root \")\" root | \"\""));
  for (int n = 0; n < (1 << 10); ++n) {  // every text of ( and ) up to 10 long
    for (int len = 0; len <= 10; ++len) {
      if (n >= (1 << len)) continue;
      std::string t;
      int open = 0;
      bool ok = true;
      for (int k = 0; k < len; ++k) {
        t.push_back(n >> k & 1 ? ')' : '(');
        open += t.back() == '(' ? 1 : -1;
        ok = ok && open >= 0;
      }
      ok = ok && open == 0;
      JsonMatcher m(g);
      ASSERT_EQ(m.feed(t) && m.may_end(), ok) << t;
    }
  }
}

TEST(JsonSchema, nesting_never_strands_an_answer) {
  // Walks that favour opening ('{', '[', keys) run into the 32-frame bound: there the matcher
  // takes no key, item or option whose value could not close within it (each node below
  // needs three levels for its required "v"); at every place some byte may follow or it may end.
  const char* const schemas[] = {
      R"({"$defs": {"n": {"type": "object", "required": ["v"], "properties": {
           "next": {"$ref": "#/$defs/n"}, "list": {"type": "array", "items": {"$ref": "#/$defs/n"}},
           "v": {"type": "object", "required": ["w"], "properties": {"w": {"type": "array", "minItems": 1,
                 "items": {"type": "integer"}}}}}}}, "$ref": "#/$defs/n"})",
      R"({"$defs": {"t": {"anyOf": [{"type": "array", "minItems": 2, "prefixItems": [{"type": "integer"}], "items": {"$ref": "#/$defs/t"}},
                                     {"type": "object", "additionalProperties": {"$ref": "#/$defs/t"}}]}},
          "$ref": "#/$defs/t"})",
      "{}",
  };
  std::mt19937_64 rng(5);
  for (const char* schema : schemas) {
    std::shared_ptr<JsonGrammar> g;
    try {
      g = JsonGrammar::compile(schema);
    } catch (const Error& e) {
      FAIL() << schema << ": " << e.what();
    }
    int deep = 0;
    for (int w = 0; w < 30; ++w) {
      JsonMatcher m(g);
      std::string text;
      int depth = 0, most = 0;
      while (!m.complete() && text.size() < 3000) {
        // Opening for the first 600 bytes, then closing (and writing what is required).
        const bool opening_phase = text.size() < 600;
        const auto [ok, liked] = next_bytes(m, opening_phase ? "{[n\"" : "}]\"vw:1");
        if (ok.empty()) {
          ASSERT_TRUE(m.may_end()) << schema << " stranded after " << text;
          break;
        }
        const bool favoured = !liked.empty() && rng() % 5 != 0;
        const auto& from = favoured ? liked : ok;
        const uint8_t c = from[rng() % from.size()];
        depth += c == '{' || c == '[' ? 1 : c == '}' || c == ']' ? -1 : 0;
        most = std::max(most, depth);
        text.push_back(static_cast<char>(c));
        ASSERT_TRUE(m.feed(std::string(1, static_cast<char>(c))));
      }
      if (!m.complete()) continue;  // (cut at 3,000 bytes)
      deep += most >= 15;
      Json v;
      ASSERT_NO_THROW(v = Json::parse(text)) << text;
      const Json s = Json::parse(schema);
      ASSERT_TRUE(valid(v, s, s)) << text;
    }
    EXPECT_GE(deep, 3) << schema;  // the walks did reach the bound
  }
  // A value that must hold itself has none within the bound (or at all).
  try {
    JsonGrammar::compile(R"({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]})");
    ADD_FAILURE() << "compiled";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no value of it nests within 32 levels"), std::string::npos) << e.what();
  }
}

TEST(Ebnf, nesting_never_strands_an_answer) {
  // Walks that favour '(' run into the 32-frame bound: before it, the matcher stops
  // taking what it could not close; at every place some byte may follow or it may end.
  const auto g = JsonGrammar::compile(ebnf_grammar(
      "root ::= expr\nexpr ::= term ((\"+\" | \"-\") term)*\nterm ::= [0-9] | \"(\" expr \")\" | \"[\" expr (\",\" expr)* \"]\""));
  std::mt19937_64 rng(4);
  int deep = 0;
  for (int w = 0; w < 60; ++w) {
    JsonMatcher m(g);
    std::string text;
    int depth = 0, most = 0;
    while (text.size() < 400) {
      const auto [ok, opening] = next_bytes(m, "(");
      if (ok.empty()) {
        ASSERT_TRUE(m.may_end()) << "stranded after " << text;
        break;
      }
      const bool opens = !opening.empty() && text.size() < 200 && rng() % 4 != 0;
      const uint8_t c = opens ? '(' : ok[rng() % ok.size()];
      depth += c == '(' || c == '[' ? 1 : c == ')' || c == ']' ? -1 : 0;
      most = std::max(most, depth);
      text.push_back(static_cast<char>(c));
      ASSERT_TRUE(m.feed(text.substr(text.size() - 1)));
    }
    deep += most >= 8;
  }
  EXPECT_GT(deep, 30);  // the walks did reach the bound's neighbourhood
}

TEST(Ebnf, an_answer_with_too_many_readings_is_an_error_not_a_stall) {
  // After n x's, 2^n ways to close them: past 1,024 at once the matcher says so.
  JsonMatcher m(JsonGrammar::compile(ebnf_grammar("root ::= s\ns ::= \"x\" s \"y\" | \"x\" s \"z\" | \"\"")));
  ASSERT_TRUE(m.feed("xxxxxxxxxx"));  // 1,024
  try {
    m.feed("x");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("too ambiguous"), std::string::npos) << e.what();
  }
}

TEST(Ebnf, refuses_what_it_cannot_read_naming_it) {
  const std::pair<std::string, const char*> cases[] = {
      {"root ::= x", "the rule 'x' is used but not defined"},
      {"start ::= \"a\"", "no rule 'root'"},
      {"root ::= root \"a\" | \"a\"", "'root' reaches itself before reading a byte"},
      {"root ::= a | \"z\"\na ::= b? root\nb ::= \"x\"", "reaches itself"},
      {"root ::= \"a\" root", "derives no text"},
      {"b ::= \"x\"\nroot ::= (b?)*", "can be empty"},
      {"root ::= \"a", "line 1: an unclosed string"},
      {"root ::= \"a\"\n\nroot ::= \"b\"", "line 3: the rule 'root' is defined twice"},
      {"root = \"a\"", "'::='"},
      {"root ::= \"a\"{3,1}", "n below m"},
      {"root ::= [b-a]", "out of order"},
      {"root ::= (\"a\"", "unclosed '('"},
      {"root ::= \"\xC3(\"", "not valid UTF-8"},  // a lead byte without its continuation
      {"root ::= " + std::string(100000, '(') + "\"a\"" + std::string(100000, ')'), "groups nest deeper than 128"},
  };
  for (const auto& [text, why] : cases) {
    try {
      JsonGrammar::compile(ebnf_grammar(text));
      ADD_FAILURE() << text << " compiled";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << text << ": " << e.what();
    }
  }
}

TEST(JsonSchema, refuses_what_it_does_not_hold) {
  const std::pair<const char*, const char*> cases[] = {
      {"not json", "not JSON"},
      {"false", "matches nothing"},
      {R"({"properties": {"a": {"type": "string", "pattern": "(?=x)a"}}})", "#/properties/a/pattern': regex '(?=x)a' at offset 1: lookahead"},
      {R"({"type": "string", "pattern": 7})", "#/pattern': must be a string"},
      {R"({"type": "string", "pattern": "[0-9]{4}", "maxLength": 3})", "no text of at most 3 characters (maxLength) matches its pattern"},
      {R"({"type": "string", "format": "date", "maxLength": 9})", "matches its format"},
      {R"({"type": "array", "items": {"type": "string"}, "uniqueItems": true})", "#/uniqueItems': uniqueItems is held only for items"},
      {R"({"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": true, "minItems": 3})", "minItems is above the 2 distinct"},
      {R"({"type": "array", "prefixItems": [{}], "uniqueItems": true})", "beside prefixItems"},
      {R"({"minimum": 0})", "'minimum' is held only beside type number or integer"},
      {R"({"type": "integer", "minimum": 0.5, "maximum": 0.9})", "no integer lies in the range"},
      {R"({"type": "number", "minimum": 2, "exclusiveMaximum": 2})", "the range of values is empty"},
      {R"({"type": "number", "minimum": 1, "exclusiveMinimum": true})", "draft 4"},
      {R"({"properties": {"a": {"type": "number", "multipleOf": 0.5}}})", "#/properties/a/multipleOf': multipleOf 0.5 is held only as a whole number"},
      {R"({"type": "integer", "multipleOf": 7, "minimum": 1, "maximum": 6})", "no multiple of 7 lies in the range"},
      {R"({"properties": {"a": {}}, "propertyNames": {"maxLength": 3}})", "propertyNames beside properties"},
      {R"({"propertyNames": {"type": "integer"}})", "#/propertyNames': must be a string schema"},
      {R"({"properties": {"m_x": {}}, "patternProperties": {"^m_": {}}})", "the property 'm_x' matches it too"},
      {R"j({"patternProperties": {"(?=a)": {}}})j", "#/patternProperties/(?=a)': regex"},
      {R"({"properties": {"a": {}}, "minProperties": 2})", "minProperties is above the 1 properties"},
      {R"({"properties": {"a": {}, "b": {}}, "required": ["a", "b"], "maxProperties": 1})", "below the 2 required"},
      {R"({"type": "object", "minProperties": 3, "maxProperties": 2})", "maxProperties is below minProperties"},
      {R"({"properties": {"a": {}}, "required": ["b"]})", "\"b\" is not one of the properties"},
      {R"({"$ref": "http://example.com/s.json"})", "only references into this document"},
      {R"({"$ref": "#/$defs/none"})", "names nothing"},
      {R"({"type": "decimal"})", "unknown type 'decimal'"},
      {R"({"allOf": [{}, {}]})", "allOf of one"},
      {R"({"$ref": "#"})", "refers to itself"},
      {R"({"type": "array", "minItems": 3, "maxItems": 2})", "maxItems is below minItems"},
      {R"({"type": "array", "prefixItems": [{}], "items": false, "minItems": 2})", "no value of it nests within"},
      {R"({"type": "string", "maxLength": -1})", "non-negative integer"},
  };
  for (const auto& [schema, why] : cases) {
    try {
      JsonGrammar::compile(schema);
      ADD_FAILURE() << schema << " compiled";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  }
}

// A random answer the matcher allows, byte by byte, leaning towards bytes that
// close things so that most walks end; empty when a walk runs past `cap`.
std::string walk(const std::string& schema, std::mt19937_64& rng, size_t cap) {
  JsonMatcher m(JsonGrammar::compile(schema));
  std::string text;
  const std::string closers = "\"}],:0123456789tfn{[ ";
  while (text.size() < cap) {
    if (m.may_end() && (m.complete() || rng() % 4 == 0)) return text;
    const auto [ok, closing] = next_bytes(m, closers);
    if (ok.empty()) return {};  // stuck: fails below
    const auto& from = !closing.empty() && rng() % 3 != 0 ? closing : ok;
    const uint8_t c = from[rng() % from.size()];
    text.push_back(static_cast<char>(c));
    EXPECT_TRUE(m.feed(std::string(1, static_cast<char>(c))));
  }
  return {};
}

TEST(JsonSchema, random_answers_are_valid_json_under_the_schema) {
  const char* const schemas[] = {
      "{}",
      kPerson,
      R"({"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["id"]}, "minItems": 1, "maxItems": 4})",
      R"({"anyOf": [{"type": "string", "maxLength": 3}, {"type": "array", "items": {"type": ["integer", "null"]}}]})",
      R"({"type": "object", "additionalProperties": {"enum": ["x", 2, true, {"a": [1]}]}})",
      R"({"type": "array", "prefixItems": [{"type": "integer", "minimum": -20, "maximum": 300}, {"type": "number", "exclusiveMinimum": 0.5, "maximum": 2.25}], "items": {"type": "integer", "exclusiveMaximum": 0}})",
  };
  std::mt19937_64 rng(7);
  for (const char* schema : schemas) {
    const Json s = Json::parse(schema);
    int ended = 0;
    for (int i = 0; i < 60; ++i) {
      const std::string text = walk(schema, rng, 300);
      if (text.empty()) continue;
      ++ended;
      Json v;
      ASSERT_NO_THROW(v = Json::parse(text)) << text;
      EXPECT_TRUE(valid(v, s, s)) << schema << "\n" << text;
    }
    EXPECT_GT(ended, 20) << schema;
  }
}

// A random schema of the held keywords, `depth` levels at most.
Json random_schema(std::mt19937_64& rng, int depth) {
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); };
  const int kind = depth <= 0 ? 2 + pick(6) : pick(9);
  switch (kind) {
    case 0: {  // object
      Json s = {{"type", "object"}};
      if (pick(4) == 0) {
        s["additionalProperties"] = random_schema(rng, depth - 1);
        static const char* const kNames[] = {R"({"pattern": "^[a-c]+$"})", R"({"maxLength": 2})",
                                             R"({"enum": ["a", "ab", "b\"q"]})", R"({"type": "string", "pattern": "b"})"};
        if (pick(2) == 0) s["propertyNames"] = Json::parse(kNames[pick(4)]);
        if (pick(3) == 0) s["minProperties"] = pick(3);
        if (pick(3) == 0) s["maxProperties"] = s.value("minProperties", 0) + pick(3);
        return s;
      }
      Json props = Json::object(), req = Json::array();
      const int n = pick(4);
      for (int i = 0; i < n; ++i) {
        // Names that are prefixes of others ("a", "ab"), quoted ones, one that is not ASCII.
        static const char* const kNames[] = {"a", "ab", "b\\\"q", "abc", "\\u00e9", ""};
        const std::string name = pick(2) == 0 ? std::string(1, static_cast<char>('a' + i)) + (pick(3) == 0 ? "\"q" : "")
                                              : Json::parse(std::string("\"") + kNames[pick(6)] + "\"").get<std::string>();
        props[name] = random_schema(rng, depth - 1);
        if (pick(2) == 0) req.push_back(name);
      }
      s["properties"] = props;
      if (!req.empty()) s["required"] = req;
      if (pick(3) == 0) s["additionalProperties"] = pick(2) == 0 ? Json(true) : random_schema(rng, depth - 1);
      if (pick(3) == 0) {  // (a pattern a name matches is refused: such a schema is skipped)
        static const char* const kPatterns[] = {"^x", "y$", "^z\\d?$", "q"};
        s["patternProperties"] = Json::object();
        for (int k = pick(3); k >= 0; --k) s["patternProperties"][kPatterns[pick(4)]] = random_schema(rng, depth - 1);
      }
      const int64_t most = s.contains("additionalProperties") ? 4 : static_cast<int64_t>(props.size());
      if (pick(3) == 0) s["minProperties"] = std::min<int64_t>(pick(3), most);
      if (pick(3) == 0) s["maxProperties"] = std::max<int64_t>(s.value("minProperties", 0), static_cast<int64_t>(req.size())) + pick(2);
      return s;
    }
    case 1: {  // array
      Json s = {{"type", "array"}, {"items", random_schema(rng, depth - 1)}};
      if (pick(3) == 0) s["prefixItems"] = Json::array({random_schema(rng, depth - 1)});
      if (pick(2) == 0) s["maxItems"] = pick(4);
      if (pick(3) == 0) s["minItems"] = pick(2);
      if (s.contains("minItems") && s.contains("maxItems") && s["maxItems"] < s["minItems"]) s.erase("minItems");
      if (s["items"].contains("enum") && pick(2) == 0) {  // a set of those values
        s.erase("prefixItems");
        s["uniqueItems"] = true;
      }
      return s;
    }
    case 2: {
      Json s = {{"type", "string"}};
      if (pick(2) == 0) s["maxLength"] = pick(6);
      if (pick(3) == 0) s["minLength"] = std::min(pick(3), s.value("maxLength", 3));
      static const char* const kPatterns[] = {"^[a-c]+$", "b", "^\\d{2,3}$", "x|y", "^(ab)*$", "\\\\", "^\"?[0-9a-f]{1,2}$"};
      if (pick(3) == 0 && s.value("maxLength", 5) >= 3) s["pattern"] = kPatterns[pick(7)];
      return s;
    }
    case 3:
    case 4: {  // bounded or free numbers
      Json s = {{"type", pick(2) == 0 ? "integer" : "number"}};
      if (pick(2) == 0) s[pick(2) == 0 ? "minimum" : "exclusiveMinimum"] = pick(2) == 0 ? -7 : 2.5;
      if (pick(2) == 0) s[pick(2) == 0 ? "maximum" : "exclusiveMaximum"] = pick(2) == 0 ? 40 : 1234.75;
      if (pick(3) == 0) s["multipleOf"] = pick(2) == 0 ? 3 : 25;  // (a range without a multiple is refused: skipped)
      return s;
    }
    case 5: return {{"enum", Json::array({"x", 1, 12, nullptr, Json::array({true})})}};
    case 6: return {{"type", Json::array({"boolean", "null"})}};
    case 7: return depth > 0 ? Json{{"anyOf", Json::array({random_schema(rng, depth - 1), random_schema(rng, depth - 1)})}}
                             : Json{{"const", "c"}};
    default: return Json::object();  // any value
  }
}

TEST(JsonSchema, random_answers_under_random_schemas_are_valid) {
  std::mt19937_64 rng(11);
  int schemas = 0, answers = 0, mutants = 0;
  for (int i = 0; i < 150; ++i) {
    const Json s = random_schema(rng, 3);
    std::shared_ptr<JsonGrammar> g;
    try {
      g = JsonGrammar::compile(s.dump());
    } catch (const Error& e) {
      continue;  // e.g. an integer range with no integer in it
    }
    ++schemas;
    for (int w = 0; w < 6; ++w) {
      const std::string text = walk(s.dump(), rng, 200);
      if (text.empty()) continue;
      ++answers;
      Json v;
      ASSERT_NO_THROW(v = Json::parse(text)) << s.dump() << "\n" << text;
      ASSERT_TRUE(valid(v, s, s)) << s.dump() << "\n" << text;
      // One byte changed: whatever the matcher still takes whole is valid too.
      const std::string bytes = "{}[],:\"\\-.0159eEtfnu x\x80";
      for (int m = 0; m < 8; ++m) {
        std::string t = text;
        t[rng() % t.size()] = bytes[rng() % bytes.size()];
        JsonMatcher mt(g);
        if (!mt.feed(t) || !mt.may_end()) continue;
        ++mutants;
        ASSERT_NO_THROW(v = Json::parse(t)) << s.dump() << "\n" << t;
        ASSERT_TRUE(valid(v, s, s)) << s.dump() << "\n" << t;
      }
    }
  }
  EXPECT_GT(mutants, 100);
  EXPECT_GT(schemas, 120);
  EXPECT_GT(answers, 400);
}

// The mask at each place equals feeding every token on a copy.
void expect_masks_exact(const std::string& schema, const TokenVocabulary& vocab, const std::vector<std::string>& prefixes) {
  for (const auto& prefix : prefixes) {
    JsonMatcher m(JsonGrammar::compile(schema));
    ASSERT_TRUE(m.feed(prefix)) << prefix;
    const TokenMask mask = m.allowed(vocab);
    int64_t allowed = 0;
    for (int32_t id = 0; id < vocab.size(); ++id) {
      const std::string_view b = vocab.bytes(id);
      JsonMatcher t = m;
      const bool want = !b.empty() && t.feed(b);
      const bool got = mask[static_cast<size_t>(id) >> 6] >> (id & 63) & 1;
      allowed += got;
      ASSERT_EQ(got, want) << "after '" << prefix << "' token " << id << " '" << b << "'";
    }
    EXPECT_EQ(m.allowed(vocab), mask);  // cached: the same
    EXPECT_GT(allowed, 0) << prefix;
  }
}

TEST(JsonSchema, token_masks_equal_feeding_each_token) {
  std::vector<std::string> bytes = {"\"", "\"}", "\",", "\":", "\"a", "a\"", "{\"", "}", "]}", "},{", "\\", "\\u", "00e9",
                                    "\\u00e9\"", "\\n", "1", "10", "1.", "1e", "e+5", ".5", "-", "true", "tr", "ue}",
                                    "null", " ", "  ", "\n", " \"", ", \"", "\xC3", "\xA9", "\xC3\xA9", "\xA9\"", "name",
                                    "\"name\": \"", "age\":", "x\\\"y", "\":\"", "\x01", "", "[", "[]", "[1,", "a,"};
  for (int c = 32; c < 127; ++c) bytes.emplace_back(1, static_cast<char>(c));
  const TokenVocabulary vocab(bytes);
  expect_masks_exact(kPerson, vocab, {"", "{", "{\"", "{\"na", "{\"name\": \"A", "{\"name\": \"abcdefghijk",
                                      "{\"name\": \"Ann\", \"age\": 1", "{\"name\": \"Ann\", \"age\": 12, \"tags\": [1",
                                      "{\"age\": 1, \"name\": \"x\", \"home\": {\"zip\": \"x\\", "{\"age\": 1, \"name\": \"\xC3"});
  expect_masks_exact("{}", vocab, {"", "[", "[\"", "{\"a\": 1.", "[tr", "{\"x\":{\"y\":[1, 2"});
  const char* bounded = R"({"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1},
                            "n": {"type": "array", "prefixItems": [{"type": "integer", "minimum": 3, "maximum": 12}],
                                  "items": false}}})";
  expect_masks_exact(bounded, vocab, {"{\"p\": ", "{\"p\": 0", "{\"p\": 1", "{\"p\": 0.", "{\"n\": [", "{\"n\": [1",
                                      "{\"n\": [12"});
  const char* patterned = R"({"type": "array", "items": {"type": "string", "pattern": "^[a-z]+(\\.[a-z]+)*@e\\.\\w{2}$",
                                                           "maxLength": 12}})";
  expect_masks_exact(patterned, vocab, {"[\"", "[\"a", "[\"ab.", "[\"a@e", "[\"a@e.", "[\"a@e.x", "[\"a@e.xy",
                                        "[\"abcdef", "[\"abcdefg"});
  expect_masks_exact(R"({"type": "array", "items": {"enum": ["a", "ab", 1, 10]}, "uniqueItems": true})", vocab,
                     {"[", "[\"a\", ", "[1, ", "[10, 1", "[\"ab\", \"a", "[\"a\", 1, 10"});
  expect_masks_exact(R"({"type": "string", "pattern": "^[^\\u0003]*\\u0001$"})", vocab,
                     {"\"", "\"a\\", "\"a\\u", "\"a\\u00", "\"a\\u000", "\"a\\u0001"});
}

TEST(JsonSchema, token_masks_equal_feeding_each_token_of_the_deepseek_vocabulary) {
  const auto tok = tokenizer::Tokenizer::load(tokenizer::default_tokenizer_dir());
  const TokenVocabulary vocab(tok->vocabulary_bytes());
  expect_masks_exact(kPerson, vocab, {"", "{\"", "{\"name\": \"Jo", "{\"name\": \"Ann\", \"age\": 4",
                                      "{\"name\": \"Ann\", \"age\": 4, \"tags\": [", "{\"age\": 1, \"name\": \"abcdefghij"});
  expect_masks_exact(R"({"type": "string", "format": "date-time"})", vocab, {"", "\"", "\"2026-1", "\"2026-12-05T1", "\"2026-12-05T10:00:00"});
  expect_masks_exact(R"({"properties": {"name": {"type": "string"}, "n": {"type": "integer"}}, "additionalProperties": {"type": "boolean"}})",
                     vocab, {"{", "{\"", "{\"n", "{\"na", "{\"name", "{\"name\"", "{\"nam\"", "{\"n\": 1, \"", "{\"x"});
  expect_masks_exact(R"({"properties": {"id": {"type": "integer"}}, "patternProperties": {"^m_": {"type": "string"}, "_z$": {}}})",
                     vocab, {"{", "{\"", "{\"m", "{\"m_", "{\"m_a", "{\"i", "{\"a_z"});
  expect_masks_exact(regex_grammar("(Yes|No), because [^.]{1,40}\\."), vocab, {"", "Yes", "No, because", "Yes, because it"});
  // EBNF: most tokens step many bytes through several readings at once.
  expect_masks_exact(ebnf_grammar("root ::= word (\" \" word)*\nword ::= [a-z]+"), vocab, {"", "ab", "ab cd "});
  expect_masks_exact(ebnf_grammar("root ::= expr\nexpr ::= term ((\"+\" | \"-\") term)*\nterm ::= [0-9]+ | \"(\" expr \")\""),
                     vocab, {"", "(1+", "((2"});
}

TEST(JsonSchema, the_cache_compiles_a_schema_once) {
  GrammarCache cache;
  const auto a = cache.get(kPerson);
  EXPECT_EQ(cache.get(kPerson), a);
  EXPECT_NE(cache.get("{}"), a);
  EXPECT_THROW(cache.get("{\"type\": 1}"), Error);
}

}  // namespace
}  // namespace troupe::engine
