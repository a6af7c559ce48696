"""The measurement scripts in assets/ that the devlogs quote: they run, and what they check still holds."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU_RUNS = ROOT / "devlogs" / "runs" / "single-gpu-ft"


def run_asset(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )  # fmt: skip
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


@pytest.mark.parametrize("run", ["gpu-4b-shape-lora-bf16", "gpu-4b-shape-qlora-nf4"])
def test_memory_model_matches_the_committed_h100_runs(run: str, monkeypatch, capsys):
    """The H100 runs in the single-GPU devlog: every step's measured CUDA peak within 7% of the memory model's
    prediction for that step's batch (the devlog quotes 0.938..1.024). Those runs computed the adapters in fp32
    (they predate models.adapters_compute_in), so they check the model's fp32_adapter_compute branch and every
    term it shares with the bf16 one. A change to ftkit/memory.py that breaks the one-GPU prediction fails here
    against real GPU measurements."""
    # In this process (runpy, as `python assets/memory_check.py ...` runs it): the imports are paid once.
    monkeypatch.setattr(sys, "argv", ["memory_check.py", str(GPU_RUNS / run), "--data", "qmsum-ami", "--fp32-adapters"])
    runpy.run_path(str(ROOT / "assets" / "memory_check.py"), run_name="__main__")
    table = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in table.splitlines()[2:]]
    steps = json.loads((GPU_RUNS / run / "summary.json").read_text())["steps_run"]
    assert len(rows) == steps
    ratios = [float(r[-1]) for r in rows]
    assert all(0.93 <= x <= 1.03 for x in ratios), ratios


def test_the_planners_cpu_check_is_reproduced_from_its_committed_inputs(monkeypatch, capsys):
    """devlogs/plan-cpu-check.md: the planner's CPU step-time predictions against the benchmark, rebuilt from the
    committed calibration and benchmark summaries (no measurement here: the check is that the report is what its
    inputs give, so an edit to ftkit/plan.py that changes a prediction must regenerate it)."""
    monkeypatch.setattr(sys, "argv", ["plan_cpu_check.py", "--check"])
    runpy.run_path(str(ROOT / "assets" / "plan_cpu_check.py"), run_name="__main__")
    assert "reproduced from the committed inputs" in capsys.readouterr().out
