#!/usr/bin/env bash
# The measured runs behind devlogs/fsdp-tp-ft.md, and the regeneration of the devlog's tables.
#   bash assets/fsdp_tp_runs.sh [DATA]      CPU runs: torchrun, 4 or 2 processes, gloo (any machine)
#   PYTHON=.venv/bin/python bash ...        an environment's interpreter instead of `uv run python`
# Each run's summary.json and metrics.jsonl are copied into devlogs/runs/fsdp-tp-ft/<name>/: the single-process
# LoRA reference and fsdp-tp-ft on meshes 2x2, 1x2 and 2x1, all with the same flags.
set -euo pipefail
case ${1:-} in -*) sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0" && exit 0 ;; esac # -h, --help: the lines above
cd "$(dirname "$0")/.."
DATA=${1:-qmsum-ami}  # the AMI meetings the package ships
PY=${PYTHON:-uv run python}
STAMP=$(date +%Y%m%d-%H%M%S)
# The --smoke defaults (tiny Qwen3, fp32, LoRA rank 16, global batch 8, micro-batch 2, max length 512), 10 steps,
# no activation checkpointing so that each forward collective runs once per micro-batch; one padded sequence per
# row (--no-packing), the layout of the committed runs, which predate packing by default.
FLAGS=(--smoke --data "$DATA" --max-steps 10 --eval-every 5 --eval-examples 8 --no-grad-checkpointing --no-packing
    --no-progress)

copy_run() {  # copy_run RUN_DIR NAME
    mkdir -p "devlogs/runs/fsdp-tp-ft/$2"
    cp "$1/summary.json" "$1/metrics.jsonl" "devlogs/runs/fsdp-tp-ft/$2/"
}

dir=runs/devlog/fsdp-tp-ft/reference-$STAMP
$PY experiments/single-gpu-ft/train.py "${FLAGS[@]}" --quant none --output-dir "$dir"
copy_run "$dir" cpu-reference

for mesh in 2,2 1,2 2,1; do
    dp=${mesh%,*} tp=${mesh#*,}
    dir=runs/devlog/fsdp-tp-ft/mesh-${dp}x${tp}-$STAMP
    $PY -m torch.distributed.run --standalone --nproc_per_node=$((dp * tp)) experiments/fsdp-tp-ft/train.py \
        "${FLAGS[@]}" --mesh-shape "$mesh" --output-dir "$dir"
    copy_run "$dir" "cpu-mesh-${dp}x${tp}"
done

$PY assets/devlog_tables.py fsdp-tp-ft
