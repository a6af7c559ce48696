"""assets/hf_baseline.py: the same job through transformers' Trainer + PEFT runs end to end on CPU with both
collators, computes the project's loss on the project's examples, writes the run directory the benchmark reads, and
the benchmark's table gets its row and the x HF (padded) ratio.

2 steps of 4 sequences of <= 128 tokens, no warmup, seed 13: step 1's global batch holds one example of 121 tokens,
so its last padded micro-batch has padding (and the flattened one none): the two collators compute different
layouts of the same examples."""

from __future__ import annotations

import json
import runpy

import pytest
from conftest import ROOT, run_script

HF = "assets/hf_baseline.py"
FLAGS = ["--smoke", "--seed", "13", "--max-steps", "2", "--warmup-steps", "0", "--batch-size", "4"]
FLAGS += ["--max-length", "128", "--eval-every", "2", "--eval-examples", "2", "--no-progress"]
ROW_KEYS = {"step", "loss", "lr", "grad_norm", "target_tokens", "tokens", "step_time_s", "tokens_per_s", "peak_rss"}


def read(run_dir) -> tuple[dict, list[dict]]:
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir) -> dict:
    """The project's single-process LoRA step (the reference of the bf16-LoRA techniques) and the Trainer's with
    each collator, on the same flags."""
    root = tmp_path_factory.mktemp("hf")
    launches = {
        "reference": ("experiments/single-gpu-ft/train.py", "--quant", "none"),
        "padded": (HF, "--collator", "padded"),
        "flatten": (HF, "--collator", "flatten"),
    }
    out = {}
    for name, command in launches.items():
        proc = run_script(*command, *FLAGS, "--data", str(data_dir), "--output-dir", str(root / name))
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = root / name
    return out


def test_writes_the_run_directory_the_benchmark_reads(runs):
    for collator in ("padded", "flatten"):
        summary, rows = read(runs[collator])
        assert summary["status"] == "completed" and summary["steps_run"] == 2
        assert summary["config"]["experiment"] == "hf-baseline" and summary["collator"] == collator
        assert summary["attn_implementation"] == "sdpa" and summary["trainer"]["model_accepts_loss_kwargs"]
        assert summary["hardware"]["device"] == "cpu" and {"transformers", "peft"} <= set(summary["versions"])
        assert summary["median_tokens_per_s"] > 0 and summary["max_peak_rss"] > 0
        assert summary["memory_predicted"]["total"] > 0 and summary["differences"] and summary["timing_note"]
        assert [r["step"] for r in rows] == [1, 2] and all(ROW_KEYS <= set(r) for r in rows)
        assert "eval_loss" in rows[-1]
        assert (runs[collator] / "adapter" / "adapter_model.safetensors").exists()
        assert not (runs[collator] / "trainer").exists()


def test_same_examples_and_the_projects_loss(runs):
    """The Trainer normalises by the global batch's target tokens (num_items_in_batch), as the project does, so
    on the same examples from the same model and LoRA init its losses are the reference's, step for step (fp32):
    step 1 before any update, step 2 after an AdamW step (torch's fused AdamW, the Trainer's default, against the
    project's torch.optim.AdamW) with the gradient norm clipped to 1."""
    _, ref = read(runs["reference"])
    for collator in ("padded", "flatten"):
        _, rows = read(runs[collator])
        for mine, theirs in zip(rows, ref, strict=True):
            assert mine["tokens"] == theirs["tokens"] and mine["target_tokens"] == theirs["target_tokens"]
            assert mine["num_items_in_batch"] == mine["target_tokens"]  # what the Trainer passed to the model
            assert mine["lr"] == pytest.approx(theirs["lr"], abs=1e-12)
            assert abs(mine["loss"] - theirs["loss"]) <= 1e-5, (collator, mine["step"], mine["loss"], theirs["loss"])
            assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)


def test_flatten_equals_padded_with_its_own_layout(runs):
    """The flattened row (position_ids restarting per example, no attention mask) computes the padded batch's loss:
    transformers' block-diagonal mask keeps each example's attention to itself. Its layout is its own: one row
    per micro-batch and no padding, where step 1's padded micro-batches have some (a 121-token example)."""
    _, padded = read(runs["padded"])
    _, flat = read(runs["flatten"])
    for p, f in zip(padded, flat, strict=True):
        assert abs(p["loss"] - f["loss"]) <= 1e-5
        assert p["micro_batches"] == f["micro_batches"] == 2  # 4 examples, 2 per forward
        assert (p["rows"], f["rows"]) == (4, 2) and f["padding_fraction"] == 0
    assert padded[0]["padding_fraction"] == pytest.approx(7 / (4 * 128)) and padded[1]["padding_fraction"] == 0


def test_refuses_resume(tmp_path):
    proc = run_script(HF, "--smoke", "--resume", str(tmp_path))
    assert proc.returncode == 2 and "--resume: not for the Hugging Face baseline" in proc.stderr


def test_benchmark_table_has_the_hf_rows_and_ratio(runs, monkeypatch, tmp_path):
    """assets/benchmark.py's table from these run directories (no benchmark launched): the Hugging Face rows, and
    every configuration's tokens/s as a ratio to the padded one's; the launch lines it would use."""
    monkeypatch.syspath_prepend(str(ROOT / "assets"))  # as `python assets/benchmark.py` finds devlog_tables
    bench = runpy.run_path(str(ROOT / "assets" / "benchmark.py"))
    args = bench["parse_args"](["--nproc", "2", "--smoke", "--experiments", "single-gpu-ft", "--repeats", "1"])
    args.runs_dir = tmp_path
    planned = {r.config: r for r in bench["plan"](args)}
    assert list(planned)[:2] == ["hf-baseline-padded-1rank", "hf-baseline-flatten-1rank"]
    line = bench["command"](planned["hf-baseline-flatten-1rank"], args, "uv")
    assert line[:6] == ["uv", "run", "python", HF, "--collator", "flatten"] and "--smoke" in line

    names = {"hf-baseline-padded-1rank": "padded", "hf-baseline-flatten-1rank": "flatten"}
    names["single-gpu-ft-none-1rank"] = "reference"
    configs = {c: [f"{c}-r1"] for c in names}
    data = {f"{c}-r1": read(runs[n]) for c, n in names.items()}
    launches = [{"run": n, "started": "t", "load_average_1min_before": 1.0} for n in data]
    text = bench["report"](args, configs, data, launches, ["--smoke"], "figure")
    table = text.split("## Throughput, memory, scaling\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in table.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    rows = {row[0]: dict(zip(header, row)) for row in cells}
    assert list(rows) == ["hf-baseline (padded)", "hf-baseline (flatten)", "single-gpu-ft"]
    hf = data["hf-baseline-padded-1rank-r1"][0]["median_tokens_per_s"]
    for summary, _ in data.values():
        assert rows[bench["label"](summary)]["x HF (padded)"] == f"{summary['median_tokens_per_s'] / hf:.2f}"
    assert rows["hf-baseline (padded)"]["x HF (padded)"] == "1.00"
    assert rows["hf-baseline (padded)"]["scaling efficiency"] == "-"
    assert rows["single-gpu-ft"]["scaling efficiency"] == "1.00"
    assert "**On CPU, with the tiny model, the ratio is measured but is no GPU figure**" in text
    assert "`DataCollatorForSeq2Seq` (padded) and `DataCollatorWithFlattening` (flatten)" in text

    # Without the baseline (--hf-collators none, or a benchmark from before it): no HF rows, the column empty.
    only = "single-gpu-ft-none-1rank-r1"
    text = bench["report"](args, {"single-gpu-ft-none-1rank": [only]}, {only: data[only]}, launches, [], "figure")
    assert "| single-gpu-ft | none | 1 |" in text and "hf-baseline (" not in text
