"""--profile-steps: parsing, the window found by step number (fresh, resumed, cut short), and the files written;
the CUDA branch with the profiler and the memory recorder faked, so it runs on CPU."""

import argparse
import json
import re
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity

from ftkit.profiling import StepProfiler, parse_profile_steps

CPU = torch.device("cpu")


@pytest.mark.parametrize("text, steps", [("3:4", (3, 4)), ("1:1", (1, 1)), ("2:10", (2, 10))])
def test_parse_good(text, steps):
    assert parse_profile_steps(text) == steps


@pytest.mark.parametrize("text", ["3", "0:2", "4:3", "a:b", "3:", ":4", "1:2:3", ""])
def test_parse_bad_names_the_form(text):
    with pytest.raises(ValueError, match=r"A:B.*--profile-steps 3:4") as e:
        parse_profile_steps(text)
    assert repr(text) in str(e.value)


def test_parse_bad_message_reaches_argparse(capsys):
    p = argparse.ArgumentParser()
    p.add_argument("--profile-steps", type=parse_profile_steps)
    with pytest.raises(SystemExit):
        p.parse_args(["--profile-steps", "4:3"])
    assert "expected A:B" in capsys.readouterr().err


def train(profiler: StepProfiler, first: int, last: int) -> None:
    """Optimizer steps first..last (1-based) of a tiny model, reporting each to the profiler as train.py does."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(first, last + 1):
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        profiler.step(step)


def trace_names(path) -> set[str]:
    return {e.get("name", "") for e in json.loads(path.read_text())["traceEvents"]}


def steps_done(names: set[str]) -> set[int]:
    """The steps whose end the profiler marked in the trace."""
    return {int(m[1]) for n in names if (m := re.fullmatch(r"optimizer step (\d+) done", n))}


def test_window_writes_trace_and_table(tmp_path, capsys):
    with StepProfiler((2, 3), tmp_path, CPU) as profiler:
        train(profiler, 1, 5)
    trace = tmp_path / "profile" / "trace-rank0-steps2-3.json"
    ops = tmp_path / "profile" / "ops-rank0-steps2-3.txt"
    assert profiler.files == [trace, ops]
    names = trace_names(trace)
    assert any(op in n for n in names for op in ("aten::addmm", "aten::mm", "aten::linear"))
    # Exactly the window's steps: 2 and 3, not 1 or 4.
    assert steps_done(names) == {2, 3}
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e.get("name") == "Optimizer.step#AdamW.step" for e in events) == 2
    assert "Self CPU" in ops.read_text() and "aten::" in ops.read_text()
    out = capsys.readouterr().out
    assert "profiled steps 2-3:" in out and "ui.perfetto.dev" in out


def test_no_window_writes_nothing(tmp_path):
    with StepProfiler(None, tmp_path, CPU) as profiler:
        train(profiler, 1, 3)
    assert profiler.files == [] and not (tmp_path / "profile").exists()


def test_other_ranks_write_their_own_files_silently(tmp_path, capsys):
    with StepProfiler((1, 1), tmp_path, CPU, rank=3) as profiler:
        train(profiler, 1, 2)
    assert (tmp_path / "profile" / "trace-rank3-steps1-1.json").is_file()
    assert capsys.readouterr().out == ""


def test_resumed_run_starting_at_the_window(tmp_path):
    # Resumed after step 2: the loop's first step is 3 = A, so profiling starts at __enter__.
    with StepProfiler((3, 4), tmp_path, CPU, start_step=2) as profiler:
        train(profiler, 3, 5)
    names = trace_names(tmp_path / "profile" / "trace-rank0-steps3-4.json")
    assert steps_done(names) == {3, 4}


def test_resumed_run_past_the_window_profiles_nothing(tmp_path, capsys):
    with StepProfiler((1, 2), tmp_path, CPU, start_step=2) as profiler:
        train(profiler, 3, 4)
    assert profiler.files == [] and "nothing to profile" in capsys.readouterr().out


def test_window_cut_short_still_exports(tmp_path, capsys):
    # --stop-after 3 inside the window 2:4: the context exit stops the profiler and exports steps 2-3.
    with StepProfiler((2, 4), tmp_path, CPU) as profiler:
        train(profiler, 1, 3)
    trace = tmp_path / "profile" / "trace-rank0-steps2-4.json"
    assert trace in profiler.files
    assert steps_done(trace_names(trace)) == {2, 3}
    assert "profiled steps 2-3 of 2-4" in capsys.readouterr().out


class FakeProfile:
    """Stands in for torch.profiler.profile: records how it was built and what was exported."""

    made: list["FakeProfile"] = []

    def __init__(self, **kwargs):
        self.kwargs, self.calls = kwargs, []
        FakeProfile.made.append(self)

    def start(self):
        self.calls.append("start")

    def stop(self):
        self.calls.append("stop")

    def export_chrome_trace(self, path):
        self.calls.append(("trace", path))
        Path(path).write_text("{}")

    def key_averages(self):
        return self

    def table(self, sort_by, row_limit):
        self.calls.append(("table", sort_by, row_limit))
        return "ops"


def test_cuda_records_memory_history_and_device_activity(tmp_path, monkeypatch):
    history, dumps = [], []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: history.append(kw))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: dumps.append((path, len(history))))
    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    FakeProfile.made.clear()

    with StepProfiler((2, 3), tmp_path, torch.device("cuda"), rank=1) as profiler:
        for step in range(1, 5):
            profiler.step(step)
            if step == 1:  # recording starts as step 2 begins
                assert history == [{"max_entries": 100_000}]

    (prof,) = FakeProfile.made
    assert prof.kwargs["activities"] == [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    assert prof.kwargs["record_shapes"] and prof.kwargs["profile_memory"] and not prof.kwargs["with_stack"]
    assert ("table", "self_device_time_total", 25) in prof.calls
    snapshot = tmp_path / "profile" / "memory-rank1-steps2-3.pickle"
    # Dumped once, while recording was still on, then recording switched off.
    assert dumps == [(str(snapshot), 1)]
    assert history == [{"max_entries": 100_000}, {"enabled": None}]
    assert snapshot in profiler.files


def test_cpu_does_not_touch_cuda_memory(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("CUDA memory history used on CPU")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", fail)
    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    FakeProfile.made.clear()
    with StepProfiler((1, 1), tmp_path, CPU) as profiler:
        profiler.step(1)
    (prof,) = FakeProfile.made
    assert prof.kwargs["activities"] == [ProfilerActivity.CPU]
    assert ("table", "self_cpu_time_total", 25) in prof.calls
