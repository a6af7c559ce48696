"""A stated model, not a measurement: what each GPU sends for LoRA on Qwen3-4B with 2 GPUs at the reference
configuration, tensor (+ sequence) parallel against FSDP, and how long that takes on PCIe and on NVLink. It prints the
table blogs/tp-sp.md quotes (`table`); assets/tp_sp_layer.py draws one decoder layer's share of it.

    uv run python assets/tp_comm_model.py [--world 2]

- Bytes: each script's own theory (ftkit/comm.py), the one its summary states beside what it recorded, and which
  ftkit.realscale checks to the byte at Qwen3-4B's shape (devlogs/runs/realscale/): `tp_sp_collective_theory` for
  tp-sp-ft with and without SP, `tp_all_reduce_theory` for tp-ft's DTensor plan, `fsdp_theory` for fsdp-ft. These
  are buffer bytes, the size of each collective's whole tensor.
- The reference configuration (README; `REAL` in ftkit/cli.py): a micro-batch is 2 sequences of 2048 tokens, bf16,
  LoRA rank 16, checkpointing on (the recompute repeats a layer's forward collectives, up to the MLP's exit), global
  batch 16. TP ranks run every micro-batch of the step (8); FSDP ranks their own share (4 each on 2 GPUs).
- Once per step, the gradients: tp-sp-ft all-reduces the LoRA tensors every rank holds whole (fp32), fsdp-ft
  reduce-scatters the LoRA gradients (fp32); tp-ft's plan sums them inside its per-module all-reduces, counted above.
- Wire bytes per GPU: the ring algorithms (`ring_wire_bytes`): an all-reduce puts 2(N-1)/N of its buffer on the
  wire, an all-gather or a reduce-scatter (N-1)/N.
- Links, per direction, from ftkit/hardware.py (each with its datasheet): PCIe 4.0 x16 31.5 GB/s, NVLink 4 on H100
  SXM 450 GB/s, each at the planner's assumed 80% of it (ftkit/plan/settings.py's link_efficiency). Bandwidth terms
  only (no latency). TP's collectives sit between matmuls that need their result: on the critical path. FSDP's
  gathers can be prefetched under the previous layer's compute.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from ftkit import comm, hardware
from ftkit.lora import COLUMN_PARALLEL, LORA_TARGETS
from ftkit.memory import QWEN3_4B, lora_params
from ftkit.plan import settings

BF16, FP32 = 2, 4
SHAPE = QWEN3_4B
REFERENCE = dict(seq_len=2048, micro_batch_size=2, batch_size=16, lora_rank=16, grad_checkpointing=True)
LINKS = {"PCIe 4.0 x16": hardware.LINKS["pcie4"], "NVLink 4": hardware.LINKS["nvlink4"]}
# technique -> (the table's label, the script and flags)
TECHNIQUES = {
    "tp": "TP, `tp-sp-ft --no-sequence-parallel`",
    "tp-sp": "TP+SP, `tp-sp-ft`",
    "tp-ft": "TP, `tp-ft` (DTensor plan)",
    "fsdp": "FSDP, `fsdp-ft` (frozen bf16 base gathered)",
}


def config(layers: int = SHAPE.layers) -> SimpleNamespace:
    """Qwen3-4B's config as the theory functions read it (`layers` changed: one layer's share is a difference)."""
    return SimpleNamespace(num_hidden_layers=layers, hidden_size=SHAPE.hidden)


def script_args(sequence_parallel: bool = True, **changes) -> SimpleNamespace:
    return SimpleNamespace(**{**REFERENCE, "sequence_parallel": sequence_parallel, **changes})


def activation_bytes(args: SimpleNamespace) -> int:
    """One micro-batch's activation between the blocks, [micro, seq, hidden] in bf16: what each TP collective moves
    (tp-sp-ft's `activation_bytes` for one micro-batch of full-length rows)."""
    return args.micro_batch_size * args.seq_len * SHAPE.hidden * BF16


def replicated_lora_bytes(lora_rank: int) -> int:
    """The fp32 LoRA tensors every TP rank holds whole, whose gradient shares tp-sp-ft all-reduces once per step: A
    (r x in) of the column-parallel projections and B (out x r) of the row-parallel ones."""
    dims = SHAPE.linears()
    per_layer = sum(lora_rank * dims[n][0 if n in COLUMN_PARALLEL else 1] for n in LORA_TARGETS)
    return SHAPE.layers * per_layer * FP32


def tp_micro_batch(technique: str, layers: int = SHAPE.layers, world: int = 2, **changes) -> dict[str, float]:
    """Buffer bytes per kind that one TP micro-batch sends (the per-step gradient sync left out)."""
    args = script_args(sequence_parallel=technique == "tp-sp", **changes)
    rows = [{"activation_bytes": activation_bytes(args), "comm": True}]
    if technique == "tp-ft":
        return {"all_reduce": comm.tp_all_reduce_theory(config(layers), args, rows, tp=world)}
    theory = comm.tp_sp_collective_theory(config(layers), args, rows, replicated_bytes=0)
    return {kind: b for kind, b in theory.items() if b}


def fsdp_micro_batch(world: int) -> dict[str, float]:
    """fsdp-ft's all-gathers per micro-batch: the whole model once in forward (param_dtype bf16, the fp32 adapters
    cast), the 36 decoder layers again in backward (resharded after forward); the root, the embedding and the final
    norm, stays gathered from forward to backward."""
    lora = lora_params(SHAPE, REFERENCE["lora_rank"])
    layers = SHAPE.layers * (SHAPE.linear_params() + SHAPE.norm_params())
    theory = comm.fsdp_theory(
        param_bytes=(SHAPE.n_params() + lora) * BF16,
        layer_unit_bytes=(layers + lora) * BF16,
        micro_steps=1,
        reshard_after_forward=True,
        grad_bytes=0,
        world_size=world,
    )
    return {"all_gather": theory["all_gather"]}


def wire(by_kind: dict[str, float], world: int) -> float:
    return sum(comm.ring_wire_bytes(kind, b, world) for kind, b in by_kind.items())


def rows(world: int = 2) -> list[dict]:
    """Per GPU and technique: bytes sent per micro-batch, micro-batches per step, bytes sent per step (the gradient
    sync included) and that step's traffic time on each link."""
    out = []
    for technique, label in TECHNIQUES.items():
        if technique == "fsdp":
            micro, micro_steps = (
                fsdp_micro_batch(world),
                REFERENCE["batch_size"] // (REFERENCE["micro_batch_size"] * world),
            )
            sync = {"reduce_scatter": lora_params(SHAPE, REFERENCE["lora_rank"]) * FP32}
        else:
            micro, micro_steps = (
                tp_micro_batch(technique, world=world),
                REFERENCE["batch_size"] // REFERENCE["micro_batch_size"],
            )
            sync = {} if technique == "tp-ft" else {"all_reduce": replicated_lora_bytes(REFERENCE["lora_rank"])}
        per_step = micro_steps * wire(micro, world) + wire(sync, world)
        times = {name: per_step / (link.bytes_per_s * settings.Setting.link_efficiency) for name, link in LINKS.items()}
        out.append(
            dict(
                technique=technique,
                label=label,
                micro_batch=wire(micro, world),
                micro_steps=micro_steps,
                sync=wire(sync, world),
                step=per_step,
                seconds=times,
            )
        )
    return out


def table(world: int = 2) -> str:
    """The Markdown table blogs/tp-sp.md shows (tests/test_assets.py checks that it does)."""
    bw = {name: link.bytes_per_s * settings.Setting.link_efficiency / 1e9 for name, link in LINKS.items()}
    head = " | ".join(f"{name} ({gb:g} GB/s)" for name, gb in bw.items())
    lines = [
        f"| {world} GPUs, per GPU | sent per micro-batch | micro-batches per step | sent per step | {head} |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows(world):
        where = "prefetchable" if r["technique"] == "fsdp" else "on the critical path"
        pcie, nvlink = r["seconds"].values()
        lines.append(
            f"| {r['label']} | {r['micro_batch'] / 1e9:.2f} GB | {r['micro_steps']} | {r['step'] / 1e9:.1f} GB | "
            f"{pcie:.2f} s, {where} | {nvlink * 1e3:.0f} ms |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    args = p.parse_args()
    print(f"Qwen3-4B LoRA at the reference configuration, {args.world} GPUs, bf16: bytes each GPU sends (a model)")
    print(table(args.world))


if __name__ == "__main__":
    main()
