"""GPU and interconnect figures, from the vendors' datasheets: one table for the MFU peak (`ftkit/metrics.py`) and
the planner (`ftkit/plan/`). Datasheet peaks, not measurements: a step reaches a fraction of them, which the
planner states as an assumption.

FLOP/s are dense bf16 tensor-core peaks (the datasheets' "with sparsity" figures halved). Link bandwidths are per
direction per GPU, in bytes/s. Memory is not the datasheet's "24 GB" (a 4090 has 24 GiB of GDDR6X) but what torch
reports as `total_memory`, the card's less the driver's share, which moves by up to about 0.1 GiB with the driver
and OS: each row says where its figure is from.

A GPU is found by its whole `torch.cuda.get_device_name()`, never by a part of it: "NVIDIA L40" is not an L4,
"NVIDIA RTX A1000" not an A100, and a MIG slice ("NVIDIA H100 80GB HBM3 MIG 1g.10gb") not a whole H100. A name the
table does not list gets no peak, and so no MFU, with the reason (`no_peak_reason`), rather than another GPU's.
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class GPU:
    key: str  # the --gpu name
    names: tuple[str, ...]  # its torch.cuda.get_device_name()s, whole (one per variant the driver reports)
    bf16_flops: float
    memory_bytes: float
    hbm_bytes_per_s: float  # memory bandwidth (GDDR on the L4/L40/Ada/GeForce/RTX rows)
    source: str
    # The link between the GPUs of one node as the card is built: NVLink on the SXM boards, PCIe for a card in a
    # slot (the NVLink bridges of H100 NVL and RTX A6000 join two cards only, so a node of more goes over PCIe),
    # PCIe through host memory for the GeForce cards, which the driver gives no peer-to-peer.
    link: str = "pcie4"
    memory_source: str = ""  # where the memory figure, torch's total_memory, is from


MIB, GIB = 2**20, 2**30
GPUS = [
    GPU(
        "h200",
        ("NVIDIA H200",),
        989e12,
        150_109_880_320,
        4.8e12,
        "NVIDIA H200 Tensor Core GPU datasheet (SXM)",
        "nvlink4",
        memory_source="this project's H200 session (devlogs/runs/*-gpu, gpu_memory)",
    ),
    GPU(
        "h100-pcie",
        ("NVIDIA H100 PCIe",),
        756e12,
        81_008 * MIB,
        2.0e12,
        "NVIDIA H100 Tensor Core GPU datasheet (PCIe)",
        "pcie5",
        memory_source="torch 2.0.1 repr of an H100 PCIe, total_memory=81008MB",
    ),
    GPU(
        "h100-nvl",
        ("NVIDIA H100 NVL",),
        835e12,
        93.00 * GIB,
        3.9e12,
        "NVIDIA H100 Tensor Core GPU datasheet (NVL)",
        "pcie5",
        memory_source="an out-of-memory report on an H100 NVL, total capacity 93.00 GiB (ali-vilab/VACE#56)",
    ),
    GPU(
        "h100-sxm",
        ("NVIDIA H100 80GB HBM3",),
        989e12,
        85_017_493_504,
        3.35e12,
        "NVIDIA H100 Tensor Core GPU datasheet (SXM5)",
        "nvlink4",
        memory_source="this project's H100 runs (devlogs/runs/*-gpu, gpu_memory)",
    ),
    # Every A100 has the same tensor peak, 312 TFLOP/s bf16 dense (624 with sparsity): the PCIe cards' is the SXM's
    # on the datasheet, though their lower power limit (300 W against 400 W) may hold a long step further below it.
    GPU(
        "a100-80gb",
        ("NVIDIA A100-SXM4-80GB",),
        312e12,
        81_049 * MIB,
        2.039e12,
        "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM)",
        "nvlink3",
        memory_source="mixbench on an A100 80GB PCIe, 81049 MB (ekondis/mixbench#47); "
        "deviceQuery on SXM ones reads 81,051-81,158 MiB",
    ),
    GPU(
        "a100-40gb",
        ("NVIDIA A100-SXM4-40GB",),
        312e12,
        40_339 * MIB,
        1.555e12,
        "NVIDIA A100 Tensor Core GPU datasheet, 2020 edition (40GB SXM)",
        "nvlink3",
        memory_source="deviceQuery on an A100-SXM4-40GB, 40339 MBytes (bottlerocket-os/bottlerocket#3873)",
    ),
    GPU(
        "a100-80gb-pcie",
        ("NVIDIA A100 80GB PCIe",),
        312e12,
        81_049 * MIB,
        1.935e12,
        "NVIDIA A100 Tensor Core GPU datasheet (80GB PCIe: the same 312 TFLOP/s bf16 as the SXM)",
        memory_source="mixbench on an A100 80GB PCIe, 81049 MB (ekondis/mixbench#47)",
    ),
    GPU(
        "a100-40gb-pcie",
        ("NVIDIA A100-PCIE-40GB",),
        312e12,
        40_326 * MIB,
        1.555e12,
        "NVIDIA A100 Tensor Core GPU datasheet, 2020 edition (40GB PCIe: the same 312 TFLOP/s bf16 as the SXM)",
        memory_source="torch 1.9.0 repr of an A100-PCIE-40GB, total_memory=40326MB",
    ),
    GPU(
        "l40s",
        ("NVIDIA L40S",),
        362e12,
        45_589 * MIB,
        864e9,
        "NVIDIA L40S datasheet",
        memory_source="deviceQuery on an L40S, 45589 MBytes (thamada/nvidia-smi, nvsim/L40S_deviceQuery.py)",
    ),
    GPU(
        "l40",
        ("NVIDIA L40",),
        181e12,
        44.40 * GIB,
        864e9,
        "NVIDIA L40 datasheet (BF16 Tensor Core 181.05 | 362.1*)",
        memory_source="an out-of-memory report on an L40, total capacity 44.40 GiB (QwenLM/Qwen3-VL#2097)",
    ),
    GPU(
        "l4",
        ("NVIDIA L4",),
        121e12,
        22_518 * MIB,
        300e9,
        "NVIDIA L4 Tensor Core GPU datasheet",
        memory_source="deviceQuery on an L4, 22518 MBytes; "
        "an out-of-memory report reads 22.03 GiB (ArcInstitute/evo2#190)",
    ),
    GPU(
        "a10",
        ("NVIDIA A10",),
        125e12,
        22_516 * MIB,
        600e9,
        "NVIDIA A10 Tensor Core GPU datasheet (BF16 125 | 250* TF)",
        memory_source="deviceQuery on an A10, 22516-22599 MBytes with the driver",
    ),
    # The workstation cards run bf16 with fp32 accumulation at their full tensor rate, as the data-center ones do...
    GPU(
        "rtx6000-ada",
        ("NVIDIA RTX 6000 Ada Generation",),
        364.2e12,
        48_622 * MIB,
        960e9,
        "NVIDIA Ada GPU architecture whitepaper (RTX 6000 Ada: bf16, fp32 accumulate, 364.2 | 728.5*); its datasheet's "
        "1,457 TFLOP/s is fp8 with sparsity, 4x that",
        memory_source="torch 2.3.0 repr of an RTX 6000 Ada, total_memory=48622MB",
    ),
    GPU(
        "rtx-a6000",
        ("NVIDIA RTX A6000",),
        154.8e12,
        48_676 * MIB,
        768e9,
        "NVIDIA Ampere GA102 GPU architecture whitepaper (RTX A6000: bf16, fp32 accumulate, 154.8 | 309.7*)",
        memory_source="torch repr of an RTX A6000, total_memory=48676MB (pytorch/ao, torchao/prototype/hqq/README.md)",
    ),
    # ...the GeForce cards at half their fp16-accumulate rate.
    GPU(
        "rtx4090",
        ("NVIDIA GeForce RTX 4090",),
        165.2e12,
        23.64 * GIB,
        1008e9,
        "NVIDIA Ada GPU architecture whitepaper (GeForce RTX 4090)",
        "pcie4-host",
        memory_source="an out-of-memory report on a 4090, total capacity 23.64 GiB (ali-vilab/VGen#104); "
        "another reads 23.68 (zai-org/CogVideo#36)",
    ),
    GPU(
        "rtx3090",
        ("NVIDIA GeForce RTX 3090",),
        71e12,
        25_286_672_384,
        936e9,
        "NVIDIA Ampere GA102 whitepaper (GeForce RTX 3090)",
        "pcie4-host",
        memory_source="totalGlobalMem of a 3090, 25286672384 bytes (Jumperkables/cuda-benchmarking, "
        "00_deviceQuery/README.md); deviceQuery outputs read 23.55-23.70 GiB",
    ),
]

# GPUs recognised but given no bf16 peak, each with the reason: MFU is not reported for a bf16 step on them.
WITHOUT_PEAK = [
    (
        re.compile(r"Tesla T4"),
        "a Turing GPU: its tensor cores do fp16, int8 and int4 but not bf16 (NVIDIA T4 datasheet), so a bf16 step "
        "has no tensor peak to be measured against",
    ),
    (
        re.compile(r"Tesla V100S?-(SXM2|SXM3|PCIE)-(16|32)GB"),
        "a Volta GPU: its tensor cores do fp16 but not bf16 (NVIDIA V100 datasheet), so a bf16 step has no tensor "
        "peak to be measured against",
    ),
    (
        re.compile(r"NVIDIA A10G"),
        "AWS's variant of the A10, for which NVIDIA publishes no datasheet; its tensor peak is not the A10's",
    ),
]


def gpu(key: str) -> GPU:
    for g in GPUS:
        if g.key == key:
            return g
    raise ValueError(f"unknown GPU {key!r}; known: {', '.join(g.key for g in GPUS)}")


def gpu_for_device_name(name: str) -> GPU | None:
    """The table's row for a torch.cuda.get_device_name(), matched on the whole name; None for a GPU the table
    does not list, a MIG slice among them (`no_peak_reason` says why)."""
    name = name.strip()
    return next((g for g in GPUS if name in g.names), None)


def no_peak_reason(name: str) -> str | None:
    """Why a torch.cuda.get_device_name() has no bf16 peak in the table, so no MFU; None where it has one."""
    name = name.strip()
    if re.search(r"\bMIG\b", name):
        return (
            f"{name!r} is a MIG slice: its peak is a fraction of the whole GPU's, which ftkit/hardware.py does not "
            "list, so no MFU"
        )
    if gpu_for_device_name(name):
        return None
    for pattern, why in WITHOUT_PEAK:
        if pattern.fullmatch(name):
            return f"{name!r} is {why}; no MFU"
    return (
        f"{name!r} is not in ftkit/hardware.py's table of bf16 peaks (matched on the whole device name), so no MFU; "
        "add its row, with its datasheet, to report one"
    )


@dataclass(frozen=True)
class Link:
    key: str
    bytes_per_s: float  # per direction per GPU
    latency_s: float  # per message; an assumed order of magnitude, not a datasheet figure
    source: str


LINKS = {
    link.key: link
    for link in [
        Link("nvlink4", 450e9, 2e-6, "NVIDIA H100 datasheet: NVLink 4, 900 GB/s per GPU in both directions"),
        Link("nvlink3", 300e9, 2e-6, "NVIDIA A100 datasheet: NVLink 3, 600 GB/s per GPU in both directions"),
        Link("pcie5", 63e9, 10e-6, "PCI-SIG PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b encoding, per direction"),
        Link("pcie4", 31.5e9, 10e-6, "PCI-SIG PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b encoding, per direction"),
        # GeForce cards get no peer-to-peer over PCIe from NVIDIA's driver, so NCCL stages every transfer through
        # pinned host memory (its SHM transport): a copy rate users measured (half of the both-ways figure below),
        # not a datasheet's, which the planner still takes at --link-efficiency (NCCL's protocol on top of the copy).
        Link(
            "pcie4-host",
            12.9e9,
            15e-6,
            "PCIe 4.0 x16 without peer-to-peer, through host memory: 25.8 GB/s both directions together, "
            "CUDA's p2pBandwidthLatencyTest with P2P disabled on 3 x RTX 4090 (tinygrad/open-gpu-kernel-modules#6); "
            "latency 12-17 us with P2P disabled (8 x RTX 3090, NVIDIA/nccl#1127)",
        ),
        Link("ib-ndr", 50e9, 5e-6, "NVIDIA ConnectX-7: InfiniBand NDR 400 Gb/s, one adapter per GPU (DGX H100)"),
        Link("ib-hdr", 25e9, 5e-6, "NVIDIA ConnectX-6: InfiniBand HDR 200 Gb/s, one adapter per GPU (DGX A100)"),
        # Ethernet between nodes of PCIe cards: one NIC per node serves a ring, which crosses each node's link once
        # each way. NCCL's socket transport over TCP: the latency is an assumed order of magnitude.
        Link("eth-100g", 12.5e9, 30e-6, "IEEE 802.3 100 Gb/s Ethernet line rate, one NIC per node, per direction"),
        Link("eth-25g", 3.125e9, 30e-6, "IEEE 802.3 25 Gb/s Ethernet line rate, one NIC per node, per direction"),
        Link("eth-10g", 1.25e9, 30e-6, "IEEE 802.3 10 Gb/s Ethernet line rate, one NIC per node, per direction"),
    ]
}


def describe(device: torch.device, world_size: int) -> dict:
    """config.json's record of the machine a run ran on: the device, the ranks and nodes, the host CPU and its
    threads, and on a GPU its name, memory and CUDA version."""
    info = {
        "device": device.type,
        "world_size": world_size,
        "nodes": int(os.environ.get("GROUP_WORLD_SIZE", "1")),  # torchrun's agents: one per node
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory=props.total_memory, cuda=torch.version.cuda)
    return info


def cpu_model() -> str:
    """The host CPU's model name (Linux: /proc/cpuinfo), else its architecture. It matters on GPUs too: a step
    that issues many small ops waits on the host (devlogs/single-gpu-ft.md, "First GPU measurements")."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "datasets", "flash-attn"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out
