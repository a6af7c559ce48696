"""The repository stands on its own: nothing in it points at the development folder that sat beside the
checkout on the project's machines, which a fresh clone does not have; and the README's commands are ones the
scripts accept."""

from __future__ import annotations

import re
import runpy
import subprocess
import sys

import pytest
from conftest import ROOT

# Spelled in two parts so that this file does not match itself.
OUTSIDE = "../" + "shared"
EXPERIMENTS = ("single-gpu-ft", "ddp-ft", "fsdp-ft", "tp-ft", "tp-sp-ft", "pp-ft")


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


def readme_train_commands() -> list[list[str]]:
    """Every `uv run python|torchrun ... experiments/<x>/train.py FLAGS` command the README shows (code blocks and
    the experiment table), as the train.py's argument list."""
    commands = []
    for line in (ROOT / "README.md").read_text().splitlines():
        for text in re.findall(r"`(uv run [^`]+)`", line) or ([line] if line.lstrip().startswith("uv run") else []):
            words = text.split("#")[0].split()
            scripts = [i for i, w in enumerate(words) if re.fullmatch(r"experiments/[\w-]+/train\.py", w)]
            if scripts:
                commands.append(words[scripts[0] :])
    return commands


def test_every_readme_train_command_parses(monkeypatch):
    """The README's train.py commands name scripts that exist and flags their parsers accept, resolved as a run
    would resolve them (scale defaults, range checks). Running them all verbatim costs minutes each; every one is
    run with smaller flags by its technique's tests."""
    commands = readme_train_commands()
    assert {c[0] for c in commands} >= {f"experiments/{e}/train.py" for e in EXPERIMENTS}, commands
    assert sum("--smoke" in c for c in commands) >= len(EXPERIMENTS)  # the CPU walkthrough of each
    for script, *flags in commands:
        module = runpy.run_path(str(ROOT / script))
        monkeypatch.setattr(sys, "argv", [script, *flags])
        try:
            args = module["parse_args"]()
        except SystemExit as e:
            pytest.fail(f"README: `{script} {' '.join(flags)}` is refused by its parser (exit {e.code})")
        assert args.experiment == script.split("/")[1] and args.max_steps > 0
