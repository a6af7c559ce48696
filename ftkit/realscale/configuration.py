"""What one measurement runs, settled before any model is built: the script and the flags it runs with (its own
parser and defaults), the rank this process plays, and the batch's arithmetic. Every refusal, the script's own
included, is raised here."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
from unittest import mock

import torch

from ftkit import batching, cli, models
from ftkit.realscale import SCRIPTS, SEQUENCE_SPLIT, RealScaleError

# The common flags this command passes on to the script's own parser (a flag not given takes the script's default).
PASSED_ON = ("micro_batch_size", "max_length", "batch_size", "lora_rank", "lora_alpha", "lora_dropout")


def script_args(script, opts: argparse.Namespace) -> argparse.Namespace:
    """The flags the script would run with: its own parser and defaults (`cli.resolve`), given this command's."""
    argv = ["train.py", "--model", models.QWEN3_4B_SHAPE, "--no-progress"]
    for key in PASSED_ON:
        if getattr(opts, key) is not None:
            argv += [f"--{key.replace('_', '-')}", str(getattr(opts, key))]
    if not opts.grad_checkpointing:
        argv.append("--no-grad-checkpointing")
    if getattr(opts, "checkpointing", None) is not None:
        argv += ["--checkpointing", opts.checkpointing]
    if opts.schedule is not None:
        argv += ["--schedule", opts.schedule]
    if opts.technique == "pp":
        argv.append("--no-packing")  # the padded layout pp-ft runs (it notes so, on stdout, when asked to pack)
    if opts.technique in (*SEQUENCE_SPLIT, "pp"):
        if opts.quant == "nf4":
            raise RealScaleError(
                f"--quant nf4: experiments/{SCRIPTS[opts.technique]}/train.py trains LoRA on a bf16 base (no QLoRA)"
            )
    elif opts.quant is not None:
        argv += ["--quant", opts.quant]
    with mock.patch.object(sys, "argv", argv):
        args = script.parse_args()
    return args


def configure(opts: argparse.Namespace) -> tuple:
    """The script, its flags and the rank this process plays; every refusal (the script's own included) raised
    here, before any model is built. pp: the script's refusal of stages that do not split the layers evenly; cp: of a
    sequence the ranks cannot cut into equal chunks."""
    script = cli.load_experiment(SCRIPTS[opts.technique])
    args = script_args(script, opts)
    rank = 0
    if opts.technique == "pp":
        layers = opts.layers or models.QWEN3_4B_CONFIG["num_hidden_layers"]
        n_stages, _ = script.stage_layout(layers, opts.world, args.schedule)
        if opts.pp_stage == "last":  # pp-ft's last_rank: the rank that holds the last stage
            rank = next(
                r for r in range(opts.world) if n_stages - 1 in script.rank_stages(r, opts.world, args.schedule)
            )
    if opts.technique == "cp":  # cp-ft's refusals: the world its sequences split over, chunks of equal length
        script.check_layout(args, opts.world)
    return script, args, rank


@dataclasses.dataclass(frozen=True)
class Setup:
    """One measurement: this command's options, the script (its module) and its flags, the rank this process plays
    (rank 0; with pp, --pp-stage's), the device its fake tensors live on, and the batch's arithmetic."""

    opts: argparse.Namespace
    script: types.ModuleType
    args: argparse.Namespace
    rank: int
    device: torch.device
    dp: int  # the data-parallel ranks, each with its own sequences
    accum: int  # accumulation micro-steps per optimizer step (pp: the pipeline's micro-batches)
    runs: int  # micro-steps run per optimizer step (pp: in one schedule.step)

    @property
    def technique(self) -> str:
        return self.opts.technique

    @property
    def world(self) -> int:
        return self.opts.world

    @property
    def pp(self) -> bool:
        return self.technique == "pp"

    @property
    def dtype(self) -> torch.dtype:
        return cli.torch_dtype(self.args.dtype)

    @property
    def nf4(self) -> bool:
        return getattr(self.args, "quant", "none") == "nf4"


def setup(opts: argparse.Namespace) -> Setup:
    script, args, rank = configure(opts)
    # TP splits the layers, PP the depth, CP the sequence, not the batch; PP's accumulation steps are the pipeline's
    # micro-batches
    dp = 1 if opts.technique in ("single", *SEQUENCE_SPLIT, "pp") else opts.world
    accum = batching.accumulation_steps(args.batch_size, args.micro_batch_size, data_parallel=dp)
    runs = min(accum, opts.micro_steps or accum)  # micro-steps run per optimizer step (pp: in one schedule.step)
    return Setup(opts, script, args, rank, torch.device("cpu"), dp, accum, runs)
