"""assets/ddp_buckets.py, the DDP post's bucket timeline: its buckets are torch's bucketing of the LoRA gradients at
Qwen3-4B's shape, its first step is the committed runs' single all-reduce, its times are the post's link model and
the MFU convention's FLOPs, and the post shows it with the numbers it draws. Nothing is drawn here."""

from __future__ import annotations

import ast
import json
import runpy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT

from ftkit import cli, comm, hardware, metrics, models
from ftkit.memory import QWEN3_4B, lora_params

SCRIPT = ROOT / "assets" / "ddp_buckets.py"
POST = ROOT / "blogs" / "ddp.md"


@pytest.fixture(scope="module")
def fig():
    return runpy.run_path(str(SCRIPT))  # not as __main__: nothing written


@pytest.fixture(scope="module")
def timeline(fig):
    return fig["timeline"]()


def test_the_caps_are_the_installed_torchs(fig):
    """25 MiB buckets with a 1 MiB first one: what the post says DDP uses by default."""
    assert fig["BUCKET_CAP_BYTES"] == 25 * 2**20 and fig["FIRST_BUCKET_BYTES"] == 2**20
    assert torch.__version__.startswith("2.15")


def test_the_buckets_are_torchs_own_assignment(fig, timeline):
    """The script's rule against the function DDP's reducer calls, on tensors of the same shapes in the same order."""
    order = fig["ready_order"]()
    tensors = [torch.empty(n, device="meta") for *_, n in order]
    limits = [fig["FIRST_BUCKET_BYTES"], fig["BUCKET_CAP_BYTES"]]
    expected, _ = dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(tensors))
    sizes = [n * 4 for *_, n in order]
    assert fig["bucket_assignment"](sizes, limits) == [list(b) for b in expected]
    got = [b["bytes"] for b in timeline["buckets"]]
    assert got == [sum(sizes[i] for i in b) for b in expected]
    # What DDP itself rebuilt for these shapes (assets/ddp_buckets.py --check; devlogs/ddp-ft.md).
    assert got == [1409024, 26476544, 26279936, 26411008, 26640384, 24903680]


def test_the_gradients_are_the_lora_adapters_of_qwen3_4b(fig, timeline):
    order = fig["ready_order"]()
    assert order == fig["lora_tensors"]()[::-1]
    assert order[0][:3] == (35, "down_proj", "B") and order[-1][:3] == (0, "q_proj", "A")
    total = lora_params(QWEN3_4B, 16) * 4
    assert total == 33_030_144 * 4  # the post's table: 33,030,144 fp32 parameters, 126 MiB
    assert timeline["first_step"]["bytes"] == total == sum(b["bytes"] for b in timeline["buckets"])


def test_the_first_step_is_one_all_reduce_in_the_committed_runs():
    """No buckets in DDP's first backward (torch 2.15): one all-reduce there in every 2-process run that neither
    asks for the graph search (bucketed from the start) nor syncs every micro-step (one in its first micro-step)."""
    runs = sorted((ROOT / "devlogs" / "runs" / "ddp-ft").glob("*2proc*"))
    firsts = {}
    for run in runs:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
        firsts[run.name] = (rows[0]["comm"]["all_reduce"]["count"], rows[1]["comm"]["all_reduce"]["count"])
    plain = {n: c for n, c in firsts.items() if "find-unused" not in n and "sync-every" not in n}
    assert len(plain) >= 6 and all(first == 1 for first, _ in plain.values()), plain
    assert firsts["cpu-heavy-2proc"] == (1, 2) and firsts["cpu-heavy-2proc-tiny-buckets"] == (1, 56)


def test_the_times_are_the_posts_link_model(fig, timeline):
    link = hardware.LINKS["pcie4"]
    first = timeline["first_step"]
    seconds = comm.ring_wire_bytes("all_reduce", first["bytes"], 2) / link.bytes_per_s
    assert first["end_s"] - first["start_s"] == pytest.approx(seconds)
    assert f"{seconds * 1e3:.2f} ms" == "4.19 ms"  # the post's table, PCIe Gen4, 2 GPUs
    assert "| | | PCIe Gen4 x16, 31.5 GB/s | 4.19 ms |" in POST.read_text()
    last = timeline["buckets"][-1]
    assert timeline["exposed_rebuilt_s"] == pytest.approx(last["bytes"] / link.bytes_per_s)
    assert timeline["exposed_first_step_s"] == pytest.approx(seconds)
    # Buckets go one at a time, in order, each once its last gradient is ready; all but the last finish in the
    # backward.
    for before, after in zip(timeline["buckets"], timeline["buckets"][1:]):
        assert before["end_s"] <= after["start_s"] and after["start_s"] >= after["ready_s"]
    assert all(b["end_s"] < timeline["backward_s"] for b in timeline["buckets"][:-1])
    assert last["ready_s"] == pytest.approx(timeline["backward_s"])


def test_the_compute_is_the_posts_assumed_mfu(fig, timeline):
    """The backward with checkpointing's recompute does the MFU convention's FLOPs of the decoder layers for the
    micro-batch (forward 2, backward 4 per trained weight; 4 per frozen one; attention 6*d*s^2 per sequence), run at
    the post's assumed MFU: a full micro-step (the lm_head at its 2 x 256 answer positions) takes 0.23 s."""
    config = SimpleNamespace(**models.QWEN3_4B_CONFIG)
    seq, micro = cli.REAL["max_length"], cli.REAL["micro_batch_size"]
    assert (fig["SEQ"], fig["MICRO_BATCH"]) == (seq, micro)
    lora = lora_params(QWEN3_4B, 16)
    flops = sum(f for *_, f in fig["backward_segments"]())
    assert flops == pytest.approx(metrics.step_flops([seq] * micro, config, lora, logit_positions=0), rel=1e-12)
    model = ast.parse((ROOT / "assets" / "ddp_comm_model.py").read_text())
    mfu = next(n.value.value for n in model.body if isinstance(n, ast.Assign) and n.targets[0].id == "ASSUMED_MFU")
    assert fig["ASSUMED_MFU"] == mfu
    peak = hardware.gpu("h100-sxm").bf16_flops
    full = metrics.step_flops([seq] * micro, config, lora, logit_positions=micro * 256)
    assert full / (mfu * peak) == pytest.approx(0.23, abs=0.005)
    run = json.loads((ROOT / "devlogs" / "runs" / "realscale" / "ddp-world2.json").read_text())
    ratio = run["flops_counted_with_recompute"] / run["flops_convention_at_logits"]
    assert ratio == pytest.approx(1.49, abs=0.005)
    assert timeline["backward_s"] == pytest.approx(flops / (mfu * peak * ratio))


def test_the_post_shows_the_figure_and_its_numbers(timeline):
    text = POST.read_text()
    assert "![" in text and "(../assets/ddp_buckets.png)" in text
    png = ROOT / "assets" / "ddp_buckets.png"
    assert png.exists() and png.stat().st_size < 300_000
    buckets = timeline["buckets"]
    assert len(buckets) == 6 and "six buckets" in text
    for b in (buckets[0], buckets[-1]):
        assert f"{b['bytes'] / 2**20:.2f} MiB" in text
    assert f"{timeline['exposed_rebuilt_s'] * 1e3:.2f} ms" in text
    assert f"{timeline['backward_s'] * 1e3:.0f} ms" in text
