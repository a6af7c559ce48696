"""The parity harness: a technique launched with torchrun on CPU processes (gloo, tiny model, fp32, fixed seed)
against the single-process reference with the same flags and global batch, compared step by step.

A technique's test is a few lines (see tests/test_ddp.py):

    dist = parity.torchrun("experiments/fsdp-ft/train.py", *flags, "--output-dir", str(tmp / "fsdp"))
    ref = parity.reference(tmp, *flags, quant="none")      # bf16-LoRA techniques: the reference without 4-bit
    assert parity.compare_losses(dist.run_dir, ref) <= parity.LOSS_TOL
    assert parity.compare_adapters(dist.run_dir / "adapter", ref / "adapter") <= parity.ADAPTER_TOL

Launches are made robust, because a flaky distributed test is a broken test: torchrun's `--standalone`
rendezvous binds a port the OS picks (no two launches race for one), every launch has a timeout after which its
whole process tree is stopped, and each rank's stdout and stderr go to files that are printed with the result,
so a failing test shows what every rank said.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from conftest import ROOT, Forked, fork_server, run_script
from safetensors.torch import load_file

REFERENCE = "experiments/single-gpu-ft/train.py"
# Per-step losses: the project's parity bar (DESIGN.md). fp32 on CPU, so only summation order differs.
LOSS_TOL = 1e-5
# Adapter tensors after a few steps. AdamW moves each element by lr * m / (sqrt(v) + eps): the update is
# normalised by the gradient's own size, so where a gradient element is tiny a rounding-level difference in it
# (another summation order over ranks and micro-batches) becomes a visible difference in the step, bounded by
# lr (2e-3 in --smoke) per step. 1e-4 is 1/20 of one such step, and 25x the largest difference measured
# (DDP vs reference, 6 steps: 3.8e-6); a wrong gradient (a missing rank, a mean of means) moves the adapter by
# far more (and the loss check catches it first).
ADAPTER_TOL = 1e-4

_references: dict[tuple, Path] = {}


@dataclass
class Launch:
    """One torchrun launch: its exit code, torchrun's own output, and what each local rank printed."""

    args: list[str]
    pid: int  # the agent's
    returncode: int
    seconds: float
    output: str
    ranks: dict[int, dict[str, str]] = field(default_factory=dict)  # local rank -> {"stdout": ..., "stderr": ...}

    @property
    def run_dir(self) -> Path:
        return Path(self.args[self.args.index("--output-dir") + 1])

    def stderr(self, rank: int) -> str:
        return self.ranks.get(rank, {}).get("stderr", "")

    def report(self) -> str:
        parts = [f"$ {' '.join(self.args)}\n(exit {self.returncode} after {self.seconds:.1f} s)"]
        parts += [f"--- torchrun\n{self.output[-3000:]}"]
        for rank, streams in sorted(self.ranks.items()):
            for name, text in streams.items():
                parts.append(f"--- rank {rank} {name}\n{text[-4000:]}")
        return "\n".join(parts)


def torchrun(
    script: str,
    *flags: str,
    nproc: int = 2,
    timeout: float = 300,
    max_restarts: int = 0,
    meanwhile=None,
    env: dict | None = None,
    fork_workers: bool = True,
) -> Launch:
    """`python -m torch.distributed.run --standalone --nproc_per_node=N [--max-restarts=K] script flags`, from the
    repo root. `meanwhile(proc)`, if given, runs while the launch does (e.g. `kill_rank_when`). The workers are
    forked from the agent (tests/forkserver.py), or started as fresh interpreters with `fork_workers=False`."""
    # A fresh log folder per launch, next to the run directory when there is one.
    out = Path(flags[flags.index("--output-dir") + 1]) if "--output-dir" in flags else None
    parent = out.parent if out is not None else None
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix=f"{out.name if out else 'torchrun'}.logs-", dir=parent))
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        f"--max-restarts={max_restarts}",
        "--log-dir",
        str(log_dir),
        "--redirects",
        "3",  # each rank's stdout and stderr into its own files under --log-dir
        script,
        *flags,
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", **(env or {})}
    start = time.monotonic()
    # The agent is forked from the fork server (conftest.fork_server: torch already imported) in a session of its
    # own, so a launch that hangs can be stopped with every process it started.
    output_file = log_dir.with_name(log_dir.name + ".out")  # torchrun's own output, beside its log folder
    proc = fork_server().start(args[1:], env, output_file, output_file, fork_workers=fork_workers)
    try:
        if meanwhile is not None:
            meanwhile(proc)
        returncode = proc.wait(timeout)
        output = output_file.read_text(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # torchrun passes it on to the ranks
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(60)
        output = f"TIMED OUT after {timeout} s\n{output_file.read_text(errors='replace')}"
        returncode = -1
    launch = Launch(args, proc.pid, returncode, time.monotonic() - start, output, _rank_logs(log_dir))
    print(launch.report())  # pytest shows it when the test fails
    return launch


SRUN = """#!/usr/bin/env bash
# srun, standing in for Slurm: the job step's command once per node of the job, here as processes of this machine,
# each "node" bound to its own share of the cores as Slurm binds a job step to its node's (with more nodes than
# cores, nodes share one).
while [[ $1 == -* ]]; do shift; done
cores=$(nproc)
for node in $(seq 0 $((SLURM_JOB_NUM_NODES - 1))); do
    per=$(( cores > SLURM_JOB_NUM_NODES ? cores / SLURM_JOB_NUM_NODES : 1 ))
    first=$(( (node * per) % cores ))
    taskset -c "$first-$((first + per - 1))" "$@" &
done
status=0
for job in $(jobs -p); do wait "$job" || status=$?; done
exit $status
"""


UV = """#!/usr/bin/env bash
# uv, standing in: `uv run [--no-sync] python ARGS` and `uv run [--no-sync] torchrun ARGS` run the same script, or
# torch.distributed.run, on the same arguments through the suite's fork client (tests/forkclient.py: forked from
# the fork server instead of importing torch afresh, on this process's cores); anything else goes to the real uv.
if [[ $1 == run ]]; then
    args=("${@:2}")
    [[ ${args[0]} == --no-sync ]] && args=("${args[@]:1}")
    [[ ${args[0]} == python ]] && exec $FORKCLIENT "${args[@]:1}"
    [[ ${args[0]} == torchrun ]] && exec $FORKCLIENT -m torch.distributed.run "${args[@]:1}"
fi
exec "$REAL_UV" "$@"
"""


def forked_uv(bin_dir: Path, fork_socket: Path) -> dict[str, str]:
    """A `uv` stand-in (UV) in `bin_dir`, and the environment that puts it first on PATH and reaches the fork
    server at `fork_socket` (conftest's): `uv run python` / `uv run torchrun` launches, forked."""
    import shutil

    real = shutil.which("uv")
    assert real, "the launches are `uv run` commands: install uv (pip install uv)"
    (bin_dir / "uv").write_text(UV)
    (bin_dir / "uv").chmod(0o755)
    return {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "REAL_UV": real,
        "FORKSERVER_SOCKET": str(fork_socket),
        "FORKCLIENT": f"{sys.executable} {ROOT / 'tests' / 'forkclient.py'}",
    }


def slurm(
    bin_dir: Path, script: str, *flags: str, nodes: int = 2, per_node: int = 1, fork_socket: Path | None = None
) -> subprocess.CompletedProcess:
    """assets/slurm/train.sbatch run as a `nodes`-node job: srun and scontrol stand-ins (in `bin_dir`) run its
    torchrun command once per "node" on this machine, the agents meeting at the c10d rendezvous on the first node
    (loopback), as separate machines would. With `fork_socket` (conftest's), each node's `uv run torchrun` is
    forked from that fork server (`forked_uv`), on its node's cores."""
    import shutil
    import socket

    uv = shutil.which("uv")
    assert uv, "the Slurm script runs `uv run`: install uv (pip install uv)"
    (bin_dir / "srun").write_text(SRUN)
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho 127.0.0.1\n")  # `show hostnames`: the nodes
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{Path(uv).parent}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": f"node[1-{nodes}]",
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_JOB_ID": port,
        "PORT": port,
        "GPUS_PER_NODE": str(per_node),
        "TOKENIZERS_PARALLELISM": "false",
    }
    if fork_socket is not None:
        env |= forked_uv(bin_dir, fork_socket)
    command = ["bash", "assets/slurm/train.sbatch", script, *flags]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def kill_rank_when(rank: int, appears: Path, timeout: float = 240):
    """A `meanwhile` for `torchrun`: once the path `appears` exists, SIGKILL the worker process of `rank` (found by
    the output file torchrun gave it, <log-dir>/.../<local rank>/stdout.log), as a crashed GPU or node would end it."""

    def kill(proc: Forked) -> None:
        deadline = time.monotonic() + timeout
        while not appears.exists():
            assert proc.poll() is None, f"the launch ended before {appears} appeared"
            assert time.monotonic() < deadline, f"{appears} did not appear within {timeout} s"
            time.sleep(0.02)
        workers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _is_worker(p, proc.pid, rank)]
        assert len(workers) == 1, f"rank {rank}: found worker processes {[p.name for p in workers]}"
        os.kill(int(workers[0].name), signal.SIGKILL)

    return kill


def _is_worker(proc_dir: Path, agent_pid: int, rank: int) -> bool:
    """Whether /proc/<pid> is a worker of the torchrun agent `agent_pid` running local rank `rank`."""
    try:
        ppid = int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
        stdout = Path(os.readlink(proc_dir / "fd" / "1"))
    except (OSError, ValueError, IndexError):
        return False  # gone meanwhile, or not ours to read
    return ppid == agent_pid and stdout.name == "stdout.log" and stdout.parent.name == str(rank)


def _rank_logs(log_dir: Path) -> dict[int, dict[str, str]]:
    """torchrun writes <log-dir>/<run id>/attempt_<k>/<local rank>/{stdout,stderr}.log; the last attempt's are
    kept (attempts sort in order)."""
    ranks: dict[int, dict[str, str]] = {}
    for path in sorted(log_dir.glob("*/attempt_*/*/std*.log")):
        ranks.setdefault(int(path.parent.name), {})[path.stem] = path.read_text(errors="replace")
    return ranks


def refused(monkeypatch, script: str, *argv: str, world: int | None = None) -> str:
    """`script`'s main() run in this process with `argv` (as rank 0 of `world` torchrun ranks, if given): the
    message of the error it stops with (a RunError, DataError, ModelError or CheckpointError, which ranks.launch prints
    on rank 0 alone as one line with exit code 2; test_ddp.py checks that in a real launch). A script that starts
    its process group before refusing fails here: bad flags are refused before any rank waits on another.
    In-process, so that each check does not pay for importing torch again."""
    import runpy

    import pytest
    import torch.distributed as dist

    from ftkit import errors

    if world is not None:
        for key in ("RANK", "LOCAL_RANK"):
            monkeypatch.setenv(key, "0")
        for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
            monkeypatch.setenv(key, str(world))

    def no_group(*args, **kwargs):
        raise AssertionError(f"{script} started its process group before refusing")

    monkeypatch.setattr(dist, "init_process_group", no_group)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    main = runpy.run_path(str(ROOT / script))["main"]
    with pytest.raises((errors.RunError, errors.DataError, errors.ModelError, errors.CheckpointError)) as error:
        main()
    return str(error.value)


def reference(base: Path, *flags: str, quant: str = "nf4", timeout: float = 300) -> Path:
    """The single-process reference run (experiments/single-gpu-ft/train.py) with these flags; its run directory.
    Cached per test session by flags, so techniques that compare against the same reference share one run."""
    key = (flags, quant)
    if key not in _references:
        out = Path(tempfile.mkdtemp(prefix="reference-", dir=base))
        proc = run_script(REFERENCE, *flags, "--quant", quant, "--output-dir", str(out / "run"), timeout=timeout)
        assert proc.returncode == 0, f"the reference run failed:\n{proc.stderr[-3000:]}"
        _references[key] = out / "run"
    return _references[key]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]


def compare_losses(run_a: Path, run_b: Path, key: str = "loss") -> float:
    """Max |a - b| of a per-step metric (loss, eval_loss) over the steps both runs logged it; the runs must have
    logged the same steps."""
    a, b = metrics(run_a), metrics(run_b)
    assert [r["step"] for r in a] == [r["step"] for r in b], "the runs logged different steps"
    pairs = [(x[key], y[key]) for x, y in zip(a, b) if key in x or key in y]
    assert pairs, f"no {key} logged"
    return max(abs(x - y) for x, y in pairs)


def compare_adapters(dir_a: Path, dir_b: Path) -> float:
    """Max |a - b| over the tensors of two PEFT adapters (adapter_model.safetensors), which must have the same keys
    and shapes: a reassembled adapter must be the whole adapter, under the names PEFT gives it, and name the same
    base model (the adapter alone says what to load it on)."""
    bases = [
        json.loads((Path(d) / "adapter_config.json").read_text())["base_model_name_or_path"] for d in (dir_a, dir_b)
    ]
    assert bases[0] is not None and bases[0] == bases[1], f"base_model_name_or_path: {bases}"
    a = load_file(Path(dir_a) / "adapter_model.safetensors")
    b = load_file(Path(dir_b) / "adapter_model.safetensors")
    assert a.keys() == b.keys(), f"different tensors: {sorted(a.keys() ^ b.keys())[:6]}"
    assert all(a[k].shape == b[k].shape for k in a), "different shapes"
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# Host syncs per optimizer step a train.py may make (.item()/.tolist() and the like on tensors, from its own code):
# on CUDA each one stalls the host until the GPU has caught up. The scripts make one (the metrics' scalars, copied
# together); a sync per micro-batch would show as at least the accumulation steps.
MAX_HOST_SYNCS = 2


def host_syncs(run_dir: Path, save_every: int) -> list[int]:
    """`host_syncs` of the steps that are only a training step: not an eval step, and not right after a checkpoint
    (whose count includes the save)."""
    rows = metrics(run_dir)
    after_checkpoint = [r["step"] > 1 and (r["step"] - 1) % save_every == 0 for r in rows]
    counts = [r["host_syncs"] for r, after in zip(rows, after_checkpoint) if "eval_loss" not in r and not after]
    assert counts, "no plain training step to count (every step evaluated or followed a checkpoint)"
    return counts


def infer_with_a_loud_adapter(script: str, run_dir: Path, tmp: Path, *extra: str) -> dict:
    """Run an experiment's infer.py on a copy of `run_dir` whose adapter's lora_B matrices are replaced by N(0, 1)
    draws, far from a few steps' training: the base column must then differ from the finetuned one in every example,
    which a script that generated both columns from the base model (or both with the adapter) would fail. The copy
    keeps the technique's own adapter files (names, config), so their loading is what runs. Returns infer-test.json."""
    import shutil

    import torch
    from safetensors.torch import save_file

    copy = tmp / f"{run_dir.name}-loud"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints", "profile", "merged"))
    weights = load_file(copy / "adapter" / "adapter_model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for key, t in weights.items():
        if "lora_B" in key:
            weights[key] = torch.randn(t.shape, generator=generator).to(t.dtype)
    save_file(weights, copy / "adapter" / "adapter_model.safetensors")
    proc = run_script(script, "--smoke", "--run", str(copy), "--num-examples", "2", "--max-new-tokens", "8", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ROUGE F1" in proc.stdout
    result = json.loads((copy / "infer-test.json").read_text())
    assert len(result["examples"]) == 2 and set(result["rouge"]) == {"base", "finetuned"}
    assert all(e["reference"] for e in result["examples"])
    assert all(e["base"] != e["finetuned"] for e in result["examples"]), result["examples"]
    return result


def rank_dropout_streams(ckpt: Path, world: int = 2) -> list:
    """Each rank's CPU generator state (LoRA dropout's stream) in a checkpoint: rng-rank<r>.pt, or the "rng" of
    rank<r>.pt where each rank writes one file (tp-sp-ft, pp-ft)."""
    import torch

    def state(r: int):
        own = ckpt / f"rng-rank{r}.pt"
        if own.exists():
            return torch.load(own, weights_only=True)["torch"]
        return torch.load(ckpt / f"rank{r}.pt", weights_only=True)["rng"]["torch"]

    return [state(r) for r in range(world)]
