"""The errors that end a run with their message (exit code 2) instead of a traceback: `ranks.launch` catches them,
and `ranks.on_rank0` raises one that rank 0 met on every rank. Each message says what is wrong and how to fix it."""

from __future__ import annotations


class RunError(RuntimeError):
    """A problem with the run's setup; the message says how to fix it."""


class RunComplete(RunError):
    """--resume of a run that has nothing left to do: said, and the process exits 0 with the run untouched."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from (missing, damaged, or written by another layout)."""


class DataError(ValueError):
    """The data given cannot be used; the message says what is wrong and how to fix it."""


class ModelError(ValueError):
    """The --model given cannot be had; the message says what is wrong and what to do."""


# What the memory model predicted for the run's layout (set by `fit`): `ranks.launch` says it beside an out-of-memory
# error, so a run that does not fit says which prediction was wrong, and by how much.
memory_prediction: str | None = None
