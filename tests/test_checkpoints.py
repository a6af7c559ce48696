"""A checkpoint is data, not code: its optimizer, scheduler and RNG files load with `weights_only=True`; a file
that would run code when unpickled is refused with a clear error, and its code never runs. (That every script's
own checkpoints load this way is what the resume tests of each technique show.)"""

from __future__ import annotations

import pathlib
import random

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup

from ftkit import run


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
    state = run.load_torch(tmp_path / "optimizer.pt")
    assert state["scheduler"]["last_epoch"] == 1 and torch.equal(
        state["optimizer"]["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"]
    )
    torch.save(run.rng_state(), tmp_path / "rng.pt")
    first = random.random(), torch.rand(1).item()
    run.set_rng_state(run.load_torch(tmp_path / "rng.pt"))
    assert (random.random(), torch.rand(1).item()) == first  # the restored state draws the same numbers again


def test_a_pickle_that_runs_code_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "payload-ran"
    torch.save({"optimizer": Payload(marker)}, tmp_path / "optimizer.pt")
    with pytest.raises(run.CheckpointError, match="refused, it holds objects other than tensors and plain data"):
        run.load_torch(tmp_path / "optimizer.pt")
    assert not marker.exists()


def test_a_corrupt_file_is_reported_as_corrupt(tmp_path):
    (tmp_path / "rng.pt").write_bytes(b"garbage")
    with pytest.raises(run.CheckpointError, match="corrupt or unreadable"):
        run.load_torch(tmp_path / "rng.pt")
