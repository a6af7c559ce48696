"""Memory over one optimizer step of single-gpu-ft (QLoRA) at Qwen3-4B's shape, measured by `ftkit.realscale`:
writes devlogs/runs/realscale/memory-over-step/memory-over-step.json and assets/memory_over_step.png, the picture
of blogs/what-fills-gpu-memory.md's "Activation checkpointing": backward's two peaks, at the loss and in the first
recomputed layer.

It runs realscale's own measurement (`ftkit.realscale.measure.measure`, the same run as `python -m ftkit.realscale`
with the same flags) and records the memory tracker's snapshot (the total and each category) after every op it
tracks, with the step's events: the micro-steps, the loss, each decoder layer's backward (the first one, the last
layer, is also the first recomputed), the optimizer step. The recorder patches realscale's tracker only inside this
script (`recording`); `python -m ftkit.realscale` runs without it. The drawn step is the last one tracked: the first
optimizer step creates AdamW's state lazily, in its `optimizer.step()`, so only the second holds it throughout.

    uv run python assets/memory_over_step.py                      # the reference configuration (~5 minutes)
    uv run python assets/memory_over_step.py --layers 2 --max-length 128 --no-write   # a quick check
    uv run python assets/memory_over_step.py --draw-only      # redraw the PNG from the committed JSON

Any other flags are realscale's (`python -m ftkit.realscale --help`); the defaults are the reference configuration:
--technique single --quant nf4 --micro-steps 2 (the script's micro-batch 2 x 2048 tokens, LoRA r=16 with dropout
0.05, checkpointing on every layer; 2 of the step's 8 accumulation micro-steps, as devlogs/runs/realscale's
single-nf4-world1.json: the 3rd to 8th repeat the 2nd).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
import time
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parent.parent
# In a folder of its own: devlogs/runs/realscale/*.json are realscale's own runs, which tests and
# assets/real_scale_table.py read as such.
JSON = ROOT / "devlogs" / "runs" / "realscale" / "memory-over-step" / "memory-over-step.json"
PNG = ROOT / "assets" / "memory_over_step.png"
REFERENCE = ["--technique", "single", "--quant", "nf4", "--micro-steps", "2"]
CATEGORIES = ("Parameter", "Buffer", "Other", "Optstate", "Gradient", "Activation", "Temp")  # stacked bottom up
COLOURS = dict(
    Parameter="#4c72b0",
    Buffer="#937860",
    Other="#8da0cb",
    Optstate="#dd8452",
    Gradient="#c44e52",
    Activation="#8172b3",
    Temp="#ccb974",
)
LEGEND = dict(
    Parameter="parameters (NF4 base, LoRA)",
    Buffer="buffers",
    Other="other (NF4 constants, batch)",
    Optstate="AdamW state",
    Gradient="gradients",
    Activation="activations",
    Temp="backward temporaries",
)
BINS = 400  # the samples kept: each bin's maximum and minimum total
ZOOM_BINS = 300
GIB = 2**30
LAYER = re.compile(r"\.layers\.(\d+)$")


class Recorder:
    """Every op's snapshot while the tracked steps run: (total, categories, in backward, decoder layer or -1), and
    the events, each at the index of the next sample."""

    def __init__(self):
        self.samples: list[tuple] = []
        self.events: list[tuple[str, int]] = []
        self.active = False

    def mark(self, name: str) -> None:
        if self.active:
            self.events.append((name, len(self.samples)))

    def snapshot(self, tracker) -> None:
        layers = [int(m.group(1)) for p in tracker._mod_tracker.parents if (m := LAYER.search(p))]
        backward = torch._C._current_graph_task_id() != -1
        for snap in tracker._curr_mem_snap.values():  # one device
            cats = tuple(snap.get(c, 0) for c in CATEGORIES)
            self.samples.append((snap["Total"], cats, backward, max(layers, default=-1)))


@contextlib.contextmanager
def recording(recorder: Recorder):
    """realscale's tracker and step with `recorder` watching: the tracker's per-op peak update also records the
    snapshot, and the step's parts mark their events. Only inside this context."""
    from ftkit import batching
    from ftkit.realscale import measure, step, trackers

    def watch(name, fn, before=True):
        def wrapped(*args, **kwargs):
            recorder.mark(f"{name} start" if not before else name)
            out = fn(*args, **kwargs)
            if not before:
                recorder.mark(f"{name} end")
            return out

        return wrapped

    update = trackers.RunPeakOnly._update_peak_stats

    def update_and_record(self, peak_state):
        update(self, peak_state)
        recorder.snapshot(self)

    tracked = measure.tracked_steps

    def tracked_steps(*args, **kwargs):
        recorder.active = True
        try:
            return tracked(*args, **kwargs)
        finally:
            recorder.active = False

    T = step.TrainingStep
    with (
        mock.patch.object(trackers.RunPeakOnly, "_update_peak_stats", update_and_record),
        mock.patch.object(measure, "tracked_steps", tracked_steps),
        mock.patch.object(T, "optimizer_step_of_micro_steps", watch("step", T.optimizer_step_of_micro_steps, False)),
        mock.patch.object(T, "micro_step", watch("micro-step", T.micro_step, False)),
        mock.patch.object(T, "optimizer_step", watch("optimizer step", T.optimizer_step, False)),
        mock.patch.object(batching, "token_loss_sum", watch("loss", batching.token_loss_sum)),
        mock.patch.object(torch.Tensor, "backward", watch("backward", torch.Tensor.backward)),
    ):
        yield recorder


def spans(events: list[tuple[str, int]], name: str) -> list[tuple[int, int]]:
    starts = [i for n, i in events if n == f"{name} start"]
    ends = [i for n, i in events if n == f"{name} end"]
    return list(zip(starts, ends, strict=True))


def peak_in(samples: list[tuple], lo: int, hi: int, keep=lambda s: True) -> dict | None:
    """The largest total among samples[lo:hi] that `keep` accepts: its value and its index (first of equals)."""
    best = None
    for i in range(lo, hi):
        if keep(samples[i]) and (best is None or samples[i][0] > samples[best][0]):
            best = i
    return None if best is None else {"op": best, "bytes": samples[best][0]}


def step_events(rec: Recorder, step: tuple[int, int], layers: int) -> dict:
    """The drawn step's events, op indices from the step's first op: its micro-steps, each with its loss, its
    backward's start, the peak at the loss (backward before any decoder layer: the cross-entropy's and the
    lm_head's backward), the first op of each layer's recompute and backward (the last layer's first: the first
    recomputed), the peak in the first recomputed layer and every layer's backward peak; the optimizer step; the
    step's peak."""
    lo, hi = step
    s = rec.samples
    micro = []
    for a, b in spans(rec.events, "micro-step"):
        if not lo <= a < hi:
            continue
        bw = next(i for n, i in rec.events if n == "backward" and a <= i <= b)
        layer_start = {}
        for i in range(bw, b):
            if s[i][2] and s[i][3] >= 0:
                layer_start.setdefault(s[i][3], i)
        at_loss = peak_in(s, bw, layer_start.get(layers - 1, b))
        per_layer = {k: peak_in(s, bw, b, lambda x, k=k: x[2] and x[3] == k) for k in range(layers)}
        micro.append(
            {
                "start": a - lo,
                "end": b - lo,
                "loss": next(i for n, i in rec.events if n == "loss" and a <= i <= b) - lo,
                "backward": bw - lo,
                "peak_at_loss": shift(at_loss, lo),
                "first_recomputed_layer": layers - 1,
                "peak_in_first_recomputed_layer": shift(per_layer[layers - 1], lo),
                "layer_backward_starts": [layer_start[k] - lo for k in range(layers)],
                "layer_backward_peaks": [shift(per_layer[k], lo) for k in range(layers)],
                "peak": shift(peak_in(s, a, b), lo),
            }
        )
    opt = next((a, b) for a, b in spans(rec.events, "optimizer step") if lo <= a < hi)
    return {
        "micro_steps": micro,
        "optimizer_step": {"start": opt[0] - lo, "end": opt[1] - lo, "peak": shift(peak_in(s, *opt), lo)},
        "peak": shift(peak_in(s, lo, hi), lo),
    }


def shift(p: dict | None, lo: int) -> dict | None:
    return None if p is None else {"op": p["op"] - lo, "bytes": p["bytes"]}


def downsample(samples: list[tuple], must: set[int], bins: int, lo: int = 0, hi: int | None = None) -> list[int]:
    """The indices in [lo, hi) kept: each bin's maximum and minimum total (every peak wider than a bin, the
    window's peak exactly), the first and last op and `must` (the events' ops)."""
    hi = len(samples) if hi is None else hi
    keep = {lo, hi - 1, *(i for i in must if lo <= i < hi)}
    width = max(1, -(-(hi - lo) // bins))
    for a in range(lo, hi, width):
        chunk = range(a, min(hi, a + width))
        keep.add(max(chunk, key=lambda i: samples[i][0]))
        keep.add(min(chunk, key=lambda i: samples[i][0]))
    return sorted(keep)


def columns(samples: list[tuple], kept: list[int]) -> dict:
    return {
        "op": kept,
        "Total": [samples[i][0] for i in kept],
        **{c: [samples[i][1][j] for i in kept] for j, c in enumerate(CATEGORIES)},
    }


def run(argv: list[str]) -> dict:
    """realscale's measurement of `argv` (its flags) with the recorder on; the JSON's content. The samples: the
    drawn step's, downsampled, and the last micro-step's backward from its loss to the fourth layer recomputed
    (`zoom`), finer."""
    from ftkit.realscale import command, measure

    opts = command.parse_args(argv)
    started = time.perf_counter()
    with recording(Recorder()) as rec:
        result = measure.measure(opts)
    seconds = time.perf_counter() - started
    steps = spans(rec.events, "step")
    lo, hi = steps[-1]
    layers = result["config"]["layers"]
    events = step_events(rec, (lo, hi), layers)
    must = set()
    for m in events["micro_steps"]:
        must |= {m["start"], m["end"] - 1, m["peak_at_loss"]["op"], m["peak_in_first_recomputed_layer"]["op"]}
    must |= {events["optimizer_step"]["start"], events["optimizer_step"]["peak"]["op"]}
    step_samples = rec.samples[lo:hi]
    last = events["micro_steps"][-1]
    starts = last["layer_backward_starts"]
    before = (starts[-2] - starts[-1]) // 4 if layers > 1 else 0  # a quarter of a layer's backward, of forward
    zoom = (max(last["start"], last["loss"] - before), starts[layers - 4] if layers > 3 else last["end"])
    return {
        "command": "uv run python assets/memory_over_step.py " + " ".join(argv),
        "label": result["label"],
        "drawn_step": len(steps),
        "steps_tracked": len(steps),
        "config": result["config"],
        "versions": result["versions"],
        "seconds": round(seconds, 1),
        "ops_in_drawn_step": hi - lo,
        "ops_tracked": len(rec.samples),
        "run_peak": peak_in(rec.samples, 0, len(rec.samples)),
        "step_peaks": [peak_in(rec.samples, a, b)["bytes"] for a, b in steps],
        "tracked_peak_bytes": result["tracked_peak_bytes"],
        "tracked_peak_categories": result["categories"],
        "predicted_bytes": result["predicted_bytes"],
        "predicted": result["predicted"],
        "tracked_over_predicted": result["tracked_over_predicted"],
        "events": events,
        "downsampling": f"samples: each of {BINS} bins' largest and smallest total and the events' ops; zoom: the "
        f"same over ops {zoom[0]}..{zoom[1]} in {ZOOM_BINS} bins; op: counted from the drawn step's first",
        "samples": columns(step_samples, downsample(step_samples, must, BINS)),
        "zoom": columns(step_samples, downsample(step_samples, must, ZOOM_BINS, *zoom)),
    }


def stack(ax, s: dict) -> None:
    ax.stackplot(
        s["op"],
        *([v / GIB for v in s[c]] for c in CATEGORIES),
        labels=[LEGEND[c] for c in CATEGORIES],
        colors=[COLOURS[c] for c in CATEGORIES],
        linewidth=0,
        step="post",
    )


def mark(ax, x: float, text: str, y: float, ls: str = ":", ha: str = "left") -> None:
    ax.axvline(x, color="0.25", lw=0.8, ls=ls)
    ax.text(x, y, text, fontsize=8, va="top", ha=ha)


def predicted_line(ax, data: dict, x: float) -> None:
    predicted = data["predicted_bytes"] / GIB
    ax.axhline(predicted, color="black", lw=0.8, ls="--")
    ax.text(x, predicted, f"memory model {predicted:.2f} GiB ", fontsize=7.5, ha="right", va="bottom")


def draw_step(ax, data: dict) -> None:
    """The whole drawn step: its micro-steps' forward and backward, the optimizer step, the zoomed window."""
    ev, n = data["events"], data["ops_in_drawn_step"]
    stack(ax, data["samples"])
    top = max(data["samples"]["Total"]) / GIB * 1.17
    y = top * 0.98
    for k, m in enumerate(ev["micro_steps"], 1):
        mark(ax, m["start"], f" micro-step {k}\n forward", y)
        mark(ax, m["backward"], " backward", y, ls="--")
    mark(ax, ev["optimizer_step"]["start"], "optimizer\nstep ", y, ha="right")
    predicted_line(ax, data, n)
    peak = ev["peak"]
    ax.plot(peak["op"], peak["bytes"] / GIB, "v", color="black", ms=5)
    z = data["zoom"]["op"]
    ax.axvspan(z[0], z[-1], color="0.5", alpha=0.18, lw=0)
    ax.set_xlim(0, n)
    ax.set_ylim(0, top)
    ax.set_xlabel(f"op of optimizer step {data['drawn_step']} (the ops the tracker sees, in order); shaded: below")
    ax.set_ylabel("GiB")
    ax.legend(loc="lower left", fontsize=7.5, ncol=4, framealpha=0.9)


def draw_zoom(ax, data: dict) -> None:
    """The last micro-step's backward from its loss: the peak at the loss, then each layer recomputed in turn."""
    m = data["events"]["micro_steps"][-1]
    z, layers = data["zoom"], data["config"]["layers"]
    stack(ax, z)
    base = max(0.0, math.floor(2 * (min(z["Total"]) / GIB - 1)) / 2)  # 2.5 GiB at the reference configuration
    top = base + (max(z["Total"]) / GIB - base) * 1.6
    y = top - (top - base) * 0.015
    mark(ax, m["loss"], "forward's\nend: the\nloss ", y, ls=":", ha="right")
    mark(ax, m["backward"], "", y, ls="--")
    for k in range(layers - 1, max(-1, layers - 4), -1):
        start = m["layer_backward_starts"][k]
        if start <= z["op"][-1]:
            mark(ax, start, f" layer {k}\n recomputed\n + backward", y)
    for key, label, x in (
        ("peak_at_loss", "at the loss", 0.13),
        ("peak_in_first_recomputed_layer", "in the first\nrecomputed layer", 0.5),
    ):
        p = m[key]
        ax.annotate(
            f"{label}: {p['bytes'] / GIB:.3f} GiB",
            (p["op"], p["bytes"] / GIB),
            xytext=(x, 0.76),
            textcoords="axes fraction",
            fontsize=8.5,
            arrowprops=dict(arrowstyle="->", lw=0.7),
        )
    predicted_line(ax, data, z["op"][-1])
    ax.set_xlim(z["op"][0], z["op"][-1])
    ax.set_ylim(base, top)
    ax.set_xlabel(
        f"op of optimizer step {data['drawn_step']}: micro-step {len(data['events']['micro_steps'])}'s "
        f"backward, finer (the axis starts at {base:.1f} GiB)"
    )
    ax.set_ylabel("GiB")


def draw(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8.4), height_ratios=(1.15, 1))
    draw_step(top, data)
    draw_zoom(bottom, data)
    fig.suptitle(title(data), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def title(data: dict) -> str:
    c = data["config"]
    return (
        f"Memory over one optimizer step: single-gpu-ft QLoRA ({c['quant']}) at Qwen3-4B's shape ({c['layers']} "
        f"layers), peak {data['run_peak']['bytes'] / GIB:.2f} GiB\nmicro-batch {c['micro_batch_size']} x "
        f"{c['max_length']}, LoRA r={c['lora_rank']} (dropout {c['lora_dropout']}), every layer checkpointed; "
        f"micro-steps 1-{c['micro_steps_run']} of {c['accumulation_steps']} (the rest repeat the last)\n"
        f"measured by ftkit.realscale on fake tensors, CPU, torch {data['versions']['torch']}"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-write", action="store_true", help="print the summary; write neither file")
    p.add_argument("--draw-only", action="store_true", help="redraw the PNG from the committed JSON; run nothing")
    opts, rest = p.parse_known_args(argv)
    if opts.draw_only:
        draw(json.loads(JSON.read_text()), PNG)
        return
    argv = [*REFERENCE, *rest]  # realscale's flags: the last of each wins
    data = run(argv)
    summary = {k: v for k, v in data.items() if k not in ("samples", "zoom")}
    print(json.dumps(summary, indent=1)[:4000])
    if not opts.no_write:
        JSON.parent.mkdir(exist_ok=True)
        JSON.write_text(json.dumps(data, separators=(",", ":")) + "\n")
        draw(data, PNG)
        print(f"wrote {JSON.relative_to(ROOT)} ({JSON.stat().st_size} B) and {PNG.relative_to(ROOT)}")


if __name__ == "__main__":
    main(sys.argv[1:])
