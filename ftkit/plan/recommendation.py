"""The planner's answer for a setting: every experiment's row, the recommendation with its reason, and what a
prediction assumes, in words."""

from __future__ import annotations

import dataclasses

from ftkit.memory import GIB
from ftkit.plan.fitting import FIT_CHECKPOINTING, FIT_TOKENS, describe, row
from ftkit.plan.hosts import HOSTS, NF4_PASS_S, host_calibration, ops_source
from ftkit.plan.layouts import resolve
from ftkit.plan.settings import Setting
from ftkit.plan.techniques import EXPERIMENTS, MEMORY_MARGIN, candidates

# At predicted speeds within NEAR of the fastest, the simpler technique is recommended: the list's order.
SIMPLER_FIRST = list(EXPERIMENTS)
NEAR = 0.97


def mesh_label(mesh: dict[str, int]) -> str:
    return " x ".join(f"{k}{v}" for k, v in mesh.items()) or "1 GPU"


def label(row: dict) -> str:
    # The flag to pass: single-gpu-ft and ddp-ft default to --quant nf4, fsdp-ft to none (the others have no flag).
    default_nf4 = row["technique"] in ("single", "ddp")
    quant = " --quant nf4" if row["quant"] == "nf4" else " --quant none" if default_nf4 else ""
    return f"{row['experiment']}{quant} ({mesh_label(row['mesh'])})"


def recommend(rows: list[dict], s: Setting, dividing: tuple[int, str] | None = None) -> dict:
    """The pick among the rows that fit: the fastest, or a simpler one within NEAR of it; `dividing`: the pick at the
    next global batch that divides over the GPUs, where data-parallel rows were refused for the batch alone."""
    fitting = [r for r in rows if r.get("fits")]
    if not fitting:
        least = min((r for r in rows if "required_bytes" in r), key=lambda r: r["required_bytes"])
        return {
            "technique": None,
            "mesh": None,
            "quant": None,
            "reason": f"nothing fits in {s.memory_bytes / GIB:.1f} GiB: the least, {label(least)}, needs "
            f"{least['required_bytes'] / GIB:.1f} GiB; lower "
            "--max-length or --micro-batch-size, or add GPUs",
        }
    best = max(fitting, key=lambda r: r["tokens_per_s"])
    near = [r for r in fitting if r["tokens_per_s"] >= NEAR * best["tokens_per_s"]]
    pick = min(near, key=lambda r: (SIMPLER_FIRST.index(r["technique"]), r["quant"] == "nf4"))
    reason = (
        f"fits ({pick['required_bytes'] / GIB:.1f} of {s.memory_bytes / GIB:.1f} GiB with the margin); predicted "
        f"{pick['tokens_per_s']:,.0f} tokens/s"
    )
    if pick.get("fit"):
        reason += f" at --fit auto's {describe(pick['fit'], s.micro_batch_size)}"
    if pick is not best:
        behind = 1 - pick["tokens_per_s"] / best["tokens_per_s"]
        reason += f", {behind:.1%} behind the fastest, {label(best)}, and simpler"
    else:
        runner_up = max((r for r in fitting if r is not best), key=lambda r: r["tokens_per_s"], default=None)
        if runner_up:
            ahead = best["tokens_per_s"] / runner_up["tokens_per_s"] - 1
            reason += f", {ahead:.1%} ahead of the next, {label(runner_up)}"
    limits = sorted((r for r in rows if r.get("refused") is None and not r["fits"]), key=lambda r: r["experiment"])
    if limits:
        reason += "; does not fit: " + ", ".join(label(r) for r in limits)
    unpriced = [
        EXPERIMENTS[t] for t in SIMPLER_FIRST if any(r["technique"] == t for r in rows if r.get("batch_refused"))
    ]
    if unpriced:  # a pick by elimination: the refused ones may be faster at a batch that divides
        reason += (
            f"; not priced because --batch-size {s.batch_size} does not divide over their ranks: "
            f"{', '.join(unpriced)} (their rows name a batch that does)"
        )
        if dividing:
            reason += f"; at --batch-size {dividing[0]} (another global batch: another run) the pick is {dividing[1]}"
    return {
        **{k: pick[k] for k in ("technique", "experiment", "mesh", "quant", "tokens_per_s", "required_bytes")},
        "fit": pick.get("fit"),
        "reason": reason,
    }


def at_dividing_batch(s: Setting, rows: list[dict]) -> tuple[int, str] | None:
    """Where rows were refused only because the global batch does not divide over their ranks (3 or 6 GPUs at 16), the
    next batch that divides over every GPU and the pick there: a pick by elimination can be far slower."""
    if not any(r.get("batch_refused") for r in rows):
        return None
    per_step = (1 if s.micro_batch_tokens else s.micro_batch_size) * s.gpus
    n = -(-s.batch_size // per_step) * per_step
    at_n = dataclasses.replace(s, batch_size=n)
    rec = recommend([row(at_n, *c) for c in candidates(at_n)], at_n)
    if rec["technique"] is None:
        return None
    return n, (
        f"{label(rec)}, fits ({rec['required_bytes'] / GIB:.1f} of {s.memory_bytes / GIB:.1f} GiB with the margin); "
        f"predicted {rec['tokens_per_s']:,.0f} tokens/s"
    )


def plan(s: Setting) -> dict:
    rows = [row(s, *c) for c in candidates(s)]
    dividing = at_dividing_batch(s, rows)
    auto, s = s.layout == "auto", resolve(s)
    op_s, mfu = host_calibration(s)
    result = {
        "setting": {
            "gpu": s.gpu.key,
            "gpus": s.gpus,
            "nodes": s.nodes,
            "link": s.link.key,
            "inter_node_link": s.inter_node_link.key if s.nodes > 1 else None,
            "memory_bytes": s.memory_bytes,
            **{k: getattr(s, k) for k in ("batch_size", "micro_batch_size", "max_length", "answer_tokens")},
            **{k: getattr(s, k) for k in ("lora_rank", "lora_dropout", "grad_checkpointing", "checkpoint_every")},
        },
        "assumptions": {
            "mfu": mfu,
            "link_efficiency": s.link_efficiency,
            "memory_margin": MEMORY_MARGIN,
            "reserve_bytes": s.reserve_bytes,
            "gpu_source": s.gpu.source,
            "link_source": s.link.source,
        },
        "techniques": rows,
        "recommendation": recommend(rows, s, dividing),
    }
    if not s.legacy:
        result["setting"].update(
            layout=s.layout, compile=s.compile, fit=s.fit, host=s.host, seed=s.seed, tokenizer=s.tokenizer
        )
        result["assumptions"].update(host_op_s=op_s, nf4_pass_s=NF4_PASS_S if op_s else 0.0)
        result["prediction"] = prediction_notes(s, rows, auto)
    return result


def prediction_notes(s: Setting, rows: list[dict], auto: bool = False) -> list[str]:
    """What a prediction with the host or an AMI layout assumes, in words, each number's source named; `auto`: the
    layout is the command's default, the scripts' own."""
    op_s, mfu = host_calibration(s)
    done = [r for r in rows if "refused" not in r]
    steps = done[0]["steps_predicted"] if done else 0
    notes = ["PREDICTED by ftkit.plan: a model, not a measurement"]
    layout = {
        "full": "every row --max-length real tokens (an upper bound on the work; no padding)",
        "padded": "the AMI training examples (AMI_LENGTHS) in the scripts' "
        f"length-grouped global batches (seed {s.seed}), one example per row, each micro-batch right-padded to its "
        "longest (--no-packing)",
        "packed": f"the same global batches packed first-fit decreasing into rows of up to {s.max_length} "
        f"(batching.pack), {s.micro_batch_size} rows a micro-batch as wide as the fullest (batching.packed_width), "
        "every rank the same micro-steps; the attention kernel computes each whole row (SDPA with the block-diagonal "
        "mask)",
        "masked": "padded as the scripts ran it until issue 30, the padding mask passed (the committed H100 runs)",
        "fixed": "the AMI training examples one per row, right-padded to --max-length (pp-ft's one shape)",
    }[s.layout]
    if s.layout != "full":
        layout += f"; the examples in the {s.tokenizer} tokenizer's tokens; step time: the median of {steps} steps"
    if auto:
        layout = "the scripts' own (--layout auto): " + layout
        if s.layout == "packed" and any(r["technique"] == "pp" for r in rows):
            layout += "; pp-ft's one example per row, right-padded to --max-length (its stages' one shape)"
    notes.append(f"layout: {layout}")
    if any(r.get("fit") for r in rows):
        budgets = ", ".join(f"{t:,}" for t in FIT_TOKENS if t)
        notes.append(
            "fit: each experiment marked in the fit column at the layout its run's --fit auto chooses (ftkit/fit.py): "
            f"one packed row of {budgets} positions or {s.micro_batch_size} rows a micro-batch, checkpointing "
            f"{', '.join(FIT_CHECKPOINTING)}, the fastest predicted to fit, chosen as the run chooses (on its GPU's "
            "calibrated host: plan/fitting.py); --fit off or a layout flag: every experiment at the flags' layout"
        )
    if op_s:
        compiled = (
            "; compiled layers: the compiled graphs' kernels and extern ops, counted on a CPU's inductor (C++ kernels "
            "standing in for CUDA's Triton ones: a prediction), each costing what an eager op does"
            if any(r["compiled"] for r in done)
            else ""
        )
        counts = {
            (r["quant"], r["compiled"]): r["host_ops_per_micro_batch"] for r in done if r["mesh"].get("pp", 1) == 1
        }
        counts = ", ".join(
            f"{n:,} ({'NF4' if q == 'nf4' else 'bf16'}, {'compiled' if c else 'eager'})" for (q, c), n in counts.items()
        )
        notes.append(
            f"host: {counts} ops per micro-batch on a rank that holds every layer ({ops_source(s)} code, counted by "
            f"assets/host_ops.py{compiled}) x {op_s * 1e6:.2f} us per op"
            + (f" (calibrated: {HOSTS[s.host]['source']})" if s.host and s.host_op_s is None else " (--host-op-us)")
        )
        if any(r["quant"] == "nf4" for r in done):
            notes.append(
                f"host, NF4: {NF4_PASS_S * 1e6:.0f} us more per 4-bit linear pass (calibrated on the first H100 "
                "session's QLoRA and LoRA runs; not attributed)"
            )
        notes.append(
            "step: each micro-batch costs max(host, GPU) with the host running ahead of the GPU (`queue`); a rank's "
            "host dispatches the ops of the layers it holds; DDP's, FSDP's and DTensor's own host work is not "
            "counted (devlogs/plan-cpu-check.md: large for TP)"
        )
    else:
        notes.append("host: not modelled (its cost 0; --host h100-vm models the committed H100 runs' host)")
    source = HOSTS[s.host]["kernels"] if s.host and s.mfu is None else "assumed (--mfu)"
    if not s.host and s.mfu is None:
        source = "assumed"
    notes.append(
        f"GPU: the FLOPs the kernels compute (padding and the recompute included) at {mfu:.1%} of the dense bf16 "
        f"peak ({source})" + ("; compiled kernels taken as no faster than eager ones" if op_s and s.compile else "")
    )
    return notes
