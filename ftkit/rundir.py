"""Run directories: where a run lives, how --resume and torchrun's restarts find it again, and what it records.

A run directory holds `config.json` (resolved args, versions, hardware, world size), `metrics.jsonl`,
`summary.json`, `adapter/` (a stock PEFT adapter) and `checkpoints/step-N/`. Runs never overwrite each other:
without --output-dir a run gets a fresh timestamped folder under runs/<experiment>/, and `latest` points at it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
from pathlib import Path

import torch

from ftkit import attention, checkpoint, hardware, metrics, models, ranks
from ftkit.errors import RunComplete, RunError

RUNS = Path("runs")


# Flags whose change would make a resumed run a different run (other data, other batches, other schedule).
RESUME_MUST_MATCH = (
    "model",
    "tokenizer",
    "data",
    "task",
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

# Flags --resume takes from the run's config.json unless given again, and that may then differ: the same step's math
# with another memory/time trade (`--checkpointing`, `--no-grad-checkpointing`: recomputing a layer restores its RNG
# state, so its dropout masks are the first forward's). A run recorded before --checkpointing has grad_checkpointing
# only, which `cli.resolve_checkpointing` maps to all or none.
RESUME_MAY_CHANGE = ("checkpointing", "grad_checkpointing")


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
    ckpt = checkpoint.latest(target)
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
    old["tokenizer"] = models.recorded_tokenizer(old)  # a run from before --tokenizer continues with the one it used
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
        elif getattr(args, key) != value and key not in RESUME_MAY_CHANGE:
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
    if ranks.restart_count() == 0:
        return
    run_dir = resume_target(args)[0] if args.resume else args.output_dir
    if started_by_this_launch(run_dir) and checkpoint.latest(run_dir) is not None:
        args.resume = str(run_dir)  # its newest complete checkpoint: one being written when the rank died is not


def report_end(args: argparse.Namespace, run_dir: Path, finished: bool) -> None:
    """The run's last lines (rank 0): where it is, and its adapter or, stopped early, the exact command that
    continues it (--resume takes the run's flags from its config.json)."""
    if finished:
        ranks.print0(f"run directory: {run_dir}\nadapter: {run_dir / 'adapter'}")
        return
    launcher = "uv run python"
    if "LOCAL_RANK" in os.environ:
        launcher = f"uv run torchrun --nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', '1')}"
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
        if nodes > 1:  # every node runs it again, with the rendezvous flags it was launched with
            launcher += f" --nnodes={nodes} <the rendezvous flags of this launch>"
    ranks.print0(
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


def resolve(args: argparse.Namespace) -> tuple[Path, Path | None]:
    """(run directory, checkpoint to resume from or None). Refuses to write into a directory that already
    holds a run unless resuming it, so nothing a user had is overwritten."""
    if args.resume:
        return resume_target(args)
    run_dir = args.output_dir or experiment_root(args) / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    if ranks.restart_count() > 0 and started_by_this_launch(run_dir):
        # An earlier attempt of this launch died before its first checkpoint: start again, its rows set aside.
        if (run_dir / "metrics.jsonl").exists():
            os.replace(run_dir / "metrics.jsonl", run_dir / f"metrics.before-restart-{ranks.restart_count()}.jsonl")
        return run_dir, None
    if (run_dir / "config.json").exists() or (run_dir / "metrics.jsonl").exists():
        raise RunError(
            f"{run_dir} already holds a run: pass --resume {run_dir} to continue it, or another --output-dir"
        )
    return run_dir, None


def init(run_dir: Path, args: argparse.Namespace, config: dict, resume_step: int | None) -> None:
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
    a sharded model with the reassembled adapter on one device. dtype: as in `evaluation.loss_sums`."""
    from ftkit.batching import to_device
    from ftkit.lora import compute_autocast

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
        ranks.print0(f"resumed from {resume_from} at step {start_step}")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    machine = hardware.describe(device, world_size=world)
    kernels = attention.kernels(model_config._attn_implementation)  # what each layout's attention runs
    ranks.print0(f"attention: packed rows: {kernels['packed']}; padded rows: {kernels['padded']}")
    config = metrics.run_config(args, machine, train_stats.as_dict(), counts, accum, attention=kernels, **technique)
    ranks.on_rank0(init, run_dir, args, config, resume_step=start_step if resume_from is not None else None)
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
