"""assets/hf_baseline.py: the same job through transformers' Trainer + PEFT runs end to end on CPU, stock (padded
batches) and --tuned (padding-free: DataCollatorWithFlattening with its varlen boundaries), computes the project's
loss on the project's examples, writes the run directory the benchmark reads, and the benchmark's table gets its
rows and the x HF ratio (against the tuned row, else the stock padded one). What --tuned chooses on a GPU (batch,
checkpointing, attention, Liger, compile) is tested on its own, with no GPU and nothing imported.

2 steps of 4 sequences of <= 128 tokens, no warmup, seed 13: step 1's global batch holds one example of 121 tokens,
so its last padded micro-batch has padding (and the flattened one none): the two layouts differ on the same
examples. (The stock flatten collator is the tuned run's without the varlen kwargs, which SDPA does not read.)"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import runpy

import pytest
import torch
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
    """The project's single-process LoRA step (the reference of the bf16-LoRA techniques) and the Trainer's, stock
    with padded batches and tuned, on the same flags."""
    root = tmp_path_factory.mktemp("hf")
    launches = {
        "reference": ("experiments/single-gpu-ft/train.py", "--quant", "none"),
        "padded": (HF, "--collator", "padded"),
        "tuned": (HF, "--tuned"),
    }
    out = {}
    for name, command in launches.items():
        proc = run_script(*command, *FLAGS, "--data", str(data_dir), "--output-dir", str(root / name))
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = root / name
    return out


def test_writes_the_run_directory_the_benchmark_reads(runs):
    for name, collator in (("padded", "padded"), ("tuned", "flatten")):
        summary, rows = read(runs[name])
        assert summary["status"] == "completed" and summary["steps_run"] == 2
        assert summary["config"]["experiment"] == "hf-baseline" and summary["collator"] == collator
        assert summary["hf_config"] == ("tuned" if name == "tuned" else "stock")
        assert summary["attn_implementation"] == "sdpa" and summary["trainer"]["model_accepts_loss_kwargs"]
        assert summary["hardware"]["device"] == "cpu" and {"transformers", "peft"} <= set(summary["versions"])
        assert summary["median_tokens_per_s"] > 0 and summary["max_peak_rss"] > 0
        assert summary["memory_predicted"]["total"] > 0 and summary["differences"] and summary["timing_note"]
        assert [r["step"] for r in rows] == [1, 2] and all(ROW_KEYS <= set(r) for r in rows)
        assert "eval_loss" in rows[-1]
        assert (runs[name] / "adapter" / "adapter_model.safetensors").exists()
        assert not (runs[name] / "trainer").exists()
    assert read(runs["padded"])[0]["tuned"] is None


def test_tuned_on_cpu_records_what_it_ran(runs):
    """On CPU --tuned keeps --micro-batch-size (the global batch as 2 x 2), runs no checkpointing, no Liger, no
    compile, and SDPA on the flattened rows; each choice is recorded with why, and the Trainer ran what it says."""
    summary, _ = read(runs["tuned"])
    tuned, trainer = summary["tuned"], summary["trainer"]
    assert tuned["collator"] == "DataCollatorWithFlattening(return_flash_attn_kwargs=True)"
    assert summary["collator_class"] == "DataCollatorWithFlattening"
    chosen = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "activation_checkpointing": False}
    chosen |= {"use_liger_kernel": False, "torch_compile": False}
    for key, value in chosen.items():
        assert tuned[key] == trainer[key] == value, key
        assert tuned["why"][key]
    assert tuned["attn_implementation"] == "sdpa" and tuned["memory"] is None
    config = summary["config"]
    assert (config["micro_batch_size"], config["grad_checkpointing"], config["compile"]) == (2, False, False)
    assert any("torch_compile=False" in d for d in summary["differences"])


def test_same_examples_and_the_projects_loss(runs):
    """The Trainer normalises by the global batch's target tokens (num_items_in_batch), as the project does, so
    on the same examples from the same model and LoRA init its losses are the reference's, step for step (fp32):
    step 1 before any update, step 2 after an AdamW step (torch's fused AdamW, the Trainer's default, against the
    project's torch.optim.AdamW) with the gradient norm clipped to 1."""
    _, ref = read(runs["reference"])
    for collator in ("padded", "tuned"):
        _, rows = read(runs[collator])
        for mine, theirs in zip(rows, ref, strict=True):
            assert mine["tokens"] == theirs["tokens"] and mine["target_tokens"] == theirs["target_tokens"]
            assert mine["num_items_in_batch"] == mine["target_tokens"]  # what the Trainer passed to the model
            assert mine["lr"] == pytest.approx(theirs["lr"], abs=1e-12)
            assert abs(mine["loss"] - theirs["loss"]) <= 1e-5, (collator, mine["step"], mine["loss"], theirs["loss"])
            assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)


def test_tuned_equals_padded_with_its_own_layout(runs):
    """The tuned run's flattened rows (position_ids restarting per example, the varlen kwargs, no attention mask)
    compute the stock padded batches' loss, step for step to 1e-5 in fp32: transformers' block-diagonal mask keeps
    each example's attention to itself. Its layout is its own: one row
    per micro-batch and no padding, where step 1's padded micro-batches have some (a 121-token example)."""
    _, padded = read(runs["padded"])
    _, flat = read(runs["tuned"])
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
    every configuration's tokens/s as a ratio to the tuned one's, or to the stock padded one's where there is no
    tuned run (saying so); the launch lines it would use."""
    monkeypatch.syspath_prepend(str(ROOT / "assets"))  # as `python assets/benchmark.py` finds devlog_tables
    bench = runpy.run_path(str(ROOT / "assets" / "benchmark.py"))
    args = bench["parse_args"](["--nproc", "2", "--smoke", "--experiments", "single-gpu-ft", "--repeats", "1"])
    args.runs_dir = tmp_path
    planned = {r.config: r for r in bench["plan"](args)}
    assert list(planned)[:3] == ["hf-baseline-padded-1rank", "hf-baseline-flatten-1rank", "hf-baseline-tuned-1rank"]
    line = bench["command"](planned["hf-baseline-flatten-1rank"], args, "uv")
    assert line[:6] == ["uv", "run", "python", HF, "--collator", "flatten"] and "--smoke" in line
    line = bench["command"](planned["hf-baseline-tuned-1rank"], args, "uv")
    assert line[:5] == ["uv", "run", "python", HF, "--tuned"] and "--micro-batch-size" in line  # CPU: kept
    args.smoke = False  # on GPUs the tuned run fits its own per-device batch; the stock ones keep the flag
    assert "--micro-batch-size" not in bench["command"](planned["hf-baseline-tuned-1rank"], args, "uv")
    assert "--micro-batch-size" in bench["command"](planned["hf-baseline-padded-1rank"], args, "uv")
    args.smoke = True

    names = {"hf-baseline-padded-1rank": "padded", "hf-baseline-tuned-1rank": "tuned"}
    names["single-gpu-ft-none-1rank"] = "reference"
    data = {f"{c}-r1": read(runs[n]) for c, n in names.items()}
    launches = [{"run": n, "started": "t", "load_average_1min_before": 1.0} for n in data]

    def table(configs: list[str]) -> tuple[str, dict]:
        text = bench["report"](args, {c: [f"{c}-r1"] for c in configs}, data, launches, ["--smoke"], "figure")
        body = text.split("## Throughput, memory, scaling\n", 1)[1].split("\n## ", 1)[0]
        lines = [line for line in body.splitlines() if line.startswith("|")]
        header = [c.strip() for c in lines[0].strip("|").split("|")]
        cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
        return text, {row[0]: dict(zip(header, row)) for row in cells}

    text, rows = table(list(names))
    assert list(rows) == ["hf-baseline (padded)", "hf-baseline (tuned)", "single-gpu-ft"]
    hf = data["hf-baseline-tuned-1rank-r1"][0]["median_tokens_per_s"]
    for summary, _ in data.values():
        assert rows[bench["label"](summary)]["x HF (tuned)"] == f"{summary['median_tokens_per_s'] / hf:.2f}"
    assert rows["hf-baseline (tuned)"]["x HF (tuned)"] == "1.00"
    assert rows["hf-baseline (padded)"]["scaling efficiency"] == "-"
    assert rows["single-gpu-ft"]["scaling efficiency"] == "1.00"
    assert "**On CPU, with the tiny model, the ratio is measured but is no GPU figure**" in text
    assert "with `DataCollatorForSeq2Seq` (padded)." in text
    assert "`hf-baseline (tuned)`: the Trainer at its best" in text and "x HF (tuned) = " in text
    assert "`DataCollatorWithFlattening(return_flash_attn_kwargs=True)` with sdpa attention" in text

    # A benchmark without the tuned run (from before --tuned, or --hf-configs padded): the stock padded row's ratio.
    text, rows = table(["hf-baseline-padded-1rank", "single-gpu-ft-none-1rank"])
    assert rows["hf-baseline (padded)"]["x HF (padded)"] == "1.00"
    assert "No tuned Hugging Face run in this benchmark" in text and "x HF (padded) = " in text

    # Without the baseline (--hf-configs none, or a benchmark from before it): no HF rows, the column empty.
    text, rows = table(["single-gpu-ft-none-1rank"])
    assert rows["single-gpu-ft"]["x HF (tuned)"] == "-" and "hf-baseline (" not in text


@pytest.fixture(scope="module")
def hf_module() -> dict:
    """assets/hf_baseline.py's functions, its main not run."""
    return runpy.run_path(str(ROOT / HF))


def tuned_args(**given) -> argparse.Namespace:
    """The flags tuned_settings reads, at the GPU default (Qwen3-4B's global batch of 16 x 2048, bf16)."""
    flags = dict(batch_size=16, micro_batch_size=2, max_length=2048, dtype="bf16", lora_rank=16, lora_dropout=0.05)
    flags |= dict(compile=True, explicit_flags=sorted(given))
    return argparse.Namespace(**(flags | given))


def installed(monkeypatch, *names: str) -> None:
    """importlib.util.find_spec as if `names` were installed (a spec, nothing importable); the rest as they are."""
    real = importlib.util.find_spec
    fake = {name: importlib.machinery.ModuleSpec(name, None) for name in names}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: fake.get(name) or real(name, *a))


def test_tuned_fits_its_device_batch_with_the_memory_model(hf_module):
    """On CUDA (a device object only: nothing runs on it) the per-device batch is the largest dividing the global
    batch whose predicted memory x the planner's margin + reserve fits, without checkpointing where one does; with
    it only where none does; the accumulation keeps the global batch."""
    from ftkit import models

    tuned, cuda, gib = hf_module["tuned_settings"], torch.device("cuda"), 2**30
    config = models.model_config(models.QWEN3_4B_SHAPE)
    whole = tuned(tuned_args(), cuda, torch.bfloat16, config, 10_000 * gib)
    assert (whole["per_device_train_batch_size"], whole["gradient_accumulation_steps"]) == (16, 1)
    assert not whole["activation_checkpointing"] and "without checkpointing" in whole["why"]["activation_checkpointing"]

    h100 = tuned(tuned_args(), cuda, torch.bfloat16, config, 80 * gib)
    rows, fit = h100["per_device_train_batch_size"], h100["memory"]
    assert 16 % rows == 0 and rows * h100["gradient_accumulation_steps"] == 16 and not h100["activation_checkpointing"]
    assert fit["required_bytes"] <= 80 * gib and fit["required_bytes"] == pytest.approx(
        fit["memory_predicted_bytes"] * hf_module["MEMORY_MARGIN"] + hf_module["RESERVE_BYTES"]
    )
    if rows < 16:  # the next larger dividing batch does not fit without checkpointing
        bigger = min(b for b in range(rows + 1, 17) if 16 % b == 0)
        over = tuned(
            tuned_args(micro_batch_size=bigger, grad_checkpointing=False), cuda, torch.bfloat16, config, 80 * gib
        )
        assert (
            over["memory"]["required_bytes"] > 80 * gib
            and "predicted not to fit" in over["why"]["activation_checkpointing"]
        )

    # A GPU just too small for one example per forward without checkpointing: checkpointing, and the batch it fits.
    one = tuned(tuned_args(micro_batch_size=1, grad_checkpointing=False), cuda, torch.bfloat16, config, 10_000 * gib)
    small = one["memory"]["required_bytes"] - 1
    tight = tuned(tuned_args(), cuda, torch.bfloat16, config, small)
    assert tight["activation_checkpointing"] and tight["memory"]["required_bytes"] <= small
    assert "with checkpointing (none fits without)" in tight["why"]["activation_checkpointing"]


def test_tuned_chooses_kernels_from_what_is_installed(hf_module, monkeypatch):
    """Liger where liger_kernel is installed and the device is CUDA; flash_attention_2 where flash-attn is, else the
    project's varlen kernel (torch's varlen_attn); compile on CUDA unless --no-compile; on CPU none of them, SDPA.
    Decided from importlib.util.find_spec (faked here), nothing imported."""
    from ftkit import attention, models

    tuned, cuda, cpu = hf_module["tuned_settings"], torch.device("cuda"), torch.device("cpu")
    config = models.model_config(models.QWEN3_4B_SHAPE)
    bare = tuned(tuned_args(), cuda, torch.bfloat16, config, 80 * 2**30)
    assert not bare["use_liger_kernel"] and "not installed" in bare["why"]["use_liger_kernel"]
    if attention.torch_has_varlen():
        assert bare["attn_implementation"] == attention.VARLEN
    assert (
        bare["torch_compile"]
        and not tuned(tuned_args(compile=False), cuda, torch.bfloat16, config, 80 * 2**30)["torch_compile"]
    )
    installed(monkeypatch, "liger_kernel", "flash_attn")
    best = tuned(tuned_args(), cuda, torch.bfloat16, config, 80 * 2**30)
    assert best["use_liger_kernel"] and "liger_kernel is installed" in best["why"]["use_liger_kernel"]
    assert best["attn_implementation"] == "flash_attention_2"
    on_cpu = tuned(tuned_args(), cpu, torch.float32, config)
    assert not on_cpu["use_liger_kernel"] and not on_cpu["torch_compile"] and not on_cpu["activation_checkpointing"]
    assert on_cpu["attn_implementation"] == "sdpa" and on_cpu["per_device_train_batch_size"] == 2
