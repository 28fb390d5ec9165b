#!/usr/bin/env bash
# Tokenizer encoding speed: troupe's C++ tokenizer and Hugging Face `tokenizers`
# (from .venv) on the tokenizer corpus, in one run, and the section
# "Tokenizer encoding" of docs/benchmarks.md rewritten with the result (the
# other sections are kept).
#   bench/tokenizer.sh [PASSES]      (BUILD=build by default)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
PASSES=${1:-7}
TOK=model/tokenizer/data/deepseek-v4
CORPUS=tests/fixtures/tokenizer/corpus.txt
DOC=docs/benchmarks.md

cmake --build "$BUILD" --target tokenizer_bench >/dev/null
troupe_out=$("$BUILD"/bin/tokenizer_bench "$TOK" "$CORPUS" "$PASSES")
hf1_out=$(.venv/bin/python bench/tokenizer_hf.py "$TOK/tokenizer.json" "$CORPUS" "$PASSES" --threads 1)
hfn_out=$(.venv/bin/python bench/tokenizer_hf.py "$TOK/tokenizer.json" "$CORPUS" "$PASSES" --threads "$(nproc)")
echo "troupe:"; echo "$troupe_out"
echo "tokenizers, 1 thread:"; echo "$hf1_out"
echo "tokenizers, $(nproc) threads:"; echo "$hfn_out"

field() { # field OUTPUT MODE KEY
  echo "$1" | awk -v m="$2" -v k="$3" '$1 == m { for (i = 2; i <= NF; i++) { split($i, kv, "="); if (kv[1] == k) print kv[2] } }'
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", a / b }'; }

for mode in lines text; do
  if [ "$(field "$troupe_out" $mode ids)" != "$(field "$hf1_out" $mode ids)" ]; then
    echo "tokenizer.sh: troupe and tokenizers disagree on the number of ids ($mode)" >&2
    exit 1
  fi
done

row() { # row LABEL MODE
  local t1 tb h1 hb hn
  t1=$(field "$troupe_out" "$2" first_pass_mb_s); tb=$(field "$troupe_out" "$2" best_mb_s)
  h1=$(field "$hf1_out" "$2" first_pass_mb_s); hb=$(field "$hf1_out" "$2" best_mb_s)
  hn=$(field "$hfn_out" "$2" best_mb_s)
  echo "| $1 | $t1 | $tb | $h1 | $hb | $(ratio "$tb" "$hb")x | $hn |"
}

bytes=$(field "$troupe_out" lines bytes)
lines=$(field "$troupe_out" lines calls)
section=$(cat <<MD
## Tokenizer encoding

\`bench/tokenizer.sh\`, $(date -u +%Y-%m-%d): the DeepSeek-V4 tokenizer on \`$CORPUS\`
($lines lines, $bytes bytes of UTF-8), MB/s of input, $PASSES passes per mode; the
first pass starts with an empty piece cache, "best" is the fastest pass.
troupe encodes on the calling thread; tokenizers is measured on 1 thread
(Rayon) and, last column, on all $(nproc) cores. Both produce the same ids
(the script checks the counts; tests/tokenizer checks every id).
Machine: $(nproc) cores, load average $(cut -d' ' -f1 /proc/loadavg) when run (shared with other builds,
so absolute numbers are low and noisy; the ratio is the figure to read).

| mode | troupe first pass | troupe best | tokenizers first pass | tokenizers best | best ratio | tokenizers best, $(nproc) threads |
|---|---|---|---|---|---|---|
$(row "one call per line" lines)
$(row "whole file, one call" text)

Load time of tokenizer.json in troupe: $(field "$troupe_out" load seconds) s.
MD
)

mkdir -p docs
[ -f "$DOC" ] || printf '# Benchmarks\n\nSpeed, as ratios against a peer measured in the same run.\n' > "$DOC"
SECTION="$section" python3 - "$DOC" <<'PY'
import os, re, sys
path = sys.argv[1]
doc = open(path, encoding="utf-8").read()
new = os.environ["SECTION"].rstrip() + "\n"
pattern = re.compile(r"^## Tokenizer encoding\n.*?(?=^## |\Z)", re.S | re.M)
doc = pattern.sub(lambda m: new + "\n", doc) if pattern.search(doc) else doc.rstrip() + "\n\n" + new
open(path, "w", encoding="utf-8").write(doc.rstrip() + "\n")
PY
echo "wrote $DOC"
