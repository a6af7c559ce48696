#!/usr/bin/env bash
# The measured runs behind devlogs/single-gpu-ft.md, and the regeneration of its tables.
#   bash assets/single_gpu_runs.sh [DATA]          CPU walkthrough runs (any machine)
#   GPU=1 bash assets/single_gpu_runs.sh [DATA]    adds the Qwen3-4B-shape runs (needs a CUDA GPU)
# Each run gets a fresh directory under runs/devlog/; its summary.json and metrics.jsonl are copied into
# devlogs/runs/single-gpu-ft/<name>/, replacing that name's previous measurement.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-qmsum-ami}  # the AMI meetings the package ships
DEST=devlogs/runs/single-gpu-ft
STAMP=$(date +%Y%m%d-%H%M%S)

run() {
    local name=$1
    shift
    local dir=runs/devlog/single-gpu-ft/$name-$STAMP
    uv run python experiments/single-gpu-ft/train.py --data "$DATA" --no-progress --output-dir "$dir" "$@"
    mkdir -p "$DEST/$name"
    cp "$dir/summary.json" "$dir/metrics.jsonl" "$DEST/$name/"
}

run cpu-smoke-qlora-nf4 --smoke
run cpu-smoke-lora-fp32 --smoke --quant none
run cpu-smoke-qlora-no-checkpointing --smoke --no-grad-checkpointing
if [ "${GPU:-0}" = 1 ]; then
    run gpu-4b-shape-qlora-nf4 --model qwen3-4b-shape --max-steps 20 --eval-every 1000 --save-every 1000
    run gpu-4b-shape-lora-bf16 --model qwen3-4b-shape --quant none --max-steps 20 --eval-every 1000 --save-every 1000
fi
uv run python assets/devlog_tables.py single-gpu-ft
