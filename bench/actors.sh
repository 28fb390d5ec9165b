#!/usr/bin/env bash
# The actor graph's cost and `troupe serve` latency, and the section
# "Actors and serving" of docs/benchmarks.md rewritten with the result (the
# other sections are kept).
#   1. troupe_actors_bench: tokens/s through the actors (router -> worker actor
#      -> engine thread -> TokenBatch messages) vs the engine's own loop, on the
#      same batches, alternating rounds.
#   2. bench/actors_serve.py: TTFT and ITL over HTTP at several Poisson rates.
#   bench/actors.sh [ROUNDS] [SECONDS_PER_RATE]      (BUILD=build by default)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
ROUNDS=${1:-3}
SECONDS_PER_RATE=${2:-20}
RATES=${RATES:-0.5,1,2,4}
export TROUPE_HOME=${TROUPE_HOME:-$PWD/$BUILD/bench-home}
DOC=docs/benchmarks.md

cmake --build "$BUILD" --target troupe troupe_actors_bench >/dev/null
actors_out=$("$BUILD"/bin/troupe_actors_bench --batch 1,8,64 --rounds "$ROUNDS")
echo "$actors_out"
serve_out=$(.venv/bin/python bench/actors_serve.py --troupe "$BUILD"/bin/troupe --home "$TROUPE_HOME" \
  --rates "$RATES" --seconds "$SECONDS_PER_RATE")
echo "$serve_out"

SECTION_ACTORS="$actors_out" SECTION_SERVE="$serve_out" ROUNDS="$ROUNDS" SECS="$SECONDS_PER_RATE" \
  python3 - "$DOC" <<'PY'
import datetime, json, os, re, sys
path = sys.argv[1]
actors = [json.loads(l) for l in os.environ["SECTION_ACTORS"].splitlines() if l.strip()]
serve = [json.loads(l) for l in os.environ["SECTION_SERVE"].splitlines() if l.strip()]
load = open("/proc/loadavg").read().split()[0]
ms = lambda s: f"{s * 1000:.0f}"
lines = [
    "## Actors and serving",
    "",
    f"`bench/actors.sh`, {datetime.date.today()}, CPU backend, the embedded tiny model (vocab 129280, 4 layers);",
    f"{os.cpu_count()} cores, load average {load} when run (shared with other builds: absolute numbers are low",
    "and noisy, the ratio is the figure to read).",
    "",
    "Tokens/s through the actors vs the engine's own loop (`troupe_actors_bench`): each round is a batch of",
    f"requests (random 64-token prompts, 32 greedy tokens each) from submission to the last token; the engine",
    "loop steps an `engine::Engine` on the calling thread, the actor path sends `Job`s to the router and a",
    "worker actor runs the same engine on its thread, streaming `TokenBatch`/`Done` messages to a sink. "
    f"{actors[0]['rounds'] if actors else '?'} alternating rounds per batch size, fresh prompts each round.",
    "",
    "| batch | engine loop tokens/s | through the actors tokens/s | actors / engine |",
    "|---|---|---|---|",
]
for a in actors:
    lines.append(f"| {a['batch']} | {a['engine_tokens_per_s']:.0f} | {a['actors_tokens_per_s']:.0f} | {a['ratio']:.3f} |")
lines += [
    "",
    f"TTFT and ITL of `troupe serve` over HTTP (`bench/actors_serve.py`): open-loop Poisson arrivals, "
    f"{os.environ['SECS']} s per rate, streaming completions of 64-word prompts and 32 tokens (ignore_eos), one",
    "colocated worker. ITL is the distribution of gaps between token chunks (not a per-request mean).",
    "",
    "| rate (req/s) | requests | failed | output tokens/s | TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) |",
    "|---|---|---|---|---|---|",
]
for s in serve:
    lines.append(f"| {s['rate']:g} | {s['requests']} | {s['failed']} | {s['output_tokens_per_s']:.0f} | "
                 f"{ms(s['ttft_p50'])} / {ms(s['ttft_p90'])} / {ms(s['ttft_p99'])} | "
                 f"{ms(s['itl_p50'])} / {ms(s['itl_p90'])} / {ms(s['itl_p99'])} |")
new = "\n".join(lines) + "\n"
doc = open(path, encoding="utf-8").read()
pattern = re.compile(r"^## Actors and serving\n.*?(?=^## |^<!-- |\Z)", re.S | re.M)
doc = pattern.sub(lambda m: new + "\n", doc) if pattern.search(doc) else doc.rstrip() + "\n\n" + new
open(path, "w", encoding="utf-8").write(doc.rstrip() + "\n")
PY
echo "wrote $DOC"
