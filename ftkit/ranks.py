"""One process per GPU: its device, its share of the CPU cores, the process group torchrun set up, and what the
ranks do together outside the training step (rank 0 first, rank 0 only, the launch that turns a run's errors into
messages)."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import sys
import time

import torch

from ftkit import errors
from ftkit.errors import CheckpointError, DataError, ModelError, RunComplete, RunError


def device_for(args: argparse.Namespace, local_rank: int = 0) -> torch.device:
    """CUDA for the real job, CPU only when asked for with --smoke: the scale is a flag, never a fallback."""
    if args.smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        from ftkit.gpu import explain_no_cuda

        launcher = "uv run torchrun --nproc_per_node=2" if "LOCAL_RANK" in os.environ else "uv run python"
        raise RunError(
            f"no usable CUDA device: {explain_no_cuda()}\nThis script trains Qwen3-4B on GPUs. For the CPU "
            f"walkthrough (tiny Qwen3, real AMI text) add --smoke:\n    {launcher} {' '.join(sys.argv)} --smoke"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def torchrun_local_rank() -> int:
    """This process's GPU on its node, from the variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE and
    MASTER_ADDR/PORT, where rank 0 listens)."""
    if "LOCAL_RANK" not in os.environ:
        raise RunError(
            "launch this script with torchrun, one process per GPU:\n    uv run torchrun --nproc_per_node=2 "
            + " ".join(sys.argv)
        )
    return int(os.environ["LOCAL_RANK"])


def share_cpu_cores(device: torch.device) -> None:
    """On CPU the ranks of a machine share its cores instead of each taking all of them. The cores are those this
    process may run on (a Slurm job step or a container binds a subset), not all the machine has: more threads
    than cores spin against each other while a rank waits in a collective, and a step takes 10x longer."""
    if device.type == "cpu":
        affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every core counts
        cores = len(affinity(0)) if affinity else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


# How long a collective may wait for the other ranks before the run ends with an error. Set, not left to torch:
# its default depends on the backend string (10 minutes for "nccl" alone, 30 for "cpu:gloo,cuda:nccl" or "gloo" in
# torch 2.15). 30 minutes covers what ranks legitimately wait for inside the group - rank 0 loading Qwen3-4B into
# host memory while the others wait at a barrier (fsdp-ft), a checkpoint written to slow shared storage - and
# still ends a hung job within the half hour.
PROCESS_GROUP_TIMEOUT = dt.timedelta(minutes=30)


def init_process_group(device: torch.device) -> None:
    """Join the process group torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR/PORT). On GPUs both backends: NCCL
    moves CUDA tensors only, and gloo gives a CPU tensor (a metric, a pickled object, a CPU-offloaded gradient's
    norm) a route instead of an error; device_id binds the NCCL communicator to this rank's GPU. gloo on CPU. Both
    with PROCESS_GROUP_TIMEOUT."""
    import torch.distributed as dist

    if device.type == "cuda":
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device, timeout=PROCESS_GROUP_TIMEOUT)
    else:
        dist.init_process_group("gloo", timeout=PROCESS_GROUP_TIMEOUT)


def launch(main) -> None:
    """Run a train.py's `main`: a RunError/DataError/ModelError/CheckpointError ends it with its message and exit
    code 2, not a traceback. Then destroy the process group, if one is up, and leave without running the C++ static
    destructors: with gloo a launch can otherwise abort at exit ("terminate called without an active exception")
    after the work is done (devlogs/ddp-ft.md, "The exit abort")."""
    import torch.distributed as dist

    code = 0
    try:
        main()
    except RunComplete as e:
        print0(str(e))
    except torch.OutOfMemoryError:
        print(out_of_memory(), file=sys.stderr)
        raise
    except (RunError, DataError, ModelError, CheckpointError) as e:
        # Flags and data are the same on every rank, so rank 0 says it once; a checkpoint error can be one rank's
        # own shard, so every rank that meets one says so. The others wait a moment before exiting: torchrun stops
        # the whole group at the first exit, which could otherwise cut rank 0 off before it has printed.
        if int(os.environ.get("RANK", "0")) == 0 or isinstance(e, CheckpointError):
            print(f"error: {e}", file=sys.stderr)
        else:
            time.sleep(3)
        code = 2
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def out_of_memory() -> str:
    """What a run that ran out of GPU memory says beside torch's error: the memory model's prediction for its layout
    (`errors.memory_prediction`, where --fit chose it) against what the allocator held at its peak."""
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    if errors.memory_prediction is None:
        return (
            f"out of memory at {peak:.1f} GiB allocated (peak): try --micro-batch-tokens lower, or --checkpointing all"
        )
    return (
        f"out of memory at {peak:.1f} GiB allocated (peak); --fit auto chose: {errors.memory_prediction}. The memory "
        "model under-predicted this run by at least the difference; run with --fit off (or a smaller "
        "--micro-batch-tokens) and report it"
    )


def gather_split(t: torch.Tensor, dim: int | None, group=None) -> torch.Tensor:
    """The whole tensor of which each rank of `group` holds one equal part along `dim` (hand-rolled tensor
    parallelism's slices): the parts all-gathered and concatenated in rank order, the same on every rank; every
    rank takes part. `dim` None: `t` is whole on every rank already, and is returned as it is."""
    import torch.distributed as dist

    if dim is None:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def check_pipeline_microbatches(
    microbatches: int, stages: int, micro_batch_size: int, schedule: str = "1f1b", world: int | None = None
) -> None:
    """torch's schedules raise on a micro-batch count they cannot lay out, after every rank has loaded the model
    (their constructors, torch.distributed.pipelining.schedules): 1F1B and DualPipeV on fewer than the pipeline
    stages, the interleaved ones on a count that is not a whole number of rounds (max(1, m // ranks) of them).
    Refused here first, from the flags, with a --batch-size that works."""
    if schedule in ("1f1b", "dualpipev") and microbatches < stages:
        raise RunError(
            f"{microbatches} micro-batches a step are fewer than the {stages} pipeline stages, which torch's "
            f"--schedule {schedule} refuses: --batch-size {stages * micro_batch_size} or more (or fewer ranks)"
        )
    if schedule in ("interleaved-1f1b", "interleaved-zb") and world:
        rounds = max(1, microbatches // world)
        if microbatches % rounds:
            works = rounds * world * micro_batch_size
            raise RunError(
                f"{microbatches} micro-batches a step are not a whole number of rounds of {world} ranks "
                f"({rounds} rounds), which torch's --schedule {schedule} refuses: --batch-size {works}, a multiple "
                f"of {world * micro_batch_size} (ranks x --micro-batch-size)"
            )


def check_tp_degree(config, tp: int) -> None:
    """Heads and MLP columns are dealt out whole: a tensor-parallel degree must divide the KV heads (and so the
    query heads, a multiple of them) and the intermediate size. Checked from the config, before any weight loads."""
    reasons = [
        f"{n} {name}"
        for name, n in (
            ("key/value heads", config.num_key_value_heads),
            ("attention heads", config.num_attention_heads),
            ("intermediate size", config.intermediate_size),
        )
        if n % tp
    ]
    if reasons:
        ok = [d for d in range(1, config.num_key_value_heads + 1) if config.num_key_value_heads % d == 0]
        raise RunError(
            f"tensor-parallel degree {tp} does not divide the model's {', '.join(reasons)}: each rank must hold "
            f"whole heads; use --nproc_per_node in {ok}"
        )


def check_cp_chunks(max_length: int, cp: int) -> None:
    """Context parallelism cuts every sequence into 2 x cp equal chunks (rank r: chunks r and 2cp-1-r): --max-length
    must be a multiple of 2 x cp; the error says which one to pass."""
    if max_length % (2 * cp):
        fit = -(-max_length // (2 * cp)) * 2 * cp
        raise RunError(
            f"--max-length {max_length} cannot be cut into 2 x --cp = {2 * cp} equal chunks: pass --max-length {fit}"
        )


def print0(*text: str) -> None:
    """Print once per run (on rank 0), not once per rank."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(*text, flush=True)


def fail(message: str) -> None:
    """Exit with a clear message and no traceback."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)

    # Not completed with every step checkpointed (stopped while the adapter was being written): the resumed run
    # trains no step and writes the adapter and summary.


def restart_count() -> int:
    """How often torchrun has restarted this launch's worker group (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def launch_info() -> dict:
    """config.json's record of the torchrun launch: its id (the same in every attempt) and this attempt's number."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return {}
    return {"launch": {"torchelastic_run_id": os.environ["TORCHELASTIC_RUN_ID"], "restart": restart_count()}}


def on_rank0(fn, *args, **kwargs):
    """Run `fn` on rank 0 only (choosing the run directory, writing config.json) and hand every rank its result.
    A RunError/DataError/CheckpointError it raises is raised on every rank, so a bad flag stops all of them with
    the same message instead of leaving the others waiting in a collective that rank 0 never joins."""
    import torch.distributed as dist

    if not dist.is_initialized():  # one process: it is rank 0
        return fn(*args, **kwargs)
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn(*args, **kwargs))
        except (RunError, DataError, CheckpointError) as e:
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise value
    return value


@contextlib.contextmanager
def rank0_first():
    """Rank 0 runs the block first and fills the caches (the tiny tokenizer, random-init weights, hub downloads);
    the other ranks run it after, and find them ready. With a process group up, transformers' save_pretrained
    writes on rank 0 only, so a cache another rank built would come out empty."""
    import torch.distributed as dist

    if not dist.is_initialized():  # one process: nothing to wait for
        yield
        return
    if dist.get_rank() != 0:
        dist.barrier()
    yield
    if dist.get_rank() == 0:
        dist.barrier()
