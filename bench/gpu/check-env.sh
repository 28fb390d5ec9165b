# Sourced by the one-call GPU check scripts (quantized-check.sh, moe-check.sh) with their arguments
# BUNDLE OUT: sets here (the repository), bundle and out (created), the environment every run needs
# (NCCL_NVLS_ENABLE=0, the tokenizer), and records the card and its clocks in OUT/smi.txt.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bundle=$(cd "$1" && pwd) out=$2
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
export TROUPE_TOKENIZER_DIR=${TROUPE_TOKENIZER_DIR:-$here/model/tokenizer/data/deepseek-v4}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/smi.txt"
