#!/usr/bin/env bash
# The measured runs behind devlogs/ddp-ft.md and blogs/ddp.md, and the regeneration of the devlog's tables.
#   bash assets/ddp_runs.sh [DATA]          CPU runs: torchrun, 2 processes, gloo (any machine)
#   GPU=1 bash assets/ddp_runs.sh [DATA]    adds Qwen3-4B-shape runs on 2 GPUs, NCCL (needs 2 CUDA GPUs)
#   PYTHON=.venv/bin/python bash ...        an environment's interpreter instead of `uv run python`
#   REPEATS=3 (default) passes over the configurations; START_PASS=2 adds passes to the runs already there
# Pass 1 copies each run's summary.json and metrics.jsonl into devlogs/runs/ddp-ft/<name>/ (the devlog's main
# table); later passes into devlogs/runs/ddp-ft-repeats/<name>/pass-<k>/. The passes interleave the
# configurations, so a slow minute on a shared machine lands on every configuration alike; the devlog's
# effect table reports each configuration's median and range over the passes. A configuration PyTorch refuses
# to train has its error kept in devlogs/runs/ddp-ft-failures/<name>.txt instead.
set -euo pipefail
case ${1:-} in -*) sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0" && exit 0 ;; esac # -h, --help: the lines above
cd "$(dirname "$0")/.."
DATA=${1:-qmsum-ami}  # the AMI meetings the package ships
PY=${PYTHON:-uv run python}
REPEATS=${REPEATS:-3}
START_PASS=${START_PASS:-1}
STAMP=$(date +%Y%m%d-%H%M%S)

copy_run() {  # copy_run RUN_DIR DEST
    mkdir -p "$2"
    cp "$1/summary.json" "$1/metrics.jsonl" "$2/"
}

launch() {  # launch NPROC DIR FLAGS...: the DDP script under torchrun
    local nproc=$1 dir=$2
    shift 2
    $PY -m torch.distributed.run --standalone --nproc_per_node="$nproc" \
        experiments/ddp-ft/train.py --data "$DATA" --no-progress --output-dir "$dir" "$@"
}

reference() {  # reference NAME FLAGS...: the single-process script with the same flags (assets/ddp_devlog.py)
    local name=$1
    shift
    local dir=runs/devlog/ddp-ft/$name-$STAMP
    $PY experiments/single-gpu-ft/train.py --data "$DATA" --no-progress --output-dir "$dir" "$@"
    copy_run "$dir" "devlogs/runs/ddp-ft/$name"
}

measure() {  # measure NAME NPROC FLAGS..., in pass $PASS
    local name=$1 nproc=$2
    shift 2
    local dir=runs/devlog/ddp-ft/$name-$STAMP-pass$PASS
    launch "$nproc" "$dir" "$@"
    if [ "$PASS" = 1 ]; then
        copy_run "$dir" "devlogs/runs/ddp-ft/$name"
    else
        copy_run "$dir" "devlogs/runs/ddp-ft-repeats/$name/pass-$PASS"
    fi
}

fails() {  # fails NAME NPROC FLAGS...: a configuration expected to stop with an error; keep the error
    local name=$1 nproc=$2
    shift 2
    local log
    log=$(mktemp)
    if launch "$nproc" "runs/devlog/ddp-ft/$name-$STAMP" "$@" >"$log" 2>&1; then
        echo "$name: expected an error, but the run finished" >&2
        exit 1
    fi
    mkdir -p devlogs/runs/ddp-ft-failures
    {
        echo "torchrun --nproc_per_node=$nproc experiments/ddp-ft/train.py $*"
        grep -m1 -E '^\[rank0\]: [A-Za-z_.]*(Error|Exception)' "$log" | cut -c1-600 || true
    } >"devlogs/runs/ddp-ft-failures/$name.txt"
    rm -f "$log"
}

# 1. The CPU walkthrough (--smoke: tiny Qwen3, NF4, 30 steps of 8 sequences of <= 512 tokens, micro-batch 2,
#    512 KiB of LoRA gradients): DDP on one process and on two, then each misconfiguration on two.
# 2. Communication-heavy: LoRA rank 256 (8 MiB of gradients) on 8 sequences of <= 128 tokens, micro-batch 1
#    (4 accumulation steps on 2 processes), so that all-reduce is a larger part of a CPU step.
SMOKE=(--smoke)
HEAVY=(--smoke --lora-rank 256 --max-length 128 --micro-batch-size 1)
configurations() {
    measure cpu-smoke-1proc 1 "${SMOKE[@]}"
    measure cpu-smoke-2proc 2 "${SMOKE[@]}"
    measure cpu-smoke-2proc-sync-every-micro-step 2 "${SMOKE[@]}" --sync-every-micro-step
    measure cpu-smoke-2proc-find-unused-parameters 2 "${SMOKE[@]}" --find-unused-parameters
    measure cpu-smoke-2proc-tiny-buckets 2 "${SMOKE[@]}" --bucket-cap-mb 0.01
    measure cpu-smoke-2proc-reentrant-checkpointing 2 "${SMOKE[@]}" --reentrant-checkpointing
    measure cpu-heavy-1proc 1 "${HEAVY[@]}"
    measure cpu-heavy-2proc 2 "${HEAVY[@]}"
    measure cpu-heavy-2proc-sync-every-micro-step 2 "${HEAVY[@]}" --sync-every-micro-step
    measure cpu-heavy-2proc-find-unused-parameters 2 "${HEAVY[@]}" --find-unused-parameters
    measure cpu-heavy-2proc-tiny-buckets 2 "${HEAVY[@]}" --bucket-cap-mb 0.01
    measure cpu-heavy-2proc-reentrant-checkpointing 2 "${HEAVY[@]}" --reentrant-checkpointing
    if [ "${GPU:-0}" = 1 ]; then
        local g=(--model qwen3-4b-shape --fit off --max-steps 20 --eval-every 1000 --save-every 1000)
        measure gpu-4b-shape-2gpu 2 "${g[@]}"
        measure gpu-4b-shape-2gpu-sync-every-micro-step 2 "${g[@]}" --sync-every-micro-step
        measure gpu-4b-shape-2gpu-find-unused-parameters 2 "${g[@]}" --find-unused-parameters
        measure gpu-4b-shape-2gpu-tiny-buckets 2 "${g[@]}" --bucket-cap-mb 0.01
    fi
}

if [ "$START_PASS" = 1 ]; then
    # The all-reduce alone, against its size: this machine's latency and bandwidth for the ring model.
    $PY -m torch.distributed.run --standalone --nproc_per_node=2 assets/allreduce_bench.py \
        --out devlogs/runs/ddp-ft-allreduce/cpu-gloo-2proc.json
    if [ "${GPU:-0}" = 1 ]; then
        $PY -m torch.distributed.run --standalone --nproc_per_node=2 assets/allreduce_bench.py --cuda \
            --out devlogs/runs/ddp-ft-allreduce/gpu-nccl-2gpu.json
    fi
    reference cpu-smoke-reference "${SMOKE[@]}"
    reference cpu-heavy-reference "${HEAVY[@]}"
    # What PyTorch refuses: reentrant checkpointing while DDP searches for unused parameters.
    fails reentrant-with-find-unused-parameters 2 --smoke --max-steps 2 --reentrant-checkpointing --find-unused-parameters
fi
for PASS in $(seq "$START_PASS" "$REPEATS"); do
    configurations
done
$PY assets/devlog_tables.py ddp-ft
$PY assets/ddp_devlog.py
