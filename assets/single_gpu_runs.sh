#!/usr/bin/env bash
# The measured runs behind devlogs/single-gpu-ft.md, and the regeneration of its tables.
#   bash assets/single_gpu_runs.sh [DATA]          CPU walkthrough runs (any machine)
#   GPU=1 bash assets/single_gpu_runs.sh [DATA]    adds the Qwen3-4B-shape runs (needs a CUDA GPU)
#   CPU=0 GPU=1 bash ...                           the GPU runs only
#   PYTHON=python3 bash ...                        an environment's interpreter instead of `uv run python`
# Each run gets a fresh directory under runs/devlog/; its summary.json and metrics.jsonl are copied into
# devlogs/runs/single-gpu-ft/<name>/, replacing that name's previous measurement.
set -euo pipefail
case ${1:-} in -*) sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0" && exit 0 ;; esac # -h, --help: the lines above
cd "$(dirname "$0")/.."
DATA=${1:-qmsum-ami}  # the AMI meetings the package ships
DEST=devlogs/runs/single-gpu-ft
STAMP=$(date +%Y%m%d-%H%M%S)
PY=${PYTHON:-uv run python}

run() {
    local name=$1
    shift
    local dir=runs/devlog/single-gpu-ft/$name-$STAMP
    $PY experiments/single-gpu-ft/train.py --data "$DATA" --no-progress --output-dir "$dir" "$@"
    mkdir -p "$DEST/$name"
    cp "$dir/summary.json" "$dir/metrics.jsonl" "$DEST/$name/"
}

if [ "${CPU:-1}" = 1 ]; then
    run cpu-smoke-qlora-nf4 --smoke
    run cpu-smoke-lora-fp32 --smoke --quant none
    run cpu-smoke-qlora-no-checkpointing --smoke --no-grad-checkpointing
fi
if [ "${GPU:-0}" = 1 ]; then
    # Random init with Qwen3-4B's exact config (no download; about 3 minutes on the host CPU per run). QLoRA runs
    # 10 steps (warmup 3) to keep each run inside a 10-minute job on a lent GPU; the per-step rows are what the
    # devlog reads. (The runs with fp32 adapter compute, `*-fp32-adapters`, came from this script before
    # lora.adapters_compute_in; memory_check.py checks them with --fp32-adapters.) AS_RUN: the committed runs'
    # layout, not today's defaults: padded rows (they also passed the padding mask, which --no-packing no longer
    # does), eager layers, the tiny tokenizer's tokens (qwen3-4b-shape's own before issue 42), the reference layout.
    AS_RUN=(--model qwen3-4b-shape --fit off --no-packing --no-compile --tokenizer tiny --eval-every 1000
        --save-every 1000)
    run gpu-4b-shape-lora-bf16 "${AS_RUN[@]}" --quant none --max-steps 20
    run gpu-4b-shape-qlora-nf4 "${AS_RUN[@]}" --max-steps 10 --warmup-steps 3
    extra=devlogs/runs/single-gpu-ft-gpu
    mkdir -p $extra
    # Where a step's time goes: a profiled step 2 (the ops table sorted by GPU time).
    prof=runs/devlog/single-gpu-ft/profile-$STAMP
    $PY experiments/single-gpu-ft/train.py --data "$DATA" --no-progress --output-dir "$prof" "${AS_RUN[@]}" \
        --quant none --max-steps 3 --profile-steps 2:2
    cp "$prof"/profile/ops-rank0-steps2-2.txt $extra/profile-lora-bf16-step2-ops.txt
    cp "$prof"/metrics.jsonl $extra/profile-lora-bf16-metrics.jsonl
    # What the GPU allocates beyond the memory model: a step's peak with 1, 2 and 4 of Qwen3-4B's decoder layers.
    $PY assets/gpu_memory_layers.py --layers 1 2 4 >$extra/gpu-memory-layers.jsonl
    # ... and without cuBLAS's workspace, which the allocator counts.
    CUBLAS_WORKSPACE_CONFIG=:0:0 $PY assets/gpu_memory_layers.py --layers 1 2 \
        >$extra/gpu-memory-layers-cublas-workspace-0.jsonl
    # What the adapters cost in one decoder layer, by the dtype they compute in.
    $PY assets/lora_layer_bench.py >$extra/lora-layer-bench-dropout0.05.jsonl
    $PY assets/lora_layer_bench.py --lora-dropout 0 >$extra/lora-layer-bench-dropout0.jsonl
    # The memory model per step, at each step's own batch shape, beside the measured peak.
    for r in gpu-4b-shape-lora-bf16 gpu-4b-shape-qlora-nf4; do
        $PY assets/memory_check.py "$DEST/$r" --data "$DATA" >$extra/memory-check-$r.md
    done
fi
$PY assets/devlog_tables.py single-gpu-ft
