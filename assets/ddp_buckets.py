"""DDP's gradient buckets for Qwen3-4B's LoRA adapters and how their all-reduces overlap the backward pass: a
schematic from the code's own numbers, not a measurement. Writes ddp_buckets.png next to this file (blogs/ddp.md).

    uv run python assets/ddp_buckets.py            # the figure, and its numbers printed
    uv run python assets/ddp_buckets.py --check    # first checks the buckets and the gradient order against DDP

What comes from where:
- Bucket contents: torch's own rule (`bucket_assignment`, which the test checks against
  torch.distributed._compute_bucket_assignment_by_size, the function DDP's reducer calls) with the installed
  torch's caps (25 MiB, a 1 MiB first bucket), applied to the LoRA gradients at Qwen3-4B's shape in the order
  they become ready in the backward pass: the reverse of the parameters' order. In torch 2.15 DDP's first
  backward has no buckets yet (one all-reduce of every gradient, after the backward; the committed runs show one
  all-reduce there); it records the order and rebuilds the buckets in it before the next forward. `--check` runs
  DDP itself (one gloo rank) on parameters of these shapes and reads the buckets it rebuilt, and records the
  order on the tiny Qwen3 with the scripts' own LoRA.
- Compute: the FLOPs of each layer's backward with activation checkpointing (the recompute of its forward, then
  each projection's input gradient and its adapter's gradients, and attention), for one micro-batch of the
  reference configuration on one rank at its cap (2 rows of 2048 tokens; the packed reference micro-batches on 2
  ranks average about 3,200 real tokens), at the DDP post's ASSUMED 30% MFU on an H100
  (assets/ddp_comm_model.py). MFU counts the model FLOPs of ftkit/metrics.py's convention (the lm_head at the
  answer positions only), without the recompute; the step really does 1.49 times those (FlopCounterMode's count
  at Qwen3-4B's shape, devlogs/runs/realscale/ddp-world2.json, over its convention at logits), so 30% MFU is 45%
  of the peak in the FLOPs drawn here, and such a full micro-step takes 0.23 s.
- All-reduce: the ring's bandwidth term at PCIe Gen4's peak (ftkit/comm.py ring_wire_bytes, ftkit/hardware.py),
  as in the post's table; one bucket at a time, in order, each from the moment its last gradient is ready.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch.distributed as dist  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from torch.nn.parallel import distributed as ddp_module  # noqa: E402

from ftkit import comm, hardware  # noqa: E402
from ftkit.lora import LORA_TARGETS  # noqa: E402
from ftkit.memory import QWEN3_4B, ModelShape  # noqa: E402

OUT = Path(__file__).with_suffix(".png")
LORA_RANK = 16
SEQ, MICRO_BATCH = 2048, 2  # the reference configuration (ftkit/cli.py REAL): one micro-batch on one rank
WORLD = 2
LINK = "pcie4"
ASSUMED_MFU = 0.3  # the post's (assets/ddp_comm_model.py)
GPU = "h100-sxm"
# The FLOPs the step runs, recompute included, over the MFU convention's, at Qwen3-4B's shape (ftkit.realscale).
REALSCALE = Path(__file__).resolve().parents[1] / "devlogs" / "runs" / "realscale" / "ddp-world2.json"
# DDP's caps in the installed torch: 25 MiB buckets, a 1 MiB first one (the gradients that are ready first).
BUCKET_CAP_BYTES = ddp_module._DEFAULT_BUCKET_CAP_MB * 2**20
FIRST_BUCKET_BYTES = dist._DEFAULT_FIRST_BUCKET_BYTES
GRAD_BYTES = 4  # fp32 LoRA gradients


def lora_tensors(shape: ModelShape = QWEN3_4B, rank: int = LORA_RANK) -> list[tuple[int, str, str, int]]:
    """(layer, projection, "A" or "B", elements) of every LoRA weight, in the model's parameter order: layer by
    layer, the projections in Qwen3's order, lora_A (rank x in) before lora_B (out x rank)."""
    out = []
    for layer in range(shape.layers):
        for name in LORA_TARGETS:
            n_in, n_out = shape.linears()[name]
            out += [(layer, name, "A", rank * n_in), (layer, name, "B", n_out * rank)]
    return out


def ready_order(shape: ModelShape = QWEN3_4B, rank: int = LORA_RANK) -> list[tuple[int, str, str, int]]:
    """The order the gradients become ready in the backward pass, and so the order DDP rebuilds its buckets in:
    the reverse of the parameters' order (last layer first; down_proj's B, then its A, ..., q_proj's A)."""
    return lora_tensors(shape, rank)[::-1]


def bucket_assignment(sizes: list[int], limits: list[int]) -> list[list[int]]:
    """DDP's bucketing (compute_bucket_assignment_by_size): tensors in the given order join the open bucket, which
    closes as soon as it holds at least its limit; the first bucket takes the first limit, every later one the
    next, the last limit repeating. One dtype and device here, so one sequence of buckets."""
    buckets, current, total = [], [], 0
    for i, size in enumerate(sizes):
        current.append(i)
        total += size
        if total >= limits[min(len(buckets), len(limits) - 1)]:
            buckets.append(current)
            current, total = [], 0
    if current:
        buckets.append(current)
    return buckets


def backward_segments(shape: ModelShape = QWEN3_4B, rank: int = LORA_RANK) -> list[tuple[int, str, float]]:
    """(layer, part, FLOPs) of the backward pass through the decoder layers, in the order it runs them: per layer
    the checkpointed forward's recompute, then each projection's gradients (input gradient of the frozen weight,
    the adapter's two weight gradients and its input gradient) with attention's between o_proj and v_proj.
    Per token: 2 FLOPs per weight for a forward matmul, 2 for the frozen weight's input gradient, 4 for a
    trained one; attention 2*d*s per token forward and twice that backward (causal: ftkit/metrics.py's
    6*d*s^2 per sequence for both)."""
    tokens, d = MICRO_BATCH * SEQ, shape.q_dim
    dims = shape.linears()
    lora = {name: rank * (n_in + n_out) for name, (n_in, n_out) in dims.items()}
    weights = {name: n_in * n_out for name, (n_in, n_out) in dims.items()}
    attention_forward = 2 * d * SEQ * SEQ * MICRO_BATCH
    recompute = 2 * tokens * (sum(weights.values()) + sum(lora.values())) + attention_forward
    order = [n for n in ("down_proj", "up_proj", "gate_proj", "o_proj") if n in LORA_TARGETS]
    order += ["attention"] + [n for n in ("v_proj", "k_proj", "q_proj") if n in LORA_TARGETS]
    segments = []
    for layer in reversed(range(shape.layers)):
        segments.append((layer, "recompute", float(recompute)))
        for part in order:
            flops = 2 * attention_forward if part == "attention" else tokens * (2 * weights[part] + 4 * lora[part])
            segments.append((layer, part, float(flops)))
    return segments


def run_over_convention() -> float:
    counted = json.loads(REALSCALE.read_text())
    return counted["flops_counted_with_recompute"] / counted["flops_convention_at_logits"]


def timeline() -> dict:
    """Everything the figure draws, in seconds from the start of the backward through the decoder layers."""
    flops_per_s = ASSUMED_MFU * hardware.gpu(GPU).bf16_flops * run_over_convention()
    link = hardware.LINKS[LINK]
    seconds, t = [], 0.0  # (layer, part, start, end)
    for layer, part, flops in backward_segments():
        seconds.append((layer, part, t, t + flops / flops_per_s))
        t += flops / flops_per_s
    end_of = {(layer, part): b for layer, part, _, b in seconds}
    order = ready_order()
    sizes = [n * GRAD_BYTES for *_, n in order]

    def all_reduce_s(size: int) -> float:
        return comm.ring_wire_bytes("all_reduce", size, WORLD) / link.bytes_per_s

    buckets, free = [], 0.0
    for indices in bucket_assignment(sizes, [FIRST_BUCKET_BYTES, BUCKET_CAP_BYTES]):
        last = order[indices[-1]]
        ready = end_of[(last[0], last[1])]  # its last gradient: the end of that projection's backward
        start = max(ready, free)  # one bucket at a time, in order
        free = start + all_reduce_s(sum(sizes[i] for i in indices))
        layers = [order[i][0] for i in indices]
        buckets.append(
            dict(bytes=sum(sizes[i] for i in indices), tensors=len(indices), layers=(max(layers), min(layers)))
        )
        buckets[-1].update(ready_s=ready, start_s=start, end_s=free)
    backward = t
    first = dict(bytes=sum(sizes), tensors=len(sizes), start_s=backward, end_s=backward + all_reduce_s(sum(sizes)))
    return dict(
        segments=seconds,
        backward_s=backward,
        first_step=first,
        buckets=buckets,
        exposed_first_step_s=first["end_s"] - backward,
        exposed_rebuilt_s=buckets[-1]["end_s"] - backward,
        link=LINK,
        world=WORLD,
    )


def check_against_ddp() -> None:
    """The buckets DDP itself builds for parameters of these shapes (one gloo rank; gradients in reverse parameter
    order, as in the model), from its logging data, and the gradient order on the tiny Qwen3 with the scripts'
    LoRA and checkpointing. Slow (seconds, and ~0.5 GB of memory): run with --check."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    class Adapters(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.empty(n)) for *_, n in lora_tensors())

        def forward(self, x):
            for p in self.ps:  # a chain, so backward reaches the parameters in reverse order
                x = x + p[0]
            return x.sum()

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = DDP(Adapters())
        recorder = comm.CommRecorder(torch.device("cpu"))
        comm.register_ddp_hook(model, recorder)
        counts = []
        for _ in range(3):
            model(torch.zeros(1)).backward()
            counts.append(recorder.take()["all_reduce"]["count"])
        rebuilt = [int(s) for s in model._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(",")]
    finally:
        dist.destroy_process_group()
    derived = [b["bytes"] for b in timeline()["buckets"]]
    assert counts == [1, len(derived), len(derived)], counts
    assert rebuilt == derived, (rebuilt, derived)
    print(f"DDP: {counts} all-reduces in backward 1-3; rebuilt bucket bytes {rebuilt}: the figure's")

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ftkit import lora, models

    tiny = Qwen3ForCausalLM(Qwen3Config(vocab_size=512, **models.TINY_CONFIG))
    tiny = lora.apply_lora(lora.freeze_base(tiny, True), LORA_RANK, 32, 0.0, 0)
    tiny.train()
    names = {p: n for n, p in tiny.named_parameters() if p.requires_grad}
    seen = []
    for p in names:
        p.register_post_accumulate_grad_hook(lambda p: seen.append(names[p]))
    ids = torch.randint(0, 512, (2, 32))
    tiny(input_ids=ids, labels=ids).loss.backward()
    assert seen == list(names.values())[::-1], seen[:4]
    # ... and the parameters' order is lora_tensors' (layer, projection, A before B), element counts included.
    parsed = [(int(n.split(".layers.")[1].split(".")[0]), n.split(".")[-4], n.split(".")[-3][-1]) for n in seen[::-1]]
    sizes = [p.numel() for p in list(names)]
    expected = lora_tensors(ModelShape.from_config(tiny.config), LORA_RANK)
    assert [(*k, n) for k, n in zip(parsed, sizes)] == expected, (parsed[:3], expected[:3])
    print(f"tiny Qwen3 + LoRA, non-reentrant checkpointing: {len(seen)} gradients ready in reverse parameter order")


def draw(t: dict, out: Path = OUT) -> None:
    ms = 1e3
    end = t["backward_s"] * ms
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3.2, 1]}, sharey=True)
    rows = {"compute": 2, "first": 1, "rebuilt": 0}
    shades = ("#9DB4D3", "#C9D7EA")
    for a in (ax, zoom):
        for layer, part, t0, t1 in t["segments"]:
            color = "#E3C18B" if part == "recompute" else shades[layer % 2]
            a.add_patch(Rectangle((t0 * ms, rows["compute"] - 0.3), (t1 - t0) * ms, 0.6, color=color, lw=0))
        f = t["first_step"]
        a.add_patch(
            Rectangle((f["start_s"] * ms, rows["first"] - 0.25), (f["end_s"] - f["start_s"]) * ms, 0.5, color="#C44E52")
        )
        for b in t["buckets"]:
            a.add_patch(
                Rectangle(
                    (b["start_s"] * ms, rows["rebuilt"] - 0.25), (b["end_s"] - b["start_s"]) * ms, 0.5, color="#55A868"
                )
            )
        a.axvline(end, color="0.3", lw=0.8, ls="--")
    for layer, part, t0, _ in t["segments"]:
        if part == "recompute" and layer % 5 == 0 or part == "recompute" and layer == 35:
            ax.text(t0 * ms, rows["compute"] + 0.38, f"L{layer}", fontsize=7, ha="left")
    for k, b in enumerate(t["buckets"]):
        hi, lo = b["layers"]
        where = f"layer {hi}" if hi == lo else f"layers {hi}-{lo}"
        ax.annotate(
            f"{b['bytes'] / 2**20:.2f} MiB\n{where}",
            (b["start_s"] * ms, rows["rebuilt"] + 0.25),
            (b["start_s"] * ms, rows["rebuilt"] + 0.55),
            fontsize=7,
            ha="left" if k == 0 else "center",
            arrowprops=dict(arrowstyle="-", lw=0.6),
        )
    ax.annotate(
        f"one all-reduce of all {t['first_step']['bytes'] / 2**20:.0f} MiB, after the backward",
        (t["first_step"]["start_s"] * ms, rows["first"]),
        (end * 0.45, rows["first"] + 0.05),
        fontsize=8,
        va="center",
        arrowprops=dict(arrowstyle="->", lw=0.7),
    )
    ax.set_xlim(0, t["first_step"]["end_s"] * ms + 3)
    ax.set_xlabel("ms from the start of the backward through the 36 decoder layers (last micro-step)")
    ax.set_yticks(list(rows.values()))
    ax.set_yticklabels(
        [
            "backward (compute),\nlayer 35 -> 0",
            "all-reduce, step 1:\nno buckets yet",
            "all-reduce, step 2 on:\nrebuilt buckets",
        ],
        fontsize=8,
    )
    ax.set_ylim(-0.6, 2.75)
    ax.set_title(
        f"Qwen3-4B LoRA r{LORA_RANK} gradients on {t['world']} GPUs over PCIe Gen4: "
        f"{len(t['buckets'])} buckets from step 2",
        fontsize=10,
    )
    zoom.set_xlim(end - 7, t["first_step"]["end_s"] * ms + 1.2)
    for layer, part, t0, t1 in t["segments"]:
        if layer == 0 and part not in ("recompute",) and t1 - t0 > 0.0004:
            zoom.text(
                (t0 + t1) / 2 * ms,
                rows["compute"],
                part.replace("_proj", ""),
                fontsize=6,
                ha="center",
                va="center",
                rotation=90,
            )
    layer0 = min(t0 for layer, _, t0, _ in t["segments"] if layer == 0)
    zoom.text(layer0 * ms, rows["compute"] + 0.38, "L0", fontsize=7)
    exposed = ((rows["first"], t["exposed_first_step_s"]), (rows["rebuilt"], t["exposed_rebuilt_s"]))
    for y, s in exposed:
        zoom.text(end + s * ms + 0.15, y, f"{s * ms:.2f} ms\nafter the\nbackward", fontsize=7, va="center")
    last = t["buckets"][-1]
    zoom.text(
        last["start_s"] * ms - 0.2,
        rows["rebuilt"] + 0.32,
        f"last bucket {last['bytes'] / 2**20:.2f} MiB",
        fontsize=7,
        ha="right",
    )
    zoom.set_xlabel("ms (zoom on the end)")
    zoom.set_title("what the step waits for", fontsize=10)
    legend = [
        ("backward, one shade per layer", shades[0]),
        ("recompute (checkpointing)", "#E3C18B"),
        ("all-reduce, one bucket", "#C44E52"),
        ("all-reduce, rebuilt buckets", "#55A868"),
    ]
    ax.legend(
        [Rectangle((0, 0), 1, 1, color=c) for _, c in legend],
        [n for n, _ in legend],
        fontsize=7,
        ncol=4,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.16),
        frameon=False,
    )
    fig.text(
        0.01,
        0.01,
        "Schematic, not measured. Buckets: torch 2.15's rule and caps (checked against DDP). "
        f"Compute: FLOPs at an assumed {ASSUMED_MFU:.0%} MFU on an H100. "
        "All-reduce: ring bandwidth term at PCIe Gen4 peak (31.5 GB/s).",
        fontsize=7,
        color="0.3",
    )
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(check: bool = False) -> None:
    if check:
        check_against_ddp()
    t = timeline()
    print(f"backward through the layers: {t['backward_s'] * 1e3:.1f} ms ({len(t['segments'])} segments)")
    f = t["first_step"]
    print(f"step 1: one all-reduce of {f['bytes']:,} B, {(f['end_s'] - f['start_s']) * 1e3:.2f} ms after it")
    for k, b in enumerate(t["buckets"]):
        print(
            f"bucket {k}: {b['bytes']:,} B ({b['bytes'] / 2**20:.2f} MiB), {b['tensors']} tensors, layers "
            f"{b['layers'][0]}-{b['layers'][1]}, ready {b['ready_s'] * 1e3:.1f} ms, "
            f"all-reduced {b['start_s'] * 1e3:.2f}-{b['end_s'] * 1e3:.2f} ms"
        )
    print(
        f"exposed: step 1 {t['exposed_first_step_s'] * 1e3:.2f} ms, from step 2 {t['exposed_rebuilt_s'] * 1e3:.2f} ms"
    )
    draw(t)
    print(f"{OUT} written")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="first check the bucket rule against torch's DDP")
    main(parser.parse_args().check)
