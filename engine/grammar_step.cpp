// Following an answer through a compiled grammar: a byte at a time over a set of
// stacks of frames, and token masks per state.
#include "engine/grammar_parts.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <optional>

#include "base/error.hpp"

namespace troupe::engine {

using namespace grammar;

namespace {

// A copy of a stack, in a vector from a per-thread pool used last-in first-out (steps
// recurse, and each copy lives within one call): once warm, copying allocates nothing.
class StackCopy {
 public:
  explicit StackCopy(const std::vector<JsonGrammar::Frame>& s) {
    auto& pool = vectors();
    if (used() == pool.size()) pool.push_back(std::make_unique<std::vector<JsonGrammar::Frame>>());
    v_ = pool[used()++].get();
    v_->assign(s.begin(), s.end());
  }
  ~StackCopy() { --used(); }
  StackCopy(const StackCopy&) = delete;
  StackCopy& operator=(const StackCopy&) = delete;
  std::vector<JsonGrammar::Frame>& get() { return *v_; }

 private:
  static std::vector<std::unique_ptr<std::vector<JsonGrammar::Frame>>>& vectors() {
    thread_local std::vector<std::unique_ptr<std::vector<JsonGrammar::Frame>>> pool;
    return pool;
  }
  static size_t& used() {
    thread_local size_t n = 0;
    return n;
  }
  std::vector<JsonGrammar::Frame>* v_;
};

}  // namespace

namespace grammar {

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

bool meets(const JsonGrammar::Node& n, double a, bool a_open, double b, bool b_open) {
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

namespace {

using Wide = __int128;
constexpr Wide kWideFar = static_cast<Wide>(1) << 120;  // past any 32-byte number

// The integers of the node's range, as a closed interval of wide integers.
std::pair<Wide, Wide> integer_range(const JsonGrammar::Node& n) {
  auto clamp = [](double x) { return x >= 1e36 ? kWideFar : x <= -1e36 ? -kWideFar : static_cast<Wide>(x); };
  const double first = n.lo_open ? std::floor(n.lo) + 1 : std::ceil(n.lo);
  const double last = n.hi_open ? std::ceil(n.hi) - 1 : std::floor(n.hi);
  return {clamp(first), clamp(last)};
}

// Whether [a, b] (a <= b, a >= 0) holds a multiple of m.
bool holds_multiple(Wide a, Wide b, uint64_t m) {
  if (a > b) return false;
  const Wide mm = static_cast<Wide>(m);
  return (b / mm) * mm >= a;
}

// multipleOf: whether an integer that begins with t (its digits so far, within the byte
// bound) is a multiple in the range; `whole`: t itself, no digit more.
bool multiple_reachable(const JsonGrammar::Node& n, std::string_view t, bool whole) {
  const bool neg = !t.empty() && t[0] == '-';
  const std::string_view body = neg ? t.substr(1) : t;
  auto [lo, hi] = integer_range(n);
  // Magnitudes the sign allows: the value is -magnitude for a negative number.
  Wide mlo = neg ? -hi : lo, mhi = neg ? -lo : hi;
  mlo = std::max<Wide>(mlo, 0);
  if (body.empty()) {
    if (whole) return false;
    Wide most = 1;
    for (size_t i = t.size(); i < kMaxNumberBytes; ++i) most *= 10;
    return holds_multiple(mlo, std::min(mhi, most - 1), n.multiple);
  }
  Wide v = 0;
  for (char c : body) v = v * 10 + (c - '0');
  if (whole || body == "0") return holds_multiple(std::max(mlo, v), std::min(mhi, v), n.multiple);
  Wide p = 1;
  for (size_t more = 0; t.size() + more <= kMaxNumberBytes; ++more, p *= 10) {
    if (holds_multiple(std::max(mlo, v * p), std::min(mhi, v * p + p - 1), n.multiple)) return true;
  }
  return false;
}

}  // namespace

bool reachable(const JsonGrammar::Node& n, std::string_view t) {
  if (n.multiple > 0) return multiple_reachable(n, t, false);
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

bool in_range(const JsonGrammar::Node& n, std::string_view t) {
  if (n.multiple > 0) return multiple_reachable(n, t, true);
  const double v = std::strtod(std::string(t).c_str(), nullptr);
  return meets(n, v, false, v, false);
}

}  // namespace grammar

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
      p.c = child.kind == kKey ? 0 : child.node;  // another key: its node names its value
    } else {
      if (p.a != kNone) p.seen |= uint64_t{1} << p.a;
      p.sub = kObjAfterValue;
    }
  } else if (p.kind == kArray) {
    ++p.a;
    p.sub = kArrAfterValue;
    if (nodes_[p.node].unique && child.kind == kLiteral) p.seen |= uint64_t{1} << child.a;
  } else if (p.kind == kRule) {
    ++p.b;
  }
}

// The top frame reads `rule` (the rest of its alternative empty when `tail`: the rule
// takes its place, so that repeats keep the stack flat): one stack for each of the
// rule's alternatives, each given byte c.
void JsonGrammar::expand(std::vector<Frame>& s, uint32_t rule, bool tail, uint8_t c, State& out) const {
  const auto& alts = nodes_[rule].alts;
  const size_t below = tail ? s.size() - 1 : s.size();
  for (size_t i = 0; i < alts.size(); ++i) {
    if (!rule_fits(below, rule, static_cast<uint32_t>(i))) continue;
    const bool last = i + 1 == alts.size();
    std::optional<StackCopy> copy;
    if (!last) copy.emplace(s);
    std::vector<Frame>& t = last ? s : copy->get();
    Frame g;
    g.node = rule;
    g.kind = kRule;
    g.a = static_cast<uint32_t>(i);
    if (tail) {
      t.back() = g;
    } else {
      t.push_back(g);
    }
    step(t, c, out);
  }
}

// Whether a rule's alternative, begun in a frame with `below` frames under it, can be
// read whole within kMaxDepth frames. Only a new rule frame can make a stack need more
// (reading on, a frame's rest only shrinks; a terminal pushed needs its own frame alone),
// so checking each one as it is made keeps every stack able to close: no answer is led
// into nesting it could not close.
bool JsonGrammar::rule_fits(size_t below, uint32_t rule, uint32_t alt) const {
  return below + sequence_need(nodes_, nodes_[rule].alts[alt]) <= kMaxDepth;
}

bool JsonGrammar::fits(size_t below, uint32_t node) const { return below + nodes_[node].depth <= kMaxDepth; }

uint64_t JsonGrammar::unfit_names(const Node& n, size_t below) const {
  if (below + n.deepest <= kMaxDepth) return 0;  // (far from the bound: every one fits)
  uint64_t unfit = 0;
  for (size_t i = 0; i < n.values.size(); ++i) {
    if (!fits(below, n.values[i])) unfit |= uint64_t{1} << i;
  }
  return unfit;
}

// Whether a stack of EBNF rules may end here: every frame's rest (past the element
// being read, below the top) can be empty.
bool JsonGrammar::rules_may_end(std::span<const Frame> stack) const {
  for (size_t k = stack.size(); k-- > 0;) {
    const Frame& f = stack[k];
    if (f.kind != kRule) return false;  // inside a terminal
    const auto& alt = nodes_[f.node].alts[f.a];
    for (size_t j = f.b + (k + 1 < stack.size() ? 1 : 0); j < alt.size(); ++j) {
      if (!nodes_[alt[j]].nullable) return false;
    }
  }
  return true;
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
    if (!fits(s.size(), node)) return false;
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
              case Kind::any_of:
              case Kind::rule:
              case Kind::terminal: return true;  // (no JSON value is one)
            }
            return true;
          };
          uint32_t last = kNone;
          for (uint32_t o : n.options) {
            if (!starts(o) || !fits(s.size() - 1, o)) continue;
            if (last != kNone) {
              StackCopy copy(s);
              std::vector<Frame>& t = copy.get();
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
        case Kind::rule:
        case Kind::terminal: return;  // only an ebnf_grammar() has them, read by kRule frames
      }
      return;
    }
    case kObject: {
      // A key's value goes where the key's frame goes (s.size()): the names not read yet
      // whose values fit there, and other keys whose values fit; none past maxProperties.
      // (Asked only at a quote or a comma: every other byte of the object's own leaves them.)
      auto open_names = [&] { return ~(f.seen | unfit_names(n, s.size())) & low_bits(n.names.size()); };
      auto other_fits = [&](uint32_t k) { return fits(s.size(), nodes_[k].value); };
      auto others = [&] { return std::any_of(n.keys.begin(), n.keys.end(), other_fits); };
      auto more_keys = [&] {
        const bool room = n.max_count < 0 || f.b < static_cast<uint64_t>(n.max_count);
        return room && (open_names() != 0 || others());
      };
      const bool may_close = (f.seen & n.required) == n.required && f.b >= static_cast<uint64_t>(n.min_count);
      switch (f.sub) {
        case kObjOpen:
        case kObjKeyNext:
          if (is_ws(c)) return whitespace();
          if (c == '}' && f.sub == kObjOpen && may_close) {
            finish_child(s);
            return out.push(s);
          }
          if (c != '"' || !more_keys()) return;
          f.sub = kObjInKey;
          f.ws = 0;
          {
            // A named key (a literal over the names), and each kind of other key whose
            // value fits: a string of its key node.
            Frame named;
            named.node = f.node;
            named.kind = kKey;
            named.a = 0;
            named.b = static_cast<uint32_t>(n.names.size());
            named.c = 0;
            const bool some_named = open_names() != 0;
            if (!others()) {
              s.push_back(named);
              return out.push(s);
            }
            if (some_named) {
              StackCopy copy(s);
              copy.get().push_back(named);
              out.push(copy.get());
            }
            for (uint32_t k : n.keys) {
              if (!other_fits(k)) continue;
              Frame other;
              other.node = k;
              other.kind = kString;
              other.sub = kStrText;
              if (nodes_[k].pattern) other.d = nodes_[k].pattern->start();
              StackCopy copy(s);
              copy.get().push_back(other);
              out.push(copy.get());
            }
          }
          return;
        case kObjColon:
          if (is_ws(c)) return whitespace();
          if (c != ':') return;
          ++f.b;  // a key more
          f.sub = kObjInValue;
          f.ws = 0;
          if (!push_value(f.a != kNone ? n.values[f.a] : nodes_[f.c].value)) return;
          return out.push(s);
        case kObjAfterValue:
          if (is_ws(c)) return whitespace();
          if (c == ',' && more_keys()) {
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
          const bool spent = n.unique && n.items != kNone &&
                             static_cast<size_t>(__builtin_popcountll(f.seen)) >= nodes_[n.items].texts.size();
          if (c == ',' && item(f.a) != kNone && !spent && fits(s.size(), item(f.a))) {  // (uniqueItems: while a value is left)
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
    case kRule: {
      const auto& alt = n.alts[f.a];
      if (f.b == alt.size()) {  // the rule is whole: the byte is its parent's
        finish_child(s);
        return step(s, c, out);
      }
      const uint32_t e = alt[f.b];
      if (nodes_[e].kind == Kind::rule) return expand(s, e, f.b + 1 == alt.size(), c, out);
      if (s.size() >= kMaxDepth) return;
      Frame t;
      t.node = e;
      t.kind = kTerm;
      t.d = nodes_[e].pattern->start();
      s.push_back(t);
      return step(s, c, out);
    }
    case kTerm: {
      const ByteDfa& dfa = *n.pattern;
      const uint32_t d = dfa.next(f.d, c);
      if (d == ByteDfa::kDead) return;
      f.d = d;
      if (dfa.accepting(d)) {  // read whole: the parent goes on (and, where it could also go on, so may it)
        StackCopy copy(s);
        std::vector<Frame>& t = copy.get();
        finish_child(t);
        out.push(t);
        if (!dfa.extends(d)) return;
      }
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
        const uint64_t seen = s[s.size() - 2].seen | unfit_names(nodes_[s[s.size() - 2].node], s.size() - 1);
        uint32_t unseen = lo;
        while (unseen < hi && (seen >> unseen & 1)) ++unseen;
        if (unseen == hi) return;
        f.a = lo;
        f.b = hi;
        f.c = pos + 1;
        if (texts[lo].size() == pos + 1) finish_child(s);  // the closing quote: the key is read
        return out.push(s);
      }
      // An item of a uniqueItems array: only values not used yet.
      uint64_t used = 0;
      if (s.size() >= 2 && s[s.size() - 2].kind == kArray && nodes_[s[s.size() - 2].node].unique) used = s[s.size() - 2].seen;
      auto fresh = [&](uint32_t from, uint32_t to) {
        for (uint32_t i = from; i < to; ++i) {
          if (!(used >> i & 1)) return true;
        }
        return false;
      };
      if (lo < hi && fresh(lo, hi)) {  // the byte is the literal's
        StackCopy copy(s);
        std::vector<Frame>& t = copy.get();
        t.back().a = lo;
        t.back().b = hi;
        t.back().c = pos + 1;
        if (hi == lo + 1 && texts[lo].size() == pos + 1) finish_child(t);  // whole, and nothing longer
        out.push(t);
      }
      if (whole && !(used >> f.a & 1)) {  // a literal that other ones extend (1 of [1, 10]) ends at a byte none of them has
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
  if (out.stacks() > kMaxStacks) {
    raise(ErrorCode::invalid_argument, "the grammar is too ambiguous to follow: over {} readings of the answer at once", kMaxStacks);
  }
}

bool JsonGrammar::accepting(const State& s) const {
  for (size_t i = 0; i < s.stacks(); ++i) {
    const auto st = s.stack(i);
    if (st.empty()) return true;
    if (st.back().kind == kRule || st.back().kind == kTerm) {
      if (rules_may_end(st)) return true;
      continue;
    }
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
  // Tokens in byte order, each stepped from the longest prefix it shares with the last
  // one stepped (the states after each byte of that path are kept): a prefix's bytes
  // are stepped once for every token that starts with it, and once a prefix leaves no
  // reading, every token that extends it is passed over unstepped.
  std::string path;        // the bytes stepped, the state after byte i in scratch[i]
  bool path_dead = false;  // the state after the whole path has no reading
  // The states after each byte of the path, kept across calls (and grammars) for their capacity.
  thread_local std::vector<std::unique_ptr<State>> scratch;
  auto after = [&](size_t bytes) -> const State& { return bytes == 0 ? state : *scratch[bytes - 1]; };
  const TokenVocabulary::Sorted& order = in_text ? vocab.sorted_not_plain() : vocab.sorted();  // plain ones decided above
  uint32_t shared = 0;  // the bytes this token shares with every token since the path's own
  for (size_t k = 0; k < order.ids.size(); ++k) {
    shared = std::min(shared, order.lcp[k]);
    const int32_t id = order.ids[k];
    const size_t l = std::min<size_t>(shared, path.size());
    if (path_dead && l == path.size()) continue;  // extends a prefix that leaves no reading
    const std::string_view t = vocab.bytes(id);
    path.resize(l);
    path_dead = false;
    for (size_t i = l; i < t.size() && !path_dead; ++i) {
      if (scratch.size() <= i) scratch.push_back(std::make_unique<State>());
      step_all(after(i), static_cast<uint8_t>(t[i]), *scratch[i]);
      path.push_back(t[i]);
      path_dead = scratch[i]->stacks() == 0;
    }
    shared = UINT32_MAX;  // the path is a prefix of this token
    if (!path_dead) allow(id);
  }
  return masks_.emplace(std::move(key), std::move(bits)).first->second;
}

// ---- matcher --------------------------------------------------------------------------

JsonMatcher::JsonMatcher(std::shared_ptr<JsonGrammar> grammar)
    : grammar_(std::move(grammar)), state_(std::make_unique<JsonGrammar::State>()), next_(std::make_unique<JsonGrammar::State>()) {
  JsonGrammar::Frame root;
  root.node = grammar_->root_;
  if (grammar_->raw_ && grammar_->nodes_[root.node].kind == Kind::rule) {  // an ebnf_grammar(): root's alternatives
    for (size_t i = 0; i < grammar_->nodes_[root.node].alts.size(); ++i) {
      root.kind = kRule;
      root.a = static_cast<uint32_t>(i);
      if (grammar_->rule_fits(0, root.node, root.a)) state_->push({root});
    }
    return;
  }
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

}  // namespace troupe::engine
