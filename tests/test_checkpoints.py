"""A checkpoint is data, not code: its optimizer, scheduler and RNG files load with `weights_only=True`; a file
that would run code when unpickled is refused with a clear error, and its code never runs. (That every script's
own checkpoints load this way is what the resume tests of each technique show.)"""

from __future__ import annotations

import pathlib
import random

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup

from ftkit import checkpoint, cli, errors, rundir


class Payload:
    """What a malicious checkpoint could hold: unpickling it calls Path.touch on a marker file."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def test_the_scripts_checkpoint_files_load_as_data(tmp_path):
    param = torch.nn.Parameter(torch.randn(4, 4))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    param.grad = torch.randn(4, 4)
    optimizer.step()
    scheduler = get_cosine_schedule_with_warmup(optimizer, 3, 10)
    scheduler.step()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp_path / "optimizer.pt")
    state = checkpoint.load_torch(tmp_path / "optimizer.pt")
    assert state["scheduler"]["last_epoch"] == 1 and torch.equal(
        state["optimizer"]["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"]
    )
    torch.save(checkpoint.rng_state(), tmp_path / "rng.pt")
    first = random.random(), torch.rand(1).item()
    checkpoint.set_rng_state(checkpoint.load_torch(tmp_path / "rng.pt"))
    assert (random.random(), torch.rand(1).item()) == first  # the restored state draws the same numbers again


def test_a_pickle_that_runs_code_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "payload-ran"
    torch.save({"optimizer": Payload(marker)}, tmp_path / "optimizer.pt")
    with pytest.raises(errors.CheckpointError, match="refused, it holds objects other than tensors and plain data"):
        checkpoint.load_torch(tmp_path / "optimizer.pt")
    assert not marker.exists()


def test_a_corrupt_file_is_reported_as_corrupt(tmp_path):
    (tmp_path / "rng.pt").write_bytes(b"garbage")
    with pytest.raises(errors.CheckpointError, match="corrupt or unreadable"):
        checkpoint.load_torch(tmp_path / "rng.pt")


# ---- torchrun --max-restarts: what a restarted worker group decides about its run directory (rundir.follow_restart,
# rundir.resolve), with the variables torchrun sets. tests/test_ddp.py kills real ranks.


def restarted_args(monkeypatch, output_dir, restart: int, run_id: str = "launch-1"):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # torchrun under TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    args = cli.common_parser("test", experiment="ddp-ft").parse_args(
        ["--smoke", "--output-dir", str(output_dir), "--max-steps", "6"]
    )
    return args


def earlier_attempt(run_dir: pathlib.Path, run_id: str, checkpoint_step: int | None) -> None:
    """What the first attempt of launch `run_id` left: config.json, two metric rows, maybe a checkpoint, and a
    half-written checkpoint after it."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(
        '{"args": {"experiment": "ddp-ft", "smoke": true, "max_steps": 6, "seed": 0}, '
        f'"launch": {{"torchelastic_run_id": "{run_id}", "restart": 0}}}}'
    )
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    if checkpoint_step is not None:
        ckpt = run_dir / "checkpoints" / f"step-{checkpoint_step}"
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text(f'{{"step": {checkpoint_step}}}')
    (run_dir / "checkpoints" / ".tmp-step-4").mkdir(parents=True)  # written when the rank died: never picked


def test_max_restarts_needs_a_run_directory(monkeypatch, tmp_path):
    args = restarted_args(monkeypatch, tmp_path, restart=0)
    args.output_dir = None
    with pytest.raises(errors.RunError, match="--output-dir DIR"):
        rundir.follow_restart(args)


def test_max_restarts_needs_a_fresh_store_for_each_restart(monkeypatch, tmp_path):
    args = restarted_args(monkeypatch, tmp_path, restart=0)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # torchrun's default: one store for every attempt
    with pytest.raises(errors.RunError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 uv run torchrun --max-restarts=3"):
        rundir.follow_restart(args)


def test_a_restarted_group_continues_from_its_newest_complete_checkpoint(monkeypatch, tmp_path):
    earlier_attempt(tmp_path / "r", "launch-1", checkpoint_step=2)
    args = cli.resolve(restarted_args(monkeypatch, tmp_path / "r", restart=1))
    assert args.resume == str(tmp_path / "r")
    assert rundir.resolve(args) == ((tmp_path / "r").resolve(), (tmp_path / "r/checkpoints/step-2").resolve())


def test_a_group_restarted_before_any_checkpoint_starts_again_and_keeps_the_old_rows(monkeypatch, tmp_path):
    earlier_attempt(tmp_path / "r", "launch-1", checkpoint_step=None)
    args = cli.resolve(restarted_args(monkeypatch, tmp_path / "r", restart=1))
    assert args.resume is None
    assert rundir.resolve(args) == (tmp_path / "r", None)
    assert (tmp_path / "r" / "metrics.before-restart-1.jsonl").read_text().count("step") == 2
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_a_restart_never_takes_over_a_run_another_launch_started(monkeypatch, tmp_path):
    earlier_attempt(tmp_path / "r", "another-launch", checkpoint_step=2)
    args = cli.resolve(restarted_args(monkeypatch, tmp_path / "r", restart=1))
    assert args.resume is None
    with pytest.raises(errors.RunError, match="already holds a run"):
        rundir.resolve(args)


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_run_directory_some_node_cannot_see_is_refused(one_rank_group, tmp_path):
    """Multi-node runs write every rank's checkpoint part into the run directory: each rank must see the
    config.json rank 0 wrote there (as on shared storage), or all of them stop, naming the hosts that cannot."""
    import socket

    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "config.json").write_text("{}")
    rundir.check_shared_run_dir(tmp_path / "shared")
    with pytest.raises(errors.RunError, match="storage that every node shares") as refused:
        rundir.check_shared_run_dir(tmp_path / "node-local")
    assert socket.gethostname() in str(refused.value)


# ---- A resume on another GPU layout (issue: resume depended on GPU numbering). CPU tests cannot own a GPU, so
# torch.cuda's RNG calls are faked by generators that behave as torch's do: one state per visible device, the
# *_all variants index them by ordinal, an ordinal the process cannot see raises.
class FakeCudaRng:
    def __init__(self, visible: int, current: int):
        self.states = [torch.tensor([100 + i], dtype=torch.uint8) for i in range(visible)]
        self.current = current

    def _index(self, device) -> int:
        index = self.current if device in ("cuda", None) else torch.device(device).index
        if index >= len(self.states):
            raise IndexError(f"cuda:{index} is not visible to this process ({len(self.states)} GPUs)")
        return index

    def get_rng_state(self, device="cuda"):
        return self.states[self._index(device)].clone()

    def set_rng_state(self, new_state, device="cuda"):
        self.states[self._index(device)] = new_state.clone()

    def get_rng_state_all(self):
        return [s.clone() for s in self.states]

    def set_rng_state_all(self, new_states):
        for i, s in enumerate(new_states):
            self.set_rng_state(s, i)

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        for name in ("get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))


@pytest.mark.parametrize("visible, current", [(2, 1), (1, 0)], ids=["ranks-swapped", "one-gpu-per-process"])
def test_a_resume_continues_this_ranks_own_gpu_stream_on_another_layout(monkeypatch, tmp_path, visible, current):
    # Saved by the rank on cuda:5 of 8 visible GPUs; resumed by the same rank where it sees `visible` GPUs and runs
    # on cuda:<current> (another node, another CUDA_VISIBLE_DEVICES).
    saving = FakeCudaRng(visible=8, current=5)
    saving.install(monkeypatch)
    torch.save(checkpoint.rng_state(), tmp_path / "rng.pt")
    own_stream = saving.states[5].clone()

    resuming = FakeCudaRng(visible=visible, current=current)
    resuming.install(monkeypatch)
    checkpoint.set_rng_state(checkpoint.load_torch(tmp_path / "rng.pt"))
    assert torch.equal(resuming.states[current], own_stream)  # this rank's dropout stream goes on where it stopped


class CudaTagged:
    """Tags every storage saved while active with the location `cuda:7`, as torch.save writes a GPU tensor's."""

    def __enter__(self):
        self.entry = (0, lambda storage: "cuda:7", lambda storage, location: None)
        torch.serialization._package_registry.insert(0, self.entry)
        torch.serialization._package_registry.sort(key=lambda e: e[0])

    def __exit__(self, *exc):
        torch.serialization._package_registry.remove(self.entry)


def test_a_checkpoint_saved_on_another_gpu_loads_where_that_gpu_does_not_exist(tmp_path):
    with CudaTagged():
        torch.save({"exp_avg": torch.ones(3)}, tmp_path / "rank0.pt")
    assert b"cuda:7" in (tmp_path / "rank0.pt").read_bytes()  # the file names a GPU this machine does not have
    state = checkpoint.load_torch(tmp_path / "rank0.pt")
    assert state["exp_avg"].device == torch.device("cpu") and torch.equal(state["exp_avg"], torch.ones(3))


def test_dropout_streams_are_one_per_stream_and_the_same_for_every_rank_that_shares_one():
    def draws(stream: int) -> torch.Tensor:
        checkpoint.seed_dropout(0, stream)
        return torch.rand(4)

    assert torch.equal(draws(0), draws(0)) and torch.equal(draws(3), draws(3))
    assert not torch.equal(draws(0), draws(1))
    checkpoint.seed_dropout(1, 0)
    assert not torch.equal(torch.rand(4), draws(0))  # another --seed, another stream
