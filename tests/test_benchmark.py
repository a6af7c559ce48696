"""assets/benchmark.py at its smallest: pp-ft at 2 ranks and its single-process baseline, 3 steps, one repeat.
Every number of the markdown is checked against the run files its rows name, recomputed here from them. The runs it
launches with `uv run python` and `uv run torchrun` are forked from the suite's fork server (parity.forked_uv),
not started as fresh interpreters: what is tested is the benchmark's bookkeeping, not how long torch takes to
import."""

from __future__ import annotations

import json
import re
import runpy
import statistics
import sys

import parity
from conftest import ROOT, run_script


def table(text: str, heading: str) -> list[dict[str, str]]:
    """The markdown table under `## heading`, as one dict per row keyed by the header cells."""
    lines = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0].splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("|")]
    return [dict(zip(cells[0], row)) for row in cells[2:]]


def load(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def test_benchmark_markdown_is_its_run_files(tmp_path, monkeypatch, fork_socket):
    runs, out, fig = tmp_path / "runs", tmp_path / "benchmark.md", tmp_path / "benchmark.png"
    (tmp_path / "bin").mkdir()
    for name, value in parity.forked_uv(tmp_path / "bin", fork_socket).items():
        monkeypatch.setenv(name, value)
    flags = ["--nproc", "2", "--smoke", "--experiments", "pp-ft", "--repeats", "1", "--max-steps", "3"]
    flags += ["--max-length", "128", "--batch-size", "4", "--runs-dir", str(runs), "--out", str(out)]
    flags += ["--hf-collators", "none"]  # the Hugging Face baseline's rows: tests/test_hf_baseline.py
    proc = run_script("assets/benchmark.py", *flags, "--figure", str(fig))
    assert proc.returncode == 0
    text = out.read_text()
    assert "**CPU numbers, not GPU numbers.**" in text
    assert f"`uv run python assets/benchmark.py {' '.join(flags)} --figure {fig}`" in text
    assert f"`{runs}/<run>/`" in text
    assert "`pp-ft` refuses 1 rank" in text
    assert fig.read_bytes().startswith(b"\x89PNG")

    # Launched as the README launches them, with the same job for every run.
    recorded = json.loads((runs / "benchmark.json").read_text())["launches"]
    launches = {x["run"]: x["command"] for x in recorded}
    assert launches["single-gpu-ft-none-1rank-r1"].startswith("uv run python experiments/single-gpu-ft/train.py")
    assert launches["pp-ft-2rank-r1"].startswith("uv run torchrun --standalone --nproc_per_node=2 experiments/pp-ft/")
    jobs = {json.dumps({k: load(runs / r)[0]["config"][k] for k in ("model", "data", "seed", "max_steps",
            "batch_size", "max_length", "micro_batch_size", "dtype")}) for r in launches}  # fmt: skip
    assert len(jobs) == 1 and '"max_steps": 3' in jobs.pop()

    rows = table(text, "Throughput, memory, scaling")
    assert [(r["experiment"], r["quant"], r["ranks"]) for r in rows] == [
        ("single-gpu-ft", "none", "1"),
        ("pp-ft", "none", "2"),
    ]
    measured = {}
    for row in rows:
        names = re.findall(r"`([^`]+)`", row["runs"])
        summaries = [load(runs / n)[0] for n in names]
        assert [s["hardware"]["world_size"] for s in summaries] == [int(row["ranks"])]
        for s, (_, metrics) in zip(summaries, (load(runs / n) for n in names)):
            # The summary's median is over the steps after the first, as the markdown says.
            assert s["median_tokens_per_s"] == statistics.median(m["tokens_per_s"] for m in metrics[1:])
        tokens_per_s = statistics.median(s["median_tokens_per_s"] for s in summaries)
        measured[row["experiment"]] = tokens_per_s
        assert row["tokens/s, median (range)"] == f"{tokens_per_s:,.0f}"
        assert row["step time s, median (range)"] == f"{summaries[0]['median_step_time_s']:.3f}"
        steps = [m["step_time_s"] for n in names for m in load(runs / n)[1][1:]]
        assert row["every step s"] == f"{min(steps):.3f}-{max(steps):.3f}"
        assert row["peak memory, rank 0"] == f"{summaries[0]['max_peak_rss'] / 2**30:.2f} GiB RSS"
        assert row["MFU"] == "-"
        loads = {x["run"]: x["load_average_1min_before"] for x in recorded}
        assert row["load before"] == ", ".join(f"{loads[n]:.1f}" for n in names)
    assert rows[1]["scaling efficiency"] == f"{measured['pp-ft'] / (2 * measured['single-gpu-ft']):.2f}"

    pp, metrics = load(runs / "pp-ft-2rank-r1")
    (comm,) = table(text, "Collective bytes per step")
    sent = [m["comm"]["send"]["bytes"] for m in metrics]
    theory = 2 * (2 - 1) * 2 * (2 * 128 * 128 * 4)  # 2 (stages - 1) m micro x seq x hidden x fp32, m = 4 / 2
    assert (
        comm["measured bytes / step (by kind)"] == f"{sum(sent) / len(sent):,.0f} (send {sum(sent) / len(sent):,.0f})"
    )
    assert comm["theory bytes / step"] == f"{theory:,}" and comm["measured / theory"] == "1.000"

    bubbles = table(text, "Pipeline bubble per rank")
    steps = metrics[1:]
    busy = [sum(m["busy_s"][k] for m in steps) / len(steps) for k in range(2)]
    for k, row in enumerate(bubbles):
        idle = sum(m["idle_s"][k] for m in steps) / sum(m["pipeline_time_s"][k] for m in steps)
        assert (row["rank"], row["bubble, median (range)"]) == (str(k), f"{idle:.3f}")
        assert row["compute s / step"] == f"{busy[k]:.3f}" and row["theory"] == f"{pp['bubble_theory']:.3f}"
        assert (row["bottleneck"] == "**bottleneck**") == (busy[k] == max(busy))

    # The markdown is a function of the run files alone: --report writes it again from them, the same.
    out.unlink()
    monkeypatch.syspath_prepend(str(ROOT / "assets"))  # as `python assets/benchmark.py` finds devlog_tables
    monkeypatch.setattr(sys, "argv", ["benchmark.py", "--report", str(runs)])
    runpy.run_path(str(ROOT / "assets" / "benchmark.py"), run_name="__main__")
    assert out.read_text() == text
