"""The planner's step-time model (ftkit/plan/) against the step times the benchmark measured on this CPU.

    uv run python assets/plan_cpu_check.py            # calibrate this CPU, predict, compare; writes the report
    uv run python assets/plan_cpu_check.py --check    # the committed report, again from the committed inputs
    uv run python assets/plan_cpu_check.py --rebuild  # rewrite the report from them (after a planner change)

1. Calibrate the CPU as the planner's "GPU": the fp32 matmul rate at a tiny-model projection's shape with 1 and
   with every core, the memory copy rate (NF4's dequantization term), and gloo's all-reduce between 2 processes on
   loopback: latency (alpha) from a 4-byte all-reduce, bandwidth (beta) from a 16 MiB one. Written to
   devlogs/runs/plan-cpu/calibration.json.
2. For every run of the committed --smoke benchmark (devlogs/runs/plan-cpu/benchmark/: the summaries of
   `assets/benchmark.py --nproc 2 --smoke`, copied from its run directories), the planner's prediction for that
   experiment, its flags and its number of processes, with the calibrated CPU in place of a GPU (each process's
   share of the cores), gloo as the link, MFU 1 and link efficiency 1 (the calibration measured the matmuls and the
   all-reduce themselves), against the median over repeats of the run's median step time. Written to
   devlogs/plan-cpu-check.md, whose analysis section below the table is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from ftkit import hardware, models
from ftkit.plan import recommendation, settings, techniques

ROOT = Path(__file__).resolve().parents[1]
CALIBRATION = ROOT / "devlogs" / "runs" / "plan-cpu" / "calibration.json"
BENCHMARK = ROOT / "devlogs" / "runs" / "plan-cpu" / "benchmark"
REPORT = ROOT / "devlogs" / "plan-cpu-check.md"
# The benchmark's configurations: run name prefix -> the planner's technique and mesh (at the run's world size).
CONFIGS = {
    "single-gpu-ft-nf4-1rank": ("single", {}),
    "single-gpu-ft-none-1rank": ("single", {}),
    "ddp-ft-1rank": ("ddp", {"dp": 1}),
    "ddp-ft-2rank": ("ddp", {"dp": 2}),
    "fsdp-ft-1rank": ("fsdp", {"dp": 1}),
    "fsdp-ft-2rank": ("fsdp", {"dp": 2}),
    "tp-ft-1rank": ("tp", {"tp": 1}),
    "tp-ft-2rank": ("tp", {"tp": 2}),
    "tp-sp-ft-1rank": ("tp-sp", {"tp": 1}),
    "tp-sp-ft-2rank": ("tp-sp", {"tp": 2}),
    "fsdp-tp-ft-1rank": ("fsdp-tp", {"dp": 1, "tp": 1}),
    "fsdp-tp-ft-2rank": ("fsdp-tp", {"dp": 1, "tp": 2}),
    "pp-ft-2rank": ("pp", {"pp": 2}),
}


def matmul_rate(threads: int, tokens: int = 1024, hidden: int = 128, out: int = 256, seconds: float = 1.0) -> float:
    """fp32 FLOP/s of x @ W^T at a tiny-model projection's shape, with `threads` threads."""
    torch.set_num_threads(threads)
    x, w = torch.randn(tokens, hidden), torch.randn(out, hidden)
    for _ in range(10):
        x @ w.T
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        x @ w.T
        n += 1
    return 2 * tokens * hidden * out * n / (time.perf_counter() - start)


def copy_rate(nbytes: int = 256 * 2**20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return 2 * 5 * nbytes / (time.perf_counter() - start)  # read + write


def _gloo_worker(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    times = {}
    for name, numel in (("small", 1), ("large", 4 * 2**20)):
        t = torch.zeros(numel)
        for _ in range(5):
            dist.all_reduce(t)
        n = 50 if name == "small" else 10
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(t)
        times[name] = (time.perf_counter() - start) / n
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def gloo_alpha_beta() -> tuple[float, float]:
    """(seconds per ring step, bytes/s) of a 2-process gloo all-reduce, the alpha-beta model's two numbers: a
    4-byte all-reduce is all latency (2 ring steps); a 16 MiB one sends 2 (N-1)/N = 1 x its bytes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.spawn(_gloo_worker, args=(f"file://{tmp}/store", out), nprocs=2)
        times = json.loads(Path(out).read_text())
    alpha = times["small"] / 2
    return alpha, 16 * 2**20 / (times["large"] - 2 * alpha)


def calibrate() -> dict:
    return {
        "matmul_flops_per_s": {str(t): matmul_rate(t) for t in (1, os.cpu_count() or 1)},
        "copy_bytes_per_s": copy_rate(),
        "gloo_alpha_s": (ab := gloo_alpha_beta())[0],
        "gloo_beta_bytes_per_s": ab[1],
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
    }


def predict(summary: dict, technique: str, mesh: dict[str, int], cal: dict, mfu: float = 1.0) -> dict:
    """The planner's row for this run, with each process's share of the CPU as its GPU: a process gets the
    threads `run.share_cpu_cores` gives it (cores / processes), and with more processes than cores each gets a
    share of one core."""
    c = summary["config"]
    procs = summary["hardware"]["world_size"]
    cores = cal["cpu_count"]
    threads = max(1, cores // procs)  # as run.share_cpu_cores sets them
    rate = cal["matmul_flops_per_s"].get(str(threads)) or cal["matmul_flops_per_s"]["1"] * threads
    rate *= min(1.0, cores / procs)  # more processes than cores share them
    cpu = hardware.GPU("cpu", (), rate, 24e9, cal["copy_bytes_per_s"], "calibrated (assets/plan_cpu_check.py)")
    gloo = hardware.Link("gloo", cal["gloo_beta_bytes_per_s"], cal["gloo_alpha_s"], "calibrated")
    config = SimpleNamespace(**{**models.TINY_CONFIG, "vocab_size": models.TINY_VOCAB})
    s = settings.Setting(
        config=config,
        gpu=cpu,
        gpus=procs,
        nodes=1,
        link=gloo,
        inter_node_link=gloo,
        memory_bytes=cpu.memory_bytes,
        **settings.run_flags(c),
        mfu=mfu,
        link_efficiency=1.0,
        layout="full",  # priced as this page always was: every row --max-length real tokens
    )
    return techniques.evaluate(s, technique, mesh, c.get("quant") or "none")


def median_step(prefix: str) -> tuple[float, dict]:
    """The median over the benchmark's repeats of a configuration's median step time, and one of its summaries."""
    summaries = [json.loads((r / "summary.json").read_text()) for r in sorted(BENCHMARK.glob(f"{prefix}-r*"))]
    return statistics.median(s["median_step_time_s"] for s in summaries), summaries[0]


def report(cal: dict) -> str:
    # One point of calibration per base: the single-process reference's achieved fraction of the matmul rate (its
    # FLOPs at MFU 1 over its measured step). Every other prediction then tests the rest of the model: the split of
    # compute over processes, the communication each technique cannot hide, the bubble.
    mfu = {}
    for quant in ("nf4", "none"):
        measured, summary = median_step(f"single-gpu-ft-{quant}-1rank")
        mfu[quant] = predict(summary, "single", {}, cal)["compute_s"] / measured
    lines = [
        "# The planner's step time against the CPU benchmark",
        "",
        "Generated by `uv run python assets/plan_cpu_check.py` (which calibrates the CPU it runs on: on another, or "
        "a busy one, its numbers differ; `--check` rebuilds this page from the committed inputs) from "
        "`devlogs/runs/plan-cpu/calibration.json` and the summaries of the benchmark's runs in "
        "`devlogs/runs/plan-cpu/benchmark/` (`assets/benchmark.py --nproc 2 --smoke`, its run of 2026-11-22; "
        "`assets/benchmark.md` has been measured again since). Predicted: `ftkit/plan/` with this CPU as the GPU: its "
        f"fp32 matmul rate at a tiny-model projection's shape ({cal['matmul_flops_per_s']['1'] / 1e9:.1f} GFLOP/s "
        f"on one core, {cal['matmul_flops_per_s'][str(cal['cpu_count'])] / 1e9:.1f} on {cal['cpu_count']}), gloo's "
        f"all-reduce (alpha {cal['gloo_alpha_s'] * 1e6:.0f} us per ring step, beta "
        f"{cal['gloo_beta_bytes_per_s'] / 1e9:.2f} GB/s), and an MFU calibrated on one point: the single-process "
        f"reference, whose step reaches {mfu['none']:.1%} of the matmul rate on a bf16/fp32 base and "
        f"{mfu['nf4']:.1%} with NF4. Measured: the median over the benchmark's repeats of each run's median step "
        "time. The tiny random Qwen3, fp32, gloo, a 2-core CPU: numbers that check the model, not GPU numbers.",
        "",
        "| configuration | technique | processes | measured s | predicted s | compute | exposed comm | bubble "
        "| predicted / measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for prefix, (technique, mesh) in CONFIGS.items():
        if not any(BENCHMARK.glob(f"{prefix}-r*")):
            continue
        measured, summary = median_step(prefix)
        p = predict(summary, technique, mesh, cal, mfu[summary["config"].get("quant") or "none"])
        label = f"{technique} {recommendation.mesh_label(mesh)}" + (
            " (the calibration point)" if technique == "single" else ""
        )
        lines.append(
            f"| `{prefix}` | {label} | {summary['hardware']['world_size']} | "
            f"{measured:.3f} | {p['step_time_s']:.3f} | {p['compute_s']:.3f} | {p['exposed_comm_s']:.3f} | "
            f"{p['bubble_s']:.3f} | {p['step_time_s'] / measured:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="rebuild the report from the committed calibration and compare")
    p.add_argument(
        "--rebuild",
        action="store_true",
        help="rewrite the report from the committed calibration, without measuring (after a change to the planner)",
    )
    args = p.parse_args()
    if args.check:
        text = report(json.loads(CALIBRATION.read_text()))
        if REPORT.read_text().partition("\n## ")[0].rstrip("\n") != text.rstrip("\n"):
            raise SystemExit(
                f"{REPORT} is not what the committed calibration and benchmark runs give: regenerate it (--rebuild)"
            )
        print(f"{REPORT}: reproduced from the committed inputs")
        return
    if args.rebuild:
        cal = json.loads(CALIBRATION.read_text())
    else:
        cal = calibrate()
        CALIBRATION.parent.mkdir(parents=True, exist_ok=True)
        CALIBRATION.write_text(json.dumps(cal, indent=2) + "\n")
    text = report(cal)
    kept = REPORT.read_text().partition("\n## ")[1:] if REPORT.exists() else ("", "")
    REPORT.write_text(text.rstrip("\n") + "\n" + "".join(kept) if kept[0] else text)  # the analysis below is kept
    print(text)


if __name__ == "__main__":
    main()
