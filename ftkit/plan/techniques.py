"""Every experiment and mesh shape the GPUs allow, and each one's row: the memory it needs (the memory model with the
planner's margin), its step time and tokens/s, or why the experiment refuses the setting."""

from __future__ import annotations

import argparse
import dataclasses
import statistics

from ftkit import batching, cli, errors, ranks
from ftkit.memory import GIB, lora_params, predict
from ftkit.plan.layouts import layout_steps, resolve
from ftkit.plan.settings import Setting
from ftkit.plan.timing import step_time

# The memory model is within 3% of every peak tracked at Qwen3-4B's shape (devlogs/runs/realscale/), and the CUDA
# peaks of the committed H100 runs are at most 1.046 x it (devlogs/single-gpu-ft.md): the margin leaves room for
# what no run here measures (the allocator's fragmentation, other kernels' workspaces, padded batches' masks).
# tests/test_plan.py fails when a tracked run exceeds it.
MEMORY_MARGIN = 1.2
# The scripts that load the whole bf16 base (and build the whole LoRA adapter) on every GPU before keeping their
# part (ftkit/prepare.py, load_lora_model): a model whose bf16 weights do not fit one GPU cannot start in them.
# fsdp-ft loads a bf16 base on rank 0's CPU and the meta device elsewhere, but quantizes a 4-bit one on each GPU.
LOADS_WHOLE_MODEL = ("pp", "tp", "tp-sp", "fsdp-tp")
EXPERIMENTS = {
    "single": "single-gpu-ft",
    "ddp": "ddp-ft",
    "fsdp": "fsdp-ft",
    "pp": "pp-ft",
    "tp": "tp-ft",
    "tp-sp": "tp-sp-ft",
    "fsdp-tp": "fsdp-tp-ft",
    "cp": "cp-ft",
}


CP_LAYOUT = (
    "cp-ft trains whole meetings (--task meetings), one padded row per micro-batch; the AMI layouts are the other "
    "scripts' rows of AMI's examples: plan cp-ft with --layout full, every row --max-length tokens (the default "
    "beyond AMI's longest example)"
)


def candidates(s: Setting) -> list[tuple[str, dict[str, int], str]]:
    """(technique, mesh, quant) for every experiment the GPUs allow; the ones with a --quant flag both ways."""
    out = [("single", {}, "nf4"), ("single", {}, "none")]
    w = s.gpus
    if w > 1:
        out += [("ddp", {"dp": w}, "nf4"), ("ddp", {"dp": w}, "none")]
        out += [("fsdp", {"dp": w}, "nf4"), ("fsdp", {"dp": w}, "none")]
        out += [("pp", {"pp": w}, "none"), ("tp", {"tp": w}, "none"), ("tp-sp", {"tp": w}, "none")]
        # cp-ft: each sequence over cp ranks of one node (its per-layer gathers), data parallelism over the rest
        cps = [c for c in range(2, min(w, s.per_node) + 1) if w % c == 0 and s.per_node % c == 0]
        out += [("cp", {"dp": w // c, "cp": c} if w > c else {"cp": c}, "none") for c in cps]
        # TP inside a node, FSDP over the rest
        tps = [t for t in range(2, s.per_node + 1) if s.per_node % t == 0 and w > t]
        out += [("fsdp-tp", {"dp": w // t, "tp": t}, "none") for t in tps]
    return out


def memory_bytes(s: Setting, technique: str, mesh: dict[str, int], quant: str, accum: int) -> float:
    """The memory model's bytes on the busiest GPU (`memory.predict`) for the experiment's configuration, `accum`
    micro-batches a step."""
    dp, tp, pp, cp = mesh.get("dp", 1), mesh.get("tp", 1), mesh.get("pp", 1), mesh.get("cp", 1)
    return predict(
        s.shape,
        technique={"fsdp-tp": "fsdp"}.get(technique, technique),
        quant=quant,
        world_size=dp * tp * pp * cp,
        tp=tp,
        pp=pp,
        cp=cp,
        lora_rank=s.lora_rank,
        lora_dropout=s.lora_dropout,
        logit_positions=s.answer_tokens,
        micro_batch_size=1 if s.micro_batch_tokens else s.micro_batch_size,
        seq_len=s.micro_batch_tokens or s.max_length,
        grad_checkpointing=s.grad_checkpointing,
        checkpoint_every=s.checkpoint_every,
        num_microbatches=accum,
        accumulation_steps=accum,
    ).total


def check_whole_model_loads(s: Setting, quant: str = "none") -> None:
    """A ValueError where the whole base (bf16, or NF4 for `quant` nf4), the whole fp32 adapter and the reserve
    exceed one GPU's memory."""
    weights = predict(s.shape, quant=quant, lora_rank=s.lora_rank).weights
    whole = weights + lora_params(s.shape, s.lora_rank) * 4 + s.reserve_bytes
    if whole > s.memory_bytes:
        base = "4-bit" if quant == "nf4" else "bf16"
        raise ValueError(
            f"it loads the whole {base} base on every GPU before keeping its part: {whole / GIB:.1f} GiB with the "
            f"reserve, more than the GPU's {s.memory_bytes / GIB:.1f} GiB"
        )


def compiled(s: Setting, technique: str, quant: str) -> bool:
    """Whether the script runs this row's decoder layers compiled: on CUDA it compiles them by default, but for
    techniques and bases that run eager whatever --compile says (cli.layers_compiled: tp-sp-ft, cp-ft, fsdp-ft on
    a 4-bit base; pp-ft's default schedule compiles). Only the host's op count depends on it."""
    run = argparse.Namespace(experiment=EXPERIMENTS[technique], quant=quant, compile=s.compile, schedule="1f1b")
    return cli.layers_compiled(run)


def evaluate(s: Setting, technique: str, mesh: dict[str, int], quant: str) -> dict:
    """One row: the memory and step-time prediction, or the reason the experiment refuses this setting (its own
    error message where it has one). With the AMI layouts, the step time is the median over the layout's steps and
    tokens/s their real tokens over their time; "auto" is the layout the scripts run (`layouts.resolve`)."""
    s = resolve(s, technique)
    s = dataclasses.replace(s, compile=compiled(s, technique, quant))
    row = {"technique": technique, "experiment": EXPERIMENTS[technique], "mesh": mesh, "quant": quant}
    row["micro_batch_size"] = s.micro_batch_size
    shape, cfg = s.shape, s.config
    dp, tp, pp, cp = mesh.get("dp", 1), mesh.get("tp", 1), mesh.get("pp", 1), mesh.get("cp", 1)
    used = dp * tp * pp * cp
    try:
        if tp > 1:
            ranks.check_tp_degree(cfg, tp)
        if cp > 1:
            ranks.check_cp_chunks(s.max_length, cp)
            if s.layout != "full":
                raise ValueError(CP_LAYOUT)
        if shape.layers % pp:
            raise ValueError(f"{pp} pipeline stages do not divide the model's {shape.layers} layers evenly")
        if technique in LOADS_WHOLE_MODEL:
            check_whole_model_loads(s)
        if technique == "fsdp" and quant == "nf4":  # fsdp-ft quantizes on each GPU, then shards the codes
            check_whole_model_loads(s, quant)
    except (ValueError, errors.RunError, errors.DataError) as e:
        return {**row, "refused": str(e)}
    try:
        accum = batching.accumulation_steps(s.batch_size, 1 if s.micro_batch_tokens else s.micro_batch_size, dp)
    except errors.DataError as e:  # the global batch, not the technique: the recommendation says so
        return {**row, "refused": str(e), "batch_refused": True}
    try:
        if pp > 1:  # pp-ft's default 1F1B, the schedule the planner models
            ranks.check_pipeline_microbatches(accum, pp, s.micro_batch_size)
    except errors.RunError as e:
        return {**row, "refused": str(e)}
    try:
        steps = [step_time(s, technique, mesh, quant, step) for step in layout_steps(s, dp)]
    except ValueError as e:  # no op count for this setting's host (host_ops_per_micro says which)
        return {**row, "refused": str(e)}
    if s.layout != "full":  # the AMI rows: the lm_head at the most answer positions a row holds (a packed row of
        # several examples, up to 446 at 2,048 tokens), not --answer-tokens' 256 per sequence
        s = dataclasses.replace(s, answer_tokens=max(m.answers // m.rows for p in steps for m in p["micros"]))
    memory = memory_bytes(s, technique, mesh, quant, accum)
    required = memory * MEMORY_MARGIN + s.reserve_bytes
    out = {
        **row,
        "gpus_used": used,
        "memory_bytes": memory,
        "required_bytes": required,
        "fits": required <= s.memory_bytes,
        **{k: statistics.median(p[k] for p in steps) for k in ("compute_s", "exposed_comm_s", "bubble_s")},
        "step_time_s": statistics.median(p["step_time_s"] for p in steps),
        "tokens_per_s": sum(p["tokens"] for p in steps) / sum(p["step_time_s"] for p in steps),
    }
    if s.legacy:
        return out
    positions = sum(p["positions"] for p in steps)
    return {
        **out,
        "host_s": statistics.median(p["host_s"] for p in steps),
        "host_ops_per_micro_batch": steps[0]["host_ops_per_micro_batch"],
        "compiled": s.compile,
        # the host's work per unit of real data: ops dispatched (eager) or launched (compiled), all ranks
        "host_ops_per_1000_tokens": 1000 * sum(p["host_ops"] for p in steps) / sum(p["tokens"] for p in steps),
        "micro_batches": statistics.median(len(p["micros"]) for p in steps),
        "padding_fraction": 1 - sum(p["tokens"] for p in steps) / positions,
        "bound": "host" if out["step_time_s"] > 1.0001 * statistics.median(p["gpu_side_s"] for p in steps) else "GPU",
        "steps_predicted": len(steps),
    }
