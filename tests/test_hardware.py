"""The MFU peak lookup (ftkit/hardware.py): a GPU is found by its whole torch.cuda.get_device_name(), never by a
part of it, and a device without a peak in the table gets no MFU and a note that says why."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ftkit import hardware, metrics

ROOT = Path(__file__).resolve().parents[1]

# Names as torch.cuda.get_device_name() (NVML) reports them, and the dense bf16 peak each must get.
PEAKS = {
    "NVIDIA H200": 989e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA L40S": 362e12,
    "NVIDIA L40": 181e12,  # not the L4's 121: a substring match read "NVIDIA L40" as an L4
    "NVIDIA L4": 121e12,
    "NVIDIA A10": 125e12,
    "NVIDIA RTX A6000": 154.8e12,
    "NVIDIA RTX 6000 Ada Generation": 364.2e12,
    "NVIDIA GeForce RTX 4090": 165.2e12,
    "NVIDIA GeForce RTX 3090": 71e12,
}


@pytest.mark.parametrize("name", PEAKS)
def test_each_gpu_gets_its_own_peak(name):
    entry = hardware.gpu_for_device_name(name)
    assert entry is not None and entry.bf16_flops == PEAKS[name], name
    assert hardware.no_peak_reason(name) is None


@pytest.mark.parametrize(
    "name, reason",
    [
        # A part of the name is another GPU's: the substring match gave the A100's, the H100's, the L4's peak.
        ("NVIDIA RTX A1000", "not in ftkit/hardware.py's table"),
        ("NVIDIA RTX A100", "not in ftkit/hardware.py's table"),
        ("NVIDIA L4 Fictional", "not in ftkit/hardware.py's table"),
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "MIG slice"),
        ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "MIG slice"),
        ("NVIDIA H100 PCIe MIG 3g.40gb", "MIG slice"),
        # Recognised, with no bf16 tensor peak.
        ("Tesla T4", "not bf16"),
        ("Tesla V100-SXM2-32GB", "not bf16"),
        ("Tesla V100-PCIE-16GB", "not bf16"),
        ("NVIDIA A10G", "no datasheet"),
    ],
)
def test_a_gpu_without_a_peak_of_its_own_gets_none_and_a_reason(name, reason):
    assert hardware.gpu_for_device_name(name) is None, name
    note = hardware.no_peak_reason(name)
    assert note and repr(name) in note and reason in note and "no MFU" in note


def test_each_name_and_key_belongs_to_one_row():
    names = [n for g in hardware.GPUS for n in g.names]
    assert len(names) == len(set(names))
    assert len({g.key for g in hardware.GPUS}) == len(hardware.GPUS)
    assert all(g.names and g.source for g in hardware.GPUS)


def test_the_planners_gpu_keys_still_work():
    """ftkit/plan/'s --gpu choices, as the README and the posts quote them."""
    for key in ("h200", "h100-pcie", "h100-nvl", "h100-sxm", "a100-80gb", "l40s", "l4", "rtx4090", "rtx3090"):
        assert hardware.gpu(key).key == key


def test_the_committed_gpu_runs_keep_their_peak():
    """The GPU runs under devlogs/runs recorded their device name and the peak their MFU was divided by: the
    whole-name lookup gives each the same peak, so their published MFU stands."""
    summaries = [json.loads(p.read_text()) for p in sorted((ROOT / "devlogs" / "runs").rglob("summary.json"))]
    gpu_runs = [s for s in summaries if s.get("hardware", {}).get("gpu")]
    assert gpu_runs
    for s in gpu_runs:
        assert hardware.gpu_for_device_name(s["hardware"]["gpu"]).bf16_flops == s["peak_flops"]


def test_each_gpus_memory_is_what_torch_reports_with_its_source():
    """The planner's memory per GPU is torch's total_memory, not the datasheet's GB read as 10^9 B: the committed GPU
    runs' recorded `gpu_memory` is their row's, and every other row names where its figure is from."""
    summaries = [json.loads(p.read_text()) for p in sorted((ROOT / "devlogs" / "runs").rglob("summary.json"))]
    gpu_runs = [s["hardware"] for s in summaries if s.get("hardware", {}).get("gpu_memory")]
    assert {h["gpu"] for h in gpu_runs} == {"NVIDIA H100 80GB HBM3", "NVIDIA H200"}
    for h in gpu_runs:
        assert hardware.gpu_for_device_name(h["gpu"]).memory_bytes == h["gpu_memory"]
    for g in hardware.GPUS:
        assert g.memory_source, g.key
    assert round(hardware.gpu("rtx4090").memory_bytes / 2**30, 2) == 23.64  # the datasheet's 24 GB would be 22.35


def test_a_run_on_an_unknown_gpu_reports_no_mfu_and_says_why(monkeypatch, tmp_path, capsys):
    """The rows' `mfu` and the summary's `peak_flops` are null, the summary's `mfu_note` names the device and the
    reason, and rank 0 prints the note once."""
    name = "NVIDIA H100 80GB HBM3 MIG 1g.10gb"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    cuda = torch.device("cuda", 0)
    assert metrics.peak_flops(cuda) is None
    assert "MIG slice" in metrics.mfu_note(cuda) and name in metrics.mfu_note(cuda)

    log = metrics.RunLog(
        tmp_path,
        0,
        SimpleNamespace(max_steps=1, progress=False),
        0,
        run_config={"args": {"max_steps": 1}},
        model_config=None,
        n_lora=0,
        devices=1,
        device=cuda,
    )
    printed = capsys.readouterr().err
    assert printed.count("MIG slice") == 1 and name in printed
    summary = log.run_summary(1, predicted={}, note="")
    assert summary["peak_flops"] is None and summary["mfu_note"] == metrics.mfu_note(cuda)
    log.close()


def test_a_cpu_run_says_mfu_is_for_gpus():
    assert metrics.peak_flops(torch.device("cpu")) is None
    assert "CUDA GPUs only" in metrics.mfu_note(torch.device("cpu"))
