"""The measurement scripts in assets/ that the devlogs quote: they run, and what they check still holds."""

from __future__ import annotations

import json
import re
import runpy
import subprocess
import sys

import pytest
from conftest import ROOT, run_script

from ftkit import models, prepare

GPU_RUNS = ROOT / "devlogs" / "runs" / "single-gpu-ft"
ENCODED: dict = {}  # memory_check's encoded examples, by what they depend on (the --data given is the same for all)
GPU_EXTRA = ROOT / "devlogs" / "runs" / "single-gpu-ft-gpu"


def run_asset(*args: str) -> str:
    out = run_script(*args, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_lora_layer_bench_runs_every_variant():
    lines = [
        json.loads(line) for line in run_asset("assets/lora_layer_bench.py", "--smoke", "--repeats", "1").splitlines()
    ]
    assert lines[0]["layer"] == "tiny"
    rows = {row["variant"]: row for row in lines[1:]}
    assert set(rows) == {"fp32-adapters", "fp32-adapters-tf32", "autocast-bf16", "no-adapters"}
    assert rows["no-adapters"]["x_no_adapters"] == 1.0
    assert all(row["ms_fwd_bwd"] > 0 for row in rows.values())


@pytest.mark.parametrize(
    "run, flags",
    [
        ("gpu-4b-shape-lora-bf16", []),
        ("gpu-4b-shape-qlora-nf4", []),
        ("gpu-4b-shape-lora-bf16-fp32-adapters", ["--fp32-adapters"]),
        ("gpu-4b-shape-qlora-nf4-fp32-adapters", ["--fp32-adapters"]),
    ],
)
def test_memory_model_matches_the_committed_h100_runs(run: str, flags: list[str], monkeypatch, capsys):
    """The H100 runs in the single-GPU devlog: every step's measured CUDA peak within 5% of the memory model's
    prediction for that step's batch (the devlog quotes 0.958..1.032 for the runs with bf16 adapter compute,
    0.956..1.046 for the earlier ones with fp32 adapters: below 1 at step 1 only, whose peak comes before AdamW's
    state exists; above it, what CUDA allocates that the model leaves out). The `-fp32-adapters` runs predate
    lora.adapters_compute_in and check the model's fp32_adapter_compute branch. A change to ftkit/memory.py
    that breaks the one-GPU prediction fails here against real GPU measurements."""
    # In this process (runpy, as `python assets/memory_check.py ...` runs it): the imports are paid once, and the four
    # runs' examples (the same data, tokenizer and length) are encoded once.
    encode = prepare.encode_data

    def encoded_once(args, splits):
        key = (args.model, args.max_length, models.recorded_tokenizer(vars(args)), getattr(args, "task", None))
        if key not in ENCODED:
            ENCODED[key] = encode(args, splits)
        return ENCODED[key]

    monkeypatch.setattr(prepare, "encode_data", encoded_once)
    monkeypatch.setattr(sys, "argv", ["memory_check.py", str(GPU_RUNS / run), "--data", "qmsum-ami", *flags])
    runpy.run_path(str(ROOT / "assets" / "memory_check.py"), run_name="__main__")
    table = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in table.splitlines()[2:]]
    steps = json.loads((GPU_RUNS / run / "summary.json").read_text())["steps_run"]
    assert len(rows) == steps
    ratios = [float(r[-1]) for r in rows]
    assert all(0.95 <= x <= 1.05 for x in ratios), ratios


def test_the_planners_cpu_check_is_reproduced_from_its_committed_inputs(monkeypatch, capsys):
    """devlogs/plan-cpu-check.md: the planner's CPU step-time predictions against the benchmark, rebuilt from the
    committed calibration and benchmark summaries (no measurement here: the check is that the report is what its
    inputs give, so an edit to ftkit/plan.py that changes a prediction must regenerate it)."""
    monkeypatch.setattr(sys, "argv", ["plan_cpu_check.py", "--check"])
    runpy.run_path(str(ROOT / "assets" / "plan_cpu_check.py"), run_name="__main__")
    assert "reproduced from the committed inputs" in capsys.readouterr().out


def test_the_memory_posts_tables_are_what_the_model_predicts():
    """blogs/what-fills-gpu-memory.md quotes assets/memory_breakdown.py's two tables: a change to the memory
    model (or to the reference configuration) that is not carried into the post fails here."""
    breakdown = runpy.run_path(str(ROOT / "assets" / "memory_breakdown.py"))  # not as __main__: nothing written
    post = (ROOT / "blogs" / "what-fills-gpu-memory.md").read_text()
    assert breakdown["table"](breakdown["rows"]()) in post
    assert breakdown["seq_table"]() in post


def test_the_real_scale_table_is_the_committed_runs(capsys, monkeypatch):
    """The table of the fake-tensor runs, as assets/real_scale_table.py prints it from devlogs/runs/realscale/, is
    the one devlogs/runs/realscale/README.md shows, and the memory post links the section that checks its figures
    against them."""
    monkeypatch.setattr(sys, "argv", ["real_scale_table.py"])
    runpy.run_path(str(ROOT / "assets" / "real_scale_table.py"), run_name="__main__")
    table = capsys.readouterr().out.strip()
    assert table.count("\n") >= 5
    devlog = (ROOT / "devlogs" / "runs" / "realscale" / "README.md").read_text()
    assert table in devlog
    assert "\n## The memory post's figures, checked\n" in devlog
    post = (ROOT / "blogs" / "what-fills-gpu-memory.md").read_text()
    assert "(../devlogs/runs/realscale/README.md#the-memory-posts-figures-checked)" in post


def test_the_cp_devlogs_fake_tensor_table_is_the_committed_runs():
    """devlogs/cp-ft.md's table of cp-ft's fake-tensor runs, and its bytes per step, are the committed JSON files'."""
    devlog = (ROOT / "devlogs" / "cp-ft.md").read_text()
    rows = re.findall(r"^\| (cp-world\d)(, no checkpointing)? \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", devlog, re.M)
    assert len(rows) == len(list((ROOT / "devlogs" / "runs" / "realscale").glob("cp-*.json")))
    for name, no_checkpointing, tracked, predicted, ratio in rows:
        stem = name + ("-no-checkpointing" if no_checkpointing else "")
        r = json.loads((ROOT / "devlogs" / "runs" / "realscale" / f"{stem}.json").read_text())
        shown = (f"{r['tracked_peak_bytes'] / 2**30:.2f}", f"{r['predicted_bytes'] / 2**30:.2f}")
        assert shown + (f"{r['tracked_over_predicted']:.3f}",) == (tracked, predicted, ratio), stem
    r = json.loads((ROOT / "devlogs" / "runs" / "realscale" / "cp-world2.json").read_text())
    sent = r["collective_bytes"]
    assert sent == r["collective_bytes_theory"]
    assert (
        f"{sent['all_gather'] / 1e9:.1f} GB all-gathered, {sent['reduce_scatter'] / 1e9:.1f} GB reduce-scattered, "
        f"{sent['all_reduce'] / 1e6:.0f} MB"
    ) in " ".join(devlog.split())


def test_the_ddp_posts_link_table_is_the_models(capsys, monkeypatch):
    """blogs/ddp.md's all-reduce times per link are assets/ddp_comm_model.py's, which reads the links from
    ftkit/hardware.py, the planner's table: one PCIe figure everywhere."""
    monkeypatch.setattr(sys, "argv", ["ddp_comm_model.py"])
    runpy.run_path(str(ROOT / "assets" / "ddp_comm_model.py"), run_name="__main__")
    table = capsys.readouterr().out.split("\n\n")[0].strip()
    assert "PCIe Gen4 x16, 31.5 GB/s" in table
    assert table in (ROOT / "blogs" / "ddp.md").read_text()


def test_the_tp_sp_posts_bytes_table_is_the_models(capsys, monkeypatch):
    """blogs/tp-sp.md's bytes and link times per micro-batch and per step are what assets/tp_comm_model.py prints
    (each script's theory from ftkit/comm.py at the reference configuration; tests/test_figure_tp_sp_layer.py checks
    that theory against the committed fake-tensor runs at Qwen3-4B's shape)."""
    monkeypatch.setattr(sys, "argv", ["tp_comm_model.py"])
    runpy.run_path(str(ROOT / "assets" / "tp_comm_model.py"), run_name="__main__")
    table = "\n".join(re.findall(r"^\|.*\|$", capsys.readouterr().out, re.M))
    assert table.count("\n") == 5  # the header, its rule and four techniques
    assert table in (ROOT / "blogs" / "tp-sp.md").read_text()


def test_each_decoder_layer_costs_on_the_h100_what_the_memory_model_says():
    """devlogs/runs/single-gpu-ft-gpu/gpu-memory-layers.jsonl (assets/gpu_memory_layers.py on an H100): the
    step's CUDA peak at Qwen3-4B's widths with 1, 2 and 4 decoder layers, padded and not. What one more layer adds
    must be what the memory model says a layer adds (to 0.5%), and the model must stay a floor under each peak,
    less than 150 MiB below it: what CUDA adds is a constant of the step, not a per-layer term (the devlog says
    what it is: 64-66 MiB, 72 MiB more with a padded row; without cuBLAS's workspace, under 8 MiB unpadded)."""
    from ftkit import cli, metrics, models
    from ftkit.realscale import command, configuration

    args = configuration.script_args(
        cli.load_experiment("single-gpu-ft"), command.parse_args(["--technique", "single", "--quant", "none"])
    )
    rows = [json.loads(line) for line in (GPU_EXTRA / "gpu-memory-layers.jsonl").read_text().splitlines()]
    runs = [r for r in rows if "layers" in r]
    assert {(r["layers"], r["padded"]) for r in runs} == {(n, p) for n in (1, 2, 4) for p in (False, True)}

    def predicted(layers: int, k: int) -> int:
        config = models.model_config(models.QWEN3_4B_SHAPE, vocab_size=None)
        config.num_hidden_layers = layers
        return metrics.predicted_memory(config, args, "single", quant="none", logit_positions=k)["total"]

    for r in runs:
        assert r["width"] == args.max_length
        model = predicted(r["layers"], r["answer_positions"])
        assert 0 <= r["peak_bytes"] - model <= 150 * 2**20, r
    for padded in (False, True):
        by = {r["layers"]: r for r in runs if r["padded"] == padded}
        measured = (by[4]["peak_bytes"] - by[1]["peak_bytes"]) / 3
        model = (predicted(4, 200) - predicted(1, 200)) / 3
        assert measured == pytest.approx(model, rel=0.005), padded
    no_workspace = GPU_EXTRA / "gpu-memory-layers-cublas-workspace-0.jsonl"
    for r in (json.loads(line) for line in no_workspace.read_text().splitlines()):
        if "layers" in r and not r["padded"]:
            assert 0 <= r["peak_bytes"] - predicted(r["layers"], r["answer_positions"]) <= 8 * 2**20, r


SCRIPTS = sorted((ROOT / "assets").glob("*.py"))
TRACKED = [
    ROOT / f for f in subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
]


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_each_script_answers_help_and_writes_nothing(script, monkeypatch, capsys):
    """`--help` prints the script's usage and exits before any work: a script that ignored it would rewrite the
    devlog, figure or run files it makes (tracked files, a reader's edits among them)."""
    before = {f: f.stat().st_mtime_ns for f in TRACKED if f.exists()}
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.syspath_prepend(str(script.parent))  # as `python assets/<name>.py` puts it first: their siblings
    with pytest.raises(SystemExit) as exit:
        runpy.run_path(str(script), run_name="__main__")
    assert exit.value.code == 0
    assert "usage:" in capsys.readouterr().out
    assert {f: f.stat().st_mtime_ns for f in before if f.exists()} == before


RUNS_SCRIPTS = sorted((ROOT / "assets").glob("*_runs.sh"))


@pytest.mark.parametrize("script", RUNS_SCRIPTS, ids=[p.name for p in RUNS_SCRIPTS])
def test_each_runs_script_answers_help_before_any_run(script):
    """`bash assets/<name>_runs.sh --help` prints its header and exits: a flag is never taken for DATA."""
    proc = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert f"bash assets/{script.name} [DATA]" in proc.stdout
