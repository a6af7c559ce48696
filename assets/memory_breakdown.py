"""Predicted per-GPU memory for finetuning Qwen3-4B, by component: writes memory_breakdown.png next to this
file and prints the same numbers as a Markdown table (quoted in blogs/what-fills-gpu-memory.md).

Every number is the memory model's (ftkit/memory.py), not a measurement.

    uv run python assets/memory_breakdown.py
"""

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ftkit.activations import layer_activation_bytes  # noqa: E402
from ftkit.memory import (
    GIB,
    QWEN3_4B,
    MemoryPrediction,
    lora_params,
    predict,
    zero_bytes,
)  # noqa: E402

# The setting of every bar unless its label says otherwise: the reference configuration (the scripts' defaults,
# README), with the lm_head on 256 answer positions per sequence, as the planner and ftkit.realscale assume (the
# scripts run it on the answer positions only; the most the committed H100 runs met was 200:
# devlogs/runs/single-gpu-ft-gpu/memory-check-*.md).
COMMON = dict(
    seq_len=2048, micro_batch_size=2, lora_rank=16, lora_dropout=0.05, grad_checkpointing=True, logit_positions=256
)
CONFIGS: list[tuple[str, dict]] = [
    ("Full finetune, bf16 + AdamW, 1 GPU", dict(full_finetune=True)),
    ("LoRA, bf16 base, 1 GPU", dict(quant="none")),
    ("QLoRA, NF4 base, 1 GPU", dict(quant="nf4")),
    ("QLoRA, NF4, 1 GPU, no checkpointing", dict(quant="nf4", grad_checkpointing=False)),
    ("QLoRA, NF4, 1 GPU, peft's fp32 upcast", dict(quant="nf4", kbit_upcast=True)),
    ("QLoRA + DDP, 2 GPUs", dict(quant="nf4", technique="ddp", world_size=2)),
    # Global batch 16 of micro-batch 2: 4 accumulation steps on 2 ranks, 1 on 8.
    ("FSDP LoRA bf16, 2 GPUs", dict(technique="fsdp", world_size=2, accumulation_steps=4)),
    ("FSDP LoRA bf16, 8 GPUs", dict(technique="fsdp", world_size=8)),
    ("TP LoRA bf16, 2 GPUs", dict(technique="tp", world_size=2)),
    ("TP+SP LoRA bf16, 2 GPUs", dict(technique="tp-sp", world_size=2)),
    ("PP LoRA bf16, 4 stages, 1F1B, 8 micro-batches", dict(technique="pp", world_size=4, num_microbatches=8)),
    (
        "PP LoRA bf16, 4 stages, GPipe, 8 micro-batches",
        dict(technique="pp", world_size=4, num_microbatches=8, pp_schedule="gpipe"),
    ),
]
# Total per GPU against sequence length: activations grow with it, model states do not.
SEQ_LENS = (2048, 8192, 16384, 32768)
SEQ_CONFIGS = [
    ("QLoRA, NF4, 1 GPU", dict(quant="nf4")),
    ("LoRA bf16, 1 GPU", dict(quant="none")),
    ("FSDP LoRA bf16, 8 GPUs", dict(technique="fsdp", world_size=8)),
    ("TP+SP LoRA bf16, 4 GPUs", dict(technique="tp-sp", world_size=4)),
    ("TP+SP LoRA bf16, 8 GPUs", dict(technique="tp-sp", world_size=8)),
]
COMPONENTS = [  # field, legend, colour
    ("weights", "base weights", "#4c72b0"),
    ("gathered", "FSDP all-gathered units", "#8da0cb"),
    ("lora", "LoRA adapters", "#55a868"),
    ("gradients", "gradients", "#c44e52"),
    ("optimizer", "AdamW state", "#dd8452"),
    ("activations", "activations + logits", "#8172b3"),
]


def table(rows: list[tuple[str, MemoryPrediction]]) -> str:
    head = ["configuration", *(legend for _, legend, _ in COMPONENTS), "total"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, p in rows:
        gib = p.gib()
        cells = [f"{gib[field]:.2f}" for field, _, _ in COMPONENTS] + [f"**{gib['total']:.2f}**"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rows() -> list[tuple[str, MemoryPrediction]]:
    return [(label, predict(QWEN3_4B, **{**COMMON, **kw})) for label, kw in CONFIGS]


def seq_table() -> str:
    lines = ["| configuration | " + " | ".join(f"seq {s}" for s in SEQ_LENS) + " |", "|" + "---|" * (len(SEQ_LENS) + 1)]
    for label, kw in SEQ_CONFIGS:
        totals = [predict(QWEN3_4B, **{**COMMON, **kw, "seq_len": s}).total / GIB for s in SEQ_LENS]
        lines.append(f"| {label} | " + " | ".join(f"{t:.2f}" for t in totals) + " |")
    return "\n".join(lines)


def bars(rows: list[tuple[str, MemoryPrediction]]) -> list[tuple[str, dict[str, float]]]:
    """What the figure draws, top bar first: each configuration's segments in GiB (the COMPONENTS' fields, in
    their order, left to right) and the total its label prints."""
    drawn = []
    for label, p in rows:
        segments = {field: getattr(p, field) / GIB for field, _, _ in COMPONENTS}
        drawn.append((label, {**segments, "total": sum(segments.values())}))
    return drawn


def title() -> str:
    c = COMMON
    return (
        "Qwen3-4B finetuning, per-GPU memory: memory model (predicted), not measured\n"
        f"seq {c['seq_len']}, micro-batch {c['micro_batch_size']}, LoRA r={c['lora_rank']} "
        f"(dropout {c['lora_dropout']}) on all 7 projections,\n"
        f"activation checkpointing on unless noted; the lm_head on {c['logit_positions']} answer positions per sequence"
    )


def plot(rows: list[tuple[str, MemoryPrediction]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(10.5, 6.6))
    drawn = bars(rows)[::-1]  # barh draws bottom up: the first configuration on top
    labels = [label for label, _ in drawn]
    left = [0.0] * len(drawn)
    for field, legend, colour in COMPONENTS:
        values = [gib[field] for _, gib in drawn]
        ax.barh(labels, values, left=left, color=colour, label=legend, height=0.65)
        left = [a + b for a, b in zip(left, values, strict=True)]
    for y, (_, gib) in enumerate(drawn):
        ax.text(gib["total"] + 0.6, y, f"{gib['total']:.1f} GiB", va="center", fontsize=9)
    ax.set_xlim(0, max(left) * 1.15)
    ax.set_xlabel("GiB per GPU (busiest rank)")
    ax.set_title(title(), fontsize=10, loc="left")
    ax.legend(loc="lower right", fontsize=9, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=150)


def main() -> None:
    predicted = rows()
    print("Per-GPU memory, GiB (2^30 bytes), memory model (predicted), Qwen3-4B:", COMMON)
    print()
    print(table(predicted))
    print()

    print("Total GiB per GPU against sequence length (memory model, predicted; otherwise as above):")
    print()
    print(seq_table())
    print()

    n, n_lora = QWEN3_4B.n_params(), lora_params(QWEN3_4B, 16)
    print(f"Qwen3-4B parameters: {n:,}; LoRA r=16 on all 7 projections: {n_lora:,} ({n_lora / n:.2%})")
    h = QWEN3_4B.hidden
    for stream, act in (("bf16 stream (LoRA)", 2), ("fp32 stream (QLoRA + kbit upcast)", 4)):
        for dropout in (0.0, 0.05):
            per = sum(layer_activation_bytes(QWEN3_4B, act_bytes=act, lora_dropout=dropout))
            print(f"saved per token per layer, {stream}, dropout {dropout}: {per:,} B = {per / h:.1f}h")
    print(f"GPT layer, Korthikanti et al. (16-bit, without the 5as/h attention matrices): 34h = {34 * h:,} B")
    positions, vocab = COMMON["micro_batch_size"] * COMMON["logit_positions"], QWEN3_4B.vocab
    loss = 3 * 4 * vocab * positions / GIB
    print(
        "at the loss peak, the fp32 log-softmax and its two gradients: "
        f"3 x 4 B x {vocab:,} x {positions} = {loss:.2f} GiB"
    )
    print(f"the same per position the lm_head runs on: 12 B x {vocab:,} = {12 * vocab / 2**20:.2f} MiB")
    zero = [zero_bytes(7.5e9, k=12, n_d=64, stage=s) / 1e9 for s in range(4)]
    print("ZeRO Fig. 1 (psi = 7.5e9, K = 12, N_d = 64), GB:", ", ".join(f"{z:.1f}" for z in zero))

    out = Path(__file__).with_suffix(".png")
    plot(predicted, out)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
