"""GPU and interconnect figures, from the vendors' datasheets: one table for the MFU peak (`ftkit/metrics.py`) and
the planner (`ftkit/plan.py`). Datasheet peaks, not measurements: a step reaches a fraction of them, which the
planner states as an assumption.

FLOP/s are dense bf16 tensor-core peaks (the datasheets' "with sparsity" figures halved). Link bandwidths are per
direction per GPU, in bytes/s.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    key: str  # the --gpu name
    match: str  # a substring of torch.cuda.get_device_name()
    bf16_flops: float
    memory_bytes: float
    hbm_bytes_per_s: float
    source: str


GB = 1e9
# The most specific `match` first: "H100 PCIe" must not be read as an SXM H100, nor an "L40S" as an "L4".
GPUS = [
    GPU("h200", "H200", 989e12, 141 * GB, 4.8e12, "NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
    GPU("h100-pcie", "H100 PCIe", 756e12, 80 * GB, 2.0e12, "NVIDIA H100 Tensor Core GPU datasheet (PCIe)"),
    GPU("h100-nvl", "H100 NVL", 835e12, 94 * GB, 3.9e12, "NVIDIA H100 Tensor Core GPU datasheet (NVL)"),
    GPU("h100-sxm", "H100", 989e12, 80 * GB, 3.35e12, "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"),
    GPU("a100-80gb", "A100", 312e12, 80 * GB, 2.039e12, "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM)"),
    GPU("l40s", "L40S", 362e12, 48 * GB, 864e9, "NVIDIA L40S datasheet"),
    GPU("l4", "L4", 121e12, 24 * GB, 300e9, "NVIDIA L4 Tensor Core GPU datasheet"),
    # GeForce cards run bf16 with fp32 accumulation at half their fp16-accumulate rate.
    GPU("rtx4090", "RTX 4090", 165.2e12, 24 * GB, 1008e9, "NVIDIA Ada GPU architecture whitepaper (GeForce RTX 4090)"),
    GPU("rtx3090", "RTX 3090", 71e12, 24 * GB, 936e9, "NVIDIA Ampere GA102 whitepaper (GeForce RTX 3090)"),
]


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
        Link("ib-ndr", 50e9, 5e-6, "NVIDIA ConnectX-7: InfiniBand NDR 400 Gb/s, one adapter per GPU (DGX H100)"),
        Link("ib-hdr", 25e9, 5e-6, "NVIDIA ConnectX-6: InfiniBand HDR 200 Gb/s, one adapter per GPU (DGX A100)"),
    ]
}


def gpu(key: str) -> GPU:
    for g in GPUS:
        if g.key == key:
            return g
    raise ValueError(f"unknown GPU {key!r}; known: {', '.join(g.key for g in GPUS)}")


def gpu_for_device_name(name: str) -> GPU | None:
    """The table's entry for a torch.cuda.get_device_name(), or None for a GPU not in it."""
    return next((g for g in GPUS if g.match in name), None)
