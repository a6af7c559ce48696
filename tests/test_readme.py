"""The repository stands on its own: nothing in it points at the development folder that sat beside the
checkout on the project's machines, which a fresh clone does not have."""

from __future__ import annotations

import subprocess

import pytest
from conftest import ROOT

# Spelled in two parts so that this file does not match itself.
OUTSIDE = "../" + "shared"


def repository_text_files() -> list[str]:
    """Tracked files, and new ones git would track (not ignored), that exist in the working tree and are text."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    files = []
    for name in filter(None, listed.split("\0")):
        path = ROOT / name
        if path.is_file() and b"\0" not in path.read_bytes():  # deleted ones and binaries (.gz, .png) left out
            files.append(name)
    return files


def test_nothing_refers_to_the_shared_folder():
    # Run records (devlogs/runs/) keep the --data path they were measured with: a record, not an instruction.
    # That folder held the same 137 QMSum meetings, byte for byte, that the package ships.
    files = [f for f in repository_text_files() if not f.startswith("devlogs/runs/")]
    assert "README.md" in files and "ftkit/data.py" in files
    hits = [
        f"{name}:{n}: {line.strip()}"
        for name in files
        for n, line in enumerate((ROOT / name).read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if OUTSIDE in line
    ]
    assert not hits, f"{len(hits)} reference(s) to {OUTSIDE}, which a clone does not have:\n" + "\n".join(hits)
