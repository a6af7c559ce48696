"""Where tensor parallelism's collectives sit in one Qwen3 decoder layer, and what each moves: Megatron's f and g
(plain TP) and sequence parallelism's all-gather / reduce-scatter (TP+SP), for blogs/tp-sp.md. A schematic; its
numbers are the code's own model at the reference configuration (2 GPUs, a micro-batch of 2 x 2048 tokens, bf16,
checkpointing on): the activation each collective moves, and per layer and per micro-batch the bytes of
ftkit/comm.py's `tp_sp_collective_theory` and `tp_all_reduce_theory`, through assets/tp_comm_model.py.

    uv run python assets/tp_sp_layer.py        # writes assets/tp_sp_layer.png

`numbers()` returns what the figure shows, for tests/test_figure_tp_sp_layer.py.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402
from PIL import Image  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import tp_comm_model as model  # noqa: E402

from ftkit import comm  # noqa: E402

OUT = Path(__file__).with_suffix(".png")
WORLD = 2
# Each block's two collectives, in experiments/tp-sp-ft/train.py: (block, side, autograd Function, forward kind,
# backward kind, forward runs, backward runs) per micro-batch of a middle layer. Forward runs are 2 where the
# checkpointed layer's recompute repeats the collective; it stops before the MLP's exit, whose output nothing in the
# layer saves (torch.utils.checkpoint's early stop). None: the Function is the identity that way.
PLACES = {
    "tp": [
        ("attention", "entry", "f: CopyToTP", None, "all_reduce", 2, 1),
        ("attention", "exit", "g: ReduceFromTP", "all_reduce", None, 2, 1),
        ("mlp", "entry", "f: CopyToTP", None, "all_reduce", 2, 1),
        ("mlp", "exit", "g: ReduceFromTP", "all_reduce", None, 1, 1),
    ],
    "tp-sp": [
        ("attention", "entry", "GatherSeqToTP", "all_gather", "reduce_scatter", 2, 1),
        ("attention", "exit", "ReduceScatterSeqFromTP", "reduce_scatter", "all_gather", 2, 1),
        ("mlp", "entry", "GatherSeqToTP", "all_gather", "reduce_scatter", 2, 1),
        ("mlp", "exit", "ReduceScatterSeqFromTP", "reduce_scatter", "all_gather", 1, 1),
    ],
}
SHORT = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter"}


def collectives(mode: str, act: int) -> list[dict]:
    """The four places of `mode`, each with the kinds it issues and its buffer and wire bytes per run."""
    out = []
    for block, side, function, fwd, bwd, fwd_runs, bwd_runs in PLACES[mode]:
        runs = {}
        for kind, n in ((fwd, fwd_runs), (bwd, bwd_runs)):
            if kind:
                runs[kind] = runs.get(kind, 0) + n
        out.append(
            dict(
                block=block,
                side=side,
                function=function,
                forward=fwd,
                backward=bwd,
                forward_runs=fwd_runs,
                backward_runs=bwd_runs,
                runs=runs,
                buffer=act,
                wire={kind: comm.ring_wire_bytes(kind, act, WORLD) for kind in runs},
            )
        )
    return out


def numbers() -> dict:
    """Everything the figure shows. Per layer: one more decoder layer's bytes in the theory (layers 2 minus 1), so
    the edges (the embedding's side of layer 0, the lm_head's all-gather) stay out; per micro-batch: all 36 layers."""
    act = model.activation_bytes(model.script_args())
    out = {"activation_bytes": act, "world": WORLD, "layers": model.SHAPE.layers, "modes": {}}
    for mode in ("tp", "tp-sp", "tp-ft"):
        two, one = model.tp_micro_batch(mode, layers=2, world=WORLD), model.tp_micro_batch(mode, layers=1, world=WORLD)
        per_layer = {kind: two[kind] - one.get(kind, 0) for kind in two}
        whole = model.tp_micro_batch(mode, world=WORLD)
        out["modes"][mode] = {
            "per_layer": per_layer,
            "per_layer_wire": model.wire(per_layer, WORLD),
            "micro_batch": whole,
            "micro_batch_wire": model.wire(whole, WORLD),
            "collectives": collectives(mode, act) if mode in PLACES else None,
        }
    out["fsdp_micro_batch_wire"] = model.wire(model.fsdp_micro_batch(WORLD), WORLD)
    out["replicated_lora_bytes"] = model.replicated_lora_bytes(model.REFERENCE["lora_rank"])
    return out


def mb(b: float) -> str:
    return f"{b / 1e6:.1f} MB"


def gb(b: float) -> str:
    return f"{b / 1e9:.2f} GB"


# Each row: the norm, the entry collective, the column-parallel linears, the op between, the row-parallel linear,
# the exit collective, the residual add; x positions and widths.
X = {"norm": 0.0, "entry": 1.45, "col": 2.95, "op": 4.25, "row": 5.45, "exit": 6.95, "add": 8.2}
WIDTH = {"norm": 1.05, "entry": 1.3, "col": 1.25, "op": 0.9, "row": 1.05, "exit": 1.4, "add": 0.32}
ROWS = {
    "attention": {
        "norm": "input_layernorm\n(RMSNorm)",
        "col": "q_proj k_proj v_proj\ncolumn-parallel:\n16 of 32 query heads,\n4 of 8 KV heads",
        "op": "attention\non this\nGPU's heads",
        "row": "o_proj\nrow-parallel:\na partial sum",
    },
    "mlp": {
        "norm": "post_attention_\nlayernorm\n(RMSNorm)",
        "col": "gate_proj up_proj\ncolumn-parallel:\n4,864 of 9,728\ncolumns each",
        "op": "SiLU(gate)\nx up",
        "row": "down_proj\nrow-parallel:\na partial sum",
    },
}
FILL = {"norm": "#e8e8e8", "col": "#c6dbef", "row": "#c6dbef", "op": "#deebf7"}
COLL_FILL = {"all_reduce": "#fdd0a2", "all_gather": "#dadaeb", "reduce_scatter": "#dadaeb"}
H = 0.95  # box height


def box(ax, x, y, w, h, text, fill, size=7.5):
    ax.add_patch(
        FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.06", fc=fill, ec="#444")
    )
    ax.text(x, y, text, ha="center", va="center", fontsize=size)


def arrow(ax, x0, y0, x1, y1, color="#444"):
    ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops=dict(arrowstyle="->", color=color, lw=1.0))


def coll_text(c: dict) -> str:
    def way(kind, runs, name):
        if kind is None:
            return f"{name}: identity"
        return f"{name}: {SHORT[kind]}{f' x{runs}' if runs > 1 else ''}"

    sends = " / ".join(sorted({mb(w) for w in c["wire"].values()}))
    return "\n".join(
        [c["function"], way(c["forward"], c["forward_runs"], "fwd"), way(c["backward"], c["backward_runs"], "bwd"),
         f"sends {sends}"]
    )  # fmt: skip


def draw_row(ax, block: str, y: float, places: dict, shade: str) -> None:
    left, right = X["norm"] - 0.8, X["add"] + 0.75
    # outside the block (the norm, the residual stream) and inside it (split by heads / columns)
    ax.add_patch(plt.Rectangle((left, y - 0.72), X["entry"] - left, 1.3, fc=shade, ec="none", zorder=0))
    ax.add_patch(plt.Rectangle((X["exit"], y - 0.72), right - X["exit"], 1.3, fc=shade, ec="none", zorder=0))
    x0, x1 = X["col"] - 0.75, X["row"] + 0.68
    ax.add_patch(plt.Rectangle((x0, y - 0.6), x1 - x0, 1.2, fc="#f3f8fc", ec="#6baed6", ls="--", zorder=0))
    ax.text(x0 + 0.03, y + 0.63, f"{block} block: split over {WORLD} GPUs, every token", fontsize=7, va="bottom")
    for part in ("norm", "col", "op", "row"):
        box(ax, X[part], y, WIDTH[part], H, ROWS[block][part], FILL[part])
    for side in ("entry", "exit"):
        c = places[(block, side)]
        box(ax, X[side], y, WIDTH[side], H + 0.1, coll_text(c), COLL_FILL[c["forward"] or c["backward"]], size=6.8)
    ax.add_patch(plt.Circle((X["add"], y), 0.16, fc="white", ec="#444"))
    ax.text(X["add"], y, "+", ha="center", va="center", fontsize=11)
    order = ["norm", "entry", "col", "op", "row", "exit", "add"]
    arrow(ax, left + 0.05, y, X["norm"] - WIDTH["norm"] / 2, y)
    for a, b in zip(order, order[1:]):
        arrow(ax, X[a] + WIDTH[a] / 2, y, X[b] - WIDTH[b] / 2 - (0.0 if b != "add" else -0.01), y)
    arrow(ax, X["add"] + 0.16, y, right - 0.02, y)
    # the residual: around the block, to the add
    ax.plot([left + 0.2, left + 0.2, X["add"]], [y, y - 0.66, y - 0.66], color="#888", lw=0.9)
    arrow(ax, X["add"], y - 0.66, X["add"], y - 0.16, color="#888")
    ax.text(right - 0.02, y + 0.08, "to the MLP" if block == "attention" else "to the\nnext layer", fontsize=7,
            ha="right", va="bottom")  # fmt: skip


def draw(n: dict, out: Path) -> None:
    fig, axes = plt.subplots(2, 1, figsize=(11.5, 8))
    act, layers = n["activation_bytes"], n["layers"]
    titles = {
        "tp": "TP: Megatron's f and g  (tp-sp-ft --no-sequence-parallel; tp-ft's plan all-reduces module by module)",
        "tp-sp": "TP + SP  (tp-sp-ft, the default): f and g become all-gather / reduce-scatter pairs",
    }
    outside = {
        "tp": ("grey: replicated, every GPU holds all 2 x 2048 tokens", "#ececec"),
        "tp-sp": ("green: sequence shard, each GPU holds 2 x 1024 tokens", "#dff0d8"),
    }
    for ax, mode in zip(axes, ("tp", "tp-sp")):
        ax.set_xlim(-0.85, 9.0)
        ax.set_ylim(-0.95, 3.3)
        ax.axis("off")
        label, shade = outside[mode]
        ax.set_title(f"{titles[mode]}\n{label}", fontsize=9.5, loc="left")
        places = {(c["block"], c["side"]): c for c in n["modes"][mode]["collectives"]}
        draw_row(ax, "attention", 2.35, places, shade)
        draw_row(ax, "mlp", 0.55, places, shade)
        m = n["modes"][mode]
        counts = " + ".join(f"{b / act:.0f} {SHORT[k]}s" for k, b in m["per_layer"].items())
        summary = (
            f"Per layer and micro-batch: {counts}, each on one {mb(act)} activation [2, 2048, 2560] bf16; "
            f"each GPU sends {mb(m['per_layer_wire'])}.\nAll {layers} layers: {gb(m['micro_batch_wire'])} "
            "sent per GPU per micro-batch"
        )
        if mode == "tp":
            ft = n["modes"]["tp-ft"]
            summary += f" (tp-ft: {mb(ft['per_layer_wire'])} per layer, {gb(ft['micro_batch_wire'])})."
        else:
            summary += f" (fsdp-ft's weight gathers: {gb(n['fsdp_micro_batch_wire'])}, prefetchable)."
        ax.text(-0.8, -0.93, summary, fontsize=8, va="bottom")
    fig.text(
        0.01,
        0.004,
        f"Qwen3-4B on {WORLD} GPUs at the reference configuration: micro-batch 2 x 2048 tokens, bf16, checkpointing on "
        "(x2: the recompute runs it again).\nA model, not a measurement: ftkit/comm.py's theory, ring algorithms "
        "(assets/tp_comm_model.py). Orange: all-reduce; purple: all-gather, reduce-scatter; blue: this GPU's "
        "slice of the weights.",
        fontsize=7.2,
        color="#444",
    )
    fig.subplots_adjust(left=0.005, right=0.995, top=0.93, bottom=0.05, hspace=0.22)
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=110)
    plt.close(fig)
    # A palette of 128 colours (flat fills and anti-aliased text need no more): a third of the RGBA file's bytes.
    Image.open(buffer).convert("RGB").quantize(128, dither=Image.Dither.NONE).save(out, optimize=True)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    draw(numbers(), OUT)
    print(f"wrote {OUT}")
