"""experiments/ddp-ft on 2 CPU processes (torchrun, gloo): the same training step as the single-process reference,
with and without gradient accumulation, QLoRA (NF4) included; DDP's all-reduce traffic as theory says; resume,
inference on the adapter, and bad input refused on every rank."""

from __future__ import annotations

import json
import os
import shutil

import parity
import pytest
import torch

from ftkit.ranks import share_cpu_cores

TRAIN = "experiments/ddp-ft/train.py"
INFER = "experiments/ddp-ft/infer.py"
# Small enough for CI, long enough to see the loss move and to cross an eval and a checkpoint: 6 steps of
# sequences of <= 256 tokens. The default --quant nf4: the QLoRA base, 4-bit on CPU.
STEPS = 6


def flags(data_dir, batch: int, *extra: str) -> list[str]:
    return [
        "--smoke",
        "--data",
        str(data_dir),
        "--max-steps",
        str(STEPS),
        "--max-length",
        "256",
        "--batch-size",
        str(batch),
        "--micro-batch-size",
        "2",
        "--eval-every",
        "3",
        "--save-every",
        "3",
        "--eval-examples",
        "8",
        "--no-progress",
        *extra,
    ]


def launch(tmp_path_factory, name: str, *args: str) -> parity.Launch:
    run = parity.torchrun(TRAIN, *args, "--output-dir", str(tmp_path_factory.mktemp("ddp") / name))
    assert run.returncode == 0, run.report()
    return run


# Global batch 8 = micro 2 x 2 ranks x 2 accumulation steps; the reference runs it as 4 micro-batches.
@pytest.fixture(scope="module")
def accum(tmp_path_factory, data_dir):
    return launch(tmp_path_factory, "accum", *flags(data_dir, 8, "--profile-steps", "2:2"))


# Global batch 4 = micro 2 x 2 ranks: no accumulation, one all-reduce per micro-batch.
@pytest.fixture(scope="module")
def no_accum(tmp_path_factory, data_dir):
    return launch(tmp_path_factory, "no-accum", *flags(data_dir, 4))


@pytest.mark.parametrize(("cores", "local_world", "threads"), [(2, 2, 1), (4, 2, 2), (1, 1, 1), (8, 1, 8)])
def test_cpu_ranks_share_the_cores_they_may_run_on(monkeypatch, cores, local_world, threads):
    """ranks.share_cpu_cores: the cores this process may run on (its affinity: what a Slurm job step or a container
    binds), split among this node's ranks; a GPU run leaves the threads alone."""
    before = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    try:
        share_cpu_cores(torch.device("cuda", 0))
        assert torch.get_num_threads() == before
        share_cpu_cores(torch.device("cpu"))
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def sync_every(tmp_path_factory, data_dir):
    return launch(tmp_path_factory, "sync-every", *flags(data_dir, 8, "--sync-every-micro-step"))


@pytest.mark.parametrize("run_name, batch", [("accum", 8), ("no_accum", 4)])
def test_same_step_as_the_single_process_reference(request, tmp_path_factory, data_dir, run_name, batch):
    run = request.getfixturevalue(run_name)
    ref = parity.reference(tmp_path_factory.mktemp("ref"), *flags(data_dir, batch), quant="nf4")
    loss = parity.compare_losses(run.run_dir, ref)
    eval_loss = parity.compare_losses(run.run_dir, ref, key="eval_loss")
    adapter = parity.compare_adapters(run.run_dir / "adapter", ref / "adapter")
    print(f"{run_name}: max |loss diff| {loss:.2e}, eval {eval_loss:.2e}, adapter {adapter:.2e}")
    assert loss <= parity.LOSS_TOL and eval_loss <= parity.LOSS_TOL
    assert adapter <= parity.ADAPTER_TOL


def test_run_directory(accum):
    summary = json.loads((accum.run_dir / "summary.json").read_text())
    config = json.loads((accum.run_dir / "config.json").read_text())
    assert summary["status"] == "completed" and summary["steps_run"] == STEPS
    assert config["hardware"]["world_size"] == 2 and config["accumulation_steps"] == 2
    assert summary["hardware"]["torch_threads"] >= 1 and summary["memory_predicted"]["total"] > 0
    rows = parity.metrics(accum.run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["tokens"] > r["target_tokens"] > 0 for r in rows)  # global counts, both ranks' shares
    # Rank 0 wrote everything, once; every rank's RNG is in the checkpoint.
    assert sorted(p.name for p in (accum.run_dir / "checkpoints").iterdir()) == ["step-3", "step-6"]
    ckpt = accum.run_dir / "checkpoints" / "step-6"
    assert {"rng-rank0.pt", "rng-rank1.pt", "optimizer.pt", "adapter"} <= {p.name for p in ckpt.iterdir()}
    assert json.loads((ckpt / "trainer_state.json").read_text())["world_size"] == 2
    assert "run directory:" in accum.ranks[0]["stdout"] and "run directory:" not in accum.ranks[1]["stdout"]


def test_all_reduce_bytes_are_the_trainable_gradients_once_per_step(accum, no_accum):
    for run in (accum, no_accum):
        summary = json.loads((run.run_dir / "summary.json").read_text())
        grad_bytes = summary["parameters"]["trainable"] * 4  # fp32 LoRA gradients
        assert summary["trainable_grad_bytes"] == grad_bytes
        for row in parity.metrics(run.run_dir):
            assert set(row["comm"]) == {"all_reduce"}
            assert row["comm"]["all_reduce"]["bytes"] == grad_bytes, row["comm"]
            # The tiny model's 512 KiB of gradients fit DDP's 1 MiB first bucket: one all-reduce.
            assert row["comm"]["all_reduce"]["count"] == 1
            assert row["comm"]["all_reduce"]["time_s"] > 0
        assert summary["comm_bytes_per_step"] == grad_bytes and summary["comm_count_per_step"] == 1


def test_no_sync_sends_once_per_step_not_once_per_micro_step(accum, sync_every):
    """With --sync-every-micro-step each of the 2 micro-steps all-reduces: twice the bytes for the same math."""
    grad_bytes = json.loads((accum.run_dir / "summary.json").read_text())["trainable_grad_bytes"]
    for row in parity.metrics(sync_every.run_dir):
        assert row["comm"]["all_reduce"]["bytes"] == 2 * grad_bytes
        assert row["comm"]["all_reduce"]["count"] == 2
    assert parity.compare_losses(sync_every.run_dir, accum.run_dir) <= parity.LOSS_TOL


@pytest.mark.parametrize(
    "baseline, batch, knobs",
    [
        # With accumulation: 2 KiB buckets (one per LoRA matrix), gradients as bucket views, the graph search.
        ("accum", 8, ["--bucket-cap-mb", "0.002", "--gradient-as-bucket-view", "--find-unused-parameters"]),
        # Without (static_graph needs that): reentrant checkpointing, which with the graph search needs the
        # static graph.
        ("no_accum", 4, ["--static-graph", "--reentrant-checkpointing", "--find-unused-parameters"]),
    ],
)
def test_ddp_knobs_and_misconfigurations_change_no_math(request, tmp_path_factory, data_dir, baseline, batch, knobs):
    base = request.getfixturevalue(baseline)
    run = launch(tmp_path_factory, "knobs", *flags(data_dir, batch, *knobs))
    assert parity.compare_losses(run.run_dir, base.run_dir) <= parity.LOSS_TOL
    assert parity.compare_adapters(run.run_dir / "adapter", base.run_dir / "adapter") <= parity.ADAPTER_TOL
    grad_bytes = json.loads((run.run_dir / "summary.json").read_text())["trainable_grad_bytes"]
    rows = parity.metrics(run.run_dir)
    assert all(r["comm"]["all_reduce"]["bytes"] == grad_bytes for r in rows)
    if "--bucket-cap-mb" in knobs:
        # Once DDP has rebuilt its buckets after the first backward, each LoRA matrix (>= 8 KiB) is one.
        assert all(r["comm"]["all_reduce"]["count"] == 56 for r in rows[1:]), [r["comm"] for r in rows]


# Dropout draws random masks in every step, on every rank: a resume or restart that lost a rank's RNG stream would
# change the losses, where without dropout (--smoke's default) it would go unnoticed.
DROPOUT = ("--lora-dropout", "0.1")
# What --max-restarts needs (ftkit/rundir.py, follow_restart): a fresh rendezvous store for each restart.
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@pytest.fixture(scope="module")
def dropout(tmp_path_factory, data_dir):
    return launch(tmp_path_factory, "dropout", *flags(data_dir, 8, *DROPOUT))


def continued_as_uninterrupted(out, uninterrupted: parity.Launch, tol: float = 1e-6) -> None:
    assert [r["step"] for r in parity.metrics(out)] == list(range(1, STEPS + 1))
    assert parity.compare_losses(out, uninterrupted.run_dir) <= tol
    assert parity.compare_adapters(out / "adapter", uninterrupted.run_dir / "adapter") <= tol


def test_resume_continues_with_the_same_losses(dropout, tmp_path):
    """A copy of the dropout run resumed from its step-3 checkpoint (the adapter, AdamW, the scheduler and each
    rank's RNG stream) runs steps 4-6 as the run itself did. (The --stop-after flow and the command it prints are
    tested with single-gpu-ft and tp-sp-ft; the restarts below resume the same way.)"""
    out = tmp_path / "resumed"
    shutil.copytree(dropout.run_dir, out)
    shutil.rmtree(out / "adapter")  # what the resumed run writes, compared below
    run = parity.torchrun(TRAIN, "--resume", str(out / "checkpoints" / "step-3"), "--output-dir", str(out))
    assert run.returncode == 0, run.report()
    assert "resumed from" in run.ranks[0]["stdout"] and "at step 3" in run.ranks[0]["stdout"]
    continued_as_uninterrupted(out, dropout)


def test_each_rank_draws_its_own_dropout_masks(dropout):
    """The ranks train on different examples: their dropout streams differ (the same seed on every rank would draw
    the same masks on each)."""
    first, second = parity.rank_dropout_streams(dropout.run_dir / "checkpoints" / "step-3")
    assert not torch.equal(first, second)


def test_resume_on_another_number_of_ranks(accum, tmp_path):
    """The replicas are whole, so a run continues on any number of ranks: the 2-rank run's step-3 checkpoint,
    resumed on 1 rank (4 micro-batches accumulated instead of 2 on each of 2 ranks), gives the same losses and
    adapter up to summation order. Without dropout: new RNG streams (stated in the output) are what differs."""
    out = tmp_path / "one-rank"
    shutil.copytree(accum.run_dir, out)
    shutil.rmtree(out / "adapter")  # what the resumed run writes, compared below
    run = parity.torchrun(TRAIN, "--resume", str(out / "checkpoints" / "step-3"), "--output-dir", str(out), nproc=1)
    assert run.returncode == 0, run.report()
    assert "written by 2: the model, optimizer, schedule and data order continue" in run.ranks[0]["stdout"]
    assert json.loads((out / "config.json").read_text())["hardware"]["world_size"] == 1
    continued_as_uninterrupted(out, accum, tol=parity.LOSS_TOL)


def test_dead_ranks_cost_at_most_one_checkpoint_interval(dropout, tmp_path, data_dir):
    """Under torchrun --max-restarts=2, two failures in one run, each followed by torchrun restarting the group with
    the same command:
    - attempt 0: rank 1 is SIGKILLed once the step-3 checkpoint exists; attempt 1 continues from step 3 by itself;
    - attempt 1: rank 0 is SIGKILLed with every file of the step-6 checkpoint written but before it is committed
      (tests/kill_at_commit.py); attempt 2 continues from step 3 again, never from the half-made step 6.
    The run ends as if uninterrupted: the same per-step losses and adapter (LoRA dropout on)."""
    out = tmp_path / "killed"
    kill = parity.kill_rank_when(1, out / "checkpoints" / "step-3" / "trainer_state.json")
    args = ("6", "1", TRAIN, *flags(data_dir, 8, *DROPOUT), "--output-dir", str(out))
    run = parity.torchrun("tests/kill_at_commit.py", *args, max_restarts=2, meanwhile=kill, env=RESTARTABLE)
    assert run.returncode == 0, run.report()
    config = json.loads((out / "config.json").read_text())
    assert config["launch"]["restart"] == 2 and config["resumed_from_step"] == 3, config
    assert [r.get("restart", 0) for r in parity.metrics(out)] == [0, 0, 0, 2, 2, 2]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-3", "step-6"]
    continued_as_uninterrupted(out, dropout)


def test_infer_on_the_ddp_adapter(accum, tmp_path):
    parity.infer_with_a_loud_adapter(INFER, accum.run_dir, tmp_path)


def test_bad_flags_are_refused_before_any_work(tmp_path, data_dir):
    """6 sequences do not split into micro-batches of 2 on 2 ranks: every rank refuses before the process group,
    rank 0 alone says why (once, not once per rank), and no rank shows a traceback."""
    run = parity.torchrun(TRAIN, *flags(data_dir, 6), "--output-dir", str(tmp_path / "o"))
    assert run.returncode != 0
    stderr = [run.stderr(rank) for rank in (0, 1)]
    assert "not a multiple" in stderr[0] and "not a multiple" not in stderr[1], run.report()
    assert not any("Traceback" in e for e in stderr), run.report()
    assert not (tmp_path / "o").exists()


def test_static_graph_with_accumulation_is_refused(tmp_path, data_dir, monkeypatch):
    """DDP(static_graph=True) under no_sync() fails an internal assert in the first backward (a PyTorch bug)."""
    argv = flags(data_dir, 8, "--static-graph", "--output-dir", str(tmp_path / "o"))
    assert "pytorch/pytorch#143580" in parity.refused(monkeypatch, TRAIN, *argv, world=2)
    assert not (tmp_path / "o").exists()


def test_launch_without_torchrun_is_refused(tmp_path, data_dir, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    message = parity.refused(monkeypatch, TRAIN, *flags(data_dir, 8, "--output-dir", str(tmp_path / "o")))
    assert "uv run torchrun --nproc_per_node" in message and not (tmp_path / "o").exists()


def test_no_host_sync_per_micro_batch(accum):
    counts = parity.host_syncs(accum.run_dir, save_every=3)
    print(f"host syncs per plain step {counts}")
    assert max(counts) <= parity.MAX_HOST_SYNCS


def test_profile_trace_of_every_rank(accum):
    """--profile-steps 2:2 (in the accum run's flags): each rank writes a trace that names the step's ops."""
    for rank in (0, 1):
        trace = accum.run_dir / "profile" / f"trace-rank{rank}-steps2-2.json"
        names = {e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]}
        assert any(n.startswith(("aten::mm", "aten::addmm", "aten::linear")) for n in names)
        assert any("allreduce" in n.lower() for n in names)  # the gradient all-reduce, traced


def test_the_committed_runs_all_reduce_once_in_the_first_backward():
    """blogs/ddp.md: in torch 2.15 DDP's first backward has no buckets yet (one all-reduce of every gradient, after
    the backward), unless find_unused_parameters asks for the initial ones; the committed runs show it, and the
    tiny-bucket counts the post quotes are those of the steps after it."""
    from conftest import ROOT

    runs = ROOT / "devlogs" / "runs" / "ddp-ft"
    counts = {}
    for run in sorted(p for p in runs.iterdir() if "2proc" in p.name):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
        counts[run.name] = [r["comm"]["all_reduce"]["count"] for r in rows]
    assert len(counts) >= 10
    for name, per_step in counts.items():
        if "find-unused" not in name and "sync-every" not in name:
            assert per_step[0] == 1, (name, per_step[:3])
    assert set(counts["cpu-smoke-2proc-tiny-buckets"][1:]) == {32}
    assert set(counts["cpu-heavy-2proc-tiny-buckets"][1:]) == {56}
    assert counts["cpu-heavy-2proc-find-unused-parameters"][0] == 2  # bucketed from the first backward
