"""Why `torch.cuda.is_available()` is False: a CPU-only torch, no NVIDIA GPU, or a driver too old for this torch.

The three look alike from torch (is_available() just says False), but the fixes differ: install the CUDA build,
use a GPU machine, or update the driver / install a torch built for an older CUDA. The driver version comes from
the kernel module (/proc/driver/nvidia/version), else from nvidia-smi.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import torch

PROC_VERSION = Path("/proc/driver/nvidia/version")
NVIDIA_SMI = ("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")

# Minimum Linux driver for a CUDA major release, any minor, from NVIDIA's CUDA Toolkit release notes: the minimums
# for minor version compatibility (11.x >= 450.80.02, 12.x >= 525.60.13, 13.x >= 580), with 580 made exact by the
# table "CUDA Toolkit and Corresponding Driver Versions" (CUDA 13.0 GA >= 580.65.06). A torch wheel brings its own
# CUDA runtime, so the driver is the only part of the machine that must be this new.
MIN_DRIVER = {"11": "450.80.02", "12": "525.60.13", "13": "580.65.06"}

_VERSION = r"\d+\.\d+(?:\.\d+)?"


def _version_key(version: str) -> tuple[int, ...]:
    """'535.104.05' -> (535, 104, 5): compare numerically, not as strings."""
    return tuple(int(part) for part in version.split("."))


def nvidia_driver_version() -> str | None:
    """The NVIDIA driver version, e.g. '550.54.14', or None when no driver is installed."""
    try:
        for line in PROC_VERSION.read_text().splitlines():
            # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024"
            if line.startswith("NVRM version:") and (m := re.search(rf"\s({_VERSION})\s", line + " ")):
                return m.group(1)
    except OSError:
        pass
    try:
        out = subprocess.run(NVIDIA_SMI, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):  # OSError covers FileNotFoundError: no nvidia-smi
        return None
    # One line per GPU. A failing nvidia-smi prints a message instead ("NVIDIA-SMI has failed because..."); any
    # version it does print (one GPU of several failing) still proves a driver.
    versions = out.stdout.split()
    return versions[0] if versions and re.fullmatch(_VERSION, versions[0]) else None


def required_driver(cuda_version: str | None) -> str | None:
    """The minimum driver for a CUDA version such as '12.8'; None for a CPU build or an unknown major."""
    return MIN_DRIVER.get(cuda_version.split(".")[0]) if cuda_version else None


def explain_no_cuda(cuda_build: str | None = torch.version.cuda) -> str:
    """What to tell the user when torch.cuda.is_available() is False, and how to fix it."""
    if cuda_build is None:
        return (
            f"torch {torch.__version__} is a CPU-only build, so it cannot use a GPU. "
            "On Linux `uv sync` installs the CUDA build from the lock."
        )
    driver = nvidia_driver_version()
    if driver is None:
        return f"no NVIDIA GPU/driver found (no {PROC_VERSION}, no working nvidia-smi), so CUDA is unavailable."
    needed = required_driver(cuda_build)
    if needed is not None and _version_key(driver) < _version_key(needed):
        fixes = f"update the NVIDIA driver to >= {needed}"
        if _version_key(driver) >= _version_key(MIN_DRIVER["12"]):  # a CUDA 12 build runs on it
            torch_version = torch.__version__.split("+")[0]  # without the local suffix (+cu132)
            fixes += (
                f", or install a torch built for an older CUDA into this environment, e.g. `uv pip install "
                f"torch=={torch_version} --index-url https://download.pytorch.org/whl/cu126` (a later `uv sync` "
                "puts the locked build back)"
            )
        return (
            f"NVIDIA driver {driver} is too old for this torch: torch {torch.__version__} is built for CUDA "
            f"{cuda_build}, which needs driver >= {needed}. Fix: {fixes}."
        )
    enough = f"CUDA {cuda_build} needs >= {needed}" if needed else f"no known minimum for CUDA {cuda_build}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (
        f"an NVIDIA GPU is present (driver {driver}; {enough}) but CUDA failed to initialise: check that "
        f"`nvidia-smi` lists the GPU and that CUDA_VISIBLE_DEVICES ({'unset' if visible is None else repr(visible)}) "
        "does not hide it."
    )
