"""--fit auto (the default on CUDA): how a run fills its GPU, chosen before the model loads from the memory model
and the planner's step time, instead of 2 rows per micro-batch with every layer checkpointed whatever the GPU.

The choice is among micro-batches by tokens (`--micro-batch-tokens`, one packed row of N positions: FIT_TOKENS) or
the default rows, each with activation checkpointing on every layer, on every other one, or off (`--checkpointing`).
A candidate fits where the memory model's bytes (`memory.predict`, through `plan.techniques.evaluate`) times the
planner's margin (`plan.techniques.MEMORY_MARGIN`) plus its reserve are at most the GPU's memory; of those, the run
takes the one the planner predicts fastest (real tokens/s over one epoch of the shipped AMI batches, on the host it
has calibrated). The step is the same math whatever is chosen (the parity tests hold for every layout and every
checkpointing), so the choice changes speed and memory only.

Every rank makes the same choice: it depends on the flags, the GPU's name and memory, the world size and the ranks
per node, the same on every rank of a job on one kind of GPU. A flag the command line gives for what the fit chooses
(--micro-batch-size, --micro-batch-tokens, --checkpointing, --no-grad-checkpointing) turns it off, as does a resumed
run (it keeps the layout it recorded). The choice is printed in one line and recorded (config.json's `fit_choice`);
a run that then runs out of memory says what the memory model predicted (`errors.memory_prediction`, printed by
`ranks.launch`)."""

from __future__ import annotations

import argparse
import os

import torch

from ftkit import batching, cli, errors, hardware, models, ranks
from ftkit.memory import GIB
from ftkit.plan import settings
from ftkit.plan.fitting import as_run_chooses, chosen, describe, fastest

# The experiments the fit lays out (the planner's technique names); pp-ft and cp-ft run padded rows of their own.
TECHNIQUE = {"single-gpu-ft": "single", "ddp-ft": "ddp", "fsdp-ft": "fsdp", "tp-ft": "tp", "tp-sp-ft": "tp-sp"}
TECHNIQUE["fsdp-tp-ft"] = "fsdp-tp"
CHOSEN_FLAGS = ("micro_batch_size", "micro_batch_tokens", "checkpointing", "grad_checkpointing")


def global_batches(args: argparse.Namespace, train_set: list, mesh: dict[str, int] | None = None):
    """The run's global batches (`batching.global_batches`), laid out as --fit auto chooses (`choose`) where it is on:
    it sets --micro-batch-tokens, --micro-batch-size and --checkpointing before the model is built."""
    why_not = reason_not_to_fit(args)
    if why_not is None:
        choice = choose(args, mesh or default_mesh(args))
        args.fit_choice = choice
        if choice.get("chosen"):
            args.micro_batch_tokens = choice["chosen"]["micro_batch_tokens"]
            args.micro_batch_size = 1 if args.micro_batch_tokens else args.micro_batch_size
            args.checkpointing = choice["chosen"]["checkpointing"]
            args.grad_checkpointing = args.checkpointing != "none"
            errors.memory_prediction = choice["said"]
        ranks.print0(f"--fit auto: {choice.get('said') or choice['off']}")
    else:
        args.fit_choice = {"off": why_not}
    return batching.global_batches(args, train_set)


def reason_not_to_fit(args: argparse.Namespace) -> str | None:
    """Why --fit auto does not choose for this run; None where it does."""
    if args.fit != "auto":
        return "--fit off"
    if args.experiment not in TECHNIQUE or not args.packing:
        return f"{args.experiment} lays out padded rows of its own"
    given = [f for f in CHOSEN_FLAGS if f in getattr(args, "explicit_flags", ())]
    if given:
        return f"--{given[0].replace('_', '-')} given"
    if args.resume:
        return "a resumed run keeps the layout it recorded"
    if args.dtype != "bf16" or not torch.cuda.is_available():
        return "the planner prices bf16 on a CUDA GPU"
    return None


def world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def nodes(world: int) -> int:
    """The job's nodes: its world over the ranks torchrun starts on each node (LOCAL_WORLD_SIZE, the same on every
    node), so that the planner prices the collectives that cross nodes on the link between them."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return world // local if local > 0 and world % local == 0 else 1


def default_mesh(args: argparse.Namespace) -> dict[str, int]:
    world = world_size()
    return {"dp": world} if TECHNIQUE[args.experiment] in ("ddp", "fsdp") else {"tp": world} if world > 1 else {}


def setting(args: argparse.Namespace, gpu: hardware.GPU, memory_bytes: float, world: int) -> settings.Setting:
    """The planner's Setting for this run on its GPU: its flags, the shipped AMI batches in Qwen3's tokens, and what
    the run assumes of its hardware (`fitting.as_run_chooses`: links, host, efficiency, reserve)."""
    base = settings.Setting(
        config=settings.model_config(args.model),
        gpu=gpu,
        gpus=world,
        nodes=nodes(world),
        link=hardware.LINKS[gpu.link],
        inter_node_link=hardware.LINKS[gpu.link],  # as_run_chooses sets both links
        memory_bytes=memory_bytes,
        batch_size=args.batch_size,
        micro_batch_size=args.micro_batch_size,
        max_length=args.max_length,
        lora_rank=args.lora_rank,
        lora_dropout=args.lora_dropout,
        compile=cli.layers_compiled(args),
        seed=args.seed,
        tokenizer=models.QWEN3,
    )
    return as_run_chooses(base)


def choose(args: argparse.Namespace, mesh: dict[str, int]) -> dict:
    """`choose_for` this process's GPU: its name (the planner's datasheet row) and its memory as torch reports it."""
    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    gpu = hardware.gpu_for_device_name(name)
    if gpu is None:
        return {"off": f"{name} is not in ftkit/hardware.py's table: the planner cannot price it"}
    return choose_for(args, gpu, torch.cuda.get_device_properties(device).total_memory, world_size(), mesh)


def choose_for(args: argparse.Namespace, gpu: hardware.GPU, memory: float, world: int, mesh: dict[str, int]) -> dict:
    """The fastest candidate the planner predicts fits `memory` bytes of `gpu`, as a record: what was chosen, its
    prediction, the reference layout's, and the line the run prints."""
    base = setting(args, gpu, memory, world)
    priced = fastest(base, TECHNIQUE[args.experiment], mesh, getattr(args, "quant", "none"))
    if priced["chosen"] is None:
        return {"off": f"no layout is predicted to fit {memory / GIB:.1f} GiB; the defaults run"}
    (s, best), reference = priced["chosen"], priced["reference"]
    said = (
        f"{describe(chosen(s), base.micro_batch_size)}: predicted {best['memory_bytes'] / GIB:.1f} GiB "
        f"({best['required_bytes'] / GIB:.1f} with the planner's margin) of {memory / GIB:.1f} on {gpu.key}, "
        f"{best['tokens_per_s']:,.0f} real tokens/s, the fastest of {priced['fits']} layouts that fit"
    )
    if reference:
        said += f" ({base.micro_batch_size} rows, every layer checkpointed: {reference['tokens_per_s']:,.0f})"
    return {
        "chosen": chosen(s),
        "predicted": {k: best[k] for k in ("memory_bytes", "required_bytes", "tokens_per_s", "step_time_s")},
        "reference_tokens_per_s": reference and reference["tokens_per_s"],
        "gpu_memory_bytes": memory,
        "said": said + " (a prediction: ftkit.plan on the shipped AMI batches)",
    }
