"""Which technique for this job on these GPUs: predicted memory per GPU, step time and tokens/s for every
experiment and mesh shape the GPUs allow, and a recommendation with its reason.

    uv run python -m ftkit.plan --model Qwen/Qwen3-4B --gpus 2 --gpu rtx4090 --link pcie4
    uv run python -m ftkit.plan --model Qwen/Qwen3-32B --gpus 16 --nodes 2 --link nvlink4 --inter-node-link ib-ndr \\
        --batch-size 64 --json

A model, not a measurement; every term is a formula in this repository or a stated assumption:
- Memory: `ftkit/memory.py`'s `predict` for the experiment's configuration (its quantization, the flags given
  here), times MEMORY_MARGIN, plus --reserve-gib for the CUDA context and NCCL buffers. The margin covers what the
  memory model leaves out: tests/test_plan.py checks it against the peaks tracked at Qwen3-4B's shape
  (devlogs/runs/realscale/).
- Compute: the MFU convention's FLOPs (`metrics.step_flops`, every sequence --max-length tokens long) plus the
  forward that activation checkpointing recomputes, at --mfu of the GPU's dense bf16 peak (`ftkit/hardware.py`),
  split evenly over the GPUs the experiment uses. 0.4 is an assumption (well-tuned dense training: PaLM reports
  46.2%); single-gpu-ft measured 4.8% on an H100 (devlogs/single-gpu-ft.md), whose step was bound by its host, not
  its GPU: the host model below (`--host h100-vm`) reproduces it.
- NF4 (QLoRA): every pass over a layer (forward, recomputed forward, backward) dequantizes its weights, reading
  the 4-bit weights and writing bf16 ones through the GPU's memory at its datasheet bandwidth.
- Communication: the alpha-beta model of a ring (bytes from `comm.ring_wire_bytes`, at --link-efficiency of the
  link's bandwidth, plus a latency per message), on the slowest link the group spans. Only what the technique
  cannot hide is added to the step:
  - DDP: the fp32 LoRA gradients' all-reduce, once per optimizer step, overlapped with the last micro-batch's
    backward (taken as half that micro-batch's compute);
  - FSDP: each micro-batch all-gathers the bf16 weights (with --quant nf4 the layers' packed 4-bit codes, 0.5 B per
    weight) twice (forward, backward), prefetched under the same micro-batch's compute, except the first layer's;
    the LoRA gradients' reduce-scatter like DDP's all-reduce;
  - TP (tp-ft, DTensor): per layer and micro-batch, the forward all-reduces of o_proj and down_proj and the
    backward all-reduces of the five column layers' inputs (q, k, v, gate, up), plus the forward ones again when
    checkpointing recomputes: 7 or 9 all-reduces of [micro, seq, hidden] on the critical path;
  - TP+SP (tp-sp-ft): Megatron's pairs, one per block entry and exit: 4 collectives per layer (5.5 with the
    recompute, which repeats the two entries' all-gathers and the attention exit's reduce-scatter but stops
    before the MLP's exit: `comm.tp_sp_collective_theory`), each all-gather + reduce-scatter or all-reduce, the
    same wire bytes, on the critical path;
  - PP (pp-ft, 1F1B): the bubble, (p - 1) / m of the compute (Narayanan et al. 2021, arXiv 2104.04473, Sec. 2.2),
    and the point-to-point activations of the fill and the drain (2 (p - 1) transfers; the steady state's are
    taken as hidden);
  - FSDP x TP on a 2-D mesh (fsdp-tp-ft): tp-ft's collectives inside a node, FSDP's gathers of the TP slices
    over the `dp` dimension, across nodes when there are several.
Not modelled: kernel efficiency varying with shapes (one --mfu for all), the pipeline schedule's own overheads,
congestion.

The host and the batch layout (issue 30; `--host`, `--layout`, `--compile`). On an H100 the eager step was bound by
its host: the GPU computed 3.39 s of a 5.77 s step (devlogs/single-gpu-ft.md). With `--host h100-vm`:
- Host: each micro-batch costs the host the ops it dispatches (`HOST_OPS`: aten ops counted per micro-batch by
  assets/host_ops.py on a CPU as CUDA dispatches them, checked against the H100 profiles' op counts; with `--compile`,
  the compiled layers' kernels and extern ops, inductor's CPU kernels standing in for Triton's: a prediction) times
  a cost per op calibrated on the committed H100 profile (`HOSTS`), plus, with NF4, a cost per 4-bit linear pass the
  op count does not carry (`NF4_PASS_S`, calibrated on the first H100 session's QLoRA/LoRA pair). A rank's host
  dispatches the ops of the layers it holds; what DDP, FSDP and DTensor add on the host is not counted.
- GPU: the FLOPs the kernels compute (padding and the recompute included, `micro_flops`) at the fraction of the
  peak the same profiled step's kernels reached while the GPU computed (`--mfu` overrides it).
- Step: the host runs ahead of the GPU (`queue`): a micro-batch costs max(host, GPU), the technique's exposed
  communication and bubble on top, as above.
- Layout: "full" (the default) every row --max-length real tokens, as before; "padded", "packed" and "masked" the
  AMI training examples (`AMI_LENGTHS`) in the scripts' own global batches (`batching.GlobalBatches`,
  `batching.pack`) over an epoch: the step time is their median, tokens/s their real tokens over their time.
Without `--host` the host costs nothing and the GPU computes at 40%: the GPU-only model above, whose numbers the
posts quote. Every output with the host or an AMI layout is labelled a prediction and lists what it assumes.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from ftkit import batching, comm, data, errors, hardware, metrics, models, ranks
from ftkit.memory import GIB, NF4_BYTES_PER_PARAM, NF4_PACKED_BYTES, ROW_PARALLEL, ModelShape, lora_params, predict

# The memory model is within 2% of every peak tracked at Qwen3-4B's shape (devlogs/runs/realscale/), and the CUDA
# peaks of the committed H100 runs are at most 1.046 x it (devlogs/single-gpu-ft.md): the margin leaves room for
# what no run here measures (the allocator's fragmentation, other kernels' workspaces, padded batches' masks).
# tests/test_plan.py fails when a tracked run exceeds it.
MEMORY_MARGIN = 1.2
BF16, FP32 = 2, 4
# Shapes of the Qwen3 models beyond the 4B one, from each model's config.json on the Hugging Face hub.
QWEN3_CONFIGS = {
    "Qwen/Qwen3-4B": models.QWEN3_4B_CONFIG,
    "Qwen/Qwen3-8B": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "Qwen/Qwen3-14B": dict(
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "Qwen/Qwen3-32B": dict(
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
}
EXPERIMENTS = {
    "single": "single-gpu-ft",
    "ddp": "ddp-ft",
    "fsdp": "fsdp-ft",
    "pp": "pp-ft",
    "tp": "tp-ft",
    "tp-sp": "tp-sp-ft",
    "fsdp-tp": "fsdp-tp-ft",
}
# At predicted speeds within NEAR of the fastest, the simpler technique is recommended: the list's order.
SIMPLER_FIRST = list(EXPERIMENTS)
NEAR = 0.97


@dataclass(frozen=True)
class Setting:
    config: SimpleNamespace  # the model's config keys (num_hidden_layers, ...)
    gpu: hardware.GPU
    gpus: int
    nodes: int
    link: hardware.Link
    inter_node_link: hardware.Link
    memory_bytes: float
    batch_size: int = 16
    micro_batch_size: int = 2
    max_length: int = 2048
    answer_tokens: int = 256
    lora_rank: int = 16
    lora_dropout: float = 0.05
    grad_checkpointing: bool = True
    mfu: float | None = None  # the GPU kernels' fraction of the dense bf16 peak [the host's calibration, or 0.4]
    link_efficiency: float = 0.8
    reserve_bytes: float = GIB
    # The host and the batch layout (issue 30). The defaults are the GPU-only model at full-length rows.
    layout: str = "full"  # full | padded | packed | masked: see LAYOUTS
    compile: bool = False  # the decoder layers compiled (the host's count: COMPILED_OPS, a prediction)
    host: str | None = None  # a calibrated host (HOSTS), or None: the host is not modelled (its cost 0)
    host_op_s: float | None = None  # seconds per op on the host [the host's calibration]
    seed: int = 0  # the global batches' seed (the scripts' --seed), for the AMI layouts
    steps: int | None = None  # optimizer steps predicted with the AMI layouts [one epoch]
    ops_source: str = "tree"  # whose op counts: "tree" (this code), "h100-session1" or "-session2" (the H100 runs')

    @property
    def shape(self) -> ModelShape:
        return ModelShape.from_config(vars(self.config))

    @property
    def per_node(self) -> int:
        return self.gpus // self.nodes

    @property
    def legacy(self) -> bool:
        """The planner as it was before it modelled the host: no host, every row --max-length real tokens."""
        return self.host is None and self.host_op_s is None and self.layout == "full" and not self.compile


# The Setting fields a run records under the same names (config.json's and summary.json's "config").
RUN_FLAGS = (
    "batch_size",
    "micro_batch_size",
    "max_length",
    "answer_tokens",
    "lora_rank",
    "lora_dropout",
    "grad_checkpointing",
    "seed",
)


def run_flags(config: dict) -> dict:
    """A run's recorded configuration as Setting fields: those of RUN_FLAGS it has."""
    return {k: config[k] for k in RUN_FLAGS if k in config}


def model_config(name: str) -> SimpleNamespace:
    """The config keys of a Qwen3 model: from the table above, else its config.json (hub id or local path)."""
    if name in QWEN3_CONFIGS:
        return SimpleNamespace(**QWEN3_CONFIGS[name])
    cfg = models.model_config(name)
    return SimpleNamespace(**{k: getattr(cfg, k) for k in QWEN3_CONFIGS["Qwen/Qwen3-8B"]})


# ---------------------------------------------------------------------------------------------------- the host
# Issue 30: on an H100 the eager step was bound by its host, not its GPU (devlogs/single-gpu-ft.md, "Second GPU
# session"). The host term is the ops it dispatches per micro-batch (counted) times a cost per op (calibrated on the
# committed H100 profile); the GPU term the FLOPs the kernels compute at a fraction of the peak (calibrated on the
# same profile). tests/test_plan.py re-derives every constant below from the committed files it names.
#
# Ops per micro-batch, counted by assets/host_ops.py (devlogs/runs/plan-host/host-ops.json): the aten ops that
# single-gpu-ft's step dispatches as CUDA dispatches them (eager; checked op by op against the H100 profiles'
# counts), or, with the decoder layers compiled, the compiled graphs' kernels and extern ops plus the eager ops
# around them (inductor's C++ kernels on a CPU standing in for its Triton ones on CUDA: a prediction). Counted at 2
# and 3 decoder layers: (ops outside the layers, ops per layer) for (layout, quant, grad_checkpointing, compiled).
# "padded" is this code's padded call (no mask: the rows are right-padded and attention causal), "packed" its packed
# call (position_ids, no mask); full-length rows dispatch what "padded" does.
HOST_OPS: dict[tuple[str, str, bool, bool], tuple[int, int]] = {
    ("padded", "none", True, False): (191, 1430),
    ("padded", "none", False, False): (113, 1002),
    ("padded", "nf4", True, False): (191, 1542),
    ("padded", "nf4", False, False): (110, 1058),
    ("packed", "none", True, False): (280, 1498),
    ("packed", "none", False, False): (202, 1045),
    ("packed", "nf4", True, False): (280, 1610),
    ("packed", "nf4", False, False): (199, 1101),
    ("packed", "none", True, True): (280, 166),  # compiled: a prediction
    ("packed", "nf4", True, True): (280, 180),  # compiled: a prediction
}
# ... and per optimizer step (gradient clipping, AdamW's foreach step, zero_grad), of which some ops are per adapter
# weight: (ops, ops per layer), with PROFILE_RESIDUAL_PER_STEP added.
HOST_OPS_PER_STEP = (24, 98)
# The code the committed H100 runs ran, 36 layers, counted the same way: the first session's (commit 3564941, the
# adapters computing in fp32) and the second's (commit 3d2ae74, in bf16), both passing the padding mask; per
# micro-batch by quant, and per step. The per-step count adds what the profiles show beyond the CPU's count of the ops
# they list, 512 add_ and 161 copy_ (AdamW's step counters live on the host, where foreach runs per tensor).
PROFILE_RESIDUAL_PER_STEP = 512 + 161
H100_OPS_PER_MICRO = {
    ("h100-session1", "none"): 53484,
    ("h100-session1", "nf4"): 56508,
    ("h100-session2", "none"): 54096,
    ("h100-session2", "nf4"): 58128,
}
H100_OPS_PER_STEP = {
    "h100-session1": 3552 + PROFILE_RESIDUAL_PER_STEP,
    "h100-session2": 3552 + PROFILE_RESIDUAL_PER_STEP,
}
# The calibration, from the committed H100 files (tests/test_plan.py reads each number back from them):
# - seconds per op: step 2 of gpu-4b-shape-lora-bf16 (8 micro-batches of 2 rows, 28,298 real tokens, 28,584 positions
#   computed, widest 2,004), unprofiled (its metrics.jsonl), over the ops it dispatched (8 micro-batches and the
#   step's own, second session's code): the step was host-bound (the profile of the same batch has the GPU computing
#   3.386 s of it, `Self CUDA time total`), so its time is the host's;
# - the kernels' fraction of the dense bf16 peak while the GPU computes: the FLOPs that step's kernels computed
#   (`micro_flops` over its 8 micro-batches at their padded widths; the test recounts them) over the profile's Self
#   CUDA time total x the H100's 989 TFLOP/s;
# - NF4_PASS_S, what a 4-bit linear pass costs beyond its counted aten ops: bitsandbytes' matmuls dispatch their
#   dequantization as custom ops (2 per forward matmul and 1 per backward one), Python kernels calling CUDA through
#   ctypes, which the aten count leaves out. The first session's QLoRA and LoRA runs (the same batches,
#   gpu-4b-shape-*-fp32-adapters, median step time over steps 2-10, both host-bound) differ by more than the ops
#   counted for that code explain: the rest, per 4-bit linear pass (7 projections x 36 layers x 3 passes: forward,
#   recompute, backward, x 8 micro-batches), is NF4_PASS_S. Not attributed (no QLoRA profile is committed); the
#   second session's QLoRA run checks it.
H100_STEP2 = dict(run="gpu-4b-shape-lora-bf16", step=2, seconds=5.768654296875, gpu_busy_s=3.386, micro_batches=8)
H100_STEP2_FLOPS = 694431274500096.0
H100_PEAK_FLOPS = 989e12
H100_SESSION1_MEDIANS = {
    "gpu-4b-shape-lora-bf16-fp32-adapters": 6.1237900390625,
    "gpu-4b-shape-qlora-nf4-fp32-adapters": 7.60574658203125,
}
_STEP2_OPS = (
    H100_STEP2["micro_batches"] * H100_OPS_PER_MICRO["h100-session2", "none"] + H100_OPS_PER_STEP["h100-session2"]
)
_H100_OP_S = H100_STEP2["seconds"] / _STEP2_OPS
_SESSION1_EXTRA_OPS = 8 * (H100_OPS_PER_MICRO["h100-session1", "nf4"] - H100_OPS_PER_MICRO["h100-session1", "none"])
NF4_PASS_S = (
    H100_SESSION1_MEDIANS["gpu-4b-shape-qlora-nf4-fp32-adapters"]
    - H100_SESSION1_MEDIANS["gpu-4b-shape-lora-bf16-fp32-adapters"]
    - _SESSION1_EXTRA_OPS * _H100_OP_S
) / (8 * 7 * 36 * 3)
HOSTS = {
    "h100-vm": dict(
        op_s=_H100_OP_S,
        kernel_mfu=H100_STEP2_FLOPS / (H100_STEP2["gpu_busy_s"] * H100_PEAK_FLOPS),
        source="the committed H100 runs' host (a Firecracker VM, 16 cores of an unnamed Intel Xeon; torch 2.11): "
        "devlogs/runs/single-gpu-ft-gpu/profile-lora-bf16-step2-ops.txt, devlogs/runs/single-gpu-ft/"
        "gpu-4b-shape-lora-bf16/metrics.jsonl (step 2)",
    ),
}
# The layouts: "full", every row --max-length real tokens (the planner's upper bound before issue 30); "padded", the
# AMI training examples (AMI_LENGTHS) in the scripts' length-grouped global batches, one example per row, each
# micro-batch right-padded to its longest (--no-packing); "packed", the same global batches packed into rows of
# at most --max-length (batching.pack, first-fit decreasing), --micro-batch-size rows per micro-batch as wide as the
# fullest (batching.packed_width), each rank the same number of micro-steps; "masked", "padded" as the scripts ran it
# until issue 30, the padding mask passed (the H100 runs).
LAYOUTS = ("full", "padded", "packed", "masked")
# The AMI training examples' token counts (the tiny tokenizer the qwen3-4b-shape runs use; Qwen3's own is not
# available offline): written by `write_ami_lengths`, the rest of a prompt and its transcript apart, so that the
# length at any --max-length follows data.ChatFormatter's rule.
AMI_LENGTHS = Path(__file__).with_name("ami_lengths.json")


def write_ami_lengths(path: Path = AMI_LENGTHS) -> None:
    """AMI_LENGTHS from the shipped data: per training example, in the training set's order, the tokens of its prompt
    and answer without the transcript, of its whole transcript, of its answer (with <|im_end|>: the targets), and
    whether its transcript may be cut. `uv run python -c "from ftkit import plan; plan.write_ami_lengths()"`."""
    splits = data.load_splits(data.SHIPPED)
    tokenizer = models.load_tokenizer(models.QWEN3_4B_SHAPE, data.corpus(splits["train"]))
    formatter = data.ChatFormatter(tokenizer, max_length=0)

    def n(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    rows = []
    for ex in splits["train"]:
        before, after = formatter.prompt_parts(ex.query)
        answer = n(ex.answer) + 1
        rows.append([len(before) + len(after) + answer, n(ex.transcript), answer, int(ex.trimmable)])
    text = json.dumps(
        {
            "data": data.SHIPPED,
            "split": "train",
            "tokenizer": f"tiny (byte-level BPE, {len(tokenizer)} tokens; models.load_tokenizer('qwen3-4b-shape'))",
            "fields": ["prompt and answer without the transcript", "transcript", "answer with <|im_end|>", "trimmable"],
            "examples": rows,
        }
    )
    path.write_text(text.replace("], [", "],\n[") + "\n")


@functools.cache
def ami_examples(max_length: int) -> tuple[tuple[int, int], ...]:
    """(tokens, target tokens) of each AMI training example data.ChatFormatter keeps at `max_length`, in order: the
    transcript cut to fit where it may be, the example dropped where it may not or where no 32 tokens of it fit."""
    out = []
    for fixed, transcript, answer, trimmable in json.loads(AMI_LENGTHS.read_text())["examples"]:
        budget = max_length - fixed
        if budget < min(data.MIN_TRANSCRIPT_TOKENS, transcript) or (transcript > budget and not trimmable):
            continue
        out.append((fixed + min(transcript, budget), answer))
    return tuple(out)


@dataclass(frozen=True)
class Micro:
    """One micro-batch on one rank: rows x width positions computed, and the positions the lm_head runs at."""

    rows: int
    width: int
    answers: int


@dataclass(frozen=True)
class Step:
    micros: tuple[Micro, ...]  # rank 0's (its micro-batches are the widest)
    tokens: int  # real tokens of the global batch
    positions: int  # positions computed, padding included, all ranks


class _Example:
    """A stand-in for data.Encoded that batching.GlobalBatches can sort: its length."""

    def __init__(self, n: int):
        self.input_ids = range(n)


def layout_steps(s: Setting, dp: int) -> list[Step]:
    """The optimizer steps the layout gives, each as rank 0's micro-batches: the first `s.steps` (one epoch if None)
    of the scripts' global batches (batching.GlobalBatches at s.seed) for the AMI layouts, one step for "full"."""
    m, length = s.micro_batch_size, s.max_length
    accum = batching.accumulation_steps(s.batch_size, m, dp)
    if s.layout == "full":
        micro = Micro(m, length, m * length)  # the convention's lm_head at every token
        return [Step((micro,) * accum, s.batch_size * length, s.batch_size * length)]
    examples = ami_examples(length)
    lengths = [n for n, _ in examples]
    pack_to = length if s.layout == "packed" else None
    batches = batching.GlobalBatches([_Example(n) for n in lengths], s.batch_size, s.seed, pack_to=pack_to)
    out = []
    for step in range(batches.per_epoch if s.steps is None else s.steps):
        rows = batches.rows(step)  # longest first; packed, batching.pack's rows
        per_rank = batches.micro_steps(step, m, dp)
        parts = [rows[j * dp * m : (j * dp + 1) * m] for j in range(per_rank)]  # rank 0's
        if pack_to:  # each micro-batch as wide as its fullest row, rounded up (batching.packed_width)
            micros = tuple(
                Micro(
                    m,
                    batching.packed_width([sum(lengths[i] for i in row) for row in p], length),
                    m * max(sum(examples[i][1] for i in row) for row in p),
                )
                for p in parts
            )
            positions = sum(batches.padded_tokens(step, m, r, dp) for r in range(dp))
        else:
            micros = tuple(Micro(m, lengths[p[0][0]], m * max(examples[i][1] for [i] in p)) for p in parts)
            positions = sum(m * lengths[rows[k * m][0]] for k in range(per_rank * dp))
        out.append(Step(micros, sum(lengths[i] for row in rows for i in row), positions))
    return out


def ops_source(s: Setting) -> str:
    """Whose op counts price the host: s.ops_source, and for the "masked" layout the H100 runs' code (the second
    session's) where it is "tree" (this code no longer passes the mask)."""
    return "h100-session2" if s.layout == "masked" and s.ops_source == "tree" else s.ops_source


def host_ops_per_micro(s: Setting, quant: str, layers: int) -> int:
    """Ops the host dispatches (eager) or launches (compiled) per micro-batch, on a rank that holds `layers`."""
    source = ops_source(s)
    if source != "tree":
        if s.compile or s.layout not in ("masked", "full") or layers != 36:
            raise ValueError(f"{source}'s op count is of its eager 36-layer step with the padding mask, on one rank")
        return H100_OPS_PER_MICRO[(source, quant)]
    layout = "packed" if s.compile or s.layout == "packed" else "padded"  # full-length rows: padded's path
    key = (layout, quant, s.grad_checkpointing, s.compile)
    if key not in HOST_OPS:
        raise ValueError(f"no host op count for {key} (assets/host_ops.py counts compiled layers with checkpointing)")
    base, per_layer = HOST_OPS[key]
    return base + per_layer * layers


def queue(host: list[float], gpu: list[float], host_after: float = 0.0) -> float:
    """Seconds from the first op to the step's end, the host running ahead of the GPU: micro-batch i's kernels run
    once the GPU is free and cannot end before the host has issued them (its ops interleave with its kernels), and
    the step ends when the GPU is done and the host has issued the step's own ops (`host_after`). With a host of cost
    0 this is the GPU's time; with a slow one, the host's."""
    host_t = gpu_t = 0.0
    for h, g in zip(host, gpu):
        host_t += h
        gpu_t = max(gpu_t + g, host_t)
    return max(gpu_t, host_t + host_after)


def collective_s(kind: str, size: float, n: int, link: hardware.Link, efficiency: float) -> float:
    """Seconds for one ring collective on a `size`-byte buffer over n GPUs: wire bytes at the achievable
    bandwidth, plus one latency per ring step (2(n-1) for an all-reduce, n-1 for either half)."""
    if n == 1:
        return 0.0
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return comm.ring_wire_bytes(kind, size, n) / (link.bytes_per_s * efficiency) + steps * link.latency_s


def candidates(s: Setting) -> list[tuple[str, dict[str, int], str]]:
    """(technique, mesh, quant) for every experiment the GPUs allow; the ones with a --quant flag both ways."""
    out = [("single", {}, "nf4"), ("single", {}, "none")]
    w = s.gpus
    if w > 1:
        out += [("ddp", {"dp": w}, "nf4"), ("ddp", {"dp": w}, "none")]
        out += [("fsdp", {"dp": w}, "nf4"), ("fsdp", {"dp": w}, "none")]
        out += [("pp", {"pp": w}, "none"), ("tp", {"tp": w}, "none"), ("tp-sp", {"tp": w}, "none")]
        # TP inside a node, FSDP over the rest
        tps = [t for t in range(2, s.per_node + 1) if s.per_node % t == 0 and w > t]
        out += [("fsdp-tp", {"dp": w // t, "tp": t}, "none") for t in tps]
    return out


def evaluate(s: Setting, technique: str, mesh: dict[str, int], quant: str) -> dict:
    """One row: the memory and step-time prediction, or the reason the experiment refuses this setting (its own
    error message where it has one). With the AMI layouts, the step time is the median over the layout's steps and
    tokens/s their real tokens over their time."""
    row = {"technique": technique, "experiment": EXPERIMENTS[technique], "mesh": mesh, "quant": quant}
    shape, cfg = s.shape, s.config
    dp, tp, pp = mesh.get("dp", 1), mesh.get("tp", 1), mesh.get("pp", 1)
    used = dp * tp * pp
    try:
        if tp > 1:
            ranks.check_tp_degree(cfg, tp)
        if shape.layers % pp:
            raise ValueError(f"{pp} pipeline stages do not divide the model's {shape.layers} layers evenly")
        accum = batching.accumulation_steps(s.batch_size, s.micro_batch_size, dp)
    except (ValueError, errors.RunError, errors.DataError) as e:
        return {**row, "refused": str(e)}
    memory = predict(
        shape,
        technique={"fsdp-tp": "fsdp"}.get(technique, technique),
        quant=quant,
        world_size=used,
        tp=tp,
        pp=pp,
        lora_rank=s.lora_rank,
        lora_dropout=s.lora_dropout,
        logit_positions=s.answer_tokens,
        micro_batch_size=s.micro_batch_size,
        seq_len=s.max_length,
        grad_checkpointing=s.grad_checkpointing,
        num_microbatches=accum,
        accumulation_steps=accum,
    ).total
    required = memory * MEMORY_MARGIN + s.reserve_bytes
    try:
        steps = [step_time(s, technique, mesh, quant, step) for step in layout_steps(s, dp)]
    except ValueError as e:  # no op count for this setting's host (host_ops_per_micro says which)
        return {**row, "refused": str(e)}
    out = {
        **row,
        "gpus_used": used,
        "memory_bytes": memory,
        "required_bytes": required,
        "fits": required <= s.memory_bytes,
        **{k: statistics.median(p[k] for p in steps) for k in ("compute_s", "exposed_comm_s", "bubble_s")},
        "step_time_s": statistics.median(p["step_time_s"] for p in steps),
        "tokens_per_s": sum(p["tokens"] for p in steps) / sum(p["step_time_s"] for p in steps),
    }
    if s.legacy:
        return out
    positions = sum(p["positions"] for p in steps)
    return {
        **out,
        "host_s": statistics.median(p["host_s"] for p in steps),
        "host_ops_per_micro_batch": steps[0]["host_ops_per_micro_batch"],
        # the host's work per unit of real data: ops dispatched (eager) or launched (compiled), all ranks
        "host_ops_per_1000_tokens": 1000 * sum(p["host_ops"] for p in steps) / sum(p["tokens"] for p in steps),
        "micro_batches": statistics.median(len(p["micros"]) for p in steps),
        "padding_fraction": 1 - sum(p["tokens"] for p in steps) / positions,
        "bound": "host" if out["step_time_s"] > 1.0001 * statistics.median(p["gpu_side_s"] for p in steps) else "GPU",
        "steps_predicted": len(steps),
    }


ASSUMED_MFU = 0.4  # without a calibrated host: well-tuned dense training (PaLM reports 46.2%)


def host_calibration(s: Setting) -> tuple[float, float]:
    """(seconds per host op, the kernels' fraction of the dense bf16 peak while the GPU computes): --host's
    calibration, with --host-op-us and --mfu over it; without --host, no host cost and ASSUMED_MFU."""
    host = HOSTS[s.host] if s.host else {"op_s": 0.0, "kernel_mfu": ASSUMED_MFU}
    return (host["op_s"] if s.host_op_s is None else s.host_op_s), (host["kernel_mfu"] if s.mfu is None else s.mfu)


def micro_flops(s: Setting, m: Micro) -> float:
    """FLOPs the kernels compute for one micro-batch: the MFU convention's (`metrics.step_flops`) over every position
    of its rows, padding included (attention over each row's whole width), the lm_head at its answer positions (at
    every position with the "full" layout, as the planner counted before issue 30), and the layers' forward again
    where checkpointing recomputes it."""
    shape, cfg = s.shape, s.config
    n_lora = lora_params(shape, s.lora_rank)
    flops = metrics.step_flops([m.width] * m.rows, cfg, n_lora, None if s.layout == "full" else m.answers)
    if s.grad_checkpointing:  # the layers' forward again: 2 FLOPs per layer weight and adapter weight, attention
        d = shape.heads * shape.head_dim
        layer_matmul = metrics.matmul_params(cfg) - shape.vocab * shape.hidden
        flops += m.rows * m.width * (2 * layer_matmul + 2 * n_lora + 2 * shape.layers * d * m.width)
    return flops


def step_time(s: Setting, technique: str, mesh: dict[str, int], quant: str, step: Step) -> dict:
    """One optimizer step on rank 0: its micro-batches' GPU and host time through the queue, plus the communication
    the technique cannot hide and the pipeline's bubble."""
    shape = s.shape
    dp, tp, pp = mesh.get("dp", 1), mesh.get("tp", 1), mesh.get("pp", 1)
    op_s, mfu = host_calibration(s)
    n_lora = lora_params(shape, s.lora_rank)
    passes = 3 if s.grad_checkpointing else 2  # forward, (recompute,) backward

    # ---- each micro-batch's GPU time on this rank: the FLOPs its kernels compute split over TP and PP, at mfu of the
    # dense bf16 peak, and NF4's dequantization of every layer's weights on every pass, at the HBM's datasheet bandwidth
    gpu = []
    for m in step.micros:
        g = micro_flops(s, m) / (tp * pp * s.gpu.bf16_flops * mfu)
        if quant == "nf4":
            weights = shape.layers * shape.linear_params() / tp / pp
            g += passes * weights * (NF4_BYTES_PER_PARAM + BF16) / s.gpu.hbm_bytes_per_s
        gpu.append(g)
    compute = sum(gpu)

    # ---- the host: ops per micro-batch (of the layers this rank holds) x seconds per op, plus bitsandbytes' calls
    ops = host_ops_per_micro(s, quant, shape.layers // pp) if op_s else 0
    host_micro = ops * op_s
    if quant == "nf4" and op_s:
        host_micro += NF4_PASS_S * passes * 7 * (shape.layers // pp)
    if not op_s:
        step_ops = 0
    elif ops_source(s) == "tree":
        step_ops = HOST_OPS_PER_STEP[0] + HOST_OPS_PER_STEP[1] * (shape.layers // pp) + PROFILE_RESIDUAL_PER_STEP
    else:
        step_ops = H100_OPS_PER_STEP[ops_source(s)]
    busy = queue([host_micro] * len(gpu), gpu, step_ops * op_s)  # == compute when the host costs nothing
    accum = len(gpu)
    micro = busy / accum  # one micro-batch's share, the window the overlapped collectives have

    # ---- what the technique cannot hide
    # TP is the innermost mesh dimension (neighbouring ranks, one node); any other group spans the GPUs used.
    spans_nodes = dp * tp * pp > s.per_node

    def coll(kind: str, size: float, n: int, inside_node: bool = False) -> float:
        link = s.inter_node_link if spans_nodes and not inside_node else s.link
        return collective_s(kind, size, n, link, s.link_efficiency)

    activations = [m.rows * m.width * shape.hidden * BF16 for m in step.micros]
    exposed = bubble = 0.0
    if technique == "ddp":
        exposed = max(0.0, coll("all_reduce", FP32 * n_lora, dp) - micro / 2)
    if technique in ("fsdp", "fsdp-tp"):
        # a 4-bit layer is gathered as its packed codes, 0.5 B per weight (its constants are resident on every rank)
        linear_bytes = NF4_PACKED_BYTES if quant == "nf4" else BF16
        layer_bytes = shape.linear_params() / tp * linear_bytes + shape.norm_params() * BF16
        gathers = coll("all_gather", 2 * shape.layers * layer_bytes + shape.embedding_params() * BF16, dp)
        exposed = accum * (max(0.0, gathers - micro) + gathers / (2 * shape.layers))
        exposed += max(0.0, coll("reduce_scatter", FP32 * n_lora / tp, dp) - micro / 2)
    if technique in ("tp", "fsdp-tp"):
        per_layer = 9 if s.grad_checkpointing else 7
        exposed += sum(shape.layers * per_layer * coll("all_reduce", a, tp, inside_node=True) for a in activations)
    if technique == "tp-sp":
        per_layer = 5.5 if s.grad_checkpointing else 4  # in pairs: the recompute adds three halves
        replicated = (
            shape.layers
            * s.lora_rank
            * sum(n_out if name in ROW_PARALLEL else n_in for name, (n_in, n_out) in shape.linears().items())
        )
        exposed = sum(
            shape.layers * per_layer * (coll("all_gather", a, tp, True) + coll("reduce_scatter", a, tp, True))
            for a in activations
        )
        exposed += coll("all_reduce", FP32 * replicated, tp, True)
    if technique == "pp":
        bubble = (pp - 1) / accum * busy
        hop = s.inter_node_link if spans_nodes else s.link
        exposed = 2 * (pp - 1) * (activations[0] / (hop.bytes_per_s * s.link_efficiency) + hop.latency_s)
    step_s = busy + exposed + bubble
    return {
        "micros": step.micros,
        "tokens": step.tokens,
        "positions": step.positions,
        "compute_s": compute,
        "host_s": host_micro * accum + step_ops * op_s,
        "host_ops_per_micro_batch": ops,
        "host_ops": (ops * accum + step_ops) * dp * tp * pp,  # every rank's, this step
        "gpu_side_s": compute + exposed + bubble,
        "exposed_comm_s": exposed,
        "bubble_s": bubble,
        "step_time_s": step_s,
    }


def mesh_label(mesh: dict[str, int]) -> str:
    return " x ".join(f"{k}{v}" for k, v in mesh.items()) or "1 GPU"


def label(row: dict) -> str:
    # The flag to pass: single-gpu-ft and ddp-ft default to --quant nf4, fsdp-ft to none (the others have no flag).
    default_nf4 = row["technique"] in ("single", "ddp")
    quant = " --quant nf4" if row["quant"] == "nf4" else " --quant none" if default_nf4 else ""
    return f"{row['experiment']}{quant} ({mesh_label(row['mesh'])})"


def recommend(rows: list[dict], s: Setting) -> dict:
    fitting = [r for r in rows if r.get("fits")]
    if not fitting:
        least = min((r for r in rows if "required_bytes" in r), key=lambda r: r["required_bytes"])
        return {
            "technique": None,
            "mesh": None,
            "quant": None,
            "reason": f"nothing fits in {s.memory_bytes / GIB:.0f} GiB: the least, {label(least)}, needs "
            f"{least['required_bytes'] / GIB:.1f} GiB; lower "
            "--max-length or --micro-batch-size, or add GPUs",
        }
    best = max(fitting, key=lambda r: r["tokens_per_s"])
    near = [r for r in fitting if r["tokens_per_s"] >= NEAR * best["tokens_per_s"]]
    pick = min(near, key=lambda r: (SIMPLER_FIRST.index(r["technique"]), r["quant"] == "nf4"))
    reason = (
        f"fits ({pick['required_bytes'] / GIB:.1f} of {s.memory_bytes / GIB:.0f} GiB with the margin); predicted "
        f"{pick['tokens_per_s']:,.0f} tokens/s"
    )
    if pick is not best:
        behind = 1 - pick["tokens_per_s"] / best["tokens_per_s"]
        reason += f", {behind:.1%} behind the fastest, {label(best)}, and simpler"
    else:
        runner_up = max((r for r in fitting if r is not best), key=lambda r: r["tokens_per_s"], default=None)
        if runner_up:
            ahead = best["tokens_per_s"] / runner_up["tokens_per_s"] - 1
            reason += f", {ahead:.1%} ahead of the next, {label(runner_up)}"
    limits = sorted((r for r in rows if r.get("refused") is None and not r["fits"]), key=lambda r: r["experiment"])
    if limits:
        reason += "; does not fit: " + ", ".join(label(r) for r in limits)
    return {
        "technique": pick["technique"],
        "experiment": pick["experiment"],
        "mesh": pick["mesh"],
        "quant": pick["quant"],
        "reason": reason,
    }


def plan(s: Setting) -> dict:
    rows = [evaluate(s, *c) for c in candidates(s)]
    op_s, mfu = host_calibration(s)
    result = {
        "setting": {
            "gpu": s.gpu.key,
            "gpus": s.gpus,
            "nodes": s.nodes,
            "link": s.link.key,
            "inter_node_link": s.inter_node_link.key if s.nodes > 1 else None,
            "memory_bytes": s.memory_bytes,
            **{k: getattr(s, k) for k in ("batch_size", "micro_batch_size", "max_length", "answer_tokens")},
            **{k: getattr(s, k) for k in ("lora_rank", "lora_dropout", "grad_checkpointing")},
        },
        "assumptions": {
            "mfu": mfu,
            "link_efficiency": s.link_efficiency,
            "memory_margin": MEMORY_MARGIN,
            "reserve_bytes": s.reserve_bytes,
            "gpu_source": s.gpu.source,
            "link_source": s.link.source,
        },
        "techniques": rows,
        "recommendation": recommend(rows, s),
    }
    if not s.legacy:
        result["setting"].update(layout=s.layout, compile=s.compile, host=s.host, seed=s.seed)
        result["assumptions"].update(host_op_s=op_s, nf4_pass_s=NF4_PASS_S if op_s else 0.0)
        result["prediction"] = prediction_notes(s, rows)
    return result


def prediction_notes(s: Setting, rows: list[dict]) -> list[str]:
    """What a prediction with the host or an AMI layout assumes, in words, each number's source named."""
    op_s, mfu = host_calibration(s)
    done = [r for r in rows if "refused" not in r]
    steps = done[0]["steps_predicted"] if done else 0
    notes = ["PREDICTED by ftkit.plan: a model, not a measurement"]
    layout = {
        "full": "every row --max-length real tokens (an upper bound on the work; no padding)",
        "padded": "the AMI training examples (AMI_LENGTHS: the tiny tokenizer's counts) in the scripts' "
        f"length-grouped global batches (seed {s.seed}), one example per row, each micro-batch right-padded to its "
        "longest (--no-packing)",
        "packed": f"the same global batches packed first-fit decreasing into rows of up to {s.max_length} "
        "(batching.pack), "
        f"{s.micro_batch_size} rows a micro-batch as wide as the fullest (batching.packed_width), every rank the same "
        "micro-steps; the attention kernel computes each whole row (SDPA with the block-diagonal mask)",
        "masked": "padded as the scripts ran it until issue 30, the padding mask passed (the committed H100 runs)",
    }[s.layout]
    notes.append(f"layout: {layout}" + (f"; step time: the median of {steps} steps" if s.layout != "full" else ""))
    if op_s:
        compiled = (
            "; the decoder layers compiled: the compiled graphs' kernels and extern ops, counted on a CPU's inductor "
            "(C++ kernels standing in for CUDA's Triton ones: a prediction), each costing what an eager op does"
            if s.compile
            else ""
        )
        counts = {r["quant"]: r["host_ops_per_micro_batch"] for r in done if r["mesh"].get("pp", 1) == 1}
        counts = ", ".join(f"{n:,} ({'NF4' if q == 'nf4' else 'bf16'})" for q, n in counts.items())
        notes.append(
            f"host: {counts} ops per micro-batch on a rank that holds every layer ({ops_source(s)} code, counted by "
            f"assets/host_ops.py{compiled}) x {op_s * 1e6:.2f} us per op"
            + (f" (calibrated: {HOSTS[s.host]['source']})" if s.host and s.host_op_s is None else " (--host-op-us)")
        )
        if any(r["quant"] == "nf4" for r in done):
            notes.append(
                f"host, NF4: {NF4_PASS_S * 1e6:.0f} us more per 4-bit linear pass (calibrated on the first H100 "
                "session's QLoRA and LoRA runs; not attributed)"
            )
        notes.append(
            "step: each micro-batch costs max(host, GPU) with the host running ahead of the GPU (`queue`); a rank's "
            "host dispatches the ops of the layers it holds; DDP's, FSDP's and DTensor's own host work is not "
            "counted (devlogs/plan-cpu-check.md: large for TP)"
        )
    else:
        notes.append("host: not modelled (its cost 0; --host h100-vm models the committed H100 runs' host)")
    source = "calibrated on the same profile, eager kernels" if s.host and s.mfu is None else "assumed (--mfu)"
    if not s.host and s.mfu is None:
        source = "assumed"
    notes.append(
        f"GPU: the FLOPs the kernels compute (padding and the recompute included) at {mfu:.1%} of the dense bf16 "
        f"peak ({source})" + ("; compiled kernels taken as no faster than eager ones" if s.compile else "")
    )
    return notes


def print_table(result: dict, model: str) -> None:
    st, a = result["setting"], result["assumptions"]
    print(
        f"{model}: {st['gpus']} x {st['gpu']} ({st['memory_bytes'] / GIB:.0f} GiB) on {st['nodes']} node(s), "
        f"link {st['link']}" + (f", across nodes {st['inter_node_link']}" if st["inter_node_link"] else "")
    )
    notes = result.get("prediction")
    gpu = f"MFU {a['mfu']:.0%}" if notes is None else f"GPU kernels at {a['mfu']:.1%} of the peak (below)"
    print(
        f"global batch {st['batch_size']} x {st['max_length']} tokens, micro-batch {st['micro_batch_size']}, LoRA "
        f"r{st['lora_rank']}, checkpointing {'on' if st['grad_checkpointing'] else 'off'}; assumed: {gpu}, links at "
        f"{a['link_efficiency']:.0%} of their bandwidth, memory x{a['memory_margin']} "
        f"+ {a['reserve_bytes'] / GIB:.1f} GiB"
    )
    for note in notes or []:
        print(f"  {note}")
    host = "" if notes is None else f" {'host s':>7} {'mb/step':>7}"
    print(f"{'experiment':<30} {'mesh':<14} {'quant':<5} {'need GiB':>8} {'fits':<4} {'compute s':>9} "
          f"{'comm s':>7} {'bubble s':>8}{host} {'step s':>7} {'tokens/s':>9}")  # fmt: skip
    for r in result["techniques"]:
        mesh = mesh_label(r["mesh"])
        if "refused" in r:
            print(f"{r['experiment']:<30} {mesh:<14} {r['quant']:<5} refused: {r['refused']}")
            continue
        host = "" if notes is None else f" {r['host_s']:7.3f} {r['micro_batches']:7g}"
        print(
            f"{r['experiment']:<30} {mesh:<14} {r['quant']:<5} {r['required_bytes'] / GIB:8.1f} "
            f"{'yes' if r['fits'] else 'no':<4} {r['compute_s']:9.3f} {r['exposed_comm_s']:7.3f} "
            f"{r['bubble_s']:8.3f}{host} {r['step_time_s']:7.3f} {r['tokens_per_s']:9,.0f}"
        )
    rec = result["recommendation"]
    print(f"recommendation: {label(rec) if rec['technique'] else 'none'}: {rec['reason']}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=models.QWEN3_4B, help=f"{', '.join(QWEN3_CONFIGS)}, or a config's path")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu", default="h100-sxm", choices=[g.key for g in hardware.GPUS])
    p.add_argument("--gpu-memory-gib", type=float, default=None, help="[the GPU's datasheet memory]")
    p.add_argument("--link", default="nvlink4", choices=list(hardware.LINKS), help="between the GPUs of a node")
    p.add_argument("--inter-node-link", default="ib-ndr", choices=list(hardware.LINKS))
    p.add_argument("--batch-size", type=int, default=16, help="global batch, sequences")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--answer-tokens", type=int, default=256, help="positions the lm_head runs on, per sequence")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-dropout", type=float, default=0.05)
    p.add_argument("--no-grad-checkpointing", dest="grad_checkpointing", action="store_false")
    p.add_argument(
        "--mfu",
        type=float,
        default=None,
        help="the GPU kernels' fraction of the dense bf16 peak while the GPU computes [--host's calibration; "
        f"without --host, {ASSUMED_MFU}, assumed]",
    )
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="full",
        help="full: every row --max-length real tokens (the GPU-only model's upper bound); padded: the AMI training "
        "examples one per row, right-padded per micro-batch (--no-packing); packed: packed into rows of up to "
        "--max-length, each micro-batch as wide as its fullest row (the scripts' default); masked: padded with the "
        "padding mask passed (the committed H100 runs)",
    )
    p.add_argument("--compile", action="store_true", help="the decoder layers compiled (the host's count a prediction)")
    p.add_argument(
        "--host",
        choices=list(HOSTS),
        default=None,
        help="model the host's cost per micro-batch, calibrated on the committed H100 runs' host [not modelled]",
    )
    p.add_argument("--host-op-us", type=float, default=None, help="microseconds per host op [--host's calibration]")
    p.add_argument("--seed", type=int, default=0, help="the global batches' seed, for the AMI layouts")
    p.add_argument("--link-efficiency", type=float, default=0.8, help="assumed fraction of a link's bandwidth")
    p.add_argument("--reserve-gib", type=float, default=1.0, help="CUDA context and NCCL buffers, assumed")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.compile and args.layout in ("padded", "masked"):
        p.error(
            "--compile: assets/host_ops.py counts the compiled layers' launches on packed rows: --layout packed or full"
        )
    if args.compile and args.host and not args.grad_checkpointing:
        p.error("--compile --host: the compiled layers' launches are counted with checkpointing on only")
    if args.gpus < 1 or args.nodes < 1 or args.gpus % args.nodes:
        p.error(f"--gpus {args.gpus} must be a positive multiple of --nodes {args.nodes} (GPUs per node alike)")
    gpu = hardware.gpu(args.gpu)
    try:
        config = model_config(args.model)
    except errors.ModelError as e:
        p.error(str(e))  # one line and exit code 2, as a bad flag
    setting = Setting(
        config=config,
        gpu=gpu,
        gpus=args.gpus,
        nodes=args.nodes,
        link=hardware.LINKS[args.link],
        inter_node_link=hardware.LINKS[args.inter_node_link],
        memory_bytes=args.gpu_memory_gib * GIB if args.gpu_memory_gib else gpu.memory_bytes,
        reserve_bytes=args.reserve_gib * GIB,
        **{k: getattr(args, k) for k in ("batch_size", "micro_batch_size", "max_length", "answer_tokens")},
        **{k: getattr(args, k) for k in ("lora_rank", "lora_dropout", "grad_checkpointing", "mfu")},
        link_efficiency=args.link_efficiency,
        layout=args.layout,
        compile=args.compile,
        host=args.host,
        host_op_s=None if args.host_op_us is None else args.host_op_us * 1e-6,
        seed=args.seed,
    )
    result = {"model": args.model, **plan(setting)}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result, args.model)
    return result


if __name__ == "__main__":
    main()
