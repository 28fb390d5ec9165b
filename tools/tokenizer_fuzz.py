#!/usr/bin/env python3
"""Random differential testing of troupe's tokenizer and chat template against
Hugging Face, on texts and conversations the fixtures (tools/tokenizer_corpus.py)
do not hold.

    .venv/bin/python tools/tokenizer_fuzz.py --cases 3000 --chats 300 --seed 1

Texts (--cases): random mixes of scripts, emoji (ZWJ, skin tones, flags),
combining marks, numbers of every length and digit script, whitespace runs,
punctuation, code, URLs, contractions, added-token strings whole, partial and
mangled, and very long words. For each, troupe (model/tokenizer through a small
driver compiled against build/) must equal `tokenizers`:
  plain    encode(text)                    == pre_tokenizer + BPE ids (no added-token matching)
  special  encode(text, parse_special)     == encode(text, add_special_tokens=False)
  decode   decode(ids), skip_special too   == decode(ids); also slices of ids that cut characters,
           and StreamDecoder's concatenation
Every --cli-every'th batch is also run through `troupe tokenize` (plain,
--special, --decode) line by line.

Conversations (--chats): system/user/assistant/tool turns in random order,
empty content, tool calls (the DeepSeek template's only extra), fields the
template ignores (reasoning_content, name, ...), add_generation_prompt either
way. troupe's render_chat must equal transformers' apply_chat_template text
(run by --oracle-python, which has transformers), and encode_chat must equal
the ids Hugging Face gives the same prompt with the template's markers as
tokens and every message field encoded as plain text (for messages without
added-token strings that is encode(text), i.e. apply_chat_template(tokenize=True)
with transformers 4.x).

Conversations are kept to what both sides accept (see docs/tokenizer.md for
troupe's documented refusals and OpenAI-shape mappings, which are not fuzzed).

Exits 1 on any mismatch, after printing each one shrunk to a minimal input.
"""
import argparse
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TOKENIZER_DIR = os.path.join(ROOT, "model", "tokenizer", "data", "deepseek-v4")

# ---------------------------------------------------------------------------
# troupe side: a driver linked against the built library (JSON lines in/out).

DRIVER_SOURCE = r"""
#include <iostream>
#include <nlohmann/json.hpp>
#include "model/tokenizer/openai_messages.hpp"
#include "model/tokenizer/stream_decoder.hpp"
#include "model/tokenizer/tokenizer.hpp"
using namespace troupe::tokenizer;
using json = nlohmann::json;
int main(int argc, char** argv) {
  if (argc != 2) { std::cerr << "usage: driver TOKENIZER_DIR\n"; return 2; }
  auto tok = Tokenizer::load(argv[1]);
  std::ios::sync_with_stdio(false);
  std::string line;
  while (std::getline(std::cin, line)) {
    json out = json::object();
    try {
      const json req = json::parse(line);
      const std::string op = req.at("op").get<std::string>();
      if (op == "encode") {
        EncodeOptions o;
        o.parse_special = req.value("special", false);
        out["ids"] = tok->encode(req.at("text").get<std::string>(), o);
      } else if (op == "decode") {
        DecodeOptions o;
        o.skip_special = req.value("skip", false);
        const auto ids = req.at("ids").get<std::vector<int32_t>>();
        out["text"] = tok->decode(ids, o);
        StreamDecoder sd(*tok, o);
        std::string s;
        for (int32_t id : ids) s += sd.push(id);
        s += sd.finish();
        out["stream"] = s;
      } else if (op == "chat") {
        const auto messages = messages_from_json(req.at("messages"));
        ChatOptions o;
        o.add_generation_prompt = req.value("gen", false);
        out["text"] = tok->render_chat(messages, o);
        out["ids"] = tok->encode_chat(messages, o);
      } else {
        out["error"] = "unknown op " + op;
      }
    } catch (const std::exception& e) {
      out = json{{"error", e.what()}};
    }
    std::cout << out.dump(-1, ' ', false, json::error_handler_t::replace) << '\n' << std::flush;
  }
}
"""


def build_driver(build_dir):
    libs = [os.path.join(build_dir, "model", "tokenizer", "libtroupe_tokenizer.a"),
            os.path.join(build_dir, "base", "libtroupe_base.a")]
    for lib in libs:
        if not os.path.exists(lib):
            sys.exit(f"{lib} is missing: build troupe first (ninja -C {build_dir} troupe)")
    out_dir = os.path.join(build_dir, "tokenizer_fuzz")
    os.makedirs(out_dir, exist_ok=True)
    src = os.path.join(out_dir, "driver.cpp")
    exe = os.path.join(out_dir, "driver-" + hashlib.sha1(DRIVER_SOURCE.encode()).hexdigest()[:10])
    newest_lib = max(os.path.getmtime(lib) for lib in libs)
    if os.path.exists(exe) and os.path.getmtime(exe) >= newest_lib:
        return exe
    with open(src, "w") as f:
        f.write(DRIVER_SOURCE)
    cmd = ["c++", "-std=c++20", "-O1", "-DFMT_SHARED", "-DSPDLOG_COMPILED_LIB", "-DSPDLOG_FMT_EXTERNAL",
           "-DSPDLOG_SHARED_LIB", "-I" + ROOT, src, "-o", exe, *libs, "-lspdlog", "-lfmt", "-lpcre2-8", "-lpthread"]
    print("building the troupe driver:", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)
    return exe


class JsonProcess:
    """A child that answers one JSON line per JSON line."""

    def __init__(self, argv):
        self.argv = argv
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, encoding="utf-8")

    def ask(self, req):
        self.p.stdin.write(json.dumps(req, ensure_ascii=True) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.argv[0]} died on {req!r}")
        return json.loads(line)

    def close(self):
        self.p.stdin.close()
        self.p.wait()


# ---------------------------------------------------------------------------
# The chat oracle: transformers' apply_chat_template, in the Python that has it.

def serve_chat_oracle():
    import transformers  # noqa: F401
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            text = hf.apply_chat_template(req["messages"], tokenize=False, add_generation_prompt=req["gen"])
            out = {"text": text}
        except Exception as e:  # noqa: BLE001 - any refusal is an answer
            out = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(out, ensure_ascii=True) + "\n")
        sys.stdout.flush()


# ---------------------------------------------------------------------------
# Random texts.

LATIN = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
ACCENTED = "àáâãäåæçèéêëìíîïñòóôõöøùúûüýÿßÀÁÂÃÄÅÆÇÈÉÊËÌÍÎÏÑÒÓÔÕÖØÙÚÛÜÝŸąćęłńśźżĄĆĘŁŃŚŹŻčďěňřšťůžČŠŽőűŐŰğışİŞĞœŒǅǈǋẞ"
COMBINING = [chr(c) for c in list(range(0x300, 0x370)) + [0x1AB0, 0x1DC0, 0x20D0, 0x20E3, 0xFE20, 0x302A, 0x3099, 0x309A]]
WORDS = ["the", "of", "and", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on", "are", "as", "with",
         "his", "they", "I", "at", "be", "this", "have", "from", "or", "one", "had", "by", "word", "but", "not",
         "what", "all", "were", "we", "when", "your", "can", "said", "there", "use", "an", "each", "which", "she",
         "do", "how", "their", "if", "will", "up", "other", "about", "out", "many", "then", "them", "these", "so",
         "Hello", "World", "THE", "Tokenizer", "token", "tokens", "naïve", "café", "über", "straße", "niño",
         "résumé", "coöperate", "ﬁnance", "Ωmega", "İstanbul", "ǅemal", "İi", "ΑΒΓ", "привет", "мир", "Ёжик"]
CJK = [chr(c) for c in range(0x4E00, 0x9FA6)]                 # in the pre-tokenizer's [一-龥]
CJK_OUT = [chr(c) for c in list(range(0x9FA6, 0x9FFF)) + list(range(0x3400, 0x4DC0)) + list(range(0x20000, 0x20100))
           + list(range(0xF900, 0xFA6E)) + list(range(0x2F800, 0x2F900)) + [0x3005, 0x3006, 0x3007, 0x303B]]
HIRAGANA = [chr(c) for c in range(0x3041, 0x30A0)]
KATAKANA = [chr(c) for c in range(0x30A0, 0x3100)] + [chr(c) for c in range(0x31F0, 0x3200)] + \
           [chr(c) for c in range(0xFF66, 0xFF9F)]
HANGUL = [chr(c) for c in range(0xAC00, 0xD7A4)]
JAMO = [chr(c) for c in list(range(0x1100, 0x1200)) + list(range(0x3131, 0x318F))]
ARABIC = [chr(c) for c in range(0x0621, 0x064B)] + ["\u0671", "\u067e", "\u0686", "\u06af", "\u06cc", "\u06c1"]
ARABIC_MARKS = [chr(c) for c in range(0x064B, 0x0660)] + ["\u0670"]
HEBREW = [chr(c) for c in range(0x05D0, 0x05EB)]
HEBREW_MARKS = [chr(c) for c in range(0x05B0, 0x05C8)]
DEVANAGARI = [chr(c) for c in range(0x0905, 0x093A)] + [chr(c) for c in range(0x093E, 0x094E)] + \
             ["\u094d", "\u093c", "\u0902", "\u0903", "\u0901", "\u0964", "\u0965"]
THAI = [chr(c) for c in range(0x0E01, 0x0E3B)] + [chr(c) for c in range(0x0E40, 0x0E4F)]
BIDI = ["\u200e", "\u200f", "\u202a", "\u202b", "\u202c", "\u202d", "\u202e", "\u2066", "\u2067", "\u2068", "\u2069",
        "\u061c"]
EMOJI = ["😀", "😂", "🥲", "🤖", "🎉", "🔥", "💯", "🍕", "🚀", "🌍", "❤", "☺", "✨", "⭐", "⚡", "🫠", "🫶", "🪿", "🧠",
         "👍", "👋", "🙏", "💪", "👨", "👩", "🧑", "👧", "👦", "🤷", "🏃", "🏳", "🏴", "🐻", "😶", "👁", "🐕", "🫱", "🫲"]
SKIN = ["\U0001f3fb", "\U0001f3fc", "\U0001f3fd", "\U0001f3fe", "\U0001f3ff"]
ZWJ_TAILS = ["♀️", "♂️", "💻", "🚀", "🌈", "☠️", "❄️", "🌫️", "🔥", "🩹", "🦺", "🗨️", "➡️", "🤝‍🧑", "❤️‍💋‍👨", "👩‍👧‍👦"]
FLAGS = ["🇯🇵", "🇺🇸", "🇫🇷", "🇩🇪", "🇧🇷", "🇮🇳", "🇨🇳", "🇰🇷", "🇺🇦", "🇪🇺", "🏴󠁧󠁢󠁳󠁣󠁴󠁿"]
DIGIT_SETS = ["0123456789", "٠١٢٣٤٥٦٧٨٩", "۰۱۲۳۴۵۶۷۸۹", "०१२३४५६७८९", "০১২৩৪৫৬৭৮৯", "๐๑๒๓๔๕๖๗๘๙",
              "０１２３４５６７８９", "𝟎𝟏𝟐𝟑𝟒𝟓𝟔𝟕𝟖𝟗", "၀၁၂၃၄၅၆၇၈၉", "᠐᠑᠒᠓᠔᠕᠖᠗᠘᠙", "𑁦𑁧𑁨𑁩𑁪𑁫𑁬𑁭𑁮𑁯",
              "¹²³⁴⁵⁶⁷⁸⁹⁰", "₀₁₂₃₄₅₆₇₈₉", "①②③④⑤⑥⑦⑧⑨⑩", "ⅠⅡⅢⅣⅤⅥⅦⅧⅨⅩ", "½⅓¼⅕⅙⅛", "〇一二三", "〡〢〣〤〥"]
SPACES = [" ", " ", " ", " ", "\t", "\t", "\n", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2003", "\u2009", "\u202f",
          "\u205f", "\u1680", "\u180e", "\u200b", "\ufeff", "\x0b", "\x0c", "\x85", "\u2028", "\u2029", "\x1c", "\x1e"]
PUNCT = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") + list("…—–‒―‘’“”„«»‹›¡¿·•†‡§¶°′″‰€£¥₹₩©®™✓→←↑↓⇒∀∈∑√∞≠≤≥±×÷"
                                                          "、。，！？：；「」『』【】〈〉《》〜・（）［］｛｝～＠＃＄％＾＆＊＋＝")
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'VE", "'M", "'LL", "'D", "'Re", "'Ll",
                "’s", "’t", "’re", "'", "''", "`s"]
CODE = ["def f(x):\n    return x**2\n", "for (int i = 0; i < n; ++i) { a[i] += b[i]; }", "x => x?.y ?? z",
        "if err != nil {\n\treturn err\n}", "#include <vector>\n", "SELECT * FROM t WHERE a='x';", "fn main() {}",
        "console.log(`${a}+${b}`);", "    self.w = nn.Linear(d, 4 * d, bias=False)", "$ ls -la | grep '^d'",
        "<div class=\"a\">&amp;</div>", "{\"k\": [1, 2.5e-3, null, true], \"s\": \"\\u00e9\\n\"}", "a[::-1]", "i++;j--",
        "/* c */ // c++ # py -- sql", "λx.x", "::std::move(v)", "0xDEADbeef 0b1010 1_000 3.14f 1e-9", "@decorator\n"]
URLS = ["https://example.com/a/b?c=d&e=f#g", "http://localhost:8080/v1/chat/completions", "ftp://u:p@h.org:21/x.tar.gz",
        "https://例え.jp/パス?q=値", "mailto:a.b+c@d.co.uk", "www.test.org", "file:///C:/Users/x%20y.txt",
        "https://github.com/huggingface/tokenizers/blob/main/tokenizers/src/pre_tokenizers/byte_level.rs#L42"]


def added_tokens():
    with open(os.path.join(TOKENIZER_DIR, "tokenizer.json"), encoding="utf-8") as f:
        return [(t["content"], t["id"]) for t in json.load(f)["added_tokens"]]


ADDED = added_tokens()
NAMED_ADDED = [c for c, _ in ADDED if "place▁holder" not in c] + ["<｜place▁holder▁no▁0｜>", "<｜place▁holder▁no▁799｜>",
                                                                  "<｜place▁holder▁no▁42｜>"]


def mangle_special(rng):
    t = rng.choice(NAMED_ADDED)
    r = rng.random()
    if r < 0.25:
        return t
    if r < 0.40:  # a prefix or a suffix
        k = rng.randint(1, len(t) - 1)
        return t[:k] if rng.random() < 0.5 else t[k:]
    if r < 0.55:  # lookalikes: ASCII bar, underscore or space for ▁, fullwidth brackets
        repl = rng.choice([("｜", "|"), ("▁", "_"), ("▁", " "), ("<", "＜"), (">", "＞"), ("｜", "｜｜"), ("▁", "")])
        return t.replace(*repl)
    if r < 0.65:  # a character dropped or doubled
        k = rng.randrange(len(t))
        return t[:k] + t[k + 1:] if rng.random() < 0.5 else t[:k] + t[k] + t[k:]
    if r < 0.75:  # nested
        u = rng.choice(NAMED_ADDED)
        k = rng.randint(1, len(t) - 1)
        return t[:k] + u + t[k:]
    if r < 0.85:  # case
        return t.upper() if rng.random() < 0.5 else t.lower()
    if r < 0.92:  # glued runs
        return "".join(rng.choice(NAMED_ADDED) for _ in range(rng.randint(2, 4)))
    return t + rng.choice(["", " ", "\n", "x", "<", "｜>", ">"]) + rng.choice(NAMED_ADDED)


def word(rng, alphabet, lo=1, hi=10):
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def number(rng):
    r = rng.random()
    if r < 0.45:
        return "".join(rng.choice("0123456789") for _ in range(rng.choice([1, 2, 3, 4, 5, 6, 7, 9, 12, 16, 25, 40])))
    if r < 0.6:  # grouped
        sep = rng.choice([",", ".", " ", "'", "_", "\u00a0", "\u202f", "\u2009"])
        groups = [str(rng.randint(1, 999))] + ["%03d" % rng.randint(0, 999) for _ in range(rng.randint(1, 5))]
        s = sep.join(groups)
        if rng.random() < 0.3:
            s += rng.choice([".", ","]) + str(rng.randint(0, 99999))
        return s
    if r < 0.7:
        return rng.choice(["-", "+", "±", "−", "$", "€", "#", "v", "x", "0x", ""]) + str(rng.random() * 10 ** rng.randint(0, 12))
    ds = rng.choice(DIGIT_SETS)
    return "".join(rng.choice(ds) for _ in range(rng.randint(1, 14)))


def emoji(rng):
    r = rng.random()
    e = rng.choice(EMOJI)
    if r < 0.3:
        return e
    if r < 0.5:
        return e + rng.choice(SKIN)
    if r < 0.75:  # ZWJ sequences, optionally with skin tone and VS16
        s = e + (rng.choice(SKIN) if rng.random() < 0.4 else "")
        for _ in range(rng.randint(1, 3)):
            s += "\u200d" + rng.choice(ZWJ_TAILS + EMOJI)
        return s
    if r < 0.85:
        return rng.choice(FLAGS)
    if r < 0.92:
        return rng.choice("0123456789#*") + "\ufe0f\u20e3"
    return e + rng.choice(["\ufe0f", "\ufe0e", "\u200d", "\u20e0"])


def contraction(rng):
    w = rng.choice(["I", "you", "we", "they", "it", "she", "DON", "Can", "isn", "WON", "o", "rock", "l", "d", "",
                    "ça", "l", "Jean", "123", "😀", "中"])
    return w + rng.choice(CONTRACTIONS) + rng.choice(["", "", " ", ".", "s", "ll", "x", "!"])


def whitespace(rng):
    n = rng.choice([1, 1, 1, 2, 2, 3, 4, 5, 8, 17, 40])
    return "".join(rng.choice(SPACES) for _ in range(n))


def punctuation(rng):
    s = "".join(rng.choice(PUNCT) for _ in range(rng.choice([1, 1, 2, 3, 5, 9])))
    if rng.random() < 0.3:  # the regex's "[punct][A-Za-z]+" and " ?[punct]+[\r\n]*" branches
        s += rng.choice([word(rng, LATIN), "\r\n", "\n\n", "\r", " "])
    return s


def random_codepoints(rng):
    out = []
    for _ in range(rng.randint(1, 8)):
        cp = rng.choice([rng.randrange(0x20, 0x3000), rng.randrange(0x3000, 0x10000), rng.randrange(0x10000, 0x30000),
                         rng.randrange(0xE0000, 0xE0080), rng.randrange(0xF0000, 0x110000)])
        if 0xD800 <= cp <= 0xDFFF:
            cp = 0xFFFD
        out.append(chr(cp))
    return "".join(out)


def long_word(rng):
    n = rng.choice([200, 700, 1500, 5000, 20000])
    kind = rng.randrange(7)
    if kind == 0:
        return word(rng, LATIN, n, n)
    if kind == 1:
        return rng.choice(LATIN + ACCENTED) * n
    if kind == 2:
        return "".join(rng.choice(CJK + HIRAGANA) for _ in range(n // 4))
    if kind == 3:
        return "".join(rng.choice("0123456789") for _ in range(n))
    if kind == 4:
        return rng.choice([" ", "\t", "\n", "\r\n", " \n"]) * (n // 2) + rng.choice(["", "x", "!", "1"])
    if kind == 5:
        return rng.choice(PUNCT) * n
    return "".join(rng.choice(HANGUL + THAI + ARABIC) for _ in range(n // 4))


def segment(rng):
    gens = [
        (10, lambda: rng.choice(WORDS)),
        (6, lambda: word(rng, LATIN + ACCENTED * 2)),
        (4, lambda: word(rng, LATIN) + "".join(rng.choice(COMBINING) for _ in range(rng.randint(1, 3)))),
        (3, lambda: "".join(rng.choice(COMBINING) for _ in range(rng.randint(1, 4)))),
        (6, lambda: word(rng, CJK, 1, 8)),
        (2, lambda: word(rng, CJK_OUT, 1, 4)),
        (4, lambda: word(rng, HIRAGANA + KATAKANA, 1, 8)),
        (2, lambda: word(rng, CJK + HIRAGANA + KATAKANA + ["ー", "・", "々", "〆"], 2, 10)),
        (4, lambda: word(rng, HANGUL, 1, 6)),
        (1, lambda: word(rng, JAMO, 1, 6)),
        (3, lambda: "".join(rng.choice(ARABIC) + (rng.choice(ARABIC_MARKS) if rng.random() < 0.4 else "")
                            for _ in range(rng.randint(1, 7)))),
        (3, lambda: "".join(rng.choice(HEBREW) + (rng.choice(HEBREW_MARKS) if rng.random() < 0.3 else "")
                            for _ in range(rng.randint(1, 7)))),
        (1, lambda: rng.choice(BIDI)),
        (3, lambda: word(rng, DEVANAGARI, 1, 8)),
        (3, lambda: word(rng, THAI, 1, 10)),
        (6, lambda: emoji(rng)),
        (8, lambda: number(rng)),
        (10, lambda: whitespace(rng)),
        (6, lambda: punctuation(rng)),
        (3, lambda: rng.choice(CODE)),
        (2, lambda: rng.choice(URLS)),
        (4, lambda: contraction(rng)),
        (5, lambda: mangle_special(rng)),
        (2, lambda: random_codepoints(rng)),
        (1, lambda: chr(rng.choice([0, 1, 7, 8, 0x1b, 0x7f, 0x80, 0x9f]))),
    ]
    total = sum(w for w, _ in gens)
    x = rng.uniform(0, total)
    for w, g in gens:
        x -= w
        if x <= 0:
            return g()
    return gens[-1][1]()


def random_text(rng, max_segments=24):
    if rng.random() < 0.02:
        return long_word(rng) + (segment(rng) if rng.random() < 0.5 else "")
    parts = []
    for _ in range(rng.randint(1, max_segments)):
        parts.append(segment(rng))
        r = rng.random()
        if r < 0.45:
            parts.append(" ")
        elif r < 0.55:
            parts.append(whitespace(rng))
    return "".join(parts)


# ---------------------------------------------------------------------------
# Hugging Face side of texts.

class HF:
    def __init__(self):
        from tokenizers import Tokenizer
        import tokenizers
        self.version = tokenizers.__version__
        self.tok = Tokenizer.from_file(os.path.join(TOKENIZER_DIR, "tokenizer.json"))
        self.added_list = sorted(i for _, i in ADDED)
        self.vocab = self.tok.get_vocab_size(with_added_tokens=False)

    def plain(self, text):
        ids = []
        for piece, _ in self.tok.pre_tokenizer.pre_tokenize_str(text):
            ids.extend(t.id for t in self.tok.model.tokenize(piece))
        return ids

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip=False):
        return self.tok.decode(ids, skip_special_tokens=skip)


def short(x, limit=600):
    s = repr(x)
    return s if len(s) <= limit else s[:limit] + f"... ({len(s)} chars)"


def first_diff(a, b):
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n if len(a) != len(b) else None


def text_checks(troupe, hf, text, rng=None):
    """The failed checks for `text`: a list of (name, detail dict)."""
    fails = []
    hf_plain = hf.plain(text)
    t = troupe.ask({"op": "encode", "text": text})
    if t.get("ids") != hf_plain:
        fails.append(("encode-plain", {"expected": hf_plain, "got": t.get("ids", t)}))
    hf_ids = hf.encode(text)
    t = troupe.ask({"op": "encode", "text": text, "special": True})
    if t.get("ids") != hf_ids:
        fails.append(("encode-special", {"expected": hf_ids, "got": t.get("ids", t)}))
    seqs = [("ids", hf_ids)]
    if hf_plain != hf_ids:
        seqs.append(("plain-ids", hf_plain))
    if rng is not None and len(hf_ids) > 1:
        a = rng.randrange(len(hf_ids))
        seqs.append(("slice", hf_ids[a:a + rng.randint(1, 5)]))
    if rng is not None:  # any ids at all: byte tokens that make invalid UTF-8, added tokens
        pool = [lambda: rng.randrange(hf.vocab), lambda: rng.randrange(3, 260), lambda: rng.choice(hf.added_list)]
        seqs.append(("random", [rng.choice(pool)() for _ in range(rng.randint(1, 10))]))
    for name, ids in seqs:
        for skip in (False, True):
            expected = hf.decode(ids, skip)
            t = troupe.ask({"op": "decode", "ids": ids, "skip": skip})
            if t.get("text") != expected:
                fails.append((f"decode-{name}{'-skip' if skip else ''}", {"ids": ids, "expected": expected, "got": t}))
            elif t.get("stream") != expected:
                fails.append((f"stream-{name}{'-skip' if skip else ''}",
                              {"ids": ids, "expected": expected, "got": t.get("stream")}))
    return fails


# ---------------------------------------------------------------------------
# Conversations.

IDENT = "abcdefghijklmnopqrstuvwxyz_"


def random_json_value(rng, depth=0):
    r = rng.random()
    if depth > 2 or r < 0.3:
        return rng.choice([rng.randint(-10**6, 10**6), rng.random(), True, False, None,
                           random_text(rng, 3), rng.choice(WORDS)])
    if r < 0.65:
        return {word(rng, IDENT, 1, 8): random_json_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return [random_json_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]


def random_content(rng):
    r = rng.random()
    if r < 0.12:
        return ""
    if r < 0.2:
        return rng.choice([" ", "\n", "\n\n", "  \n", "\t"])
    if r < 0.3:
        return mangle_special(rng) + (random_text(rng, 3) if rng.random() < 0.5 else "")
    return random_text(rng, rng.choice([2, 4, 8, 16]))


def random_tool_call(rng, k):
    if rng.random() < 0.8:
        args = json.dumps(random_json_value(rng), ensure_ascii=rng.random() < 0.5,
                          indent=rng.choice([None, None, 2]))
    else:
        args = rng.choice(["", "{}", "not json", random_text(rng, 3)])
    name = rng.choice(["get_weather", "search", "run_code", "f", word(rng, IDENT, 1, 20), "工具", random_text(rng, 2)])
    call = {"id": f"call_{k}", "type": "function", "function": {"name": name, "arguments": args}}
    if rng.random() < 0.05:
        call["type"] = rng.choice(["code", "function ", "工具"])
    return call


def random_conversation(rng):
    msgs = []
    k = 0
    n = rng.choice([1, 1, 2, 2, 3, 4, 5, 6, 8, 10])
    if rng.random() < 0.4:
        msgs.append({"role": "system", "content": random_content(rng)})
    for _ in range(n):
        r = rng.random()
        if r < 0.35:
            m = {"role": "user", "content": random_content(rng)}
        elif r < 0.6:
            m = {"role": "assistant", "content": random_content(rng)}
        elif r < 0.75:
            calls = []
            for _ in range(rng.choice([1, 1, 1, 2, 3])):
                calls.append(random_tool_call(rng, k))
                k += 1
            m = {"role": "assistant", "content": None, "tool_calls": calls}
        elif r < 0.92:
            m = {"role": "tool", "content": random_content(rng)}
            if rng.random() < 0.7:
                m["tool_call_id"] = f"call_{rng.randrange(k + 1)}"
        else:
            m = {"role": "system", "content": random_content(rng)}
        # Fields this template does not render: both sides must ignore them.
        if m["role"] == "assistant" and rng.random() < 0.2:
            m[rng.choice(["reasoning_content", "reasoning", "thinking"])] = random_text(rng, 3)
        if rng.random() < 0.05:
            m["name"] = rng.choice(["alice", "bob", "tool_x"])
        msgs.append(m)
    return msgs, rng.random() < 0.5


class Chat:
    """Expected chat prompts from transformers (text) and `tokenizers` (ids)."""

    def __init__(self, oracle, hf):
        self.oracle = oracle
        self.hf = hf
        by_len = sorted((c for c, _ in ADDED), key=len, reverse=True)
        self.added_re = re.compile("|".join(re.escape(c) for c in by_len))
        self.added_id = dict(ADDED)

    def expected(self, msgs, gen):
        """{"error"} when transformers refuses, else {"text", "ids", "ids_of_text"}
        (ids None when the fields cannot be told apart from the markers)."""
        real = self.oracle.ask({"messages": msgs, "gen": gen})
        if "error" in real:
            return real
        # The template's own markers vs message fields: render again with a
        # placeholder in every string field, split at added tokens, put the
        # fields back into the text runs, and encode those runs as plain text.
        fields = []

        def ph(s):
            fields.append(s)
            return f"\U0010fffd{len(fields) - 1}\U0010fffd"

        def sub(m):
            out = {}
            for key, v in m.items():
                if isinstance(v, str) and key != "role":
                    out[key] = ph(v)
                elif key == "tool_calls":
                    out[key] = [{"id": c["id"], "type": ph(c["type"]),
                                 "function": {"name": ph(c["function"]["name"]),
                                              "arguments": ph(c["function"]["arguments"])}} for c in v]
                else:
                    out[key] = v
            return out

        if any("\U0010fffd" in s for m in msgs for s in _strings(m)):
            return {"text": real["text"], "ids": None, "ids_of_text": None}  # text only
        r = self.oracle.ask({"messages": [sub(m) for m in msgs], "gen": gen})
        if "error" in r:
            return {"text": real["text"], "ids": None, "ids_of_text": None}
        unph = re.compile("\U0010fffd(\\d+)\U0010fffd")
        ids, text, at = [], "", 0

        def run(s):
            nonlocal text
            s = unph.sub(lambda mm: fields[int(mm.group(1))], s)
            text += s
            ids.extend(self.hf.plain(s))

        for m in self.added_re.finditer(r["text"]):
            if m.start() > at:
                run(r["text"][at:m.start()])
            ids.append(self.added_id[m.group(0)])
            text += m.group(0)
            at = m.end()
        if at < len(r["text"]):
            run(r["text"][at:])
        if text != real["text"]:
            raise RuntimeError(f"placeholder rendering differs from the real one: {text!r} vs {real['text']!r}")
        return {"text": real["text"], "ids": ids, "ids_of_text": self.hf.encode(real["text"])}


def _strings(m):
    for key, v in m.items():
        if isinstance(v, str):
            yield v
        elif key == "tool_calls":
            for c in v:
                yield c["type"]
                yield c["function"]["name"]
                yield c["function"]["arguments"]


def chat_checks(troupe, chat, msgs, gen):
    exp = chat.expected(msgs, gen)
    got = troupe.ask({"op": "chat", "messages": msgs, "gen": gen})
    if "error" in exp:  # transformers refused; troupe must refuse too
        return [] if "error" in got else [("chat-accepted", {"transformers": exp["error"], "got": got})]
    text, ids, ids_of_text = exp["text"], exp["ids"], exp["ids_of_text"]
    fails = []
    if "error" in got:
        return [("chat-refused", {"expected_text": text, "got": got["error"]})]
    if got["text"] != text:
        i = first_diff(text, got["text"])
        fails.append(("chat-text", {"expected": text, "got": got["text"], "first_diff_at": i}))
    if ids is not None and got["ids"] != ids:
        fails.append(("chat-ids", {"expected": ids, "got": got["ids"], "first_diff_at": first_diff(ids, got["ids"])}))
    has_added = any(chat.added_re.search(s) for m in msgs for s in _strings(m))
    if ids is not None and not has_added and ids != ids_of_text:
        fails.append(("harness", {"note": "marker split and encode(text) disagree without added-token text",
                                  "split": ids, "encode": ids_of_text}))
    return fails


# ---------------------------------------------------------------------------
# Shrinking.

def shrink_string(s, still_fails, budget):
    """Delta debugging over code points, then simpler characters."""
    chars = list(s)
    calls = 0
    n = 2
    while len(chars) > 1 and calls < budget:
        chunk = max(1, len(chars) // n)
        removed = False
        i = 0
        while i < len(chars) and calls < budget:
            cand = chars[:i] + chars[i + chunk:]
            calls += 1
            if cand and still_fails("".join(cand)):
                chars = cand
                removed = True
            else:
                i += chunk
        if not removed:
            if chunk == 1:
                break
            n = min(len(chars), n * 2)
        else:
            n = max(2, n - 1)
    for i in range(len(chars)):  # plainer stand-ins keep the failure readable
        if calls >= budget:
            break
        for simple in ("a", " ", "1", "."):
            if chars[i] == simple:
                break
            cand = chars[:i] + [simple] + chars[i + 1:]
            calls += 1
            if still_fails("".join(cand)):
                chars = cand
                break
    return "".join(chars)


def shrink_text(troupe, hf, text, check, budget=4000):
    def still_fails(t):
        return any(name == check for name, _ in text_checks(troupe, hf, t))
    return shrink_string(text, still_fails, budget)


def shrink_chat(troupe, chat, msgs, gen, check, budget=1500):
    import copy

    def still_fails(ms, g):
        try:
            return any(name == check for name, _ in chat_checks(troupe, chat, ms, g))
        except RuntimeError:
            return False

    msgs = copy.deepcopy(msgs)
    if gen and still_fails(msgs, False):
        gen = False
    changed = True
    while changed:  # drop whole messages, tool calls, ignored fields
        changed = False
        for i in range(len(msgs)):
            cand = msgs[:i] + msgs[i + 1:]
            if cand and still_fails(cand, gen):
                msgs, changed = cand, True
                break
        for i, m in enumerate(msgs):
            for key in [k for k in m if k not in ("role", "content", "tool_calls")]:
                cand = copy.deepcopy(msgs)
                del cand[i][key]
                if still_fails(cand, gen):
                    msgs, changed = cand, True
            calls = m.get("tool_calls") or []
            for j in range(len(calls)):
                if len(calls) > 1:
                    cand = copy.deepcopy(msgs)
                    del cand[i]["tool_calls"][j]
                    if still_fails(cand, gen):
                        msgs, changed = cand, True
                        break
    # shrink each string field
    paths = []
    for i, m in enumerate(msgs):
        if isinstance(m.get("content"), str):
            paths.append((i, "content"))
        for j, _ in enumerate(m.get("tool_calls") or []):
            paths += [(i, "tool_calls", j, "function", "name"), (i, "tool_calls", j, "function", "arguments"),
                      (i, "tool_calls", j, "type")]

    def get(ms, p):
        x = ms
        for k in p:
            x = x[k]
        return x

    def with_value(ms, p, v):
        ms = copy.deepcopy(ms)
        x = ms
        for k in p[:-1]:
            x = x[k]
        x[p[-1]] = v
        return ms

    for p in paths:
        s = get(msgs, p)
        if s:
            s = shrink_string(s, lambda t, p=p: still_fails(with_value(msgs, p, t), gen), budget // max(1, len(paths)))
            if s == "" or not still_fails(with_value(msgs, p, ""), gen):
                msgs = with_value(msgs, p, s)
            else:
                msgs = with_value(msgs, p, "")
    return msgs, gen


# ---------------------------------------------------------------------------
# The CLI, on whole batches.

def cli_check(troupe_bin, hf, texts):
    """`troupe tokenize` line by line: plain, --special and --decode."""
    lines = [line for t in texts for line in t.split("\n")]
    fails = []
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "in.txt")
        with open(src, "w", encoding="utf-8", newline="") as f:
            f.write("".join(line + "\n" for line in lines))
        for special in (False, True):
            args = [troupe_bin, "tokenize", "--tokenizer", TOKENIZER_DIR, "--text-file", src] + (["--special"] if special else [])
            r = subprocess.run(args, capture_output=True)
            if r.returncode != 0:
                fails.append((f"cli-encode{'-special' if special else ''}", {"stderr": r.stderr.decode(errors="replace")}))
                continue
            got = r.stdout.decode().split("\n")
            if got and got[-1] == "":
                got.pop()
            for k, line in enumerate(lines):
                exp = hf.encode(line) if special else hf.plain(line)
                g = [int(x) for x in got[k].split()] if k < len(got) else None
                if g != exp:
                    fails.append((f"cli-encode{'-special' if special else ''}", {"line": line, "expected": exp, "got": g}))
                    break
        ids_file = os.path.join(d, "ids.txt")
        id_lines = [hf.encode(line) for line in lines]
        with open(ids_file, "w") as f:
            f.write("".join(" ".join(map(str, ids)) + "\n" for ids in id_lines))
        r = subprocess.run([troupe_bin, "tokenize", "--tokenizer", TOKENIZER_DIR, "--decode", "--text-file", ids_file],
                           capture_output=True)
        if r.returncode != 0:
            fails.append(("cli-decode", {"stderr": r.stderr.decode(errors="replace")}))
        else:
            got = r.stdout.decode().split("\n")
            for k, ids in enumerate(id_lines):
                exp = hf.decode(ids)
                if k >= len(got) or got[k] != exp:
                    fails.append(("cli-decode", {"ids": ids, "expected": exp, "got": got[k] if k < len(got) else None}))
                    break
    return fails


# ---------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=1000, help="random texts")
    ap.add_argument("--chats", type=int, default=None, help="random conversations (default: cases/10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    ap.add_argument("--oracle-python", default=os.environ.get("TROUPE_ORACLE_PYTHON", "/tmp/oracle/bin/python"),
                    help="a Python with transformers, for apply_chat_template")
    ap.add_argument("--max-failures", type=int, default=10, help="stop after this many distinct failures")
    ap.add_argument("--cli-every", type=int, default=4, help="run every Nth batch of 100 texts through `troupe tokenize` (0: never)")
    ap.add_argument("--no-shrink", action="store_true")
    ap.add_argument("--serve-chat-oracle", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_chat_oracle:
        serve_chat_oracle()
        return 0
    chats = args.cases // 10 if args.chats is None else args.chats

    hf = HF()
    driver = build_driver(args.build_dir)
    troupe = JsonProcess([driver, TOKENIZER_DIR])
    troupe_bin = os.path.join(args.build_dir, "bin", "troupe")
    print(f"tokenizers {hf.version}; seed {args.seed}; {args.cases} texts, {chats} conversations", flush=True)

    failures = []  # (kind, input, detail)
    seen = set()

    def report(kind, what, detail):
        key = kind
        if key in seen:  # one shrunk example per kind of check
            return
        seen.add(key)
        failures.append((kind, what, detail))
        print(f"\nMISMATCH {kind}\n  input: {short(what, 2000)}", flush=True)
        for k, v in detail.items():
            print(f"  {k}: {short(v, 2000)}", flush=True)

    rng = random.Random(args.seed)
    batch = []
    stats = {"texts": 0, "chars": 0, "chats": 0, "cli_lines": 0}
    for i in range(args.cases):
        text = random_text(rng)
        stats["texts"] += 1
        stats["chars"] += len(text)
        for kind, detail in text_checks(troupe, hf, text, rng):
            if kind in seen:
                continue
            small = text if args.no_shrink or kind.startswith(("decode-slice", "stream-slice", "decode-random", "stream-random")) else \
                shrink_text(troupe, hf, text, kind)
            d = text_checks(troupe, hf, small)
            detail = next((dd for k, dd in d if k == kind), detail)
            report(kind, small, detail)
        batch.append(text)
        if len(batch) == 100 or i == args.cases - 1:
            n_batch = (i // 100)
            if args.cli_every and n_batch % args.cli_every == 0:
                stats["cli_lines"] += sum(t.count("\n") + 1 for t in batch)
                for kind, detail in cli_check(troupe_bin, hf, batch):
                    report(kind, detail.get("line", detail.get("ids")), detail)
            batch = []
        if (i + 1) % 500 == 0:
            print(f"  {i + 1} texts, {len(failures)} failing checks", flush=True)
        if len(failures) >= args.max_failures:
            break

    if chats:
        if not os.path.exists(args.oracle_python):
            sys.exit(f"{args.oracle_python}: no such Python (--oracle-python, with transformers)")
        oracle = JsonProcess([args.oracle_python, os.path.abspath(__file__), "--serve-chat-oracle"])
        chat = Chat(oracle, hf)
        crng = random.Random(args.seed * 7919 + 1)
        for i in range(chats):
            if len(failures) >= args.max_failures:
                break
            msgs, gen = random_conversation(crng)
            stats["chats"] += 1
            for kind, detail in chat_checks(troupe, chat, msgs, gen):
                if kind in seen:
                    continue
                m2, g2 = (msgs, gen) if args.no_shrink else shrink_chat(troupe, chat, msgs, gen, kind)
                d = chat_checks(troupe, chat, m2, g2)
                detail = next((dd for k, dd in d if k == kind), detail)
                report(kind, {"messages": m2, "add_generation_prompt": g2}, detail)
            if (i + 1) % 100 == 0:
                print(f"  {i + 1} conversations, {len(failures)} failing checks", flush=True)
        oracle.close()
    troupe.close()

    print(f"\n{stats['texts']} texts ({stats['chars']} code points), {stats['cli_lines']} CLI lines, "
          f"{stats['chats']} conversations: {len(failures)} kinds of mismatch"
          + (": " + ", ".join(k for k, _, _ in failures) if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
