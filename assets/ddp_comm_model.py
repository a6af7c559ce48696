"""What DDP sends for Qwen3-4B, and how long a ring all-reduce of it takes on common links: a model, not a measurement.

    uv run python assets/ddp_comm_model.py

Prints the Markdown tables the DDP post quotes (blogs/ddp.md). Bytes come from the model's shape (the memory
model's parameter counts); times from the ring all-reduce's bandwidth term, 2(N-1)/N x bytes / link bandwidth
(Patarasuk & Yuan 2009), at the links' *peak* per-direction bandwidth from NVIDIA's datasheets. Real NCCL runs
reach less than peak and add 2(N-1) message latencies, so the times are lower bounds. The compute time beside
them assumes an MFU, stated in the table; it is an assumption, not a measurement.
"""

from __future__ import annotations

from transformers import Qwen3Config

from ftkit import comm, hardware, metrics, models
from ftkit.memory import ModelShape, lora_params

# Peak bandwidth per direction, bytes/s, for one GPU's link into the all-reduce.
LINKS = {
    # H100 SXM5: NVLink 4, 900 GB/s total (both directions) per GPU (NVIDIA H100 datasheet).
    "NVLink 4 (H100 SXM), 450 GB/s": 450e9,
    # PCIe Gen5 x16: 128 GB/s total, 64 GB/s each way (NVIDIA H100 PCIe datasheet).
    "PCIe Gen5 x16, 64 GB/s": 64e9,
    # PCIe Gen4 x16: 64 GB/s total, 32 GB/s each way (NVIDIA A100 PCIe datasheet).
    "PCIe Gen4 x16, 32 GB/s": 32e9,
    # Across nodes: one 400 Gb/s InfiniBand NDR adapter per GPU (ConnectX-7, as in a DGX H100).
    "InfiniBand NDR 400 Gb/s, 50 GB/s": 50e9,
}
ASSUMED_MFU = 0.3
H100_BF16 = hardware.gpu("h100-sxm").bf16_flops
SEQ, GLOBAL_BATCH, LORA_RANK = 2048, 16, 16  # the real run's defaults (ftkit/run.py REAL)


def main() -> None:
    config = Qwen3Config(**models.QWEN3_4B_CONFIG)
    shape = ModelShape.from_config(config)
    lora = lora_params(shape, LORA_RANK)
    syncs = {
        f"LoRA r{LORA_RANK} gradients, fp32 ({lora:,} params)": lora * 4,
        f"full finetune gradients, bf16 ({shape.n_params():,} params)": shape.n_params() * 2,
    }
    # One optimizer step of the real run: 16 sequences of 2048 tokens (all counted as real tokens).
    flops = metrics.step_flops([SEQ] * GLOBAL_BATCH, config, lora)

    print("Bytes per sync, and ring all-reduce time (bandwidth term, peak link bandwidth): model, not measured\n")
    print("| gradients | MiB per sync | link | GPUs | wire MiB per GPU | all-reduce ms |")
    print("|---|---|---|---|---|---|")
    for what, size in syncs.items():
        for link, bw in LINKS.items():
            for n in (2, 8):
                wire = comm.ring_wire_bytes("all_reduce", size, n)
                print(f"| {what} | {size / 2**20:,.0f} | {link} | {n} | {wire / 2**20:,.0f} | {1e3 * wire / bw:,.2f} |")

    print(f"\nCompute per optimizer step ({GLOBAL_BATCH} x {SEQ} tokens, {flops:.3g} model FLOPs, the MFU convention")
    print(f"of ftkit/metrics.py), at an ASSUMED {ASSUMED_MFU:.0%} MFU on H100s ({H100_BF16:.3g} FLOP/s bf16 peak):\n")
    print("| GPUs | compute s per step | LoRA all-reduce over NVLink 4, % of compute | over PCIe Gen4 |")
    print("|---|---|---|---|")
    for n in (2, 8):
        seconds = flops / n / (ASSUMED_MFU * H100_BF16)
        wire = comm.ring_wire_bytes("all_reduce", lora * 4, n)
        nvlink, pcie = wire / LINKS["NVLink 4 (H100 SXM), 450 GB/s"], wire / LINKS["PCIe Gen4 x16, 32 GB/s"]
        print(f"| {n} | {seconds:.2f} | {100 * nvlink / seconds:.2f}% | {100 * pcie / seconds:.2f}% |")


if __name__ == "__main__":
    main()
