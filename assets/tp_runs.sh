#!/usr/bin/env bash
# The measured runs behind devlogs/tp-sp-ft.md and blogs/tp-sp.md, and the regeneration of the devlog's tables.
#   bash assets/tp_runs.sh [DATA]          CPU runs: torchrun, 2 processes, gloo (any machine)
#   PYTHON=.venv/bin/python bash ...       an environment's interpreter instead of `uv run python`
# Each run's summary.json and metrics.jsonl are copied into devlogs/runs/tp-sp-ft/<name>/: the single-process
# LoRA reference, tp-ft (DTensor parallelize_module), tp-sp-ft with and without sequence parallelism, all with
# the same flags at --max-length 512. The naive plan's error is kept in devlogs/runs/tp-sp-ft-failures/.
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
    mkdir -p "devlogs/runs/tp-sp-ft/$2"
    cp "$1/summary.json" "$1/metrics.jsonl" "devlogs/runs/tp-sp-ft/$2/"
}

tp_launch() {  # tp_launch SCRIPT DIR FLAGS...
    local script=$1 dir=$2
    shift 2
    $PY -m torch.distributed.run --standalone --nproc_per_node=2 "$script" "${FLAGS[@]}" --output-dir "$dir" "$@"
}

dir=runs/devlog/tp-sp-ft/reference-$STAMP
$PY experiments/single-gpu-ft/train.py "${FLAGS[@]}" --quant none --output-dir "$dir"
copy_run "$dir" cpu-reference

dir=runs/devlog/tp-sp-ft/tp-ft-$STAMP
tp_launch experiments/tp-ft/train.py "$dir"
copy_run "$dir" cpu-tp-ft

dir=runs/devlog/tp-sp-ft/megatron-tp-$STAMP
tp_launch experiments/tp-sp-ft/train.py "$dir" --no-sequence-parallel
copy_run "$dir" cpu-tp-sp-ft-no-sp

dir=runs/devlog/tp-sp-ft/tp-sp-$STAMP
tp_launch experiments/tp-sp-ft/train.py "$dir"
copy_run "$dir" cpu-tp-sp-ft

mkdir -p devlogs/runs/tp-sp-ft-failures
if tp_launch experiments/tp-ft/train.py "runs/devlog/tp-sp-ft/naive-$STAMP" --naive-plan --max-steps 1 \
    >/dev/null 2>"devlogs/runs/tp-sp-ft-failures/naive-plan.stderr"; then
    echo "--naive-plan: expected an error, but the run finished" >&2
    exit 1
fi
grep -ho "error: .*" "devlogs/runs/tp-sp-ft-failures/naive-plan.stderr" | sort -u >devlogs/runs/tp-sp-ft-failures/naive-plan.txt
rm devlogs/runs/tp-sp-ft-failures/naive-plan.stderr

$PY assets/devlog_tables.py tp-sp-ft
