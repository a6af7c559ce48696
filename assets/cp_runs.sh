#!/usr/bin/env bash
# The measured runs behind devlogs/cp-ft.md, and the regeneration of the devlog's tables.
#   bash assets/cp_runs.sh [DATA]          CPU runs: torchrun, 2 and 4 processes, gloo (any machine)
#   PYTHON=.venv/bin/python bash ...       an environment's interpreter instead of `uv run python`
# Each run's summary.json and metrics.jsonl are copied into devlogs/runs/cp-ft/<name>/: the single-process LoRA
# reference (single-gpu-ft on the same whole meetings, one padded row each) and cp-ft on 2 and 4 processes, all
# with cp-ft's --smoke defaults (whole meetings up to 4,096 tokens, global batch 2, micro-batch 1), 6 steps.
set -euo pipefail
case ${1:-} in -*) sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0" && exit 0 ;; esac # -h, --help: the lines above
cd "$(dirname "$0")/.."
DATA=${1:-qmsum-ami}  # the AMI meetings the package ships
PY=${PYTHON:-uv run python}
STAMP=$(date +%Y%m%d-%H%M%S)
FLAGS=(--smoke --data "$DATA" --task meetings --max-length 4096 --batch-size 2 --micro-batch-size 1 --max-steps 6
    --eval-every 3 --eval-examples 4 --no-progress)

copy_run() {  # copy_run RUN_DIR NAME
    mkdir -p "devlogs/runs/cp-ft/$2"
    cp "$1/summary.json" "$1/metrics.jsonl" "devlogs/runs/cp-ft/$2/"
}

dir=runs/devlog/cp-ft/reference-$STAMP
$PY experiments/single-gpu-ft/train.py "${FLAGS[@]}" --quant none --no-packing --output-dir "$dir"
copy_run "$dir" cpu-reference

for n in 2 4; do
    dir=runs/devlog/cp-ft/cp$n-$STAMP
    $PY -m torch.distributed.run --standalone --nproc_per_node=$n experiments/cp-ft/train.py "${FLAGS[@]}" \
        --output-dir "$dir"
    copy_run "$dir" "cpu-cp$n"
done

$PY assets/devlog_tables.py cp-ft
