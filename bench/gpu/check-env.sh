# Sourced by the one-call GPU check scripts (device-check.sh, quantized-check.sh, moe-check.sh, topk-check.sh) with their
# arguments BUNDLE OUT: sets here (the repository), bundle and out (created), the environment every run needs
# (NCCL_NVLS_ENABLE=0, the tokenizer), records the card and its clocks in OUT/smi.txt, and defines
# count EXIT LOG: a gtest run's exit status and its OK / FAILED line counts, as one phrase.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bundle=$(cd "$1" && pwd) out=$2
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
export TROUPE_TOKENIZER_DIR=${TROUPE_TOKENIZER_DIR:-$here/model/tokenizer/data/deepseek-v4}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/smi.txt"
count() { echo "exit $1 ($(grep -c '^\[       OK' "$2") ok, $(grep -c '^\[  FAILED' "$2") failed lines)"; }
