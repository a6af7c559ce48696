"""Every experiment on the same data, global batch, sequence length and steps, at 1 and N ranks, in one table.

    uv run python assets/benchmark.py --nproc 2 --smoke    # CPU: tiny random Qwen3, fp32, gloo
    uv run python assets/benchmark.py --nproc 2            # GPUs: NCCL, CUDA peak memory, MFU

Each run is launched as the README launches it (`uv run python` for single-gpu-ft, `uv run torchrun` for the
others) with the same common flags, and writes its own run directory under --runs-dir. The tables are made from
those directories' summary.json and metrics.jsonl alone, never from what the runs print:

- tokens/s and step time: each run's summary median (over its steps after the first, which warms up); the
  table gives the median over --repeats runs and their range, the runs interleaved (every configuration once,
  then again) so that a slow minute on a shared machine lands on every configuration alike, as the DDP devlog
  does (assets/ddp_runs.sh);
- peak memory on rank 0 (CUDA peak allocated on GPUs, process peak RSS on CPU) and the memory model beside it;
- MFU (GPUs only) as the summaries state it, with their convention;
- collective bytes per step, measured (the comm recorder, ftkit/comm.py) and what the run's summary says theory
  sends;
- the pipeline bubble per rank from pp-ft's per-rank busy/idle times, and the bottleneck rank;
- scaling efficiency: tokens/s / (ranks x the tokens/s of the single-process reference the experiment equals,
  single-gpu-ft with the run's --quant);
- x HF (tuned): tokens/s / the tokens/s of the same job through Hugging Face's own stack at its best
  (assets/hf_baseline.py --tuned: transformers' Trainer + PEFT with the per-device batch the memory model fits,
  padding-free batches with a varlen attention, Liger kernels where installed, torch.compile on CUDA), which runs
  beside the experiments with the stock Trainer's rows (--hf-configs: padded, flatten and tuned by default) and is
  what a user would run instead; x HF (padded), against the stock padded row, where the runs have no tuned one.

Then assets/benchmark.md (and assets/benchmark.png) says what it ran on and with which command.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from devlog_tables import hardware, peak_memory

from ftkit import cli, rundir

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ("single-gpu-ft", "ddp-ft", "fsdp-ft", "tp-ft", "tp-sp-ft", "pp-ft", "fsdp-tp-ft")
BASELINE = "single-gpu-ft"
# The single-process reference each technique's step equals (DESIGN.md, "Equal to the reference"): QLoRA for DDP,
# whose --quant defaults to nf4; LoRA on an unquantized base for the others, which have no 4-bit path.
QUANT = {"ddp-ft": "nf4"}
# Experiments that refuse one rank, with their reason (experiments/pp-ft/train.py says it and exits).
NEEDS_TWO = {"pp-ft": "a pipeline needs at least 2 ranks"}
# What a user would run instead: the same job through transformers' Trainer + PEFT, one process: stock with one of
# its collators, or tuned (assets/hf_baseline.py --tuned); "x HF" divides every configuration's tokens/s by the tuned
# one's, or by the stock padded one's where the runs have no tuned one (HF_REFERENCES, in that order).
HF = "hf-baseline"
HF_SCRIPT = "assets/hf_baseline.py"
HF_CONFIGS = ("padded", "flatten", "tuned")
HF_REFERENCES = {"tuned": f"{HF}-tuned-1rank", "padded": f"{HF}-padded-1rank"}


@dataclass
class Run:
    experiment: str
    ranks: int
    quant: str | None  # single-gpu-ft's --quant; the others run with their own default
    repeat: int
    hf: str | None = None  # the Hugging Face baseline's configuration: a stock collator, or tuned

    @property
    def config(self) -> str:
        variant = self.quant or self.hf
        return f"{self.experiment}{f'-{variant}' if variant else ''}-{self.ranks}rank"

    @property
    def name(self) -> str:
        return f"{self.config}-r{self.repeat}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, help="N: the ranks of the distributed runs (>= 2)")
    p.add_argument("--smoke", action="store_true", help="the CPU walkthrough's scale, passed to every run")
    p.add_argument(
        "--experiments",
        default=",".join(EXPERIMENTS),
        help="comma-separated; single-gpu-ft runs as the baseline of the others whether listed or not",
    )
    p.add_argument(
        "--hf-configs",
        "--hf-collators",  # its name before the tuned configuration
        dest="hf_configs",
        default=",".join(HF_CONFIGS),
        help=f"the Hugging Face baseline ({HF_SCRIPT}) in these configurations, comma-separated: padded and flatten "
        "(the stock Trainer with that --collator), tuned (--tuned); 'none' runs it not (and leaves the x HF column "
        "empty)",
    )
    p.add_argument("--repeats", type=int, default=3, help="runs of each configuration")
    p.add_argument("--max-steps", type=int, default=None, help="steps per run [smoke: 6; GPU: 20]")
    p.add_argument("--batch-size", type=int, default=None, help="global batch [the scripts' default]")
    p.add_argument("--micro-batch-size", type=int, default=None, help="[the scripts' default]")
    p.add_argument("--max-length", type=int, default=None, help="[the scripts' default]")
    p.add_argument("--model", default=None, help="[the scripts' default: Qwen/Qwen3-4B; smoke: tiny]")
    p.add_argument("--data", default=None, help="[the scripts' default: the shipped AMI meetings]")
    p.add_argument("--runs-dir", type=Path, default=None, help="[runs/benchmark/<time>/]")
    p.add_argument("--out", type=Path, default=ROOT / "assets" / "benchmark.md")
    p.add_argument("--figure", type=Path, default=ROOT / "assets" / "benchmark.png")
    p.add_argument(
        "--note",
        default=None,
        help="a sentence for the header, e.g. what else ran on the machine (with --report: replaces the recorded one)",
    )
    p.add_argument(
        "--report",
        type=Path,
        metavar="RUNS_DIR",
        help="run nothing: write the markdown and figure again from a finished benchmark's run directories, with "
        "the flags recorded in its benchmark.json",
    )
    args = p.parse_args(argv)
    if args.report:
        return args
    if args.nproc is None:
        p.error("--nproc is required")
    args.experiments = args.experiments.split(",")
    unknown = [e for e in args.experiments if e not in EXPERIMENTS]
    if unknown:
        p.error(f"unknown experiments {unknown}; known: {', '.join(EXPERIMENTS)}")
    args.hf_configs = [] if args.hf_configs in ("none", "") else args.hf_configs.split(",")
    if set(args.hf_configs) - set(HF_CONFIGS):
        p.error(f"--hf-configs: {args.hf_configs}; known: {', '.join(HF_CONFIGS)} or none")
    if args.nproc < 2 or args.repeats < 1:
        p.error("--nproc must be at least 2 and --repeats at least 1")
    scale = cli.SMOKE if args.smoke else cli.REAL
    # A benchmark measures steps, not convergence: fewer than the scripts' default, enough for a median.
    args.max_steps = args.max_steps or (6 if args.smoke else 20)
    for key in ("batch_size", "micro_batch_size", "max_length", "model", "data"):
        if getattr(args, key) is None:
            setattr(args, key, scale[key])
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    # Absolute: the runs start in the repository root, whatever the directory this command started in.
    args.runs_dir = (args.runs_dir or ROOT / rundir.RUNS / "benchmark" / stamp).resolve()
    return args


def plan(args: argparse.Namespace) -> list[Run]:
    """Every configuration, once per repeat, interleaved."""
    others = [e for e in args.experiments if e != BASELINE]
    quants = {QUANT.get(e, "none") for e in others}
    if BASELINE in args.experiments or not others:
        quants = {"nf4", "none"}
    configs = [(HF, 1, None, c) for c in args.hf_configs]
    configs += [(BASELINE, 1, q, None) for q in sorted(quants)]
    for e in others:
        configs += [(e, n, None, None) for n in (1, args.nproc) if not (n == 1 and e in NEEDS_TWO)]
    return [Run(e, n, q, k, c) for k in range(1, args.repeats + 1) for e, n, q, c in configs]


def command(r: Run, args: argparse.Namespace, uv: str) -> list[str]:
    """The README's launch line for this run, plus the common flags that make every run the same job."""
    script = f"experiments/{r.experiment}/train.py"
    if r.experiment == HF:
        launcher = [uv, "run", "python", HF_SCRIPT, *(["--tuned"] if r.hf == "tuned" else ["--collator", r.hf])]
    elif r.experiment == BASELINE:
        launcher = [uv, "run", "python", script, "--quant", r.quant]
    else:
        # --standalone: a free port for the rendezvous, so that other jobs on the machine do not collide on 29500.
        launcher = [uv, "run", "torchrun", "--standalone", f"--nproc_per_node={r.ranks}", script]
    flags = ["--smoke"] if args.smoke else []
    flags += ["--model", args.model, "--data", str(args.data), "--max-steps", str(args.max_steps)]
    flags += ["--batch-size", str(args.batch_size)]
    if r.hf != "tuned" or args.smoke:  # on GPUs the tuned Trainer fits its own per-device batch to the GPU
        flags += ["--micro-batch-size", str(args.micro_batch_size)]
    flags += ["--max-length", str(args.max_length)]
    # One eval (after the last step, outside the step times) and no checkpoint: the steps are what is measured.
    flags += ["--eval-every", str(args.max_steps), "--save-every", str(args.max_steps + 1)]
    return launcher + flags + ["--no-progress", "--output-dir", str(args.runs_dir / r.name)]


def launch(runs: list[Run], args: argparse.Namespace, argv: list[str]) -> list[dict]:
    """Run each in turn; a failed run stops the benchmark with its log's end. What each launch was (command, start,
    wall time, the machine's load) goes to benchmark.json in the runs directory as it happens."""
    uv = shutil.which("uv")
    if uv is None:
        sys.exit("the runs are launched as the README launches them, with `uv run`: install uv (pip install uv)")
    launches = []
    for i, r in enumerate(runs, 1):
        cmd = command(r, args, uv)
        log = args.runs_dir / f"{r.name}.log"
        print(f"[{i}/{len(runs)}] {r.name}", flush=True)
        started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        load, t0 = os.getloadavg()[0], time.perf_counter()
        with log.open("w") as f:
            code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
        if code != 0:
            sys.exit(f"{r.name} failed (exit {code}):\n{log.read_text()[-3000:]}\nlog: {log}")
        launches.append(
            {
                "run": r.name,
                "command": shlex.join(["uv", *cmd[1:]]),
                "started": started,
                "wall_s": round(time.perf_counter() - t0, 1),
                "load_average_1min_before": load,
            }
        )
        (args.runs_dir / "benchmark.json").write_text(json.dumps({"argv": argv, "launches": launches}, indent=2))
    return launches


# ---------------------------------------------------------------------------------------------------- reading


def load(run_dir: Path) -> tuple[dict, list[dict]]:
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return summary, rows


def comm_theory(s: dict, key: str) -> tuple[float | None, str]:
    """Bytes per optimizer step that the run's summary says theory sends on the collectives recorded under `key`
    (`comm`; fsdp-tp-ft adds `comm_tp` for its tp dimension), in the measured convention (bytes of the buffers),
    and where the summary states it."""
    e = s["config"]["experiment"]
    if e == "ddp-ft":
        return s["trainable_grad_bytes"] * s["syncs_per_step"], "`trainable_grad_bytes` x `syncs_per_step`"
    if key == "comm_tp":
        return s["theory_comm_tp_bytes_per_step"], "`theory_comm_tp_bytes_per_step`"
    if e == "tp-ft" and "theory_comm_bytes_per_step" in s:  # summaries written before it was stated have none
        return s["theory_comm_bytes_per_step"], "`theory_comm_bytes_per_step`"
    if e in ("fsdp-ft", "fsdp-tp-ft"):
        return (
            s["theory_all_gather_bytes"] + s["theory_reduce_scatter_bytes"],
            "`theory_all_gather_bytes` + `theory_reduce_scatter_bytes`",
        )
    if e == "pp-ft":
        pipe = s["pipeline"]
        return (
            2 * (pipe["stages"] - 1) * pipe["microbatches"] * s["activation_bytes_per_microbatch"],
            "2 (`stages` - 1) x `microbatches` x `activation_bytes_per_microbatch`",
        )
    return None, "none stated: the collectives per layer are in the script's comments and tests/test_tp.py"


def label(s: dict) -> str:
    """The experiment, and its mesh where it has one (the Hugging Face baseline: its collator, or tuned)."""
    if s["config"]["experiment"] == HF:
        return f"{HF} ({hf_variant(s)})"
    mesh = s.get("mesh")
    return s["config"]["experiment"] + (f" (dp {mesh['dp']} x tp {mesh['tp']})" if mesh else "")


def hf_variant(s: dict) -> str:
    """A Hugging Face baseline run's configuration: "tuned", or its stock collator (runs from before --tuned have
    no `hf_config`: stock)."""
    return "tuned" if s.get("hf_config") == "tuned" else s["collator"]


def bubble(rows: list[dict]) -> tuple[list[float], list[float]]:
    """Per rank over the steps after the first: (idle / time inside the schedule, compute seconds per step)."""
    rows = rows[1:] if len(rows) > 1 else rows
    ranks = range(len(rows[0]["busy_s"]))
    pipe = [sum(r["pipeline_time_s"][k] for r in rows) for k in ranks]
    idle = [sum(r["idle_s"][k] for r in rows) for k in ranks]
    busy = [sum(r["busy_s"][k] for r in rows) / len(rows) for k in ranks]
    return [i / p for i, p in zip(idle, pipe)], busy


def shown(path: Path) -> str:
    """A path as the markdown names it: relative to the repository root when inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def threads(hw: dict) -> str:
    n, k = hw["world_size"], hw["torch_threads"]
    return f"{n} rank{'s' if n > 1 else ''} x {k} intra-op thread{'s' if k > 1 else ''}"


def spread(values: list[float], fmt: str) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, fmt)
    return f"{format(med, fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


# ---------------------------------------------------------------------------------------------------- writing


def report(
    args: argparse.Namespace, configs: dict[str, list[str]], data: dict, launches: list[dict], argv: list[str],
    figure_note: str
) -> str:  # fmt: skip
    tps = {c: statistics.median(data[n][0]["median_tokens_per_s"] for n in names) for c, names in configs.items()}
    baseline = {data[names[0]][0]["config"]["quant"]: tps[c] for c, names in configs.items() if c.startswith(BASELINE)}
    # x HF: against the tuned Trainer where the runs have one, else the stock padded one (None: no HF rows).
    hf_ref = next((v for v, c in HF_REFERENCES.items() if c in tps), None)
    hf = tps[HF_REFERENCES[hf_ref]] if hf_ref else None
    x_hf = f"x HF ({hf_ref or 'tuned'})"

    summaries = [s for s, _ in data.values()]
    first = summaries[0]
    hw = first["hardware"]
    gpu = hw["device"] == "cuda"
    versions = sorted({", ".join(f"{k} {v}" for k, v in s["versions"].items()) for s in summaries})
    load = {x["run"]: x["load_average_1min_before"] for x in launches}
    cfg = first["config"]
    device = f"{hw['gpu']} GPUs" if gpu else f"CPU only ({hw['cpu']}, {hw['cpu_count']} cores)"
    out = [
        "# Benchmark: every experiment, the same job, 1 and N ranks",
        "",
        "Generated by `assets/benchmark.py` from the run directories named below; do not edit by hand.",
        "",
    ]
    if not gpu:
        out += [
            f"**CPU numbers, not GPU numbers.** Measured on {hw['cpu_count']} CPU cores with the tiny random Qwen3 "
            "of the CPU walkthrough (`--smoke`: fp32, gloo over loopback). They show the mechanics and what each "
            "technique costs on this machine at this size, and say nothing about Qwen3-4B on GPUs; on CPU the "
            "N ranks share the same cores, so N ranks cannot be N times faster here: "
            + "; ".join(sorted({threads(s["hardware"]) for s in summaries}))
            + " (`ftkit.ranks.share_cpu_cores`).",
            "",
        ]
    out += [
        f"- Device: {device}; hardware of the runs: {', '.join(sorted({hardware(s) for s in summaries}))}; "
        f"platform {hw['platform']}.",
        f"- Software: {'; '.join(versions)}.",
        f"- Command: `{shlex.join(['uv', 'run', 'python', 'assets/benchmark.py', *argv])}` "
        f"(runs started {launches[0]['started']} to {launches[-1]['started']}).",
        f"- Every run: model `{cfg['model']}`, data `{cfg['data']}`, global batch {cfg['batch_size']} sequences "
        f"of at most {cfg['max_length']} tokens, micro-batch {cfg['micro_batch_size']}, {cfg['max_steps']} steps, "
        f"seed {cfg['seed']}, dtype {cfg['dtype']}; each configuration {args.repeats} time(s), interleaved.",
        f"- Run directories: `{shown(args.runs_dir)}/<run>/` (config.json, metrics.jsonl, summary.json), each "
        f"launch's command and log in `{shown(args.runs_dir)}/benchmark.json` and `<run>.log`. The same command "
        "writes them again.",
        f"- The machine's 1-minute load average before each launch: {min(load.values()):.2f}-"
        f"{max(load.values()):.2f} (column `load before`)" + (f". {args.note}" if args.note else "."),
        "",
        "## Throughput, memory, scaling",
        "",
        f"| experiment | quant | ranks | tokens/s, median (range) | {x_hf} | step time s, median (range) | "
        "every step s | scaling efficiency | peak memory, rank 0 | memory model | MFU | runs | load before |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c, names in configs.items():
        s = data[names[0]][0]
        quant = s["config"].get("quant", "none")
        ranks = s["hardware"]["world_size"]
        hf_row = s["config"]["experiment"] == HF
        base = None if hf_row else baseline.get(quant)  # HF's step is not one this project's techniques equal
        eff = f"{tps[c] / (ranks * base):.2f}" if base else "-"
        mfus = [data[n][0].get("median_mfu") for n in names]
        cells = [
            label(s),
            quant,
            str(ranks),
            spread([data[n][0]["median_tokens_per_s"] for n in names], ",.0f"),
            f"{tps[c] / hf:.2f}" if hf else "-",
            spread([data[n][0]["median_step_time_s"] for n in names], ".3f"),
            "{:.3f}-{:.3f}".format(*(f(r["step_time_s"] for n in names for r in data[n][1][1:]) for f in (min, max))),
            eff,
            peak_memory(
                max((data[n][0] for n in names), key=lambda x: x.get("max_peak_allocated", x.get("max_peak_rss")))
            ),
            "-" if hf_row else f"{s['memory_predicted']['total'] / 2**30:.3f} GiB",
            f"{100 * statistics.median(mfus):.1f}%" if None not in mfus else "-",
            ", ".join(f"`{n}`" for n in names),
            ", ".join(f"{load[n]:.1f}" for n in names),
        ]
        out.append("| " + " | ".join(cells) + " |")
    skipped = [e for e in args.experiments if e in NEEDS_TWO]
    out += [
        "",
        "Scaling efficiency = tokens/s / (ranks x the median tokens/s of `single-gpu-ft` with the same `--quant`, "
        "the single-process step every technique equals: NF4 for `ddp-ft`, none for the others). The 1-rank "
        "baseline of every experiment is `single-gpu-ft`; a distributed script on 1 rank is listed beside it "
        "where it runs (its efficiency is what its machinery costs on one rank)"
        + (f"; {', '.join(f'`{e}`' for e in skipped)} refuses 1 rank ({NEEDS_TWO[skipped[0]]})." if skipped else ".")
        + " Tokens are the real (non-pad) tokens of the global batch. Peak memory is rank 0's, the largest over "
        "the repeats"
        + (
            ""
            if gpu
            else ": process peak RSS, which counts Python and the libraries too, so it is not "
            "comparable with the memory model's bytes"
        )
        + ". The range is the smallest and largest of the repeats' medians; every step: the fastest and the "
        "slowest step after the first in any repeat, which shows how much other work on the machine moved "
        "single steps.",
    ]
    if any(data[names[0]][0]["config"]["experiment"] == HF for names in configs.values()):
        out += ["", hf_note(configs, data, gpu, hf_ref)]
    out += ["", figure_note]
    out += comm_table(configs, data)
    out += bubble_table(configs, data)
    return "\n".join(out) + "\n"


def hf_note(configs: dict[str, list[str]], data: dict, gpu: bool, ref: str | None) -> str:
    """What the `hf-baseline` rows are (stock and tuned), what x HF means here (`ref`: the row it is taken against,
    tuned, else padded), and how their step differs (from the first run's summary.json of each)."""
    hf = [data[names[0]][0] for names in configs.values() if data[names[0]][0]["config"]["experiment"] == HF]
    stock = [s for s in hf if hf_variant(s) != "tuned"]
    tuned = next((s for s in hf if hf_variant(s) == "tuned"), None)
    out = []
    if stock:
        trainer = stock[0]["trainer"]
        out.append(
            f"`{HF}`: the same job through Hugging Face's own stack (`{HF_SCRIPT}`: transformers' `Trainer` + PEFT; "
            "the same examples in the same order, the same LoRA initialisation; where a project script packs, it "
            "counts its micro-batch in rows of the sequence length, several examples each). Stock, as most scripts "
            f"run it: {stock[0]['attn_implementation']} attention, optim `{trainer['optim']}`, no compile, the global "
            f"batch as {trainer['per_device_train_batch_size']} examples per forward x "
            f"{trainer['gradient_accumulation_steps']} accumulation steps, with "
            + " and ".join(f"`{s['collator_class']}` ({s['collator']})" for s in stock)
            + "."
        )
    if tuned:
        t = tuned["tuned"]
        on = {True: "on", False: "off"}
        out.append(
            f"`{HF} (tuned)`: the Trainer at its best, as a practitioner on an 80 GB card sets it (`{HF_SCRIPT} "
            f"--tuned`): {t['per_device_train_batch_size']} examples per forward x {t['gradient_accumulation_steps']} "
            f"accumulation steps and activation checkpointing {on[t['activation_checkpointing']]} "
            f"({t['why']['per_device_train_batch_size']}); padding-free, `{t['collator']}` with "
            f"{t['attn_implementation']} attention; Liger kernels {on[t['use_liger_kernel']]} "
            f"({t['why']['use_liger_kernel']}); torch.compile {on[t['torch_compile']]} ({t['why']['torch_compile']}). "
            "Why each, in its summary.json (`tuned`)."
        )
    if ref == "tuned":
        out.append(f"x HF (tuned) = a configuration's median tokens/s / `{HF} (tuned)`'s, in this one benchmark run.")
    elif ref == "padded":
        out.append(
            f"No tuned Hugging Face run in this benchmark (one from before `--tuned`, or `--hf-configs` without it): "
            f"x HF (padded) = a configuration's median tokens/s / the stock `{HF} (padded)`'s, in this one benchmark "
            "run: the stock Trainer, not Hugging Face at its best."
        )
    else:
        out.append("Neither a tuned nor a stock padded Hugging Face run in this benchmark: the x HF column is empty.")
    out.append(
        "On GPUs this ratio is the headline: how much faster than what a user would run instead."
        if gpu
        else "**On CPU, with the tiny model, the ratio is measured but is no GPU figure**: the Trainer's extra work "
        "(logits at every position, a host check of every micro-step's loss) costs differently on a GPU, where "
        "the host and the kernels overlap, so this ratio says nothing about Qwen3-4B on GPUs."
    )
    out.append(
        "What the Trainer's step does differently, and how its step was timed from outside (a callback), is in "
        "each run's summary.json (`differences`, `timing_note`); its memory is that of a step this project's memory "
        "model does not describe (`-`), and its scaling efficiency is not defined (`-`)."
    )
    return " ".join(out)


def comm_table(configs: dict[str, list[str]], data: dict) -> list[str]:
    out = [
        "",
        "## Collective bytes per step",
        "",
        "| experiment | ranks | measured bytes / step (by kind) | theory bytes / step | measured / theory | "
        "theory from summary.json |",
        "|---|---|---|---|---|---|",
    ]
    for names in configs.values():
        s = data[names[0]][0]
        if s["hardware"]["world_size"] == 1:
            continue
        for key in ("comm", "comm_tp"):
            if f"{key}_bytes_per_step" not in s:
                continue
            measured = s[f"{key}_bytes_per_step"]
            rows = [r[key] for r in data[names[0]][1] if key in r]
            by_kind: dict[str, float] = {}
            for row in rows:
                for k, v in row.items():
                    by_kind[k] = by_kind.get(k, 0) + v["bytes"] / len(rows)
            kinds = ", ".join(f"{k} {v:,.0f}" for k, v in by_kind.items())
            theory, source = comm_theory(s, key)
            cells = [
                label(s) + (" tp dimension" if key == "comm_tp" else ""),
                str(s["hardware"]["world_size"]),
                f"{measured:,.0f}" + (f" ({kinds})" if kinds else ""),
                f"{theory:,.0f}" if theory is not None else "-",
                f"{measured / theory:.3f}" if theory else "-",
                source,
            ]
            out.append("| " + " | ".join(cells) + " |")
    out += [
        "",
        "Measured: the summary's `comm_bytes_per_step` of the first repeat, the mean over the steps that recorded "
        "collectives (`tp-ft` and the tp dimension of `fsdp-tp-ft` record the first and the eval steps only), bytes "
        "of the whole buffers; the bytes do not change between repeats of the same job. A mesh dimension of one "
        "rank sends nothing, and its theory is 0.",
    ]
    return out


def bubble_table(configs: dict[str, list[str]], data: dict) -> list[str]:
    pipes = [names for names in configs.values() if "bubble_per_rank" in data[names[0]][0]]
    if not pipes:
        return []
    out = [
        "",
        "## Pipeline bubble per rank",
        "",
        "| experiment | ranks | schedule | rank | compute s / step | bubble, median (range) | theory | bottleneck |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for names in pipes:
        s = data[names[0]][0]
        per_run = [bubble(data[n][1]) for n in names]
        busy = [statistics.median(b[k] for _, b in per_run) for k in range(len(per_run[0][1]))]
        slowest = max(range(len(busy)), key=busy.__getitem__)
        for k, compute in enumerate(busy):
            cells = [
                s["config"]["experiment"],
                str(s["hardware"]["world_size"]),
                s["pipeline"]["schedule"],
                str(k),
                f"{compute:.3f}",
                spread([b[k] for b, _ in per_run], ".3f"),
                f"{s['bubble_theory']:.3f}",
                "**bottleneck**" if k == slowest else "",
            ]
            out.append("| " + " | ".join(cells) + " |")
    out += [
        "",
        "From each run's metrics rows after the first step: bubble = the rank's idle time / its time inside the "
        "schedule (`idle_s` / `pipeline_time_s`, summed over the steps); compute = its `busy_s` per step (the "
        "median over the repeats). The bottleneck is the rank with the most compute: the others wait for it. "
        "Theory: the summary's `bubble_theory`, (p-1)/(v m+p-1) with equal stages and free transfers.",
    ]
    return out


def figure(path: Path, configs: dict[str, list[str]], data: dict, title: str) -> None:
    """tokens/s per configuration (the repeats' median, their range as the error bar) beside the ideal, ranks x
    the baseline's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, med, lo, hi, ideal = [], [], [], [], []
    baseline = {}
    for names in configs.values():
        s = data[names[0]][0]
        tps = [data[n][0]["median_tokens_per_s"] for n in names]
        quant, ranks = s["config"].get("quant", "none"), s["hardware"]["world_size"]
        hf_row = s["config"]["experiment"] == HF
        if s["config"]["experiment"] == BASELINE:
            baseline[quant] = statistics.median(tps)
        variant = hf_variant(s) if hf_row else quant
        labels.append(f"{s['config']['experiment']}\n{ranks} rank{'s' if ranks > 1 else ''}, {variant}")
        med.append(statistics.median(tps))
        lo.append(med[-1] - min(tps))
        hi.append(max(tps) - med[-1])
        ideal.append(ranks * baseline[quant] if quant in baseline and not hf_row else None)
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels)), 4.5))
    x = range(len(labels))
    colors = [
        "tab:orange" if label.startswith(HF) else "tab:gray" if "\n1 rank," in label else "tab:blue" for label in labels
    ]
    ax.bar(
        x, med, yerr=[lo, hi], capsize=3, color=colors,
        label=f"measured (median, range over repeats; grey: 1 rank; orange: {HF}, transformers' Trainer)",
    )  # fmt: skip
    ideal_x = [i for i, v in zip(x, ideal) if v is not None]
    ax.scatter(ideal_x, [v for v in ideal if v is not None], marker="_", s=600, color="black", zorder=3,
               label="ranks x single-gpu-ft (same quant)")  # fmt: skip
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("tokens/s (real tokens of the global batch)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not args.smoke and not args.report:
        import torch

        if torch.cuda.device_count() < args.nproc:
            sys.exit(
                f"{args.nproc} ranks need {args.nproc} CUDA GPUs, found {torch.cuda.device_count()}; for the CPU "
                f"walkthrough add --smoke:\n    uv run python assets/benchmark.py {shlex.join(argv)} --smoke"
            )
    if args.report:
        recorded = json.loads((args.report / "benchmark.json").read_text())
        argv, launches = recorded["argv"], recorded["launches"]
        runs_dir, note = args.report.resolve(), args.note
        args = parse_args(argv)
        args.runs_dir, args.note = runs_dir, note or args.note
        # The runs it launched: a benchmark from before the Hugging Face baseline (or --hf-configs none) has none,
        # one from before --tuned no tuned run.
        launched = {x["run"] for x in launches}
        runs = [r for r in plan(args) if r.name in launched]
    else:
        if args.runs_dir.exists() and any(args.runs_dir.iterdir()):
            sys.exit(f"{args.runs_dir} is not empty: give a new --runs-dir")
        args.runs_dir.mkdir(parents=True, exist_ok=True)
        runs = plan(args)
        launches = launch(runs, args, argv)
    data = {r.name: load(args.runs_dir / r.name) for r in runs}
    configs: dict[str, list[str]] = {}
    for r in runs:
        configs.setdefault(r.config, []).append(r.name)
    if importlib.util.find_spec("matplotlib"):
        hw = data[runs[0].name][0]["hardware"]
        where = hw["gpu"] if hw["device"] == "cuda" else f"CPU, {hw['cpu_count']} cores, tiny model (--smoke)"
        figure(args.figure, configs, data, f"tokens/s at 1 and {args.nproc} ranks: {where}")
        rel = os.path.relpath(args.figure, args.out.parent)
        figure_note = f"![tokens/s per configuration, and ranks x the single-process baseline's]({rel})"
    else:
        figure_note = "No figure: matplotlib is not installed in this environment."
    args.out.write_text(report(args, configs, data, launches, argv, figure_note))
    print(f"{args.out}: {len(runs)} runs from {args.runs_dir}")


if __name__ == "__main__":
    main()
