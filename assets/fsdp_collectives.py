"""FSDP2's collectives along one micro-batch of experiments/fsdp-ft on Qwen3-4B, 2 GPUs, bf16 LoRA r16: writes
fsdp_collectives.png next to this file (quoted in blogs/fsdp.md).

A schematic, not a trace: no GPU ran fsdp-ft on two ranks for this project, and the committed runs record their
collectives per optimizer step, not one by one. What it draws:

- the order: FSDP2's schedule as torch 2.15 runs it (torch/distributed/fsdp/_fully_shard): every unit is
  all-gathered before its forward (the next layer's issued while the current one computes), the layers again
  before their backward (the root's pre-backward prefetches the last layer, each layer's the one before it),
  each layer's LoRA gradients reduce-scattered after its backward in the step's last micro-batch only
  (`set_requires_gradient_sync`); the root is not resharded after forward, so it is gathered once. Activation
  checkpointing's recompute runs inside the layer's backward, after its all-gather: no third gather;
- the bytes: each unit's, from Qwen3-4B's shape (`ftkit.memory.QWEN3_4B`), counted as `comm.gathered_bytes`
  counts them (floating parameters in --param-dtype, 4-bit codes as stored), the sums as `comm.fsdp_theory`
  states them;
- what each rank holds unsharded at each point: the root throughout, the running layer and the prefetched one
  (every layer gathered so far with --no-reshard-after-forward; the whole model, as one unit, with a --wrap-class
  that matches nothing).

tests/test_figure_fsdp_collectives.py checks these numbers against what was recorded: the comm recorder's
per-step bytes and counts in the CPU runs (devlogs/runs/fsdp-ft/, the tiny model) and in the fake-tensor runs at
Qwen3-4B's shape (devlogs/runs/realscale/fsdp-world*.json), and the unsharded bytes the memory tracker saw there.

    uv run python assets/fsdp_collectives.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ftkit.memory import QWEN3_4B, ModelShape, lora_params  # noqa: E402

OUT = Path(__file__).with_suffix(".png")
ROOT = Path(__file__).resolve().parents[1]
# fsdp-ft's step at Qwen3-4B's shape on fake tensors, 2 ranks, 4 micro-batches: its collectives as the comm recorder
# recorded them (bytes and counts per optimizer step; no times: the fake group returns at once).
RECORDED = ROOT / "devlogs" / "runs" / "realscale" / "fsdp-world2.json"
LAYOUTS = {  # layout -> (decoder layers are units of their own, reshard_after_forward of the layer units)
    "default": (True, True),
    "no-reshard": (True, False),  # --no-reshard-after-forward
    "wrong-wrap": (False, True),  # --wrap-class LlamaDecoderLayer: no unit but the root
}
GB = 1e9


def unit_bytes(
    shape: ModelShape = QWEN3_4B, lora_rank: int = 16, param_bytes: int = 2, reduce_bytes: int = 4, quant: str = "none"
) -> dict[str, int]:
    """What one all-gather of each unit carries (the gathered buffer, in --param-dtype; a 4-bit layer's codes as
    stored, two weights per byte), and what one layer's reduce-scatter carries (its LoRA gradients, in
    --reduce-dtype). The root: the (tied) embedding and the final norm."""
    lora = lora_params(shape, lora_rank) // shape.layers
    linear = shape.linear_params() // 2 if quant == "nf4" else shape.linear_params() * param_bytes
    embeddings = shape.embedding_params() * (1 if shape.tied_embeddings else 2)
    return {
        "root": (embeddings + shape.hidden) * param_bytes,
        "layer": linear + (shape.norm_params() + lora) * param_bytes,
        "layer_grads": lora * reduce_bytes,
        "layers": shape.layers,
    }


def micro_batch(layout: str = "default", sync: bool = True, **unit_args) -> dict:
    """One micro-batch on one rank, slot by slot: `compute` (slot, label, phase) - the embedding, each layer's
    forward, the head (final norm, lm_head, loss) forward, its backward, each layer's recompute + backward;
    `all_gather` and `reduce_scatter` (slot drawn, unit, bytes, phase) in the order FSDP2 issues them, each drawn in
    the slot it overlaps; `held` the bytes held unsharded during each compute slot. `sync`: the step's last
    micro-batch, the one that reduce-scatters."""
    units, reshard = LAYOUTS[layout]
    b = unit_bytes(**unit_args)
    n, root, layer = b["layers"], b["root"], b["layer"]
    if not units:  # the root is the only unit: the whole model, its LoRA gradients in one reduce-scatter
        root, layer = root + n * layer, 0
    fwd = {i: i + 1 for i in range(n)}  # layer -> its forward's slot
    head_fwd, head_bwd = n + 1, n + 2
    bwd = {i: head_bwd + n - i for i in range(n)}  # layer -> its backward's slot
    compute = [(0, "embed", "forward")]
    compute += [(fwd[i], f"L{i}", "forward") for i in range(n)]
    compute += [(head_fwd, "head", "forward"), (head_bwd, "head", "backward")]
    compute += [(bwd[i], f"L{i}", "backward") for i in reversed(range(n))]
    all_gather = [(-1, "root", root, "forward")]
    reduce_scatter = []
    if units:
        all_gather += [(fwd[i] - 1, f"L{i}", layer, "forward") for i in range(n)]
        if reshard:
            all_gather.append((head_bwd, f"L{n - 1}", layer, "backward"))  # the root's pre-backward prefetch
        for i in reversed(range(n)):
            if reshard and i > 0:  # layer i's pre-backward prefetches layer i - 1
                all_gather.append((bwd[i], f"L{i - 1}", layer, "backward"))
            if sync:  # after layer i's backward
                reduce_scatter.append((bwd[i] + 1, f"L{i}", b["layer_grads"], "backward"))
    elif sync:
        reduce_scatter.append((bwd[0] + 1, "root", n * b["layer_grads"], "backward"))

    def layers_held(slot: int) -> int:
        """Decoder layers held unsharded during compute slot `slot`."""
        if not units:
            return 0
        if slot < head_fwd:  # the embedding (slot 0) or layer slot - 1: it and the next layer, prefetched
            gathered_so_far = min(slot + 1, n)
            return gathered_so_far if not reshard else 1 + (0 < slot < n)
        if slot == head_fwd:  # the loss: resharded, the last layer was freed after its forward
            return n if not reshard else 0
        if slot == head_bwd:  # the last layer, prefetched by the root's pre-backward
            return n if not reshard else 1
        i = head_bwd + n - slot  # layer i's backward: it and layer i - 1, prefetched; later layers freed
        return i + 1 if not reshard else 1 + (i > 0)

    held = [root + layer * layers_held(s) for s, _, _ in compute]
    return {
        "layout": layout,
        "units": b,
        "compute": compute,
        "all_gather": all_gather,
        "reduce_scatter": reduce_scatter,
        "held": held,
    }


def per_step(layout: str = "default", micro_steps: int = 1, **unit_args) -> dict[str, dict[str, int]]:
    """Bytes and count of each collective kind in one optimizer step of `micro_steps` micro-batches per rank, from
    the micro-batches above: what the comm recorder records per step (`comm` in metrics.jsonl)."""
    mbs = [micro_batch(layout, sync=j == micro_steps - 1, **unit_args) for j in range(micro_steps)]
    return {
        kind: {"bytes": sum(e[2] for mb in mbs for e in mb[kind]), "count": sum(len(mb[kind]) for mb in mbs)}
        for kind in ("all_gather", "reduce_scatter")
    }


def numbers() -> dict:
    """Everything the figure shows: Qwen3-4B, bf16 params, fp32 reduce, 2 GPUs, the step's last micro-batch."""
    mbs = {layout: micro_batch(layout) for layout in LAYOUTS}
    d = mbs["default"]
    b = d["units"]
    frozen = QWEN3_4B.n_params() * 2  # the base, stored in bf16
    lora = lora_params(QWEN3_4B, 16) * 4  # the adapters, stored in fp32; each rank holds half of both
    run = json.loads(RECORDED.read_text())
    return {
        "recorded": {
            "micro_steps": run["config"]["micro_steps_run"],
            "bytes": run["collective_bytes"],
            "counts": run["collective_counts"],
        },
        "micro_batches": mbs,
        "root_bytes": b["root"],
        "layer_bytes": b["layer"],
        "layer_grad_bytes": b["layer_grads"],
        "forward_all_gathers": sum(1 for e in d["all_gather"] if e[3] == "forward"),
        "forward_bytes": sum(e[2] for e in d["all_gather"] if e[3] == "forward"),
        "backward_all_gathers": sum(1 for e in d["all_gather"] if e[3] == "backward"),
        "backward_bytes": sum(e[2] for e in d["all_gather"] if e[3] == "backward"),
        "reduce_scatters": len(d["reduce_scatter"]),
        "reduce_scatter_bytes": sum(e[2] for e in d["reduce_scatter"]),
        "gathered_per_micro_batch": {k: sum(e[2] for e in m["all_gather"]) for k, m in mbs.items()},
        "all_gathers_per_micro_batch": {k: len(m["all_gather"]) for k, m in mbs.items()},
        "held_max": {k: max(m["held"]) for k, m in mbs.items()},
        "shard_bytes_per_rank": (frozen + lora) // 2,
        "world": 2,
    }


COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "root": "#24416b", "rs": "#55a868", "head": "#8c8c8c"}


def plot(n: dict, path: Path) -> None:
    d = n["micro_batches"]["default"]
    layers = d["units"]["layers"]
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(12.5, 7.2), sharex=True, gridspec_kw={"height_ratios": [1.15, 1]}, layout="constrained"
    )
    for slot, label, phase in d["compute"]:
        color = COLORS["head"] if label in ("head", "embed") else COLORS[phase]
        top.barh(2, 0.9, left=slot + 0.05, height=0.6, color=color, alpha=0.35, linewidth=0)
        if label in ("embed", "head", "L0", f"L{layers - 1}"):
            top.text(slot + 0.5, 2, label, ha="center", va="center", fontsize=6.5, rotation=90)
    for slot, unit, _, phase in d["all_gather"]:
        color = COLORS["root"] if unit == "root" else COLORS[phase]
        top.barh(1, 0.9, left=slot + 0.05, height=0.6, color=color, linewidth=0)
    for slot, *_ in d["reduce_scatter"]:
        top.barh(0, 0.9, left=slot + 0.05, height=0.3, color=COLORS["rs"], linewidth=0)
    fwd_end = layers  # the slot of the last forward all-gather
    top.annotate(
        f"root {n['root_bytes'] / GB:.2f} GB",
        (-0.5, 1.3),
        (-0.5, 1.62),
        fontsize=7.5,
        ha="left",
        arrowprops=dict(arrowstyle="-", lw=0.6),
    )
    top.text(
        fwd_end / 2,
        0.55,
        f"forward: {n['forward_all_gathers']} all-gathers, {n['forward_bytes'] / GB:.2f} GB (the whole model, bf16;\n"
        f"each layer {n['layer_bytes'] / 1e6:.1f} MB), the next layer's issued while the current one computes",
        ha="center",
        va="center",
        fontsize=7.5,
    )
    top.text(
        fwd_end + 2 + layers / 2,
        0.55,
        f"backward: {n['backward_all_gathers']} all-gathers, {n['backward_bytes'] / GB:.2f} GB: every layer again "
        "(resharded after forward);\nthe recompute of checkpointing runs after it, with no gather of its own",
        ha="center",
        va="center",
        fontsize=7.5,
    )
    top.text(
        fwd_end + 3,
        -0.5,
        f"{n['reduce_scatters']} reduce-scatters of the LoRA gradients, fp32: {n['reduce_scatter_bytes'] / 1e6:.0f} MB"
        f" ({n['layer_grad_bytes'] / 1e6:.2f} MB a layer),\nafter each layer's backward, in the step's last "
        "micro-batch only (the ones before it accumulate)",
        fontsize=7.5,
        va="center",
    )
    rec = n["recorded"]
    top.text(
        -1,
        -0.5,
        "Recorded at this shape (ftkit.realscale, fake tensors, 2 ranks), "
        f"a step of {rec['micro_steps']} micro-batches:\n"
        f"{rec['counts']['all_gather']} all-gathers, {rec['bytes']['all_gather'] / GB:.2f} GB "
        f"({rec['micro_steps']} x the ones above); {rec['counts']['reduce_scatter']} reduce-scatters, "
        f"{rec['bytes']['reduce_scatter'] / 1e6:.0f} MB",
        fontsize=7.5,
        va="center",
        color="#333333",
    )
    top.set_yticks([2, 1, 0], ["compute", "all-gather\n(bf16)", "reduce-scatter\n(fp32)"], fontsize=8)
    top.set_ylim(-0.85, 2.45)
    top.axvline(layers + 2, color="black", lw=0.6, ls=":")
    top.set_title(
        f"Schematic: one micro-batch of fsdp-ft on Qwen3-4B, {n['world']} GPUs, per rank - "
        f"{n['all_gathers_per_micro_batch']['default']} all-gathers, "
        f"{n['gathered_per_micro_batch']['default'] / GB:.2f} GB, against "
        f"{n['reduce_scatter_bytes'] / 1e6:.0f} MB of gradients (order: FSDP2's schedule; bytes: the model's shape)",
        fontsize=9,
    )
    styles = {
        "default": ("default (reshard after forward)", "#4c72b0", "-"),
        "no-reshard": ("--no-reshard-after-forward", "#c44e52", "--"),
        "wrong-wrap": ("--wrap-class LlamaDecoderLayer (no unit matches)", "#8172b3", ":"),
    }
    for layout, m in n["micro_batches"].items():
        label, color, ls = styles[layout]
        xs = [s for s, _, _ in m["compute"]]
        ys = [h / GB for h in m["held"]]
        gathered = n["gathered_per_micro_batch"][layout] / GB
        count = n["all_gathers_per_micro_batch"][layout]
        bottom.step(
            [*xs, xs[-1] + 1],
            [*ys, ys[-1]],
            where="post",
            color=color,
            ls=ls,
            lw=1.6,
            label=f"{label}: {count} all-gather{'s' if count > 1 else ''}, {gathered:.2f} GB; "
            f"holds up to {max(m['held']) / GB:.2f} GB",
        )
    shards = n["shard_bytes_per_rank"] / GB
    bottom.axhline(shards, color="gray", lw=0.8, ls="-.")
    bottom.text(
        1, shards + 0.12, f"resident shards, every layout: {shards:.2f} GB per GPU", fontsize=7.5, color="dimgray"
    )
    bottom.set_ylabel("held unsharded, GB per GPU", fontsize=8.5)
    bottom.set_ylim(0, 12.2)
    bottom.legend(fontsize=7.5, loc="upper left", framealpha=0.95)
    bottom.set_title(
        "Schematic: the weights each rank holds gathered along the same micro-batch, on top of its shards",
        fontsize=9,
    )
    ticks = [(1, "L0"), (1 + layers // 2, f"L{layers // 2}"), (layers, f"L{layers - 1}")]
    ticks += [(layers + 3, f"L{layers - 1}"), (layers + 3 + layers // 2 - 1, f"L{layers // 2}"), (2 * layers + 2, "L0")]
    bottom.set_xticks([t + 0.5 for t, _ in ticks], [label for _, label in ticks], fontsize=8)
    bottom.set_xlabel(
        "the micro-batch, unit by unit (not to time scale): forward left of the dotted line, backward right of it",
        fontsize=8.5,
    )
    bottom.axvline(layers + 2, color="black", lw=0.6, ls=":")
    bottom.set_xlim(-1.2, 2 * layers + 4.2)
    fig.savefig(path, dpi=120)


def main() -> None:
    n = numbers()
    plot(n, OUT)
    print(f"wrote {OUT}")
    for key in ("root_bytes", "layer_bytes", "layer_grad_bytes", "forward_bytes", "backward_bytes"):
        print(f"  {key}: {n[key]:,}")
    for layout in LAYOUTS:
        print(
            f"  {layout}: {n['all_gathers_per_micro_batch'][layout]} all-gathers, "
            f"{n['gathered_per_micro_batch'][layout]:,} B per micro-batch; holds up to {n['held_max'][layout]:,} B"
        )


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
