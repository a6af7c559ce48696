#!/usr/bin/env bash
# The measured runs behind devlogs/fsdp-ft.md and blogs/fsdp.md, and the regeneration of the devlog's tables.
#   bash assets/fsdp_runs.sh [DATA]          CPU runs: torchrun, 2 processes, gloo (any machine)
#   GPU=1 bash assets/fsdp_runs.sh [DATA]    adds Qwen3-4B-shape runs on 2 GPUs, NCCL (needs 2 CUDA GPUs)
#   PYTHON=.venv/bin/python bash ...         an environment's interpreter instead of `uv run python`
# Each run's summary.json and metrics.jsonl are copied into devlogs/runs/fsdp-ft/<name>/; a configuration the
# script refuses has its error kept in devlogs/runs/fsdp-ft-failures/<name>.txt instead.
set -euo pipefail
case ${1:-} in -*) sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0" && exit 0 ;; esac # -h, --help: the lines above
cd "$(dirname "$0")/.."
DATA=${1:-qmsum-ami}  # the AMI meetings the package ships
PY=${PYTHON:-uv run python}
STAMP=$(date +%Y%m%d-%H%M%S)

copy_run() {  # copy_run RUN_DIR DEST
    mkdir -p "$2"
    cp "$1/summary.json" "$1/metrics.jsonl" "$2/"
}

launch() {  # launch DIR FLAGS...: the FSDP script under torchrun, 2 processes, counting lost adapter updates
    local dir=$1
    shift
    $PY -m torch.distributed.run --standalone --nproc_per_node=2 \
        experiments/fsdp-ft/train.py --data "$DATA" --no-progress --count-lost-updates --output-dir "$dir" "$@"
}

measure() {  # measure NAME FLAGS...
    local name=$1
    shift
    local dir=runs/devlog/fsdp-ft/$name-$STAMP
    launch "$dir" "$@"
    copy_run "$dir" "devlogs/runs/fsdp-ft/$name"
}

reference() {  # reference NAME FLAGS...: the single-process script with the same flags (--quant none unless given)
    local name=$1
    shift
    local dir=runs/devlog/fsdp-ft/$name-$STAMP
    $PY experiments/single-gpu-ft/train.py --data "$DATA" --no-progress --quant none --output-dir "$dir" "$@"
    copy_run "$dir" "devlogs/runs/fsdp-ft/$name"
}

fails() {  # fails NAME FLAGS...: a configuration expected to stop with an error; keep the error
    local name=$1
    shift
    local log
    log=$(mktemp)
    if launch "runs/devlog/fsdp-ft/$name-$STAMP" "$@" >"$log" 2>&1; then
        echo "$name: expected an error, but the run finished" >&2
        exit 1
    fi
    mkdir -p devlogs/runs/fsdp-ft-failures
    {
        echo "torchrun --nproc_per_node=2 experiments/fsdp-ft/train.py $*"
        grep -m1 '^error:' "$log" | cut -c1-300 || true
    } >"devlogs/runs/fsdp-ft-failures/$name.txt"
    rm -f "$log"
}

# The CPU walkthrough model (--smoke: tiny Qwen3, fp32, LoRA rank 16; 8 sequences per step, micro-batch 2: 2
# accumulation steps on 2 processes), cut to 8 steps of <= 256 tokens so that the 14 runs fit a shared 2-core
# machine; then each FSDP option and each silent failure. Bytes, shards and loss differences do not depend on
# the length of the run.
SMOKE=(--smoke --max-steps 8 --max-length 256 --eval-every 4 --save-every 4 --eval-examples 8)
reference cpu-smoke-reference "${SMOKE[@]}"
measure cpu-smoke-2proc "${SMOKE[@]}"
measure cpu-smoke-2proc-no-reshard "${SMOKE[@]}" --no-reshard-after-forward
measure cpu-smoke-2proc-prefetch-2 "${SMOKE[@]}" --prefetch 2
measure cpu-smoke-2proc-no-checkpointing "${SMOKE[@]}" --no-grad-checkpointing
measure cpu-smoke-2proc-param-bf16 "${SMOKE[@]}" --param-dtype bf16
measure cpu-smoke-2proc-param-bf16-reduce-bf16 "${SMOKE[@]}" --param-dtype bf16 --reduce-dtype bf16
# Silent failures: a wrap class that matches nothing; adapters cast to the bf16 base dtype (against the same
# bf16 base with fp32 adapters); the KV cache left on, with and without activation checkpointing.
measure cpu-smoke-2proc-wrong-wrap-class "${SMOKE[@]}" --wrap-class LlamaDecoderLayer
measure cpu-smoke-2proc-bf16-base "${SMOKE[@]}" --dtype bf16
measure cpu-smoke-2proc-bf16-base-adapters-in-base-dtype "${SMOKE[@]}" --dtype bf16 --adapters-in-base-dtype
measure cpu-smoke-2proc-use-cache "${SMOKE[@]}" --use-cache
measure cpu-smoke-2proc-use-cache-no-checkpointing "${SMOKE[@]}" --use-cache --no-grad-checkpointing
# QLoRA: the 4-bit base sharded as bytes, against the single-process QLoRA reference; offloading it is refused.
reference cpu-smoke-reference-qlora "${SMOKE[@]}" --quant nf4
measure cpu-smoke-2proc-qlora "${SMOKE[@]}" --quant nf4
fails qlora-cpu-offload --smoke --quant nf4 --cpu-offload
if [ "${GPU:-0}" = 1 ]; then
    G=(--model qwen3-4b-shape --fit off --max-steps 20 --eval-every 1000 --save-every 1000)
    measure gpu-4b-shape-2gpu "${G[@]}"
    measure gpu-4b-shape-2gpu-no-reshard "${G[@]}" --no-reshard-after-forward
    measure gpu-4b-shape-2gpu-wrong-wrap-class "${G[@]}" --wrap-class LlamaDecoderLayer
    measure gpu-4b-shape-2gpu-cpu-offload "${G[@]}" --cpu-offload
fi
$PY assets/devlog_tables.py fsdp-ft
$PY assets/fsdp_devlog.py
