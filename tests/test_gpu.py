"""Telling "no GPU" from "driver too old for this torch": the driver probe on real /proc and nvidia-smi output,
the minimums, and each message of explain_no_cuda."""

import subprocess
import sys

import pytest
import torch

from ftkit import gpu

# The two formats of /proc/driver/nvidia/version: the proprietary and the open kernel module.
PROC_PROPRIETARY = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024\n"
    "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
)
PROC_OPEN = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  "
    "(dvs-builder@U22-I3-AE18-09-1)  Sun Jul 27 06:54:38 UTC 2025\n"
    "GCC version:  gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04)\n"
)


def fake_smi(tmp_path, stdout: str, rc: int = 0) -> tuple[str, ...]:
    """A command that prints what nvidia-smi would and exits with rc."""
    script = tmp_path / "nvidia-smi.py"
    script.write_text(f"import sys\nsys.stdout.write({stdout!r})\nsys.exit({rc})\n")
    return (sys.executable, str(script))


@pytest.mark.parametrize("text, version", [(PROC_PROPRIETARY, "550.54.14"), (PROC_OPEN, "580.65.06")])
def test_driver_version_from_proc(tmp_path, monkeypatch, text, version):
    proc = tmp_path / "version"
    proc.write_text(text)
    monkeypatch.setattr(gpu, "PROC_VERSION", proc)
    monkeypatch.setattr(gpu, "NVIDIA_SMI", ("false",))  # /proc wins; nvidia-smi is not needed
    assert gpu.nvidia_driver_version() == version


def test_driver_version_from_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu, "PROC_VERSION", tmp_path / "missing")
    monkeypatch.setattr(gpu, "NVIDIA_SMI", fake_smi(tmp_path, "535.104.05\n535.104.05\n"))  # one line per GPU
    assert gpu.nvidia_driver_version() == "535.104.05"


def test_nvidia_smi_failing_means_no_driver(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu, "PROC_VERSION", tmp_path / "missing")
    failed = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"
    monkeypatch.setattr(gpu, "NVIDIA_SMI", fake_smi(tmp_path, failed, rc=9))
    assert gpu.nvidia_driver_version() is None


def test_no_proc_and_no_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu, "PROC_VERSION", tmp_path / "missing")
    monkeypatch.setattr(gpu, "NVIDIA_SMI", (str(tmp_path / "no-such-nvidia-smi"), "--query-gpu=driver_version"))
    assert gpu.nvidia_driver_version() is None


def test_nvidia_smi_hanging(tmp_path, monkeypatch):
    def hang(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], kwargs["timeout"])

    monkeypatch.setattr(gpu, "PROC_VERSION", tmp_path / "missing")
    monkeypatch.setattr(subprocess, "run", hang)
    assert gpu.nvidia_driver_version() is None


@pytest.mark.parametrize(
    "cuda, driver",
    [("12.6", "525.60.13"), ("12.8", "525.60.13"), ("13.0", "580.65.06"), ("13.2", "580.65.06"), ("14.0", None)],
)
def test_required_driver(cuda, driver):
    assert gpu.required_driver(cuda) == driver


def test_required_driver_cpu_build():
    assert gpu.required_driver(None) is None


def test_versions_compare_numerically():
    # As strings both of these would come out the other way round.
    assert gpu._version_key("535.54.14") < gpu._version_key("535.104.05")
    assert gpu._version_key("99.1") < gpu._version_key("580.65.06")
    assert gpu._version_key("535.104.05") < gpu._version_key("580.65.06")
    assert gpu._version_key("580.65.6") == gpu._version_key("580.65.06")


def with_driver(monkeypatch, version):
    monkeypatch.setattr(gpu, "nvidia_driver_version", lambda: version)


def test_explain_cpu_only_build(monkeypatch):
    with_driver(monkeypatch, "550.54.14")
    msg = gpu.explain_no_cuda(cuda_build=None)
    assert "CPU-only build" in msg and "uv sync" in msg


def test_explain_driver_too_old(monkeypatch):
    with_driver(monkeypatch, "535.104.05")
    msg = gpu.explain_no_cuda(cuda_build="13.2")
    assert "535.104.05" in msg and "CUDA 13.2" in msg and ">= 580.65.06" in msg
    base = torch.__version__.split("+")[0]
    assert f"uv pip install torch=={base} --index-url https://download.pytorch.org/whl/cu126" in msg
    assert "+" not in msg.split("uv pip install")[1].split("`")[0]  # no local suffix in the pin
    assert "uv sync" in msg and "no NVIDIA" not in msg


def test_explain_driver_too_old_even_for_cuda_12(monkeypatch):
    # 470 predates CUDA 12 too: a cu126 torch would not run either, so only the driver update is offered.
    with_driver(monkeypatch, "470.256.02")
    msg = gpu.explain_no_cuda(cuda_build="12.8")
    assert "470.256.02" in msg and ">= 525.60.13" in msg and "uv pip install" not in msg


def test_explain_no_driver(monkeypatch):
    with_driver(monkeypatch, None)
    msg = gpu.explain_no_cuda(cuda_build="13.2")
    assert "no NVIDIA GPU/driver found" in msg and "too old" not in msg


@pytest.mark.parametrize("cuda", ["13.2", "14.0"])
def test_explain_driver_fine_but_cuda_failed(monkeypatch, cuda):
    with_driver(monkeypatch, "590.44.01")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    msg = gpu.explain_no_cuda(cuda_build=cuda)
    assert "present" in msg and "failed to initialise" in msg and "too old" not in msg
    assert "nvidia-smi" in msg and "CUDA_VISIBLE_DEVICES ('')" in msg


def test_explain_default_is_this_torch(monkeypatch):
    with_driver(monkeypatch, None)
    expected = "CPU-only" if torch.version.cuda is None else "no NVIDIA GPU/driver found"
    assert expected in gpu.explain_no_cuda()
