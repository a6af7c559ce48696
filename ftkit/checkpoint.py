"""Checkpoints, adapters and RNG state. A checkpoint is written into a staging folder and committed by a rename
(`commit`), so a crash mid-save never leaves one that --resume would pick. Two layouts: `save_sharded` for
trainable state spread over the ranks as DTensors (torch.distributed.checkpoint), `save_per_rank` for ranks that
each hold their own part as plain tensors (rank<r>.pt)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path

import torch

from ftkit import ranks
from ftkit.errors import CheckpointError, RunError


def latest(run_dir: Path) -> Path | None:
    steps = [
        (int(m.group(1)), p)
        for p in (run_dir / "checkpoints").glob("step-*")
        if (m := re.fullmatch(r"step-(\d+)", p.name)) and (p / "trainer_state.json").exists()
    ]
    return max(steps)[1] if steps else None


def staging_dir(run_dir: Path, step: int) -> Path:
    """A fresh folder to write checkpoint `step` into; `commit` moves it into place, so a crash
    mid-save never leaves a half-written checkpoint that --resume would pick."""
    path = run_dir / "checkpoints" / f".tmp-step-{step}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def commit(tmp: Path, step: int, state: dict, keep: int) -> Path:
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **state}, indent=2))
    final = tmp.parent / f"step-{step}"
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    done = sorted(
        (int(p.name.split("-")[1]), p) for p in tmp.parent.glob("step-*") if re.fullmatch(r"step-\d+", p.name)
    )
    for _, old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_sharded(run_dir: Path, step: int, model, optimizer, scheduler, args: argparse.Namespace) -> None:
    """Checkpoint `step` of a run whose trainable state is spread over the ranks (FSDP's shards, TP's DTensors).
    Every rank writes its own pieces of the trainable parameters and of the optimizer state with
    torch.distributed.checkpoint, into one folder on storage all ranks see; rank 0 adds the scheduler and every
    rank's RNG state, then commits the folder (--seed recorded, --keep-checkpoints kept). A collective: every rank
    calls it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    tmp = ranks.on_rank0(staging_dir, run_dir, step)
    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp / "sharded")
    rng = [None] * world if rank == 0 else None
    dist.gather_object(rng_state(), rng, dst=0)
    if rank == 0:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        for r, state in enumerate(rng):
            torch.save(state, tmp / f"rng-rank{r}.pt")
        commit(tmp, step, {"seed": args.seed, "world_size": world}, args.keep_checkpoints)
    dist.barrier()  # no rank goes on (or exits, with --stop-after) before the checkpoint is complete


def load_sharded(ckpt: Path | None, model, optimizer, scheduler, any_world: bool = False) -> int:
    """Resume from a `save_sharded` folder: each rank reads its own pieces, the scheduler and its RNG
    stream; the step it holds. With `any_world` (FSDP) the ranks may be more or fewer than the ones that wrote it:
    torch.distributed.checkpoint stores each tensor with its global offsets and reads back whatever pieces the
    new sharding asks for (see `restore_rng` for what then differs). `ckpt` None (a fresh run): step 0."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    if ckpt is None:
        return 0
    state = read_state(ckpt, ("sharded/.metadata", "scheduler.pt"))
    if not any_world:
        check_same_world(ckpt, state, dist.get_world_size())
    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    pieces = {"model": model_state, "optimizer": optim_state}
    try:
        dcp.load(pieces, checkpoint_id=ckpt / "sharded")
    except Exception as e:
        raise CheckpointError(f"{ckpt}/sharded: unreadable sharded checkpoint ({e})") from e
    # Not strict: the checkpoint holds the trainable parameters only (the frozen base is the one just loaded).
    set_state_dict(
        model,
        optimizer,
        model_state_dict=pieces["model"],
        optim_state_dict=pieces["optimizer"],
        options=StateDictOptions(ignore_frozen_params=True, strict=False),
    )
    scheduler.load_state_dict(load_torch(ckpt / "scheduler.pt"))
    restore_rng(ckpt, state, dist.get_rank(), dist.get_world_size())
    return int(state["step"])


def save_per_rank(
    run_dir: Path, step: int, params: dict, optimizer, scheduler, args: argparse.Namespace, **state
) -> None:
    """Checkpoint `step` of a run whose ranks each hold their own part of the adapter as plain tensors (hand-rolled
    tensor parallelism's slices, a pipeline's stages): every rank writes its trainable parameters (by name), its
    optimizer state and its RNG stream to rank<r>.pt; once all have written, rank 0 adds the scheduler and commits
    the folder, with `state` in its trainer_state.json (as `save_sharded`). A collective."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    tmp = ranks.on_rank0(staging_dir, run_dir, step)
    own = {
        "params": {k: v.detach() for k, v in params.items()},
        "optimizer": optimizer.state_dict(),
        "rng": rng_state(),
    }
    torch.save(own, tmp / f"rank{rank}.pt")
    dist.barrier()  # every rank's file is complete before rank 0 commits
    if rank == 0:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        commit(tmp, step, {"seed": args.seed, "world_size": world, **state}, args.keep_checkpoints)
    dist.barrier()  # no rank goes on (or exits, with --stop-after) before the checkpoint is complete


def load_per_rank(ckpt: Path | None, params: dict, optimizer, scheduler) -> int:
    """Resume from a `save_per_rank` folder: this rank's parameters, optimizer state and RNG stream, the
    scheduler; the step it holds. The same world size only: each rank's file holds its own part of the adapter.
    `ckpt` None (a fresh run): step 0."""
    import torch.distributed as dist

    if ckpt is None:
        return 0
    rank = dist.get_rank()
    state = read_state(ckpt, ("scheduler.pt", f"rank{rank}.pt"))
    check_same_world(ckpt, state, dist.get_world_size(), "each rank's file holds its own part of the adapter")
    own = load_torch(ckpt / f"rank{rank}.pt")
    shapes = {k: tuple(v.shape) for k, v in own["params"].items()}
    if shapes != {k: tuple(v.shape) for k, v in params.items()}:
        raise CheckpointError(f"{ckpt}/rank{rank}.pt holds other tensors than this rank's trainable parameters")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(own["params"][name])
    optimizer.load_state_dict(own["optimizer"])
    scheduler.load_state_dict(load_torch(ckpt / "scheduler.pt"))
    set_rng_state(own["rng"])
    return int(state["step"])


def check_same_world(ckpt: Path, state: dict, world: int, why: str = "each rank continues its own shard") -> None:
    if state.get("world_size") != world:
        raise RunError(
            f"{ckpt} was written by {state.get('world_size')} ranks; resume it with as many "
            f"(torchrun --nproc_per_node={state.get('world_size')}), not {world}: {why}"
        )


def seed_dropout(seed: int, stream: int) -> None:
    """Seed LoRA dropout's RNG (the CPU's and every CUDA generator) for this rank, once the model and its adapter are
    built (their init is seeded on its own, the same on every rank). `stream`: ranks that train on different tokens
    (data-parallel ranks; pipeline ranks, which run other layers) pass different ones, so their masks are
    independent; one generator state everywhere would draw the same masks on every rank, noise correlated across
    the batch. Ranks that hold the same tokens (a tensor-parallel group) pass the same one: they must draw the same
    mask for a replicated input, as one GPU's layer would. Stream 0 is the single-GPU run's."""
    torch.manual_seed(int(hashlib.sha256(f"{seed}-lora-dropout-{stream}".encode()).hexdigest()[:15], 16))


def restore_rng(ckpt: Path, state: dict, rank: int, world: int) -> None:
    """Each rank continues the RNG stream (the LoRA dropout masks) it had when the checkpoint was written. At
    another world size the micro-batches are dealt to other ranks, so no saved stream matches this rank's work:
    each rank then starts a stream of its own, seeded from (seed, step, rank). The dropout masks are then all that
    differs from an uninterrupted run; without dropout, nothing does (tests/test_ddp.py, tests/test_fsdp.py)."""
    if state.get("world_size") == world:
        set_rng_state(load_torch(ckpt / f"rng-rank{rank}.pt"))
        return
    seed = int(hashlib.sha256(f"{state.get('seed')}-{state['step']}-{rank}".encode()).hexdigest()[:15], 16)
    random.seed(seed)
    torch.manual_seed(seed)  # the CPU and every CUDA device's generator
    ranks.print0(
        f"resuming on {world} ranks a checkpoint written by {state.get('world_size')}: the model, optimizer, "
        "schedule and data order continue as they were; the dropout masks come from new RNG streams"
    )


def read_state(ckpt: Path, required: tuple[str, ...]) -> dict:
    """trainer_state.json of a checkpoint, after checking the files the script needs are there."""
    try:
        state = json.loads((ckpt / "trainer_state.json").read_text())
        int(state["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{ckpt}: unreadable trainer_state.json ({e}); resume from an older checkpoint") from e
    missing = [f for f in required if not (ckpt / f).exists()]
    if missing:
        raise CheckpointError(f"{ckpt}: incomplete checkpoint, missing {', '.join(missing)}")
    return state


def load_torch(path: Path):
    """A checkpoint file (optimizer, scheduler, RNG state) as data: `weights_only=True` unpickles tensors, numbers,
    strings and containers only, so a checkpoint from elsewhere cannot run code when it is loaded."""
    import pickle

    try:
        # map_location: a tensor saved from cuda:<n> would otherwise come back to cuda:<n>, which a resume on another
        # layout may not have (and which is not this rank's GPU). Loaded to the CPU, each goes where its owner puts
        # it: parameters copy_() into theirs, the optimizer's state follows its parameter, RNG states stay on CPU.
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        # torch names the global (a class or function) it refused to import; damaged bytes name none.
        refused = [line.strip() for line in str(e).splitlines() if "GLOBAL" in line]
        if not refused:
            detail = next((line for line in str(e).splitlines() if "Unsupported" in line), "not a torch.save file")
            raise CheckpointError(f"{path}: corrupt or unreadable ({detail.strip()})") from e
        raise CheckpointError(
            f"{path}: refused, it holds objects other than tensors and plain data, which unpickling could run as "
            "code; this project's checkpoints hold only tensors, numbers and containers, so it was not written "
            f"by it (or was altered). Resume from another checkpoint. ({refused[0][:200]})"
        ) from e
    except Exception as e:
        raise CheckpointError(f"{path}: corrupt or unreadable ({type(e).__name__}: {e})") from e


def rng_state() -> dict:
    """This process's RNG streams: Python's, the CPU generator and, on a GPU, the generator of this rank's own
    device only (the current device, which `device_for` set). Not every visible GPU's by ordinal: a resume on
    another per-node layout (other GPUs per node, another CUDA_VISIBLE_DEVICES) would then restore another GPU's
    stream into this one, or index past the GPUs it sees."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda_device"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore `rng_state()`'s streams; the GPU stream into this rank's current device, whatever its ordinal."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda_device" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_device"])
    elif "cuda" in state:  # written before 2026-11-25: every visible GPU's stream, by ordinal
        ranks.print0(
            "the checkpoint's GPU RNG streams were saved by device ordinal, not per rank: not restored (the "
            "dropout masks continue from a new stream; the model, optimizer and data order are unaffected)"
        )


def save_adapter(path: Path, weights: dict[str, torch.Tensor], peft_config) -> None:
    """A stock PEFT adapter from a technique's reassembled weights (PEFT's names, without the adapter name): the
    two files `PeftModel.save_pretrained` writes, which `PeftModel.from_pretrained` loads on one device."""
    import safetensors.torch

    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in sorted(weights.items())}
    safetensors.torch.save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})
    inference_mode, peft_config.inference_mode = peft_config.inference_mode, True  # as save_pretrained writes it
    try:
        peft_config.save_pretrained(path)
    finally:
        peft_config.inference_mode = inference_mode


def save_gathered_adapter(path: Path, weights: dict[str, torch.Tensor], peft_config) -> None:
    """`save_adapter` for an adapter spread over the ranks, each holding some of its tensors whole under the full
    model's names (a pipeline's stages): rank 0 gathers every rank's and writes the one stock PEFT adapter. A
    collective: every rank calls it."""
    import torch.distributed as dist

    rank = dist.get_rank()
    parts = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object({k: p.detach().cpu() for k, p in weights.items()}, parts, dst=0)
    if rank == 0:
        save_adapter(path, {k: v for part in parts for k, v in part.items()}, peft_config)


def save_fsdp_adapter(path: Path, model) -> None:
    """`save_adapter` for a model sharded by FSDP2 (on a 2-D mesh too): the full adapter gathered onto rank 0's CPU
    (`get_model_state_dict` with full_state_dict, the frozen base left out) and written there as a stock PEFT
    adapter, the same files PeftModel.save_pretrained writes. A collective: every rank calls it."""
    import torch.distributed as dist
    from peft import get_peft_model_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    full = get_model_state_dict(model, options=options)
    if dist.get_rank() == 0:
        weights = get_peft_model_state_dict(model, state_dict=full, save_embedding_layers=False)
        save_adapter(path, weights, model.peft_config["default"])


def global_adapter_key(stage_name: str, first_layer: int) -> str:
    """A LoRA parameter's name in a pipeline stage (pp-ft) -> its key in the full model's PEFT adapter file: the
    stage-local layer index becomes the global one and PEFT's adapter name ("default") is dropped, as
    save_pretrained does. 'layers.1.mlp.up_proj.lora_A.default.weight' of the stage from layer 2 ->
    'base_model.model.model.layers.3.mlp.up_proj.lora_A.weight'."""
    parts = stage_name.split(".")
    if parts[0] != "layers" or "default" not in parts:
        raise ValueError(f"not a LoRA parameter of a decoder layer: {stage_name}")
    parts[1] = str(first_layer + int(parts[1]))
    parts.remove("default")
    return "base_model.model.model." + ".".join(parts)


def gather_slices(linears, group, grads: bool = False) -> dict[str, torch.Tensor]:
    """The whole adapter (or its gradient) of hand-rolled tensor parallelism (tp-sp-ft) under PEFT's names for the
    unsharded model. `linears`: (name, module) pairs of its parallel linears, each holding its slices of `lora_A`
    and `lora_B`, split along the dim its `split` names (None: whole on every rank). The slices are all-gathered
    and concatenated along that dim (B's rows of a column layer, A's columns of a row layer; `ranks.gather_split`).
    Every rank takes part; the result is the same on every rank."""
    out = {}
    for name, m in linears:
        for which in ("A", "B"):
            p = getattr(m, f"lora_{which}")
            t = ranks.gather_split((p.grad if grads else p).detach(), m.split[which], group)
            out[f"{name}.lora_{which}.weight"] = t.cpu().contiguous()
    return out


def save_sliced_adapter(path: Path, linears, group, peft_config) -> None:
    """`save_adapter` for an adapter sliced over the ranks (tp-sp-ft): every rank takes part in `gather_slices`,
    rank 0 writes the one stock PEFT adapter. A collective: every rank calls it."""
    import torch.distributed as dist

    weights = gather_slices(linears, group)
    if dist.get_rank() == 0:
        save_adapter(path, weights, peft_config)
