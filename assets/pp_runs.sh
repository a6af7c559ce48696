#!/usr/bin/env bash
# The measured runs behind devlogs/pp-ft.md and blogs/pp.md, the timeline figure, and the devlog's tables.
#   bash assets/pp_runs.sh [DATA]          CPU runs: torchrun, 2 processes, gloo (any machine)
#   PYTHON=.venv/bin/python bash ...        an environment's interpreter instead of `uv run python`
# Each run's summary.json, metrics.jsonl and timeline.json go to devlogs/runs/pp-ft/<name>/.
set -euo pipefail
case ${1:-} in -*) sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0" && exit 0 ;; esac # -h, --help: the lines above
cd "$(dirname "$0")/.."
DATA=${1:-qmsum-ami}  # the AMI meetings the package ships
PY=${PYTHON:-uv run python}
STAMP=$(date +%Y%m%d-%H%M%S)

copy_run() {  # copy_run RUN_DIR DEST
    mkdir -p "$2"
    cp "$1/summary.json" "$1/metrics.jsonl" "$2/"
    if [ -f "$1/timeline.json" ]; then cp "$1/timeline.json" "$2/"; fi
}

measure() {  # measure NAME FLAGS...: the PP script on 2 processes
    local name=$1
    shift
    local dir=runs/devlog/pp-ft/$name-$STAMP
    $PY -m torch.distributed.run --standalone --nproc_per_node=2 \
        experiments/pp-ft/train.py --data "$DATA" --no-progress --output-dir "$dir" "${COMMON[@]}" "$@"
    copy_run "$dir" "devlogs/runs/pp-ft/$name"
}

# The CPU walkthrough model (--smoke: tiny Qwen3, 4 layers, hidden 128, fp32), 10 steps of a global batch of 8
# sequences padded to 256 tokens. m = 8 / micro-batch size pipeline micro-batches per step.
COMMON=(--smoke --max-steps 10 --max-length 256 --batch-size 8 --eval-every 10 --save-every 10)
ref=runs/devlog/pp-ft/reference-$STAMP
$PY experiments/single-gpu-ft/train.py --quant none --data "$DATA" --no-progress --output-dir "$ref" "${COMMON[@]}"
copy_run "$ref" devlogs/runs/pp-ft/cpu-reference
for m in 2 8; do
    measure "cpu-gpipe-m$m" --schedule gpipe --microbatches "$m"
    measure "cpu-1f1b-m$m" --schedule 1f1b --microbatches "$m"
    measure "cpu-interleaved-m$m" --schedule interleaved-1f1b --microbatches "$m"
done
# The zero-bubble schedules on the same 2 ranks x 2 stages (DualPipeV needs m >= its 4 stages); ZBV and interleaved
# 1F1B also without activation checkpointing: with it, every weight-gradient action recomputes its layers.
for s in interleaved-zb zbv dualpipev; do
    measure "cpu-$s-m8" --schedule "$s" --microbatches 8
done
measure cpu-zbv-m8-no-ckpt --schedule zbv --microbatches 8 --no-grad-checkpointing
measure cpu-interleaved-m8-no-ckpt --schedule interleaved-1f1b --microbatches 8 --no-grad-checkpointing
$PY assets/devlog_tables.py pp-ft
R=devlogs/runs/pp-ft
$PY assets/pp_timeline.py "$R/cpu-gpipe-m8" "$R/cpu-1f1b-m8" "$R/cpu-interleaved-m8" "$R/cpu-interleaved-m8-no-ckpt" \
    "$R/cpu-zbv-m8-no-ckpt" "$R/cpu-zbv-m8" --out assets/pp_timeline.png \
    --devlog devlogs/pp-ft.md --table "$R"/cpu-gpipe-m2 "$R"/cpu-gpipe-m8 "$R"/cpu-1f1b-m2 "$R"/cpu-1f1b-m8 \
    "$R"/cpu-interleaved-m2 "$R"/cpu-interleaved-m8 "$R"/cpu-interleaved-zb-m8 "$R"/cpu-zbv-m8 "$R"/cpu-dualpipev-m8 \
    "$R"/cpu-interleaved-m8-no-ckpt "$R"/cpu-zbv-m8-no-ckpt
