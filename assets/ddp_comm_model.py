"""What DDP sends for Qwen3-4B, and how long a ring all-reduce of it takes on common links: a model, not a measurement.

    uv run python assets/ddp_comm_model.py

Prints the Markdown tables the DDP post quotes (blogs/ddp.md; tests/test_assets.py checks the first is
there). Bytes come from the model's shape (the memory
model's parameter counts); times from the ring all-reduce's bandwidth term, 2(N-1)/N x bytes / link bandwidth
(Patarasuk & Yuan 2009), at the links' *peak* per-direction bandwidth from NVIDIA's datasheets. Real NCCL runs
reach less than peak and add 2(N-1) message latencies, so the times are lower bounds. The compute time beside
them assumes an MFU, stated in the table; it is an assumption, not a measurement.
"""

from __future__ import annotations

import argparse
import statistics
from types import SimpleNamespace

from transformers import Qwen3Config

from ftkit import batching, comm, hardware, metrics, models
from ftkit.memory import ModelShape, lora_params
from ftkit.plan import layouts

# The links, from ftkit/hardware.py (each with its datasheet): peak bandwidth per direction, one GPU's link into
# the all-reduce. The full finetune's row leaves out InfiniBand, whose time is the LoRA row's scaled.
LINKS = {
    "NVLink 4 (H100 SXM)": hardware.LINKS["nvlink4"],
    "PCIe Gen4 x16": hardware.LINKS["pcie4"],
    "InfiniBand NDR 400 Gb/s": hardware.LINKS["ib-ndr"],
}
ASSUMED_MFU = 0.3
H100_BF16 = hardware.gpu("h100-sxm").bf16_flops
SEQ, GLOBAL_BATCH, LORA_RANK = 2048, 16, 16  # the real run's defaults (ftkit/cli.py REAL)
STEPS = 20  # the first 20 optimizer steps, as many as the committed H100 runs made


def reference_steps(config, lora: int) -> list[dict]:
    """The reference configuration's first STEPS global batches in Qwen3's tokens (the scripts' batching.GlobalBatches
    at seed 0, packed into rows of SEQ, over the AMI examples the scripts keep at SEQ: ftkit/ami_lengths.json): each
    step's real tokens, answer tokens, and model FLOPs by ftkit/metrics.py's convention (the lm_head at the answer
    positions only). Counted here rather than read from the committed H100 runs, which tokenized with the tiny
    tokenizer (they predate --tokenizer)."""
    examples = [SimpleNamespace(input_ids=range(n), n_target=t) for n, t in layouts.ami_examples(SEQ)]
    batches = batching.GlobalBatches(examples, GLOBAL_BATCH, seed=0, pack_to=SEQ)
    return [
        dict(
            tokens=batches.n_tokens(step),
            answers=batches.n_target(step),
            flops=metrics.step_flops(batches.lengths(step), config, lora, logit_positions=batches.n_target(step)),
        )
        for step in range(STEPS)
    ]


def main() -> None:
    config = Qwen3Config(**models.QWEN3_4B_CONFIG)
    shape = ModelShape.from_config(config)
    lora = lora_params(shape, LORA_RANK)
    syncs = {
        f"LoRA r{LORA_RANK} gradients, fp32 ({lora:,} params)": lora * 4,
        f"full finetune gradients, bf16 ({shape.n_params():,} params)": shape.n_params() * 2,
    }
    # One optimizer step of the real run, on average: its sequences are cut at SEQ tokens, not SEQ long.
    steps = reference_steps(config, lora)
    flops = statistics.mean(s["flops"] for s in steps)
    tokens, answers = (statistics.mean(s[k] for s in steps) for k in ("tokens", "answers"))
    cap = metrics.step_flops([SEQ] * GLOBAL_BATCH, config, lora, logit_positions=GLOBAL_BATCH * 256)

    print("| what one sync sends | MiB | link (peak, each way) | 2 GPUs | 8 GPUs |")
    print("|---|---|---|---|---|")
    for i, (what, size) in enumerate(syncs.items()):
        links = LINKS if i == 0 else {k: v for k, v in LINKS.items() if "InfiniBand" not in k}
        for j, (name, link) in enumerate(links.items()):
            times = [1e3 * comm.ring_wire_bytes("all_reduce", size, n) / link.bytes_per_s for n in (2, 8)]
            cells = [f"{t:,.2f} ms" if t < 10 else f"{t:,.1f} ms" if t < 100 else f"{t:,.0f} ms" for t in times]
            head = f"| {what} | {size / 2**20:,.0f} |" if j == 0 else "| | |"
            print(f"{head} {name}, {link.bytes_per_s / 1e9:g} GB/s | {cells[0]} | {cells[1]} |")
    print(
        f"\nCompute per optimizer step: the reference configuration's first {len(steps)} steps (Qwen3's tokens) of "
        f"{GLOBAL_BATCH} sequences cut at "
        f"{SEQ} tokens averaged {tokens:,.0f} real tokens ({answers:,.0f} answers), {flops:.3g} model FLOPs by the MFU "
        f"convention of ftkit/metrics.py ({cap:.3g} if every sequence were {SEQ} long with 256 answers), at an "
        f"ASSUMED {ASSUMED_MFU:.0%} MFU on H100s ({H100_BF16:.3g} FLOP/s bf16 peak):\n"
    )
    print("| GPUs | compute s per step | LoRA all-reduce over NVLink 4, % of compute | over PCIe Gen4 |")
    print("|---|---|---|---|")
    for n in (2, 8):
        seconds = flops / n / (ASSUMED_MFU * H100_BF16)
        wire = comm.ring_wire_bytes("all_reduce", lora * 4, n)
        nvlink, pcie = (wire / LINKS[k].bytes_per_s for k in ("NVLink 4 (H100 SXM)", "PCIe Gen4 x16"))
        print(f"| {n} | {seconds:.2f} | {100 * nvlink / seconds:.2f}% | {100 * pcie / seconds:.2f}% |")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
