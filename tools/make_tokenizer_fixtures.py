#!/usr/bin/env python3
"""Writes tests/fixtures/tokenizer/: what Hugging Face makes of the tokenizer
corpus (tools/tokenizer_corpus.py) with the shipped DeepSeek-V4 tokenizer.
The C++ tests compare troupe's tokenizer with these files.

Needs `tokenizers` (scripts/requirements.txt) and, for the chat fixtures,
`transformers` 4.x without torch, in a throwaway venv:
    python3 -m venv /tmp/tf4 && /tmp/tf4/bin/pip install "transformers<5" tokenizers==0.22.1
    /tmp/tf4/bin/python tools/make_tokenizer_fixtures.py
transformers 5.x is not used: its LlamaTokenizer rebuilds this tokenizer with
its own pre-tokenizer instead of tokenizer.json's and produces other ids
(its rendered chat text is the same; the script checks that when it can).

Files:
  corpus.txt        the corpus, one line each ('\\n'-separated)
  corpus.ids        encode(line, add_special_tokens=False) per line, ids separated by spaces
  documents.jsonl   {"text", "ids"}: texts with line breaks of every kind
  special.jsonl     {"text", "plain", "parsed"}: added-token strings in text; plain =
                    pre-tokenizer + BPE only, parsed = encode(text, add_special_tokens=False)
  decode.jsonl      {"ids", "text", "text_skip_special"}: decode() of id sequences,
                    including ones that split characters and invalid bytes
  chat.jsonl        {"messages", "add_generation_prompt", "text", "ids"} from
                    apply_chat_template (tokenize=False and tokenize=True)
  unicode_sweep.txt one line per block of 64 code points (all of U+0000..U+10FFFF
                    but surrogates): "<first code point hex> <id count> <fnv1a64 of ids>"
                    for the text sweep_text(block) below
"""
import hashlib
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import tokenizer_corpus  # noqa: E402

from tokenizers import Tokenizer  # noqa: E402

TOKENIZER_DIR = os.path.join(ROOT, "model", "tokenizer", "data", "deepseek-v4")
OUT = os.path.join(ROOT, "tests", "fixtures", "tokenizer")


def sweep_text(first):
    """The sweep line for code points [first, first+64): each code point c in
    contexts that reveal its regex classes (letter, mark, number, punctuation,
    symbol, space, CJK range, line break). tests/tokenizer builds the same text."""
    out = []
    for cp in range(first, first + 64):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        c = chr(cp)
        out.append(c + "a" + c + " " + c + "1" + c + "!" + c + c + "\n " + c)
    return "".join(out)


def fnv1a64(ids):
    h = 0xCBF29CE484222325
    for i in ids:
        for b in int(i).to_bytes(4, "little"):
            h ^= b
            h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def plain_ids(tok, text):
    """Ids with no added-token matching: the pre-tokenizer and BPE alone."""
    ids = []
    for piece, _ in tok.pre_tokenizer.pre_tokenize_str(text):
        ids.extend(t.id for t in tok.model.tokenize(piece))
    return ids


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def main():
    os.makedirs(OUT, exist_ok=True)
    tok = Tokenizer.from_file(os.path.join(TOKENIZER_DIR, "tokenizer.json"))

    lines = tokenizer_corpus.corpus()
    encs = tok.encode_batch(lines, add_special_tokens=False)
    with open(os.path.join(OUT, "corpus.txt"), "w", encoding="utf-8", newline="\n") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(OUT, "corpus.ids"), "w", encoding="utf-8", newline="\n") as f:
        for line, e in zip(lines, encs):
            assert e.ids == plain_ids(tok, line), f"corpus line has added-token text: {line!r}"
            assert tok.decode(e.ids, skip_special_tokens=False) == line, f"HF does not round-trip {line!r}"
            f.write(" ".join(map(str, e.ids)) + "\n")

    docs = tokenizer_corpus.documents()
    write_jsonl(os.path.join(OUT, "documents.jsonl"),
                [{"text": d, "ids": e.ids} for d, e in zip(docs, tok.encode_batch(docs, add_special_tokens=False))])

    write_jsonl(os.path.join(OUT, "special.jsonl"),
                [{"text": t, "plain": plain_ids(tok, t), "parsed": tok.encode(t, add_special_tokens=False).ids}
                 for t in tokenizer_corpus.special_texts()])

    rng = random.Random(99)
    vocab = tok.get_vocab_size()
    seqs = [[0, 1, 2], [128803, 128804, 128805], [0] + tok.encode("hi", add_special_tokens=False).ids + [1]]
    for line in rng.sample(lines, 60):  # the ids of a line, cut anywhere: partial characters at both ends
        ids = tok.encode(line, add_special_tokens=False).ids
        if len(ids) > 2:
            a = rng.randrange(len(ids))
            seqs.append(ids[a:a + rng.randint(1, 6)])
    byte_tokens = [i for i in range(3, 300)]  # single-byte tokens: invalid UTF-8 when alone
    for _ in range(60):
        seqs.append([rng.choice(byte_tokens) for _ in range(rng.randint(1, 8))])
    for _ in range(40):
        seqs.append([rng.randrange(vocab) for _ in range(rng.randint(1, 12))])
    write_jsonl(os.path.join(OUT, "decode.jsonl"),
                [{"ids": s, "text": tok.decode(s, skip_special_tokens=False),
                  "text_skip_special": tok.decode(s, skip_special_tokens=True)} for s in seqs])

    write_chat(tok)

    blocks = [b for b in range(0, 0x110000, 64) if not (0xD800 <= b <= 0xDFFF - 63)]
    texts = [sweep_text(b) for b in blocks]
    with open(os.path.join(OUT, "unicode_sweep.txt"), "w", encoding="utf-8", newline="\n") as f:
        for b, e in zip(blocks, tok.encode_batch(texts, add_special_tokens=False)):
            f.write(f"{b:x} {len(e.ids)} {fnv1a64(e.ids):016x}\n")

    print(f"corpus: {len(lines)} lines, {sum(len(l.encode()) for l in lines)} bytes; "
          f"{len(docs)} documents; {len(seqs)} decode cases; {len(blocks)} sweep blocks")


def write_chat(tok):
    try:
        import transformers
        from transformers import AutoTokenizer
    except ImportError:
        sys.exit("chat fixtures need transformers 4.x (see the top of this file)")
    if int(transformers.__version__.split(".")[0]) >= 5:
        sys.exit(f"transformers {transformers.__version__}: use 4.x (see the top of this file)")
    hf = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    rows = []
    for messages, gen in tokenizer_corpus.conversations():
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
        if isinstance(ids, dict):
            ids = ids["input_ids"]
        assert ids == tok.encode(text, add_special_tokens=False).ids, "transformers and tokenizers disagree"
        rows.append({"messages": messages, "add_generation_prompt": gen, "text": text, "ids": ids})
    write_jsonl(os.path.join(OUT, "chat.jsonl"), rows)
    print(f"chat: {len(rows)} conversations (transformers {transformers.__version__})")


if __name__ == "__main__":
    main()
