"""experiments/single-gpu-ft: the CPU walkthrough trains, resumes exactly, saves a stock PEFT adapter, infers,
and refuses bad input with a clear message."""

from __future__ import annotations

import gzip
import json
import shutil

import parity
import pytest
import torch
from conftest import run_script
from safetensors.torch import load_file

TRAIN = "experiments/single-gpu-ft/train.py"
INFER = "experiments/single-gpu-ft/infer.py"
# Small enough for CI, long enough for the loss to move: 10 steps of 8 sequences of <= 256 tokens. LoRA dropout on
# (the walkthrough's default is 0), so that every step draws random numbers and a resume that did not restore the
# RNG state would show in the losses.
FLAGS = [
    "--smoke",
    "--lora-dropout",
    "0.1",
    "--max-steps",
    "10",
    "--max-length",
    "256",
    "--eval-every",
    "5",
    "--save-every",
    "5",
    "--eval-examples",
    "8",
    "--profile-steps",
    "2:3",
    "--no-progress",
]


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows], [r["loss"] for r in rows]


@pytest.fixture(scope="module")
def full_run_launch(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("single") / "full"
    proc = run_script(TRAIN, *FLAGS, "--data", str(data_dir), "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


@pytest.fixture(scope="module")
def full_run(full_run_launch):
    return full_run_launch[0]


def test_smoke_run_writes_a_run_directory(full_run):
    summary = json.loads((full_run / "summary.json").read_text())
    config = json.loads((full_run / "config.json").read_text())
    assert summary["status"] == "completed" and summary["steps_run"] == 10
    assert config["args"]["quant"] == "nf4" and config["args"]["model"] == "tiny"
    assert {"torch", "transformers", "peft", "bitsandbytes"} <= set(summary["versions"])
    assert summary["hardware"]["device"] == "cpu" and summary["hardware"]["world_size"] == 1
    assert summary["median_tokens_per_s"] > 0 and summary["max_peak_rss"] > 0
    assert summary["median_mfu"] if "median_mfu" in summary else summary["peak_flops"] is None
    assert summary["memory_predicted"]["total"] > 0
    rows = [json.loads(line) for line in (full_run / "metrics.jsonl").read_text().splitlines()]
    keys = {
        "step",
        "loss",
        "lr",
        "target_tokens",
        "tokens",
        "step_time_s",
        "tokens_per_s",
        "peak_rss",
        "grad_norm",
    }
    assert all(keys <= set(r) for r in rows)
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert sum("eval_loss" in r for r in rows) == 2
    assert sorted(p.name for p in (full_run / "checkpoints").iterdir()) == ["step-10", "step-5"]


# Warnings the libraries printed in every run, which a reader can do nothing about (issue 29): transformers'
# deprecated checkpointing names (ours, and peft's: filtered in ftkit/__init__.py), and peft's look-ups of the base
# model's config.json on the hub at every save (PEFT's save_embedding_layers="auto").
UNACTIONABLE = (
    "`gradient_checkpointing_enable` is deprecated",
    "`is_gradient_checkpointing` is deprecated",
    "Unable to fetch remote file",
    "Could not find a config file in",
    "Failed to load CPU gemm_4bit_forward from kernels-community",
)


def test_smoke_run_prints_no_warning_a_reader_cannot_act_on(full_run_launch):
    stderr = full_run_launch[1].stderr
    assert not [w for w in UNACTIONABLE if w in stderr], stderr[-3000:]


def test_smoke_loss_falls(full_run):
    _, loss = losses(full_run)
    assert sum(loss[-3:]) / 3 < sum(loss[:3]) / 3 - 0.05, loss
    rows = [json.loads(line) for line in (full_run / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert evals[-1] < evals[0], evals


def test_resume_continues_with_the_same_losses(full_run, tmp_path):
    """A copy of the run resumed from its step-5 checkpoint (adapter, AdamW state, scheduler, RNG) runs steps 6-10
    as the run itself did: with LoRA dropout on, a lost RNG stream would show in the losses. (Stopping with
    --stop-after and the command a stopped run prints are checked by tests/test_readme.py's walkthroughs.)"""
    out = tmp_path / "resumed"
    shutil.copytree(full_run, out)
    shutil.rmtree(out / "adapter")  # what the resumed run writes
    proc = run_script(TRAIN, "--resume", str(out / "checkpoints" / "step-5"))
    assert proc.returncode == 0 and "at step 5" in proc.stdout, proc.stderr[-3000:]
    steps, resumed = losses(out)
    _, uninterrupted = losses(full_run)
    assert steps == list(range(1, 11))
    assert max(abs(a - b) for a, b in zip(resumed, uninterrupted)) <= 1e-6, (resumed, uninterrupted)
    assert (out / "metrics.before-resume-at-5.jsonl").exists()  # the rows the resume replaced, kept aside
    a = torch.load(out / "checkpoints" / "step-10" / "optimizer.pt", weights_only=False)["optimizer"]
    b = torch.load(full_run / "checkpoints" / "step-10" / "optimizer.pt", weights_only=False)["optimizer"]
    assert all(torch.allclose(a["state"][k]["exp_avg"], b["state"][k]["exp_avg"], atol=1e-7) for k in a["state"])


def test_adapter_loads_with_stock_peft(full_run, data_dir):
    from peft import PeftModel

    from ftkit import data, lora, models

    adapter = full_run / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 16 and set(config["target_modules"]) == set(lora.LORA_TARGETS)
    splits = data.load_splits(str(data_dir))
    tok = models.load_tokenizer("tiny", data.corpus(splits["train"]))
    base = models.load_model(
        "tiny", quant="nf4", dtype=torch.float32, device=torch.device("cpu"), seed=0, vocab_size=len(tok)
    )
    model = PeftModel.from_pretrained(base, adapter)
    saved = load_file(adapter / "adapter_model.safetensors")
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(saved) == len(loaded) == 4 * 7 * 2
    for key, tensor in saved.items():
        match = [v for k, v in loaded.items() if k.replace(".default", "").endswith(key.split("base_model.model.")[-1])]
        assert len(match) == 1 and torch.equal(match[0], tensor), key
    assert any(t.abs().sum() > 0 for k, t in saved.items() if "lora_B" in k)  # trained, not the zero init


def test_infer_reports_rouge_for_base_and_finetuned(full_run, tmp_path):
    parity.infer_with_a_loud_adapter(INFER, full_run, tmp_path)


def refused(monkeypatch, *argv: str) -> str:
    return parity.refused(monkeypatch, TRAIN, *argv)


def test_no_cuda_without_smoke_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    message = refused(monkeypatch, "--max-steps", "1")
    assert "no usable CUDA device" in message and "--smoke" in message


def test_missing_data_folder_is_refused(tmp_path, monkeypatch):
    message = refused(monkeypatch, "--smoke", "--data", str(tmp_path / "absent"), "--output-dir", str(tmp_path / "o"))
    assert "does not exist" in message
    assert not (tmp_path / "o").exists()


def test_malformed_meeting_file_is_refused(tmp_path, data_dir, monkeypatch):
    bad = tmp_path / "bad"
    shutil.copytree(data_dir, bad)
    victim = sorted((bad / "val").glob("*.json.gz"))[0]
    victim.write_bytes(gzip.compress(b'{"meeting_transcripts": [{"speaker": "A"}]}'))
    assert victim.name in refused(monkeypatch, "--smoke", "--data", str(bad), "--output-dir", str(tmp_path / "o"))


def test_batch_that_does_not_divide_is_refused(tmp_path, data_dir, monkeypatch):
    message = refused(
        monkeypatch,
        "--smoke",
        "--data",
        str(data_dir),
        "--batch-size",
        "6",
        "--micro-batch-size",
        "4",
        "--output-dir",
        str(tmp_path / "o"),
    )
    assert "not a multiple" in message


def test_existing_run_is_not_overwritten(full_run, data_dir, monkeypatch):
    before = (full_run / "metrics.jsonl").read_text()
    assert "already holds a run" in refused(monkeypatch, *FLAGS, "--data", str(data_dir), "--output-dir", str(full_run))
    assert (full_run / "metrics.jsonl").read_text() == before


def test_corrupt_checkpoint_is_refused(full_run, tmp_path, data_dir, monkeypatch):
    copy = tmp_path / "copy"
    shutil.copytree(full_run, copy)
    (copy / "checkpoints" / "step-5" / "optimizer.pt").write_bytes(b"garbage")
    message = refused(monkeypatch, *FLAGS, "--data", str(data_dir), "--resume", str(copy / "checkpoints" / "step-5"))
    assert "corrupt" in message


def test_no_host_sync_per_micro_batch(full_run):
    counts = parity.host_syncs(full_run, save_every=5)
    print(f"host syncs per plain step {counts}")
    assert max(counts) <= parity.MAX_HOST_SYNCS


def test_profile_steps_write_a_trace_of_those_steps(full_run):
    """FLAGS has --profile-steps 2:3: a Perfetto/Chrome trace of two optimizer steps and the ops table."""
    trace = json.loads((full_run / "profile" / "trace-rank0-steps2-3.json").read_text())
    names = [e.get("name", "") for e in trace["traceEvents"]]
    assert any(n.startswith(("aten::mm", "aten::addmm", "aten::linear")) for n in names)
    assert sum(n.startswith("Optimizer.step#AdamW.step") for n in names) == 2
    assert (full_run / "profile" / "ops-rank0-steps2-3.txt").read_text().strip()


def test_adapter_names_its_base_model(full_run):
    """The adapter alone says what to load it on: PEFT's base_model_name_or_path is the run's --model."""
    assert json.loads((full_run / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny"


@pytest.mark.parametrize(
    "flag, value, says",
    [
        ("--lr", "-1", "--lr must be a positive learning rate"),
        ("--lr", "nan", "--lr must be a positive learning rate"),
        ("--lora-dropout", "1.5", "--lora-dropout must be a probability in [0, 1)"),
        ("--warmup-steps", "-1", "--warmup-steps must be 0 or more"),
        ("--max-grad-norm", "-1", "--max-grad-norm must be 0 (no clipping) or a positive norm"),
        ("--weight-decay", "-0.1", "--weight-decay must be 0 or more"),
        ("--lora-alpha", "0", "--lora-alpha must be positive"),
        ("--keep-checkpoints", "0", "--keep-checkpoints must be 1 or more"),
    ],
)
def test_out_of_range_flags_are_refused_before_any_work(flag, value, says):
    from ftkit import cli, errors

    args = cli.common_parser("train", "single-gpu-ft").parse_args(["--smoke", flag, value])
    with pytest.raises(errors.RunError) as refused:
        cli.resolve(args)
    assert says in str(refused.value) and value in str(refused.value)


def test_out_of_range_flag_ends_with_the_message_not_a_traceback(tmp_path):
    proc = run_script(TRAIN, "--smoke", "--lr", "-1", "--output-dir", str(tmp_path / "o"))
    assert proc.returncode == 2 and "--lr must be a positive learning rate" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "o").exists()


def test_infer_refuses_a_truncated_adapter_before_loading_the_model(full_run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(full_run, copy)
    weights = copy / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    proc = run_script(INFER, "--smoke", "--run", str(copy), "--num-examples", "1", "--max-new-tokens", "4")
    assert proc.returncode == 2 and "corrupt or unreadable adapter" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_resume_with_a_disagreeing_flag_names_both_values(full_run, monkeypatch):
    message = refused(monkeypatch, "--resume", str(full_run / "checkpoints" / "step-5"), "--lr", "0.5", "--seed", "3")
    assert "--lr: the run used 0.002, this command says 0.5" in message
    assert "--seed: the run used 0, this command says 3" in message


def test_a_run_stopped_after_its_last_checkpoint_resumes_to_write_its_adapter(full_run, tmp_path):
    """Every step checkpointed, but the process died before the adapter and summary were written: --resume (and a
    torchrun restart, which resumes the same way) trains no step and writes them, equal to the uninterrupted run's."""
    copy = tmp_path / "copy"
    shutil.copytree(full_run, copy)
    shutil.rmtree(copy / "adapter")
    (copy / "summary.json").unlink()
    proc = run_script(TRAIN, "--resume", str(copy))
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-2000:]
    summary = json.loads((copy / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps_run"] == 0
    assert (copy / "metrics.jsonl").read_text() == (full_run / "metrics.jsonl").read_text()
    resumed = load_file(copy / "adapter" / "adapter_model.safetensors")
    uninterrupted = load_file(full_run / "adapter" / "adapter_model.safetensors")
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)


def test_resuming_a_completed_run_changes_nothing(full_run):
    before = {p: p.read_bytes() for p in full_run.rglob("*") if p.is_file()}
    proc = run_script(TRAIN, "--resume", str(full_run))
    assert proc.returncode == 0 and "has completed its 10 steps" in proc.stdout, proc.stderr[-2000:]
    assert {p: p.read_bytes() for p in full_run.rglob("*") if p.is_file()} == before
