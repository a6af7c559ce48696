"""The command line of `python -m ftkit.realscale`: its flags and their checks, its refusals, and the result as a
table (or, with --json, as JSON)."""

from __future__ import annotations

import argparse
import json
import sys

from ftkit import errors, memory, models, ranks, realscale
from ftkit.realscale import ANSWER_TOKENS, LABEL, PP_SCHEDULES, SCRIPTS, TENSOR_PARALLEL, RealScaleError
from ftkit.realscale.configuration import configure
from ftkit.realscale.measure import measure

# argparse would name the program after sys.argv[0], which under `python -m` is this package's __main__.py.
PROG = "python -m ftkit.realscale"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=realscale.__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_rank_flags(p)
    add_script_flags(p)
    add_harness_flags(p)
    opts = p.parse_args(argv)
    check(opts)
    return opts


def add_rank_flags(p: argparse.ArgumentParser) -> None:
    """The technique, the world and the rank this process plays in it."""
    p.add_argument("--technique", required=True, choices=list(SCRIPTS))
    p.add_argument(
        "--world",
        type=int,
        default=1,
        help="ranks; this process plays rank 0 (with pp: the pipeline depth, and the rank of --pp-stage)",
    )
    p.add_argument(
        "--pp-stage",
        choices=["first", "last"],
        default=None,
        help="pp: the stage this process runs and compares with the memory model's prediction for it: first (rank "
        "0: the embedding, the most micro-batches in flight) or last (the last rank: the final norm, the lm_head "
        "and the loss) [default: first]",
    )
    p.add_argument(
        "--schedule",
        default=None,
        help=f"pp: the pipeline schedule, one of {', '.join(PP_SCHEDULES)} (those the memory model predicts) "
        "[default: the script's own]",
    )


def add_script_flags(p: argparse.ArgumentParser) -> None:
    """The scripts' common flags, passed on to the script's own parser (`configuration.script_args`)."""
    g = p.add_argument_group("the scripts' common flags [default: the script's own default for Qwen3-4B]")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--max-length", type=int, default=None, help="tokens per sequence; every sequence is this long")
    g.add_argument("--batch-size", type=int, default=None, help="global batch; sets the accumulation steps")
    g.add_argument("--lora-rank", type=int, default=None)
    g.add_argument("--lora-alpha", type=float, default=None)
    g.add_argument("--lora-dropout", type=float, default=None)
    g.add_argument(
        "--quant",
        choices=["none", "nf4"],
        default=None,
        help="base weights: bf16, or 4-bit NF4 (QLoRA: single-gpu-ft's and ddp-ft's default, fsdp-ft's --quant nf4; "
        "the other scripts train on a bf16 base)",
    )
    g.add_argument("--no-grad-checkpointing", dest="grad_checkpointing", action="store_false")
    g.add_argument("--checkpointing", default=None, metavar="{all,none,every-K}", help="the layers checkpointed")


def add_harness_flags(p: argparse.ArgumentParser) -> None:
    """This command's own: the synthetic batch's answer, the depth, the steps tracked, the output."""
    p.add_argument(
        "--answer-tokens",
        type=int,
        default=ANSWER_TOKENS,
        help="answer (loss) positions at the end of each synthetic sequence, where the lm_head runs",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="only this many of Qwen3-4B's decoder layers, every width exact: a quicker check of every term (the "
        "time goes by layers) [default: all 36]",
    )
    p.add_argument("--steps", type=int, default=2, help="optimizer steps tracked")
    p.add_argument(
        "--micro-steps",
        type=int,
        default=None,
        help="run only this many (at least 2) of each optimizer step's accumulation micro-steps, for a quicker run; "
        "the FLOPs are scaled to the whole step, and the peak is the same (every micro-step after the first "
        "accumulates into the same gradients; labelled in the output) [default: all]",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def check(opts: argparse.Namespace) -> None:
    """The refusals the flags alone decide (the script's own come in `configuration.configure`); pp's stage
    defaults to the first."""
    if opts.technique == "pp":
        check_pipeline(opts)
        opts.pp_stage = opts.pp_stage or "first"
    elif opts.schedule is not None or opts.pp_stage is not None:
        raise RealScaleError("--schedule and --pp-stage are pipeline flags: --technique pp")
    if opts.world < 1 or (opts.technique == "single" and opts.world != 1):
        raise RealScaleError(f"--world {opts.world}: single runs on one device (--world 1); the others take 1 or more")
    if opts.technique in TENSOR_PARALLEL:
        ranks.check_tp_degree(models.model_config(models.QWEN3_4B_SHAPE), opts.world)
    if opts.layers is not None and not 1 <= opts.layers <= models.QWEN3_4B_CONFIG["num_hidden_layers"]:
        raise RealScaleError(f"--layers must be in 1..{models.QWEN3_4B_CONFIG['num_hidden_layers']}, got {opts.layers}")
    if opts.micro_steps is not None and opts.micro_steps < 2:
        raise RealScaleError("--micro-steps must be at least 2: the second is the first to run with gradients held")
    if opts.steps < 2:
        raise RealScaleError("--steps must be at least 2: the first step creates the optimizer state")


def check_pipeline(opts: argparse.Namespace) -> None:
    if opts.world < 2:
        raise RealScaleError(f"--world {opts.world}: a pipeline needs at least 2 ranks (stages)")
    if opts.schedule is not None and opts.schedule not in PP_SCHEDULES:
        raise RealScaleError(
            f"--schedule {opts.schedule} is not run by ftkit.realscale: the memory model predicts "
            f"{' and '.join(PP_SCHEDULES)} only, and the other schedules give each rank two stages"
        )
    if opts.micro_steps is not None:
        raise RealScaleError(
            "--micro-steps: a pipeline step is one schedule.step over all its micro-batches, and the "
            "schedule's micro-batch count sets the activations in flight; set --batch-size instead"
        )


def refusal(argv: list[str]) -> str | None:
    """Why this command refuses `argv`, or None if it would run it."""
    try:
        configure(parse_args(argv))
    except (RealScaleError, errors.RunError, errors.DataError) as e:
        return str(e)
    return None


def table(result: dict) -> str:
    gib = memory.GIB
    lines = [
        f"{result['technique']} (experiments/{SCRIPTS[result['technique']]}/train.py), rank {result['rank']} of "
        f"{result['world_size']}: {LABEL}",
        "",
        "memory, tracked peak by category:",
    ]
    lines += [f"  {k:<22} {v / gib:8.3f} GiB" for k, v in result["categories"].items() if v]
    lines += [f"  {'total':<22} {result['tracked_peak_bytes'] / gib:8.3f} GiB", "memory model (ftkit/memory.py):"]
    lines += [f"  {k:<22} {v / gib:8.3f} GiB" for k, v in result["predicted"].items() if v]
    lines += [
        f"  tracked / predicted: {result['tracked_over_predicted']:.3f}",
        "",
        f"FLOPs per optimizer step: counted {result['flops_counted']:.4g} (with recompute "
        f"{result['flops_counted_with_recompute']:.4g}), convention {result['flops_convention']:.4g}, "
        f"ratio {result['flops_counted_over_convention']:.3f}; at the logits computed "
        f"{result['flops_convention_at_logits']:.4g}, ratio {result['flops_counted_over_convention_at_logits']:.3f}",
    ]
    for k, v in result["flops_convention_by_component"].items():
        lines.append(f"  {k:<26} counted {result['flops_counted_by_component'].get(k, 0):.4g}  convention {v:.4g}")
    lines += [f"bf16 fraction of matmul FLOPs: {result['bf16_matmul_fraction']:.4f}", "", "stand-ins:"]
    lines += [f"  - {s}" for s in result["stand_ins"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        opts = parse_args(argv)
        result = measure(opts)
    except (RealScaleError, errors.RunError, errors.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if opts.json else table(result))
    return 0
