"""The common command line, run directories, checkpoints and RNG state: what every train.py shares.

A run directory holds `config.json` (resolved args, versions, hardware, world size), `metrics.jsonl`,
`summary.json`, `adapter/` (a stock PEFT adapter) and `checkpoints/step-N/`. Runs never overwrite each other:
without --output-dir a run gets a fresh timestamped folder under runs/<experiment>/, and `latest` points at it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path

import torch

from ftkit import metrics
from ftkit.data import SHIPPED
from ftkit.profiling import parse_profile_steps

# The AMI meetings the package ships, offline, for the real runs and the walkthrough alike.
DEFAULT_DATA = SHIPPED
# Hub datasets read from a revision other than their main branch: AMIsum's main branch is a loading script,
# which `datasets` no longer runs, so it is read from the hub's parquet conversion of it.
HUB_REVISIONS = {"TalTechNLP/AMIsum": "refs/convert/parquet"}
RUNS = Path("runs")

# Flags whose change would make a resumed run a different run (other data, other batches, other schedule).
RESUME_MUST_MATCH = (
    "model",
    "data",
    "seed",
    "max_steps",
    "max_length",
    "batch_size",
    "lr",
    "warmup_steps",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "quant",
    "dtype",
    "weight_decay",
    "max_grad_norm",
)


# Flags that --resume does not take from the run's config.json, and that may differ when given again: where the
# run lives, how it is watched, how often it saves and evaluates, when this invocation stops.
RESUME_FREE = (
    "output_dir",
    "resume",
    "stop_after",
    "progress",
    "profile_steps",
    "save_every",
    "keep_checkpoints",
    "eval_every",
    "eval_examples",
    "compile",  # the same step compiled or eager (tests/test_compile.py)
    "explicit_flags",
    "experiment",
)


class RunError(RuntimeError):
    """A problem with the run's setup; the message says how to fix it."""


class RunComplete(RunError):
    """--resume of a run that has nothing left to do: said, and the process exits 0 with the run untouched."""


class _Unset:
    """Stands in for every flag while parsing the command line a second time: what is still this was not given."""


class FlagParser(argparse.ArgumentParser):
    """Records which flags the command line gave (`args.explicit_flags`), so that --resume can take every other
    one from the run's config.json and tell a flag given again apart from a default."""

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        probe = argparse.Namespace(**{a.dest: _Unset for a in self._actions if a.dest != "help"})
        given = vars(super().parse_args(args, probe))
        parsed.explicit_flags = sorted(k for k, v in given.items() if v is not _Unset and k != "experiment")
        return parsed


def common_parser(description: str, experiment: str) -> argparse.ArgumentParser:
    p = FlagParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.set_defaults(experiment=experiment)
    g = p.add_argument_group("common flags (every experiment)")
    g.add_argument(
        "--smoke",
        action="store_true",
        help="CPU walkthrough: tiny random Qwen3, fp32, gloo; defaults below marked [smoke] apply",
    )
    g.add_argument(
        "--model",
        default=None,
        help="Qwen/Qwen3-4B, a local path, 'tiny' or 'qwen3-4b-shape' (random init, exact 4B config) "
        "[default: Qwen/Qwen3-4B; smoke: tiny]",
    )
    g.add_argument(
        "--data",
        default=None,
        help=f"'{SHIPPED}' (QMSum's AMI meetings, shipped in the package), a QMSum-format folder or a hub dataset "
        f"id (owner/name[:config]) [default: {DEFAULT_DATA}]",
    )
    g.add_argument(
        "--data-revision",
        default=None,
        help="hub revision [default: the main branch; "
        + ", ".join(f"{k}: {v}" for k, v in HUB_REVISIONS.items())
        + "]",
    )
    g.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help="run directory [default: a new runs/<experiment>[-smoke]/<time>/]",
    )
    g.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        help="continue a run: a run directory or checkpoint; bare --resume takes this experiment's latest run",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-steps", type=int, default=None, help="optimizer steps [100; smoke: 30]")
    g.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="exit after this step as if interrupted (schedule still spans --max-steps); "
        "for time-boxed jobs, continue with --resume",
    )
    g.add_argument("--max-length", type=int, default=None, help="tokens per sequence [2048; smoke: 512]")
    g.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="GLOBAL batch: sequences per optimizer step, whatever the number of GPUs [16; smoke: 8]",
    )
    g.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="rows per rank per forward: packed rows of up to --max-length positions (several sequences each), or with "
        "--no-packing one padded sequence per row, accumulation = batch / (micro x data-parallel ranks) [2; smoke: 2]",
    )
    g.add_argument(
        "--no-packing",
        dest="packing",
        action="store_false",
        help="one sequence per row, right-padded to the micro-batch's longest (the layout before packing, to compare)",
    )
    g.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile each decoder layer (torch.compile, regional: one graph for all layers; the first step pays "
        "for it), where the technique allows; --no-compile: eager [on CUDA: on; smoke: off]",
    )
    g.add_argument("--lr", type=float, default=None, help="peak learning rate [2e-4; smoke: 2e-3]")
    g.add_argument("--warmup-steps", type=int, default=None, help="linear warmup, then cosine [10; smoke: 3]")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    g.add_argument("--lora-rank", type=int, default=16)
    g.add_argument("--lora-alpha", type=float, default=32.0)
    g.add_argument(
        "--lora-dropout",
        type=float,
        default=None,
        help="[0.05; smoke: 0.0, so runs of different techniques are comparable step by step]",
    )
    g.add_argument(
        "--dtype",
        choices=["bf16", "fp32"],
        default=None,
        help="compute dtype [bf16; smoke: fp32, for exact parity between techniques]",
    )
    g.add_argument(
        "--no-grad-checkpointing",
        dest="grad_checkpointing",
        action="store_false",
        help="keep all activations instead of recomputing each layer in backward",
    )
    g.add_argument("--eval-every", type=int, default=None, help="eval loss on held-out meetings [25; smoke: 10]")
    g.add_argument("--eval-examples", type=int, default=None, help="held-out examples per eval [64; smoke: 16]")
    g.add_argument("--save-every", type=int, default=None, help="checkpoint every N steps [50; smoke: 10]")
    g.add_argument("--keep-checkpoints", type=int, default=2, help="newest checkpoints kept")
    g.add_argument(
        "--profile-steps",
        type=parse_profile_steps,
        default=None,
        metavar="A:B",
        help="write a torch.profiler trace of optimizer steps A..B (and a CUDA memory snapshot on GPUs) into "
        "<run>/profile/, for Perfetto / TensorBoard / pytorch.org/memory_viz",
    )
    g.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="print one JSON line per step instead of a progress bar",
    )
    return p


def add_dump_flags(group: argparse._ArgumentGroup) -> None:
    """--dump-grads and --dump-logits, for the tensor-parallel experiments: what a test compares with the same
    step on one device."""
    group.add_argument(
        "--dump-grads",
        action="store_true",
        help="write step 3's LoRA gradients, reassembled to full shapes, to grads-step3.safetensors (the column "
        "layers' A gradients are zero while B is: at init, and after step 1, which warmup runs at lr 0)",
    )
    group.add_argument(
        "--dump-logits",
        action="store_true",
        help="after training, write the logits of the first eval micro-batch to logits.pt (for a one-device check)",
    )


SMOKE = dict(
    model="tiny",
    data=DEFAULT_DATA,
    max_steps=30,
    max_length=512,
    batch_size=8,
    micro_batch_size=2,
    lr=2e-3,
    warmup_steps=3,
    lora_dropout=0.0,
    dtype="fp32",
    eval_every=10,
    eval_examples=16,
    save_every=10,
)
REAL = dict(
    model="Qwen/Qwen3-4B",
    data=DEFAULT_DATA,
    max_steps=100,
    max_length=2048,
    batch_size=16,
    micro_batch_size=2,
    lr=2e-4,
    warmup_steps=10,
    lora_dropout=0.05,
    dtype="bf16",
    eval_every=25,
    eval_examples=64,
    save_every=50,
)


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Take a resumed run's flags from its config.json, fill the scale-dependent defaults (smoke or real) and check
    the flags, all before anything expensive."""
    follow_restart(args)
    if args.resume:
        take_run_flags(args)
    for key, value in (SMOKE if args.smoke else REAL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.data_revision is None:
        args.data_revision = HUB_REVISIONS.get(args.data.partition(":")[0])
    if args.compile is None:  # compiled layers where the step's speed matters; the CPU walkthrough stays eager
        args.compile = not args.smoke
    for key in (
        "max_steps",
        "max_length",
        "batch_size",
        "micro_batch_size",
        "lora_rank",
        "eval_every",
        "save_every",
        "eval_examples",
    ):
        if getattr(args, key) <= 0:
            raise RunError(f"--{key.replace('_', '-')} must be positive, got {getattr(args, key)}")
    if args.stop_after is not None and not 0 < args.stop_after <= args.max_steps:
        raise RunError(f"--stop-after must be in 1..--max-steps ({args.max_steps}), got {args.stop_after}")
    # Written so that NaN fails every check.
    ranges = {
        "lr": (args.lr > 0, "a positive learning rate, e.g. 2e-4"),
        "warmup_steps": (args.warmup_steps >= 0, "0 or more"),
        "weight_decay": (args.weight_decay >= 0, "0 or more"),
        "max_grad_norm": (args.max_grad_norm >= 0, "0 (no clipping) or a positive norm"),
        "lora_alpha": (args.lora_alpha > 0, "positive (the adapter's scale is alpha / rank)"),
        "lora_dropout": (0 <= args.lora_dropout < 1, "a probability in [0, 1)"),
        "keep_checkpoints": (args.keep_checkpoints >= 1, "1 or more (the newest checkpoint is what --resume needs)"),
    }
    for key, (ok, expected) in ranges.items():
        if not ok:
            raise RunError(f"--{key.replace('_', '-')} must be {expected}, got {getattr(args, key)}")
    return args


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


def start_ranks(args: argparse.Namespace, tp: int | None = None) -> tuple[torch.device, dict]:
    """A torchrun process (one per GPU) up to its process group, in the order that keeps the group's timeout away:
    this rank's device (on CPU, its share of the cores); the model's files downloaded (~8 GB of weights on a first
    run) before the group exists, so that no rank waits in a collective meanwhile, where the group's 30-minute timeout
    would end the run; with `tp`, a tensor-parallel degree that does not deal out whole heads refused from the
    config (`check_tp_degree`), on every rank alike, before the data, the group or any weight; the data splits
    (a hub dataset downloads too); then the group (`init_process_group`). Returns (device, splits)."""
    from ftkit import data, models

    device = device_for(args, torchrun_local_rank())
    share_cpu_cores(device)
    models.fetch(args.model)
    if tp is not None:
        check_tp_degree(models.model_config(args.model), tp)
    splits = data.load_splits(args.data, args.data_revision)
    init_process_group(device)
    return device, splits


def launch(main) -> None:
    """Run a train.py's `main`: a RunError/DataError/ModelError/CheckpointError ends it with its message and exit
    code 2, not a traceback. Then destroy the process group, if one is up, and leave without running the C++ static
    destructors: with gloo a launch can otherwise abort at exit ("terminate called without an active exception")
    after the work is done (devlogs/ddp-ft.md, "The exit abort")."""
    import torch.distributed as dist

    from ftkit.data import DataError
    from ftkit.models import ModelError

    code = 0
    try:
        main()
    except RunComplete as e:
        print0(str(e))
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


def adamw_cosine(
    params: list[torch.nn.Parameter], args: argparse.Namespace
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """Every experiment's optimizer: AdamW (--lr, --weight-decay) over `params`, and its schedule: linear warmup
    over --warmup-steps, then cosine decay to 0 at --max-steps. Returns (optimizer, scheduler)."""
    from transformers import get_cosine_schedule_with_warmup

    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    return optimizer, get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)


def optimizer_step(optimizer: torch.optim.Optimizer, scheduler) -> float:
    """The optimizer's step, then the schedule's, and the gradients freed (set to None) for the next step's
    backward; returns the learning rate the step ran at (the scheduler's step() sets the next one's)."""
    optimizer.step()
    lr = scheduler.get_last_lr()[0]
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return lr


def squares_sum(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the tensors' squared elements, in fp32, on `device`, for a gradient norm: torch._foreach_norm
    launches one kernel per group of tensors of one device and dtype, where a loop of p.grad.pow(2).sum() launches
    three per tensor (Qwen3-4B's LoRA has 504 matrices: ~1,500 launches a step, each a host dispatch)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(torch._foreach_norm(tensors)).float().pow(2).sum()


def clip_grads_over_ranks(trainable: list, max_norm: float, group=None, replicated: tuple = ()) -> torch.Tensor:
    """The whole model's gradient norm when each rank holds a distinct share of its trainable tensors (pipeline
    stages, tensor-parallel slices), and the gradients clipped to `max_norm` (0: not clipped) as
    torch.nn.utils.clip_grad_norm_ clips one model's: the shares' squares summed over the ranks (one scalar
    all-reduce), the `replicated` tensors (whole on every rank, the same gradient) counted once. The norm stays
    on the device: no host sync."""
    import torch.distributed as dist

    shared = {id(p) for p in replicated}

    def sum_sq(params) -> torch.Tensor:
        return squares_sum([p.grad.detach() for p in params if p.grad is not None], trainable[0].device)

    sq = sum_sq(p for p in trainable if id(p) not in shared)
    dist.all_reduce(sq, group=group)
    norm = (sq + sum_sq(replicated)).sqrt()
    torch.nn.utils.clip_grads_with_norm_(trainable, max_norm if max_norm > 0 else float("inf"), norm)
    return norm


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


def load_experiment(name: str):
    """experiments/<name>/train.py as a module, so that another script (or ftkit.realscale) runs its own functions:
    one TP plan for tp-ft and fsdp-tp-ft, not a copy. Needs a repository checkout."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "experiments" / name / "train.py"
    if not path.exists():
        raise RunError(f"{path} not found: the experiments are scripts of a repository checkout, not of the package")
    module_name = f"{name.replace('-', '_')}_train"
    if module_name not in sys.modules:  # loaded once per process, as an import would be
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[module_name] = module
    return sys.modules[module_name]


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


def torch_dtype(name: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def print0(*text: str) -> None:
    """Print once per run (on rank 0), not once per rank."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(*text, flush=True)


def fail(message: str) -> None:
    """Exit with a clear message and no traceback."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


# ------------------------------------------------------------------------------------------- run dirs


def experiment_root(args: argparse.Namespace) -> Path:
    return RUNS / (args.experiment + ("-smoke" if args.smoke else ""))


def resume_target(args: argparse.Namespace) -> tuple[Path, Path]:
    """--resume's (run directory, checkpoint): a run directory resumes from its newest complete checkpoint, a
    checkpoint directory (<run>/checkpoints/step-N) from that one."""
    target = experiment_root(args) / "latest" if args.resume == "latest" else Path(args.resume)
    if not target.exists():
        raise RunError(f"--resume {args.resume}: {target} does not exist")
    target = target.resolve()
    if target.parent.name == "checkpoints":
        return target.parent.parent, target
    ckpt = latest_checkpoint(target)
    if ckpt is None:
        raise RunError(f"--resume: {target} holds no checkpoint (checkpoints/step-N/); nothing to resume")
    return target, ckpt


def take_run_flags(args: argparse.Namespace) -> None:
    """--resume continues the run as it was started: every flag it was started with comes from its config.json,
    and a flag given again must agree (those in RESUME_FREE excepted). A run with nothing left to do is left as
    it is (RunComplete)."""
    run_dir, ckpt = resume_target(args)
    cfg_path = run_dir / "config.json"
    if not cfg_path.exists():
        raise RunError(f"--resume {args.resume}: {run_dir} has no config.json, so it is not a run to continue")
    old = json.loads(cfg_path.read_text())["args"]
    if old.get("experiment") != args.experiment:
        raise RunError(
            f"--resume {args.resume}: that is a {old.get('experiment')} run; continue it with "
            f"experiments/{old.get('experiment')}/train.py --resume {run_dir}"
        )
    given = set(getattr(args, "explicit_flags", ()))
    conflicts = []
    for key, value in old.items():
        if key in RESUME_FREE or not hasattr(args, key):
            continue
        if key not in given:
            setattr(args, key, value)
        elif getattr(args, key) != value:
            conflicts.append(f"--{key.replace('_', '-')}: the run used {value}, this command says {getattr(args, key)}")
    if conflicts:
        raise RunError(
            "--resume continues a run with its own flags (from its config.json), and these disagree:\n    "
            + "\n    ".join(conflicts)
            + "\nDrop them to continue the run as it was started, or start a new run without --resume."
        )
    summary = run_dir / "summary.json"
    completed = summary.exists() and json.loads(summary.read_text()).get("status") == "completed"
    from_checkpoint = ckpt.resolve() == Path(args.resume).resolve()  # a chosen checkpoint: re-run from there
    if completed and (not from_checkpoint or int(ckpt.name.split("-")[-1]) >= args.max_steps):
        raise RunComplete(f"{run_dir} has completed its {args.max_steps} steps: nothing to resume, nothing changed")
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


def started_by_this_launch(run_dir: Path) -> bool:
    """Whether an earlier attempt of this torchrun launch started the run in `run_dir` (its config.json names the
    launch), as opposed to a run that was there before."""
    try:
        config = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return config.get("launch", {}).get("torchelastic_run_id") == os.environ.get("TORCHELASTIC_RUN_ID")


def follow_restart(args: argparse.Namespace) -> None:
    """Under `torchrun --max-restarts=K`, when a rank dies torchrun stops the others and starts the whole worker
    group again with the same command line. The new attempt continues the run from its newest complete checkpoint
    (so a dead rank costs at most --save-every steps), or, if the run died before its first checkpoint, starts it
    again in the same directory. Every attempt must find the same directory: --output-dir names it."""
    restartable = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
    if restartable and not (args.output_dir or args.resume):
        raise RunError(
            "torchrun --max-restarts starts the workers again with the same command after a rank dies; give the "
            "run a fixed directory with --output-dir DIR, so that a restarted group continues that run from its "
            "latest checkpoint instead of starting a new one"
        )
    if restartable and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # By default torchrun shares its rendezvous TCPStore with the workers, one store for every attempt, so a
        # restarted rank can read the address a dead peer left in it and fail to connect (pytorch/pytorch#135712).
        # Measured on this project's CPU tests: of 3 restarts, one failed to connect and one hung; with the store
        # unshared, 4 restarts in 4 succeeded.
        raise RunError(
            "torchrun --max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment, so that "
            "each restart gets a fresh store (pytorch/pytorch#135712), e.g.\n    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
            f"uv run torchrun --max-restarts=3 --nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', 2)} "
            f"experiments/{args.experiment}/train.py --output-dir DIR ..."
        )
    if restart_count() == 0:
        return
    run_dir = resume_target(args)[0] if args.resume else args.output_dir
    if started_by_this_launch(run_dir) and latest_checkpoint(run_dir) is not None:
        args.resume = str(run_dir)  # its newest complete checkpoint: one being written when the rank died is not


def report_end(args: argparse.Namespace, run_dir: Path, finished: bool) -> None:
    """The run's last lines (rank 0): where it is, and its adapter or, stopped early, the exact command that
    continues it (--resume takes the run's flags from its config.json)."""
    if finished:
        print0(f"run directory: {run_dir}\nadapter: {run_dir / 'adapter'}")
        return
    launcher = "uv run python"
    if "LOCAL_RANK" in os.environ:
        launcher = f"uv run torchrun --nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', '1')}"
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
        if nodes > 1:  # every node runs it again, with the rendezvous flags it was launched with
            launcher += f" --nnodes={nodes} <the rendezvous flags of this launch>"
    print0(
        f"run directory: {run_dir}\nstopped after step {args.stop_after} of {args.max_steps}; continue it with:\n"
        f"    {launcher} experiments/{args.experiment}/train.py --resume {run_dir}"
    )


def check_shared_run_dir(run_dir: Path) -> None:
    """Every rank writes into the run directory (its checkpoint shard, or its own rank<r>.pt), rank 0 commits a
    checkpoint by renaming the folder all of them wrote, and a resume reads it back on every rank: on several
    nodes the directory must be on storage every node shares (NFS, Lustre, a cluster file system), the same path
    on each. Checked once, after rank 0 has written config.json: every rank must see it. Refused otherwise, on every
    rank, naming the hosts that cannot see it."""
    import socket

    import torch.distributed as dist

    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (socket.gethostname(), (run_dir / "config.json").exists()))
    blind = sorted({host for host, visible in seen if not visible})
    if blind:
        raise RunError(
            f"{run_dir}: rank 0 wrote config.json there, but the ranks on {', '.join(blind)} cannot see it. On "
            "several nodes every rank writes its part of each checkpoint into the run directory, so --output-dir "
            "must be on storage that every node shares, under the same path (e.g. an NFS or Lustre mount)"
        )


def resolve_run_dir(args: argparse.Namespace) -> tuple[Path, Path | None]:
    """(run directory, checkpoint to resume from or None). Refuses to write into a directory that already
    holds a run unless resuming it, so nothing a user had is overwritten."""
    if args.resume:
        return resume_target(args)
    run_dir = args.output_dir or experiment_root(args) / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    if restart_count() > 0 and started_by_this_launch(run_dir):
        # An earlier attempt of this launch died before its first checkpoint: start again, its rows set aside.
        if (run_dir / "metrics.jsonl").exists():
            os.replace(run_dir / "metrics.jsonl", run_dir / f"metrics.before-restart-{restart_count()}.jsonl")
        return run_dir, None
    if (run_dir / "config.json").exists() or (run_dir / "metrics.jsonl").exists():
        raise RunError(
            f"{run_dir} already holds a run: pass --resume {run_dir} to continue it, or another --output-dir"
        )
    return run_dir, None


def init_run_dir(run_dir: Path, args: argparse.Namespace, config: dict, resume_step: int | None) -> None:
    """Rank 0: create the run dir, write config.json, point `latest` at it. On resume, check the flags that
    define the run are unchanged, and set aside metric rows past the checkpoint (kept in a side file)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir / "config.json"
    if resume_step is not None and cfg_path.exists():
        old = json.loads(cfg_path.read_text())["args"]
        changed = [k for k in RESUME_MUST_MATCH if k in old and old[k] != config["args"].get(k)]
        if changed:
            diffs = ", ".join(f"--{k.replace('_', '-')} {old[k]} -> {config['args'].get(k)}" for k in changed)
            raise RunError(f"--resume with different flags ({diffs}); use the run's own flags (see {cfg_path})")
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists():
            rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            later = [r for r in rows if r["step"] > resume_step]
            if later:
                side = run_dir / f"metrics.before-resume-at-{resume_step}.jsonl"
                for n in range(2, 1000):  # resumed at this step before: keep that side file too
                    if not side.exists():
                        break
                    side = run_dir / f"metrics.before-resume-at-{resume_step}.{n}.jsonl"
                shutil.copy(metrics, side)
                metrics.write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= resume_step))
        config = {**config, "resumed_from_step": resume_step}
    cfg_path.write_text(json.dumps(config, indent=2, default=str))
    if run_dir.parent.resolve() == experiment_root(argparse.Namespace(**config["args"])).resolve():
        link = run_dir.parent / "latest"
        tmp = run_dir.parent / f".latest-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(run_dir.name)
        os.replace(tmp, link)


# ----------------------------------------------------------------------------------------- checkpoints


class CheckpointError(RuntimeError):
    pass


def latest_checkpoint(run_dir: Path) -> Path | None:
    steps = [
        (int(m.group(1)), p)
        for p in (run_dir / "checkpoints").glob("step-*")
        if (m := re.fullmatch(r"step-(\d+)", p.name)) and (p / "trainer_state.json").exists()
    ]
    return max(steps)[1] if steps else None


def staging_dir(run_dir: Path, step: int) -> Path:
    """A fresh folder to write checkpoint `step` into; `commit_checkpoint` moves it into place, so a crash
    mid-save never leaves a half-written checkpoint that --resume would pick."""
    path = run_dir / "checkpoints" / f".tmp-step-{step}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def commit_checkpoint(tmp: Path, step: int, state: dict, keep: int) -> Path:
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


def save_sharded_checkpoint(run_dir: Path, step: int, model, optimizer, scheduler, args: argparse.Namespace) -> None:
    """Checkpoint `step` of a run whose trainable state is spread over the ranks (FSDP's shards, TP's DTensors).
    Every rank writes its own pieces of the trainable parameters and of the optimizer state with
    torch.distributed.checkpoint, into one folder on storage all ranks see; rank 0 adds the scheduler and every
    rank's RNG state, then commits the folder (--seed recorded, --keep-checkpoints kept). A collective: every rank
    calls it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    tmp = on_rank0(staging_dir, run_dir, step)
    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp / "sharded")
    rng = [None] * world if rank == 0 else None
    dist.gather_object(rng_state(), rng, dst=0)
    if rank == 0:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        for r, state in enumerate(rng):
            torch.save(state, tmp / f"rng-rank{r}.pt")
        commit_checkpoint(tmp, step, {"seed": args.seed, "world_size": world}, args.keep_checkpoints)
    dist.barrier()  # no rank goes on (or exits, with --stop-after) before the checkpoint is complete


def load_sharded_checkpoint(ckpt: Path | None, model, optimizer, scheduler, any_world: bool = False) -> int:
    """Resume from a `save_sharded_checkpoint` folder: each rank reads its own pieces, the scheduler and its RNG
    stream; the step it holds. With `any_world` (FSDP) the ranks may be more or fewer than the ones that wrote it:
    torch.distributed.checkpoint stores each tensor with its global offsets and reads back whatever pieces the
    new sharding asks for (see `restore_rng` for what then differs). `ckpt` None (a fresh run): step 0."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    if ckpt is None:
        return 0
    state = read_checkpoint_state(ckpt, ("sharded/.metadata", "scheduler.pt"))
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


def save_rank_checkpoint(
    run_dir: Path, step: int, params: dict, optimizer, scheduler, args: argparse.Namespace, **state
) -> None:
    """Checkpoint `step` of a run whose ranks each hold their own part of the adapter as plain tensors (hand-rolled
    tensor parallelism's slices, a pipeline's stages): every rank writes its trainable parameters (by name), its
    optimizer state and its RNG stream to rank<r>.pt; once all have written, rank 0 adds the scheduler and commits
    the folder, with `state` in its trainer_state.json (as `save_sharded_checkpoint`). A collective."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    tmp = on_rank0(staging_dir, run_dir, step)
    own = {
        "params": {k: v.detach() for k, v in params.items()},
        "optimizer": optimizer.state_dict(),
        "rng": rng_state(),
    }
    torch.save(own, tmp / f"rank{rank}.pt")
    dist.barrier()  # every rank's file is complete before rank 0 commits
    if rank == 0:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        commit_checkpoint(tmp, step, {"seed": args.seed, "world_size": world, **state}, args.keep_checkpoints)
    dist.barrier()  # no rank goes on (or exits, with --stop-after) before the checkpoint is complete


def load_rank_checkpoint(ckpt: Path | None, params: dict, optimizer, scheduler) -> int:
    """Resume from a `save_rank_checkpoint` folder: this rank's parameters, optimizer state and RNG stream, the
    scheduler; the step it holds. The same world size only: each rank's file holds its own part of the adapter.
    `ckpt` None (a fresh run): step 0."""
    import torch.distributed as dist

    if ckpt is None:
        return 0
    rank = dist.get_rank()
    state = read_checkpoint_state(ckpt, ("scheduler.pt", f"rank{rank}.pt"))
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
    print0(
        f"resuming on {world} ranks a checkpoint written by {state.get('world_size')}: the model, optimizer, "
        "schedule and data order continue as they were; the dropout masks come from new RNG streams"
    )


def read_checkpoint_state(ckpt: Path, required: tuple[str, ...]) -> dict:
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
        print0(
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


def dump_grads(grads: dict[str, torch.Tensor], run_dir: Path, rank: int) -> None:
    """--dump-grads: rank 0 writes the LoRA gradients of step 3, reassembled to full shapes (every rank takes part
    in the reassembly), to grads-step3.safetensors."""
    import safetensors.torch

    if rank == 0:
        safetensors.torch.save_file(grads, run_dir / "grads-step3.safetensors")


@torch.no_grad()
def dump_logits(
    model, batch: dict, device: torch.device, path: Path, rank: int, dtype: torch.dtype = torch.float32
) -> None:
    """The logits of one batch, whole, to `path` on rank 0 (every rank runs the forward): for a test to compare
    a sharded model with the reassembled adapter on one device. dtype: as in `eval_loss_sums`."""
    from ftkit.data import to_device
    from ftkit.models import compute_autocast

    model.eval()
    mb = to_device(batch, device)
    with compute_autocast(device, dtype):
        logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
    if rank == 0:
        torch.save({"batch": batch, "logits": logits.cpu()}, path)


def start_log(
    args: argparse.Namespace,
    run_dir: Path,
    device: torch.device,
    train_stats,
    counts: dict,
    accum: int,
    start_step: int,
    resume_from: Path | None,
    model_config,
    n_lora: int | None = None,
    **technique,
) -> metrics.RunLog:
    """What every run records before its first step, on every rank: its config.json (written by rank 0; on resume
    checked against the run's own flags, after saying where it resumed) and the log of its steps, which knows
    the model config and adapter size (`n_lora`, the trainable count by default) for the FLOPs and the devices
    for MFU. `technique`: what the technique adds to config.json. With a process group, every rank then checks
    that it sees the run directory rank 0 wrote to (`check_shared_run_dir`)."""
    import torch.distributed as dist

    if resume_from is not None:
        print0(f"resumed from {resume_from} at step {start_step}")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    hardware = metrics.hardware(device, world_size=world)
    config = metrics.run_config(args, hardware, train_stats.as_dict(), counts, accum, **technique)
    on_rank0(init_run_dir, run_dir, args, config, resume_step=start_step if resume_from is not None else None)
    if dist.is_initialized():
        check_shared_run_dir(run_dir)
    n_lora = counts["trainable"] if n_lora is None else n_lora
    return metrics.RunLog(
        run_dir,
        rank,
        args,
        start_step,
        run_config=config,
        model_config=model_config,
        n_lora=n_lora,
        devices=world,
        device=device,
    )


def finish(args: argparse.Namespace, run_dir: Path, summary: dict, finished: bool) -> None:
    """Rank 0, at the end: summary.json, then the run's last lines (`report_end`)."""
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    report_end(args, run_dir, finished)


# ---------------------------------------------------------------------------------------------- eval


def global_batches(args: argparse.Namespace, train_set: list):
    """The run's global batches (`data.GlobalBatches`, a function of --seed and the step): packed into rows of
    --max-length, or one padded example per row with --no-packing."""
    from ftkit import data

    return data.GlobalBatches(train_set, args.batch_size, args.seed, pack_to=args.max_length if args.packing else None)


def padded_only(args: argparse.Namespace, why: str) -> None:
    """A technique that cannot pack yet: it runs the padded layout, says why once, and records it (`padded_why`)."""
    if args.packing:
        args.packing, args.padded_why = False, why
        print0(f"note: {why}")


def eval_micro_batches(
    encoded: list,
    n_examples: int,
    micro_batch_size: int,
    rank: int = 0,
    world: int = 1,
    even: bool = False,
    collate=None,
):
    """A fixed held-out set (the first n examples, longest first to pad little), cut into micro-batches and
    dealt round-robin to ranks. `even`: refuse a set that does not split evenly over the ranks, for techniques
    whose every forward is a collective (FSDP's all-gathers) and so must run as many micro-batches on every rank.
    `collate`: what makes a micro-batch of a list of examples [`data.collate`]; a pipeline gives its own, for the
    one shape its stages send (experiments/pp-ft)."""
    from ftkit import data

    chosen = sorted(encoded[:n_examples], key=lambda e: -len(e.input_ids))
    chunks = [chosen[i : i + micro_batch_size] for i in range(0, len(chosen), micro_batch_size)]
    if even and len(chunks) % world:
        raise RunError(
            f"--eval-examples {n_examples} makes {len(chunks)} eval micro-batches of {micro_batch_size}, which do "
            f"not split evenly over {world} data-parallel groups (every FSDP forward is a collective)"
        )
    return [(collate or data.collate)(c) for c in chunks[rank::world]]


@torch.no_grad()
def eval_loss_sums(
    model, micro_batches: list[dict], device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[sum of token losses, target tokens] over these micro-batches, as a tensor ready for an all-reduce.
    dtype: the adapters' compute dtype, for a model prepared with `models.adapters_compute_in` (the forward runs
    under `models.compute_autocast`, as in training); fp32 runs it as it is."""
    from ftkit.data import to_device, token_loss_sum
    from ftkit.models import answer_logits, compute_autocast

    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for mb in micro_batches:
        mb = to_device(mb, device)
        with compute_autocast(device, dtype):
            logits = answer_logits(model, mb)
        sums[0] += token_loss_sum(logits, mb["targets"]).double()
        sums[1] += (mb["targets"] != -100).sum()
    model.train(was_training)
    return sums


# ---------------------------------------------------------------------------------------- distributed


def on_rank0(fn, *args, **kwargs):
    """Run `fn` on rank 0 only (choosing the run directory, writing config.json) and hand every rank its result.
    A RunError/DataError/CheckpointError it raises is raised on every rank, so a bad flag stops all of them with
    the same message instead of leaving the others waiting in a collective that rank 0 never joins."""
    import torch.distributed as dist

    from ftkit.data import DataError

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


def encode_data(args: argparse.Namespace, splits: dict) -> tuple:
    """(tokenizer, encoded train examples, encoded val examples, the train set's EncodeStats): the examples in
    Qwen3's chat format with the loss on the answer only, cut to --max-length. Rank 0 builds the tokenizer's
    cache first (the tiny one is trained on the run's own AMI text); the line it prints says what was kept."""
    from ftkit import data, models

    with rank0_first():
        tokenizer = models.load_tokenizer(args.model, data.corpus(splits["train"]))
    formatter = data.ChatFormatter(tokenizer, args.max_length)
    train_set, train_stats = formatter.encode_all(splits["train"])
    val_set, _ = formatter.encode_all(splits["val"])
    print0(f"train: {train_stats.describe()}")
    return tokenizer, train_set, val_set, train_stats


def load_lora_model(args: argparse.Namespace, dtype: torch.dtype, device: torch.device, vocab_size: int):
    """The whole bf16 (--dtype) base on this rank's `device`, built by rank 0 first (it fills the caches), with
    --grad-checkpointing's non-reentrant checkpointing of every decoder layer, and PEFT's LoRA from --seed: the
    same weights and adapter init on every rank, as the single-GPU run's. The start of the scripts in which every
    rank builds the whole model and then keeps its part (tp-ft, tp-sp-ft, pp-ft, fsdp-tp-ft)."""
    from ftkit import models

    with rank0_first():
        model = models.load_model(
            args.model, quant="none", dtype=dtype, device=device, seed=args.seed, vocab_size=vocab_size
        )
    if args.grad_checkpointing:
        models.checkpoint_activations(model)
    return models.apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.seed)


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
