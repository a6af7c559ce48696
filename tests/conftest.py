"""Shared fixtures: the AMI data the tests run on, a private model/tokenizer cache, and script launching."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftkit.data import SHIPPED_DIR

ROOT = Path(__file__).resolve().parents[1]
# The AMI meetings the package ships (QMSum's, gzipped): real text in any clone, offline.
DATA = SHIPPED_DIR


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """Tiny tokenizers and random-init checkpoints go to a cache of this test session, not the user's."""
    if "FTKIT_CACHE" not in os.environ:
        os.environ["FTKIT_CACHE"] = str(tmp_path_factory.mktemp("ftkit-cache"))
    yield


@pytest.fixture(scope="session", autouse=True)
def count_host_syncs():
    """Every training run of the tests counts, per optimizer step, the .item()/.tolist()-like calls its own code
    makes (ftkit.metrics.HostSyncCounter; `host_syncs` in metrics.jsonl), for the tests to bound."""
    os.environ["FTKIT_COUNT_HOST_SYNCS"] = "1"
    yield


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA


def run_script(*args: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a repository script with this interpreter; its output is returned for the assertions and shown
    when a test fails."""
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})},
    )
    print(f"$ {' '.join(args)}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return proc
