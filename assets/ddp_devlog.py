"""The DDP devlog's own tables: parity with the reference, the cost of each configuration, the all-reduce alone.

    uv run python assets/ddp_devlog.py

Reads the runs under devlogs/runs/ddp-ft/ (pass 1) and devlogs/runs/ddp-ft-repeats/<name>/pass-<k>/ (the
other passes of assets/ddp_runs.sh) and rewrites two sections of devlogs/ddp-ft.md:
- `<!-- parity:begin -->`: runs are grouped by the flags that define the optimization (the ones --resume must
  match: model, data, seed, steps, lengths, global batch, lr, LoRA, quantization, ...); every run of a group is
  compared step by step with the group's single-process reference (experiments/single-gpu-ft/train.py).
- `<!-- effects:begin -->`: per configuration, the median over the passes of each run's median step time, the
  range over the passes, and the ratio to the group's plain 2-process run; the communication per step as the
  comm hook recorded it.
- `<!-- allreduce:begin -->`: the all-reduce benchmarks in devlogs/runs/ddp-ft-allreduce/ (assets/allreduce_bench.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from ftkit.rundir import RESUME_MUST_MATCH

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "devlogs" / "runs" / "ddp-ft"
REPEATS = ROOT / "devlogs" / "runs" / "ddp-ft-repeats"
BENCH = ROOT / "devlogs" / "runs" / "ddp-ft-allreduce"
DEVLOG = ROOT / "devlogs" / "ddp-ft.md"
# DDP's flags: a run with all of them at their defaults is its group's plain DDP run.
KNOBS = (
    "sync_every_micro_step",
    "find_unused_parameters",
    "reentrant_checkpointing",
    "gradient_as_bucket_view",
    "static_graph",
    "bucket_cap_mb",
)


def load(run: Path) -> tuple[dict, list[dict]]:
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
    return summary, rows


def group_key(summary: dict) -> str:
    return json.dumps({k: summary["config"].get(k) for k in RESUME_MUST_MATCH}, sort_keys=True)


def max_diff(a: list[dict], b: list[dict], key: str) -> float | None:
    pairs = [(x[key], y[key]) for x, y in zip(a, b) if key in x and key in y]
    return max(abs(x - y) for x, y in pairs) if pairs else None


def parity(runs: dict[str, tuple[dict, list[dict]]]) -> str:
    groups: dict[str, list[str]] = {}
    for name, (summary, _) in runs.items():
        groups.setdefault(group_key(summary), []).append(name)
    lines = [
        "| run | world size | reference | steps | max abs loss diff | max abs eval-loss diff |",
        "|---|---|---|---|---|---|",
    ]
    for names in groups.values():
        refs = [n for n in names if runs[n][0]["config"]["experiment"] == "single-gpu-ft"]
        if not refs:
            continue
        ref_rows = runs[refs[0]][1]
        for n in names:
            if n == refs[0]:
                continue
            summary, rows = runs[n]
            assert [r["step"] for r in rows] == [r["step"] for r in ref_rows], f"{n}: other steps than {refs[0]}"
            loss, evals = max_diff(rows, ref_rows, "loss"), max_diff(rows, ref_rows, "eval_loss")
            cells = [f"`{n}`", str(summary["hardware"]["world_size"]), f"`{refs[0]}`", str(len(rows)), f"{loss:.2e}"]
            cells.append(f"{evals:.2e}" if evals is not None else "-")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def effects(runs: dict[str, tuple[dict, list[dict]]]) -> str:
    ddp = {n: s for n, (s, _) in runs.items() if s["config"]["experiment"] == "ddp-ft"}
    passes = {n: [s] + [load(p)[0] for p in sorted((REPEATS / n).glob("pass-*/"))] for n, s in ddp.items()}
    step = {n: statistics.median(s["median_step_time_s"] for s in ss) for n, ss in passes.items()}
    plain = {}
    for n, s in ddp.items():
        if s["hardware"]["world_size"] == 2 and not any(s["config"].get(k) for k in KNOBS):
            plain[group_key(s)] = n
    lines = [
        "| configuration | passes | step time s, median (range) | vs plain 2-process DDP | tokens/s, median | "
        "all-reduce KiB / step | all-reduces / step | all-reduce in flight ms / step, median |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, ss in passes.items():
        base = plain.get(group_key(ss[0]))
        times = [s["median_step_time_s"] for s in ss]
        cells = [
            f"`{n}`",
            str(len(ss)),
            f"{step[n]:.3f} ({min(times):.3f}-{max(times):.3f})",
            f"{step[n] / step[base]:.2f}x" if base else "-",
            f"{statistics.median(s['median_tokens_per_s'] for s in ss):,.0f}",
            f"{ss[0]['comm_bytes_per_step'] / 2**10:,.0f}",
            f"{ss[0]['comm_count_per_step']:.1f}",
            f"{1e3 * statistics.median(s['comm_time_s_per_step'] for s in ss):.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def allreduce() -> str:
    """The all-reduce benchmarks (assets/allreduce_bench.py): median time per size, and the fitted ring model."""
    lines = []
    for path in sorted(BENCH.glob("*.json")):
        b = json.loads(path.read_text())
        hw = b["hardware"]
        where = hw.get("gpu", f"CPU ({hw['cpu_count']} cores)")
        fit = b["fit"]
        lines += [
            f"`{path.name}`: {b['backend']}, {b['world_size']} processes, {where}, median of {b['repeats']} "
            f"all-reduces per size. Least-squares fit of time = alpha + 2(N-1)/N x bytes / beta: "
            f"alpha = {fit['alpha_s'] * 1e6:.0f} us, beta = {fit['beta_bytes_per_s'] / 1e9:.2f} GB/s.",
            "",
            "| bytes | median time us | bytes / time, GB/s |",
            "|---|---|---|",
        ]
        for size, seconds in b["median_seconds"].items():
            lines.append(f"| {int(size):,} | {seconds * 1e6:,.0f} | {int(size) / seconds / 1e9:.3f} |")
        lines.append("")
    return "\n".join(lines).rstrip()


def replace(text: str, section: str, content: str) -> str:
    begin, end = f"<!-- {section}:begin -->", f"<!-- {section}:end -->"
    before, rest = text.split(begin, 1)
    _, after = rest.split(end, 1)
    return f"{before}{begin}\n{content}\n{end}{after}"


def main() -> None:
    runs = {d.name: load(d) for d in sorted(RUNS.glob("*/"))}
    text = replace(DEVLOG.read_text(), "parity", parity(runs))
    text = replace(text, "effects", effects(runs))
    DEVLOG.write_text(replace(text, "allreduce", allreduce()))
    print(f"{DEVLOG}: parity, effects and all-reduce tables written")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
