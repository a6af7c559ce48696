"""Context parallelism in cp-ft, for blogs/cp.md: how the head-tail chunks share one sequence's causal attention
(left), and the memory model's bytes per GPU against the sequence length (right); and the post's tables.

Nothing here is measured on a GPU. The chunks are cp-ft's own (`Chunks` in experiments/cp-ft/train.py) and the work
of each is its query-key pairs under the causal mask (`ftkit.realscale.flops.causal_pairs`, lower right, as cp-ft's
SDPA call masks it). The memory is `ftkit.memory.predict` with the arguments the planner gives it
(`ftkit.plan.techniques.memory_bytes`): cp-ft's reference configuration, one sequence per micro-batch, a global
batch of 8, LoRA r=16 with dropout 0.05, checkpointing on, the lm_head on 256 answer positions. The tables are that
model, the fake-tensor runs of cp-ft's step at Qwen3-4B's shape (devlogs/runs/realscale/cp-world*.json), the CPU
runs (devlogs/runs/cp-ft/) and the planner (`python -m ftkit.plan`).

    uv run python assets/cp_chunks.py            # writes assets/cp_chunks.png, prints the post's tables

`layout`, `work`, `memory_curves`, `memory_table`, `realscale_table`, `planner_table` and `cpu_runs` return what the
figure draws and the post prints, for tests/test_figure_cp_chunks.py.
"""

from __future__ import annotations

import argparse
import io
import json
import runpy
import sys
from functools import cache
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Polygon, Rectangle  # noqa: E402
from PIL import Image  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import devlog_tables  # noqa: E402

from ftkit import hardware  # noqa: E402
from ftkit.memory import GIB, QWEN3_4B, predict  # noqa: E402
from ftkit.plan.__main__ import parser, setting_from  # noqa: E402
from ftkit.plan.recommendation import label as plan_label  # noqa: E402
from ftkit.plan.recommendation import plan  # noqa: E402
from ftkit.plan.techniques import MEMORY_MARGIN  # noqa: E402
from ftkit.realscale.flops import causal_pairs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).with_suffix(".png")
REALSCALE = ROOT / "devlogs" / "runs" / "realscale"
CPU_RUNS = ROOT / "devlogs" / "runs" / "cp-ft"
SEQ = 32768  # cp-ft's --max-length: the cap on a whole meeting
# What the planner passes to `predict` for cp-ft's reference configuration (ftkit/plan/techniques.py memory_bytes,
# at `python -m ftkit.plan --max-length L --micro-batch-size 1 --batch-size 8`): accumulation = 8 micro-batches.
PLANNER = dict(lora_rank=16, lora_dropout=0.05, logit_positions=256, micro_batch_size=1, grad_checkpointing=True)
ACCUM = 8
# (label, technique, GPUs, quant): the curves of the figure and the rows of the memory table
CONFIGS = [
    ("QLoRA, 1 GPU (`single-gpu-ft`)", "single", 1, "nf4"),
    ("bf16 LoRA, 1 GPU (`single-gpu-ft --quant none`)", "single", 1, "none"),
    ("CP, 2 GPUs (`cp-ft`)", "cp", 2, "none"),
    ("CP, 4 GPUs (`cp-ft`)", "cp", 4, "none"),
    ("TP+SP, 2 GPUs (`tp-sp-ft`)", "tp-sp", 2, "none"),
]
TABLE_LENGTHS = (2048, 16384, 32768)
CURVE_LENGTHS = tuple(range(2048, SEQ + 1, 2048))
CARD = hardware.gpu("rtx4090").memory_bytes  # an RTX 4090, as torch reports it
RESERVE = 1.0 * GIB  # the planner's default --reserve-gib
# The planner's settings in the post's comparison: 2 GPUs, whole meetings at the cap, cp-ft's batch.
PLAN_ARGS = ["--gpus", "2", "--micro-batch-size", "1", "--batch-size", "8"]
FULL_CONTEXT = 40960  # Qwen3-4B's max_position_embeddings
PLAN_SETTINGS = {
    "rtx4090": ["--gpu", "rtx4090"],  # its own link: PCIe through host memory (pcie4-host), no peer-to-peer
    "h100-sxm": ["--gpu", "h100-sxm", "--link", "nvlink4"],
}
# At the full context a 22 GiB card (L4, A10) is where no data-parallel layout fits.
FULL_CONTEXT_SETTINGS = {"rtx4090": PLAN_SETTINGS["rtx4090"], "l4": ["--gpu", "l4", "--link", "pcie4"]}
RANK_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52")


@cache
def chunks_class():
    """cp-ft's own `Chunks` (loading experiments/cp-ft/train.py, as tests/test_cp.py does)."""
    return runpy.run_path(str(ROOT / "experiments" / "cp-ft" / "train.py"))["Chunks"]


def layout(cp: int) -> list[int]:
    """The rank that holds each of the 2 x cp chunks, in sequence order, by cp-ft's `Chunks`."""
    owner = [-1] * (2 * cp)
    for rank in range(cp):
        for c in chunks_class()(cp, rank, 2 * cp).mine:
            owner[c] = rank
    return owner


def work(cp: int, length: int) -> dict:
    """Query-key pairs each rank computes for one sequence of `length` tokens: chunk c's queries over keys 0 ..
    (c+1) x size, masked causally at the bottom right as cp_attention does; and, to compare, the pairs of cp
    contiguous slices (rank r: tokens r x length/cp onward)."""
    n = length // (2 * cp)
    owner = layout(cp)
    pairs = [0] * cp
    for c, rank in enumerate(owner):
        pairs[rank] += causal_pairs(n, (c + 1) * n, lower_right=True)
    m = length // cp
    contiguous = [causal_pairs(m, (r + 1) * m, lower_right=True) for r in range(cp)]
    return {"chunk": n, "owner": owner, "pairs": pairs, "contiguous": contiguous, "whole": causal_pairs(length, length)}


def predicted(technique: str, gpus: int, quant: str, seq_len: int) -> float:
    """The memory model's bytes on the busiest GPU, as the planner asks for them."""
    degree = {"cp": {"cp": gpus}, "tp-sp": {"tp": gpus}}.get(technique, {})
    kw = dict(technique=technique, quant=quant, world_size=gpus, seq_len=seq_len, **degree, **PLANNER)
    return predict(QWEN3_4B, **kw, num_microbatches=ACCUM, accumulation_steps=ACCUM).total


def memory_curves() -> dict[str, list[tuple[int, float]]]:
    """Each configuration's predicted GiB per GPU at every length the figure draws."""
    return {label: [(s, predicted(t, g, q, s) / GIB) for s in CURVE_LENGTHS] for label, t, g, q in CONFIGS}


def limits() -> dict[str, float]:
    """An RTX 4090 in GiB, and the most the memory model may predict for the planner to say a run fits it."""
    return {"card": CARD / GIB, "planner": (CARD - RESERVE) / MEMORY_MARGIN / GIB}


def memory_table() -> str:
    lines = [
        "| predicted GiB per GPU | " + " | ".join(f"{s:,} tokens" for s in TABLE_LENGTHS) + " |",
        "|" + "---|" * (len(TABLE_LENGTHS) + 1),
    ]
    for label, t, g, q in CONFIGS:
        lines.append(f"| {label} | " + " | ".join(f"{predicted(t, g, q, s) / GIB:.2f}" for s in TABLE_LENGTHS) + " |")
    return "\n".join(lines)


def realscale_runs() -> list[dict]:
    return [json.loads((REALSCALE / f"cp-world{w}.json").read_text()) for w in (2, 4)]


def realscale_table() -> str:
    """cp-ft's step on fake tensors at Qwen3-4B's shape, rank 0: the tracked peak beside the model's, and the K/V
    bytes its collectives were given per meeting (the run's micro-steps are one meeting each)."""
    lines = [
        "| fake-tensor run, rank 0 | tokens per GPU | tracked peak GiB | predicted GiB | tracked / predicted "
        "| K, V all-gathered per meeting | their gradients reduce-scattered |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in realscale_runs():
        c, steps = r["config"], r["config"]["micro_steps_run"]
        gathered, scattered = (r["collective_bytes"][k] / steps / GIB for k in ("all_gather", "reduce_scatter"))
        lines.append(
            f"| `cp-world{r['world_size']}.json` | {c['max_length'] // r['world_size']:,} "
            f"| {r['tracked_peak_bytes'] / GIB:.2f} | {r['predicted_bytes'] / GIB:.2f} "
            f"| {r['tracked_peak_bytes'] / r['predicted_bytes']:.3f} | {gathered:.2f} GiB | {scattered:.2f} GiB |"
        )
    return "\n".join(lines)


@cache
def planned(gpu: str, max_length: int = SEQ) -> dict:
    """The planner's answer for 2 GPUs of this kind at cp-ft's reference configuration (`python -m ftkit.plan`)."""
    p = parser()
    flags = {**PLAN_SETTINGS, **FULL_CONTEXT_SETTINGS}[gpu]
    return plan(setting_from(p, p.parse_args([*PLAN_ARGS, "--max-length", str(max_length), *flags])))


def planned_row(gpu: str, experiment: str, quant: str = "none", max_length: int = SEQ) -> dict:
    (row,) = [r for r in planned(gpu, max_length)["techniques"] if (r["experiment"], r["quant"]) == (experiment, quant)]
    return row


def planner_rows() -> list[dict]:
    """One row per experiment: the planner's memory with its margin, and per GPU kind whether it fits, the
    communication it cannot hide and tokens/s."""
    rows = []
    results = {gpu: planned(gpu)["techniques"] for gpu in PLAN_SETTINGS}
    for i, r in enumerate(results["rtx4090"]):
        row = {"experiment": plan_label(r), "need": r["required_bytes"]}
        for gpu, rs in results.items():
            assert (rs[i]["experiment"], rs[i]["quant"]) == (r["experiment"], r["quant"])
            row[gpu] = {k: rs[i][k] for k in ("fits", "exposed_comm_s", "tokens_per_s")}
        rows.append(row)
    return rows


def planner_table() -> str:
    lines = [
        "| 8 x 32,768 tokens a step (mesh) | needs GiB | 2 x RTX 4090, PCIe 4 via host: fits | comm s per step "
        "| tokens/s | 2 x H100 SXM, NVLink 4: comm s per step | tokens/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in planner_rows():
        a, b = r["rtx4090"], r["h100-sxm"]
        lines.append(
            f"| `{r['experiment']}` | {r['need'] / GIB:.1f} | {'yes' if a['fits'] else 'no'} "
            f"| {a['exposed_comm_s']:.2f} | {a['tokens_per_s']:,.0f} | {b['exposed_comm_s']:.2f} "
            f"| {b['tokens_per_s']:,.0f} |"
        )
    return "\n".join(lines)


def cpu_runs() -> dict:
    """The CPU runs behind devlogs/cp-ft.md: each cp run's largest per-step loss difference from the single-process
    reference, and its bytes per step recorded and stated by theory."""
    out = {}
    for n in (2, 4):
        run = CPU_RUNS / f"cpu-cp{n}"
        s = json.loads((run / "summary.json").read_text())
        out[n] = {
            "max_loss_diff": devlog_tables.max_loss_diff(run, CPU_RUNS / devlog_tables.REFERENCE),
            "bytes": s["comm_bytes_per_step"],
            "theory": s["comm_theory_bytes_per_step"],
            "steps": s["steps_run"],
        }
    return out


def kv_bytes_per_token_layer() -> int:
    """K and V of one token in one layer, bf16, with Qwen3-4B's 8 KV heads: what cp-ft gathers per pass."""
    return 2 * QWEN3_4B.kv_heads * QWEN3_4B.head_dim * 2


def hidden_bytes_per_token() -> int:
    """One token of the [tokens x hidden] bf16 activation that TP+SP gathers and scatters."""
    return QWEN3_4B.hidden * 2


def repeated_kv_bytes(seq_len: int = SEQ) -> int:
    """The gathered K and V repeated to the 32 query heads for one layer, the whole sequence, bf16."""
    return 2 * seq_len * QWEN3_4B.heads * QWEN3_4B.head_dim * 2


def draw_chunks(ax, cp: int = 2) -> None:
    w = work(cp, SEQ)
    owner, k = w["owner"], 2 * cp
    for q in range(k):  # query chunk q: rows; key chunk j: columns; y grows downward
        color = RANK_COLORS[owner[q]]
        for j in range(q + 1):
            if j < q:
                ax.add_patch(Rectangle((j, q), 1, 1, fc=color, ec="white", lw=1.5, alpha=0.85))
            else:  # the diagonal block: causal within the chunk
                ax.add_patch(Polygon([(j, q), (j, q + 1), (j + 1, q + 1)], fc=color, ec="white", lw=1.5, alpha=0.85))
        ax.text(-0.12, q + 0.5, f"chunk {q}\nrank {owner[q]}", ha="right", va="center", fontsize=8.5, color=color)
        blocks = q + 0.5  # full blocks of chunk x chunk pairs, the diagonal about half of one
        ax.text(q + 1.1, q + 0.5, f"{blocks:g} blocks", ha="left", va="center", fontsize=8, color=color)
    for j in range(k):
        ax.text(
            j + 0.5,
            -0.1,
            f"K, V of\nchunk {j}\n(rank {owner[j]})",
            ha="center",
            va="bottom",
            fontsize=7.5,
            color=RANK_COLORS[owner[j]],
        )
    ax.set_xlim(-1.25, k + 1.0)
    ax.set_ylim(k + 1.95, -0.75)
    ax.set_aspect("equal")
    ax.axis("off")
    n = w["chunk"]
    ranks = "\n".join(
        f"rank {r}: chunks {', '.join(str(c) for c, o in enumerate(owner) if o == r)}: {p:,} pairs"
        for r, p in enumerate(w["pairs"])
    )
    halves = ", ".join(f"{p:,}" for p in w["contiguous"])
    ax.text(
        -1.2,
        k + 0.2,
        f"One {SEQ:,}-token sequence, cp = {cp}: {k} chunks of {n:,} tokens.\nQuery-key pairs each rank computes:\n"
        f"{ranks}\n(contiguous halves instead: {halves})",
        fontsize=8.5,
        va="top",
    )
    title = "Causal attention of one sequence, query chunks (rows) over the\ngathered keys: each block computed by "
    ax.set_title(title + "the rank of its row", fontsize=9.5, loc="left")


def draw_memory(ax) -> None:
    styles = ["--", "-", "-", "-", "-"]
    colors = ["#8c8c8c", "#222222", "#1f77b4", "#55A868", "#8172B3"]
    for (label, points), ls, color in zip(memory_curves().items(), styles, colors):
        xs, ys = zip(*points)
        ax.plot(xs, ys, ls, color=color, lw=1.8, label=label.replace("`", ""))
    for r in realscale_runs():
        ax.plot(SEQ, r["tracked_peak_bytes"] / GIB, "x", color="k", ms=8, mew=1.6)
    ax.plot([], [], "x", color="k", label="tracked on fake tensors (cp-ft, 2 and 4 ranks)")
    lim = limits()
    ax.axhline(lim["card"], color="#c44e52", lw=1.2)
    ax.text(SEQ, lim["card"] + 0.3, f"an RTX 4090: {lim['card']:.2f} GiB", color="#c44e52", fontsize=8, ha="right")
    ax.axhline(lim["planner"], color="#c44e52", lw=1.0, ls=":")
    ax.text(
        1000,
        lim["planner"] + 0.3,
        f"fits it by the planner (x{MEMORY_MARGIN} + 1 GiB): {lim['planner']:.2f} GiB",
        color="#c44e52",
        fontsize=8,
    )
    ax.set_xticks([2048, 8192, 16384, 24576, 32768])
    ax.set_xticklabels(["2k", "8k", "16k", "24k", "32k"])
    ax.set_xlim(0, SEQ + 1500)
    ax.set_ylim(0, 25)
    ax.set_xlabel("tokens per sequence (micro-batch 1)")
    ax.set_ylabel("GiB per GPU, busiest rank")
    ax.set_title("Qwen3-4B, predicted by the memory model (ftkit/memory.py)", fontsize=9.5, loc="left")
    ax.legend(fontsize=7.5, frameon=False, loc="lower right")
    ax.spines[["top", "right"]].set_visible(False)


def draw(out: Path = OUT) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.6), gridspec_kw={"width_ratios": [1, 1.25]})
    draw_chunks(left)
    draw_memory(right)
    fig.text(
        0.01,
        0.01,
        "Counts and predictions, not GPU measurements. Left: cp-ft's own Chunks; pairs by ftkit.realscale.flops."
        "causal_pairs (the lower-right causal mask cp_attention passes SDPA).\nRight: ftkit.memory.predict as the "
        "planner calls it: micro-batch 1, global batch 8, LoRA r=16, dropout 0.05, checkpointing on, the lm_head on "
        "256 answer positions; x: cp-ft's step tracked on fake tensors at Qwen3-4B's shape.",
        fontsize=7.2,
        color="#444",
    )
    fig.subplots_adjust(left=0.02, right=0.98, top=0.88, bottom=0.15, wspace=0.12)
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=110)
    plt.close(fig)
    # A palette of 128 colours (flat fills, lines and anti-aliased text need no more).
    Image.open(buffer).convert("RGB").quantize(128, dither=Image.Dither.NONE).save(out, optimize=True)


def main() -> None:
    print("Predicted GiB per GPU (ftkit.memory.predict, the planner's arguments; micro-batch 1, global batch 8):\n")
    print(memory_table())
    print("\ncp-ft on fake tensors at Qwen3-4B's shape, 32,768 tokens (devlogs/runs/realscale/cp-world*.json):\n")
    print(realscale_table())
    gpus = " / ".join(" ".join(a) for a in PLAN_SETTINGS.values())
    print(f"\nThe planner, {' '.join(PLAN_ARGS)} --max-length {SEQ} with {gpus}")
    print("(PREDICTED by ftkit.plan: a model, not a measurement):\n")
    print(planner_table())
    for gpu in PLAN_SETTINGS:
        rec = planned(gpu)["recommendation"]
        print(f"\n{gpu}: recommendation: {plan_label(rec)}: {rec['reason']}")
    for gpu in FULL_CONTEXT_SETTINGS:
        rec = planned(gpu, FULL_CONTEXT)["recommendation"]
        print(f"\n{gpu} at --max-length {FULL_CONTEXT}: recommendation: {plan_label(rec)}: {rec['reason']}")
    w = work(2, SEQ)
    print(f"\ncp 2 at {SEQ:,} tokens: pairs per rank {w['pairs']}, whole {w['whole']:,}; contiguous {w['contiguous']}")
    print(f"K and V per token and layer: {kv_bytes_per_token_layer():,} B; TP+SP's: {hidden_bytes_per_token():,} B")
    print(f"K and V repeated to the query heads, one layer at {SEQ:,} tokens: {repeated_kv_bytes() / GIB:.2f} GiB")
    for n, r in cpu_runs().items():
        diff, sent, theory = r["max_loss_diff"], r["bytes"], r["theory"]
        print(f"CPU cp {n}: max |loss diff| {diff:.1e}, bytes/step {sent:,.0f} (theory {theory:,.0f})")
    draw()
    print(f"\nwrote {OUT}")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
