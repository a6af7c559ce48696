"""assets/memory_over_step.png, memory over one optimizer step of single-gpu-ft's QLoRA at Qwen3-4B's shape: the
committed run (devlogs/runs/realscale/memory-over-step/memory-over-step.json) is the reference configuration, its
peak is ftkit.realscale's own for that configuration, backward's two largest peaks are where the memory post says
(at the loss and in the first recomputed layer), and the script's recorder sees the tracker's peak. Reads the
committed files; the only thing run is the recorder on a three-layer toy model (well under a second): the 36-layer
run takes minutes."""

from __future__ import annotations

import json
import runpy

import pytest
import torch
from conftest import ROOT

from ftkit import cli, realscale
from ftkit.realscale import trackers

FIGURE = runpy.run_path(str(ROOT / "assets" / "memory_over_step.py"))  # not as __main__: nothing run or written
# ftkit.realscale's own run of the same configuration (devlogs/runs/realscale/README.md gives its command)
REALSCALE = json.loads((ROOT / "devlogs" / "runs" / "realscale" / "single-nf4-world1.json").read_text())


@pytest.fixture(scope="module")
def RUN():
    return json.loads(FIGURE["JSON"].read_text())


def test_the_run_is_the_reference_configuration(RUN):
    """single-gpu-ft's defaults at Qwen3-4B's shape: QLoRA NF4, micro-batch 2 x 2048, LoRA r=16 with dropout 0.05,
    every layer checkpointed, 36 layers; the second of two optimizer steps drawn (AdamW's state exists)."""
    c = RUN["config"]
    assert RUN["command"] == "uv run python assets/memory_over_step.py " + " ".join(FIGURE["REFERENCE"])
    assert (c["quant"], c["micro_batch_size"], c["max_length"]) == ("nf4", cli.REAL["micro_batch_size"], 2048)
    assert (c["lora_rank"], c["lora_dropout"], c["grad_checkpointing"], c["layers"]) == (16, 0.05, True, 36)
    assert c["answer_tokens"] == realscale.ANSWER_TOKENS
    assert c["checkpointing"] == "all"  # every layer (a key realscale's committed run predates)
    assert {k: v for k, v in c.items() if k != "checkpointing"} == REALSCALE["config"]
    assert RUN["drawn_step"] == RUN["steps_tracked"] == 2
    assert RUN["tracked_peak_categories"]["Optstate"] > 0


def test_the_peak_is_realscales_own(RUN):
    """The samples' maximum is the tracker's peak, the step's and the run's, and ftkit.realscale's committed run of
    the same configuration (same torch) reports the same bytes."""
    samples = RUN["samples"]
    peak = RUN["run_peak"]["bytes"]
    assert max(samples["Total"]) == peak == RUN["events"]["peak"]["bytes"] == max(RUN["step_peaks"])
    assert peak == RUN["tracked_peak_bytes"]
    assert RUN["versions"]["torch"] == REALSCALE["versions"]["torch"]
    assert peak == REALSCALE["tracked_peak_bytes"]
    assert RUN["predicted_bytes"] == REALSCALE["predicted_bytes"]


def test_backwards_two_peaks_are_at_the_loss_and_the_first_recomputed_layer(RUN):
    """In each micro-step's backward, of the peaks at the loss (before any decoder layer) and in each layer's
    recompute and backward, the two largest are the loss's and the first recomputed layer's (the last layer); the
    step's peak is one of them."""
    events = RUN["events"]
    layers = RUN["config"]["layers"]
    for m in events["micro_steps"]:
        assert m["first_recomputed_layer"] == layers - 1
        peaks = {"loss": m["peak_at_loss"]["bytes"]}
        peaks |= {k: p["bytes"] for k, p in enumerate(m["layer_backward_peaks"])}
        top_two = sorted(peaks, key=peaks.get, reverse=True)[:2]
        assert set(top_two) == {"loss", layers - 1}, top_two
        assert m["peak_in_first_recomputed_layer"] == m["layer_backward_peaks"][-1]
        assert m["start"] <= m["loss"] <= m["backward"] <= m["peak_at_loss"]["op"] < m["end"]
    step_peak = events["peak"]
    last = events["micro_steps"][-1]
    assert step_peak in (last["peak_at_loss"], last["peak_in_first_recomputed_layer"])
    assert events["optimizer_step"]["peak"]["bytes"] < step_peak["bytes"]


def test_the_samples_keep_the_marked_peaks_and_stay_small(RUN):
    """The drawn samples hold every marked peak at its op, exactly; the zoom (the last micro-step's backward from
    its loss) holds both of its peaks; the categories stack up to the total; the files stay small."""
    events = RUN["events"]
    last = events["micro_steps"][-1]
    marked = [events["peak"], events["optimizer_step"]["peak"]]
    marked += [m[k] for m in events["micro_steps"] for k in ("peak_at_loss", "peak_in_first_recomputed_layer")]
    for samples, peaks in ((RUN["samples"], marked), (RUN["zoom"], marked[-2:])):
        at = dict(zip(samples["op"], samples["Total"], strict=True))
        for p in peaks:
            assert at[p["op"]] == p["bytes"]
        assert samples["op"] == sorted(set(samples["op"]))
        for i, total in enumerate(samples["Total"]):
            assert sum(samples[c][i] for c in FIGURE["CATEGORIES"]) == total
    assert RUN["samples"]["op"][-1] == RUN["ops_in_drawn_step"] - 1
    assert RUN["zoom"]["op"][0] < last["loss"] < last["layer_backward_starts"][-1] < RUN["zoom"]["op"][-1]
    assert FIGURE["JSON"].stat().st_size < 200_000
    assert 0 < FIGURE["PNG"].stat().st_size < 300_000


class Toy(torch.nn.Module):
    """Three checkpointed layers under a `layers` list, as a decoder's, and a loss."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))
        self.head = torch.nn.Linear(64, 512)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for layer in self.layers:
            x = checkpoint(lambda h, layer=layer: torch.relu(layer(h)).exp(), x, use_reentrant=False)
        return self.head(x).logsumexp(-1).sum()


def test_the_recorder_sees_the_trackers_peak():
    """The script's recorder under realscale's tracker (`trackers.make_tracker`, as realscale makes it): one sample
    per tracked op, their maximum the tracker's peak to the byte, the categories stacking up to the total, and the
    first decoder layer seen in backward the last one (the first recomputed)."""
    torch.manual_seed(0)
    model = Toy()
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 64)
    recorder = FIGURE["Recorder"]()
    tracker = trackers.make_tracker("single", model, optimizer, (x,))
    with FIGURE["recording"](recorder), tracker:
        recorder.active = True
        for _ in range(2):
            model(x).backward()
            tracker.reset_mod_stats()  # as realscale does after each micro-step
            optimizer.step()
            optimizer.zero_grad()
    peak = tracker.get_tracker_snapshot("peak")
    (dev,) = peak
    totals = [s[0] for s in recorder.samples]
    assert len(totals) > 50 and max(totals) == peak[dev]["Total"]
    assert all(sum(s[1]) == s[0] for s in recorder.samples)
    assert [n for n, _ in recorder.events].count("backward") == 2
    backward_layers = [s[3] for s in recorder.samples if s[2] and s[3] >= 0]
    assert backward_layers[0] == 2 and set(backward_layers) == {0, 1, 2}
