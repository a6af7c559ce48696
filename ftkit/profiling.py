"""On-demand profiling of a window of optimizer steps (`--profile-steps A:B`), for every train.py.

Each rank writes to <run_dir>/profile/:
- trace-rank{r}-steps{A}-{B}.json: a Chrome trace; open it in https://ui.perfetto.dev or chrome://tracing
  (TensorBoard's profiler plugin reads it too).
- ops-rank{r}-steps{A}-{B}.txt: the 25 ops with the most self time (device time on CUDA, CPU time otherwise).
- memory-rank{r}-steps{A}-{B}.pickle, CUDA only: the allocator's history, for https://pytorch.org/memory_viz.

Without a window the profiler does nothing, so the loop can always hold one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, record_function


class ProfileStepsError(ValueError, argparse.ArgumentTypeError):
    """A bad --profile-steps value. Also an ArgumentTypeError so that argparse, given `type=parse_profile_steps`,
    prints this message instead of a bare "invalid value"."""


def parse_profile_steps(text: str) -> tuple[int, int]:
    """'A:B' -> (A, B): the 1-based optimizer steps to profile, both included."""
    usage = f"expected A:B, 1-based optimizer steps with 1 <= A <= B (e.g. --profile-steps 3:4), got {text!r}"
    first, sep, last = text.partition(":")
    try:
        a, b = int(first), int(last)
    except ValueError:
        raise ProfileStepsError(usage) from None
    if not sep or not 1 <= a <= b:
        raise ProfileStepsError(usage)
    return a, b


class StepProfiler:
    """Profiles optimizer steps A..B of the loop it surrounds:

        with StepProfiler(args.profile_steps, run_dir, device, rank, start_step=start_step) as profiler:
            for step in range(start_step, last_step):
                ...  # one optimizer step
                profiler.step(step + 1)

    `start_step` is the number of steps already done (a resumed run), so the window is found by step number.
    """

    def __init__(
        self, steps: tuple[int, int] | None, run_dir: Path, device: torch.device, rank: int = 0, *, start_step: int = 0
    ):
        self.steps = steps
        self.dir = Path(run_dir) / "profile"
        self.cuda = device.type == "cuda"
        self.rank = rank
        self.start_step = start_step
        self.files: list[Path] = []
        self._prof: torch.profiler.profile | None = None
        self._first = self._done = start_step  # the first step profiled, the last step finished

    def __enter__(self) -> StepProfiler:
        if self.steps is not None:
            a, b = self.steps
            if a <= self.start_step + 1 <= b:  # the window starts now, or a resumed run lands inside it
                self._start(self.start_step + 1)
            elif self.start_step >= b and self.rank == 0:
                print(f"--profile-steps {a}:{b}: the run resumes after step {self.start_step}, nothing to profile")
        return self

    def step(self, step: int) -> None:
        """Call at the end of every optimizer step with its 1-based number."""
        if self.steps is None:
            return
        self._done = step
        if self._prof is not None:
            # A marker where the step ends, searchable in the trace. Not a span over the step: the next step's span
            # would have to open here, and after the run's last step it would hold whatever follows the loop.
            with record_function(f"optimizer step {step} done"):
                pass
            if step >= self.steps[1]:
                self._stop()
        elif step == self.steps[0] - 1:
            self._start(step + 1)

    def __exit__(self, *exc) -> None:
        if self._prof is not None:  # the run ended inside the window (--stop-after, an error): keep what there is
            self._stop()

    def _start(self, step: int) -> None:
        self._first = step
        if self.cuda:  # before the profiler, so the snapshot has the window's allocations from the start
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._prof = torch.profiler.profile(
            activities=activities, record_shapes=True, profile_memory=True, with_stack=False
        )
        self._prof.start()

    def _stop(self) -> None:
        prof, self._prof = self._prof, None
        prof.stop()
        a, b = self.steps
        tag = f"rank{self.rank}-steps{a}-{b}"
        self.dir.mkdir(parents=True, exist_ok=True)
        trace, ops = self.dir / f"trace-{tag}.json", self.dir / f"ops-{tag}.txt"
        prof.export_chrome_trace(str(trace))
        # "self_device_time_total" is what the deprecated "self_cuda_time_total" now maps to.
        sort_by = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        ops.write_text(prof.key_averages().table(sort_by=sort_by, row_limit=25) + "\n")
        self.files += [trace, ops]
        if self.cuda:
            memory = self.dir / f"memory-{tag}.pickle"
            torch.cuda.memory._dump_snapshot(str(memory))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.files.append(memory)
        if self.rank == 0:
            span = f"{self._first}-{max(self._done, self._first)}"
            cut = "" if span == f"{a}-{b}" else f" of {a}-{b} (the run started or stopped inside the window)"
            print(
                f"profiled steps {span}{cut}: {self.dir}/ (one set per rank) - open trace-*.json in "
                "https://ui.perfetto.dev or chrome://tracing, read ops-*.txt"
                + (", drop memory-*.pickle on https://pytorch.org/memory_viz" if self.cuda else ""),
                flush=True,
            )
