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
  46.2%); single-gpu-ft measured 4.8% on an H100 (devlogs/single-gpu-ft.md), so absolute tokens/s are optimistic.
- NF4 (QLoRA): every pass over a layer (forward, recomputed forward, backward) dequantizes its weights, reading
  the 4-bit weights and writing bf16 ones through the GPU's memory at its datasheet bandwidth.
- Communication: the alpha-beta model of a ring (bytes from `comm.ring_wire_bytes`, at --link-efficiency of the
  link's bandwidth, plus a latency per message), on the slowest link the group spans. Only what the technique
  cannot hide is added to the step:
  - DDP: the fp32 LoRA gradients' all-reduce, once per optimizer step, overlapped with the last micro-batch's
    backward (taken as half that micro-batch's compute);
  - FSDP: each micro-batch all-gathers the bf16 weights twice (forward, backward), prefetched under the same
    micro-batch's compute, except the first layer's; the LoRA gradients' reduce-scatter like DDP's all-reduce;
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
congestion, padding (real AMI sequences are shorter than --max-length after truncation only when they are short).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from types import SimpleNamespace

from ftkit import comm, data, hardware, metrics, models, run
from ftkit.memory import GIB, NF4_BYTES_PER_PARAM, ROW_PARALLEL, ModelShape, lora_params, predict

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
    mfu: float = 0.4
    link_efficiency: float = 0.8
    reserve_bytes: float = GIB

    @property
    def shape(self) -> ModelShape:
        return ModelShape.from_config(vars(self.config))

    @property
    def per_node(self) -> int:
        return self.gpus // self.nodes


# The Setting fields a run records under the same names (config.json's and summary.json's "config").
RUN_FLAGS = (
    "batch_size",
    "micro_batch_size",
    "max_length",
    "answer_tokens",
    "lora_rank",
    "lora_dropout",
    "grad_checkpointing",
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
        out += [("ddp", {"dp": w}, "nf4"), ("ddp", {"dp": w}, "none"), ("fsdp", {"dp": w}, "none")]
        out += [("pp", {"pp": w}, "none"), ("tp", {"tp": w}, "none"), ("tp-sp", {"tp": w}, "none")]
        # TP inside a node, FSDP over the rest
        tps = [t for t in range(2, s.per_node + 1) if s.per_node % t == 0 and w > t]
        out += [("fsdp-tp", {"dp": w // t, "tp": t}, "none") for t in tps]
    return out


def evaluate(s: Setting, technique: str, mesh: dict[str, int], quant: str) -> dict:
    """One row: the memory and step-time prediction, or the reason the experiment refuses this setting (its own
    error message where it has one)."""
    row = {"technique": technique, "experiment": EXPERIMENTS[technique], "mesh": mesh, "quant": quant}
    shape, cfg = s.shape, s.config
    dp, tp, pp = mesh.get("dp", 1), mesh.get("tp", 1), mesh.get("pp", 1)
    used = dp * tp * pp
    try:
        if tp > 1:
            run.check_tp_degree(cfg, tp)
        if shape.layers % pp:
            raise ValueError(f"{pp} pipeline stages do not divide the model's {shape.layers} layers evenly")
        accum = data.accumulation_steps(s.batch_size, s.micro_batch_size, dp)
    except (ValueError, run.RunError, data.DataError) as e:
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

    # ---- compute, split evenly over the GPUs used
    n_lora = lora_params(shape, s.lora_rank)
    flops = metrics.step_flops([s.max_length] * s.batch_size, cfg, n_lora)
    if s.grad_checkpointing:  # the layers' forward again: 2 FLOPs per layer weight and adapter weight, attention
        d = shape.heads * shape.head_dim
        layer_matmul = metrics.matmul_params(cfg) - shape.vocab * shape.hidden
        flops += s.batch_size * s.max_length * (2 * layer_matmul + 2 * n_lora + 2 * shape.layers * d * s.max_length)
    compute = flops / (used * s.gpu.bf16_flops * s.mfu)
    micro = compute / accum  # one micro-batch's compute on one GPU
    if quant == "nf4":
        passes = 3 if s.grad_checkpointing else 2
        weights = shape.layers * shape.linear_params() / tp / pp
        compute += passes * accum * weights * (NF4_BYTES_PER_PARAM + BF16) / s.gpu.hbm_bytes_per_s

    # ---- what the technique cannot hide
    # TP is the innermost mesh dimension (neighbouring ranks, one node); any other group spans the GPUs used.
    spans_nodes = used > s.per_node

    def coll(kind: str, size: float, n: int, inside_node: bool = False) -> float:
        link = s.inter_node_link if spans_nodes and not inside_node else s.link
        return collective_s(kind, size, n, link, s.link_efficiency)

    activation = s.micro_batch_size * s.max_length * shape.hidden * BF16
    exposed = bubble = 0.0
    if technique == "ddp":
        exposed = max(0.0, coll("all_reduce", FP32 * n_lora, dp) - micro / 2)
    if technique in ("fsdp", "fsdp-tp"):
        layer_bytes = shape.linear_params() / tp * BF16 + shape.norm_params() * BF16
        gathers = coll("all_gather", 2 * shape.layers * layer_bytes + shape.embedding_params() * BF16, dp)
        exposed = accum * (max(0.0, gathers - micro) + gathers / (2 * shape.layers))
        exposed += max(0.0, coll("reduce_scatter", FP32 * n_lora / tp, dp) - micro / 2)
    if technique in ("tp", "fsdp-tp"):
        per_layer = 9 if s.grad_checkpointing else 7
        exposed += accum * shape.layers * per_layer * coll("all_reduce", activation, tp, inside_node=True)
    if technique == "tp-sp":
        per_layer = 5.5 if s.grad_checkpointing else 4  # in pairs: the recompute adds three halves
        pair = coll("all_gather", activation, tp, True) + coll("reduce_scatter", activation, tp, True)
        replicated = (
            shape.layers
            * s.lora_rank
            * sum(n_out if name in ROW_PARALLEL else n_in for name, (n_in, n_out) in shape.linears().items())
        )
        exposed = accum * shape.layers * per_layer * pair + coll("all_reduce", FP32 * replicated, tp, True)
    if technique == "pp":
        bubble = (pp - 1) / accum * compute
        hop = s.inter_node_link if spans_nodes else s.link
        exposed = 2 * (pp - 1) * (activation / (hop.bytes_per_s * s.link_efficiency) + hop.latency_s)
    step = compute + exposed + bubble
    return {
        **row,
        "gpus_used": used,
        "memory_bytes": memory,
        "required_bytes": required,
        "fits": required <= s.memory_bytes,
        "compute_s": compute,
        "exposed_comm_s": exposed,
        "bubble_s": bubble,
        "step_time_s": step,
        "tokens_per_s": s.batch_size * s.max_length / step,
    }


def mesh_label(mesh: dict[str, int]) -> str:
    return " x ".join(f"{k}{v}" for k, v in mesh.items()) or "1 GPU"


def label(row: dict) -> str:
    quant = (
        " --quant nf4" if row["quant"] == "nf4" else " --quant none" if row["technique"] in ("single", "ddp") else ""
    )
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
    return {
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
            "mfu": s.mfu,
            "link_efficiency": s.link_efficiency,
            "memory_margin": MEMORY_MARGIN,
            "reserve_bytes": s.reserve_bytes,
            "gpu_source": s.gpu.source,
            "link_source": s.link.source,
        },
        "techniques": rows,
        "recommendation": recommend(rows, s),
    }


def print_table(result: dict, model: str) -> None:
    st, a = result["setting"], result["assumptions"]
    print(
        f"{model}: {st['gpus']} x {st['gpu']} ({st['memory_bytes'] / GIB:.0f} GiB) on {st['nodes']} node(s), "
        f"link {st['link']}" + (f", across nodes {st['inter_node_link']}" if st["inter_node_link"] else "")
    )
    print(
        f"global batch {st['batch_size']} x {st['max_length']} tokens, micro-batch {st['micro_batch_size']}, LoRA "
        f"r{st['lora_rank']}, checkpointing {'on' if st['grad_checkpointing'] else 'off'}; assumed: MFU "
        f"{a['mfu']:.0%}, links at {a['link_efficiency']:.0%} of their bandwidth, memory x{a['memory_margin']} "
        f"+ {a['reserve_bytes'] / GIB:.1f} GiB"
    )
    print(f"{'experiment':<30} {'mesh':<14} {'quant':<5} {'need GiB':>8} {'fits':<4} {'compute s':>9} "
          f"{'comm s':>7} {'bubble s':>8} {'step s':>7} {'tokens/s':>9}")  # fmt: skip
    for r in result["techniques"]:
        mesh = mesh_label(r["mesh"])
        if "refused" in r:
            print(f"{r['experiment']:<30} {mesh:<14} {r['quant']:<5} refused: {r['refused']}")
            continue
        print(
            f"{r['experiment']:<30} {mesh:<14} {r['quant']:<5} {r['required_bytes'] / GIB:8.1f} "
            f"{'yes' if r['fits'] else 'no':<4} {r['compute_s']:9.3f} {r['exposed_comm_s']:7.3f} "
            f"{r['bubble_s']:8.3f} {r['step_time_s']:7.3f} {r['tokens_per_s']:9,.0f}"
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
    p.add_argument("--mfu", type=float, default=0.4, help="assumed fraction of the dense bf16 peak")
    p.add_argument("--link-efficiency", type=float, default=0.8, help="assumed fraction of a link's bandwidth")
    p.add_argument("--reserve-gib", type=float, default=1.0, help="CUDA context and NCCL buffers, assumed")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.gpus < 1 or args.nodes < 1 or args.gpus % args.nodes:
        p.error(f"--gpus {args.gpus} must be a positive multiple of --nodes {args.nodes} (GPUs per node alike)")
    gpu = hardware.gpu(args.gpu)
    try:
        config = model_config(args.model)
    except models.ModelError as e:
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
    )
    result = {"model": args.model, **plan(setting)}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result, args.model)
    return result


if __name__ == "__main__":
    main()
