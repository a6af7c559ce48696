"""Regenerate a devlog's tables from the run summaries committed beside it.

    uv run python assets/devlog_tables.py single-gpu-ft

reads every `devlogs/runs/<experiment>/<run>/summary.json` and rewrites the part of `devlogs/<experiment>.md`
between `<!-- tables:begin -->` and `<!-- tables:end -->`. Numbers in a devlog are never typed by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- tables:begin -->", "<!-- tables:end -->"
REFERENCE = "cpu-reference"  # the single-process run a folder's parity column compares with
# Flags that every run sets on its own (paths) or that do not change what is measured.
IGNORED_FLAGS = {
    "output_dir",
    "resume",
    "progress",
    "experiment",
    "data",
    "stop_after",
    "data_revision",
    "profile_steps",
    "explicit_flags",  # which flags a command line gave (for --resume), not a setting
}


def hardware(summary: dict) -> str:
    hw = summary["hardware"]
    if hw["device"] == "cuda":
        return f"{hw['gpu']} x{hw['world_size']}"
    return f"CPU ({hw['cpu_count']} cores) x{hw['world_size']}"


def peak_memory(summary: dict) -> str:
    if "max_peak_allocated" in summary:
        return f"{summary['max_peak_allocated'] / 2**30:.2f} GiB alloc"
    return f"{summary['max_peak_rss'] / 2**30:.2f} GiB RSS"


def fmt(x, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def first_loss(run: Path) -> float | None:
    metrics = run / "metrics.jsonl"
    if not metrics.exists():
        return None
    return json.loads(metrics.read_text().splitlines()[0])["loss"]


def max_loss_diff(run: Path, reference: Path) -> float | None:
    """The largest per-step |loss difference| between two runs' metrics.jsonl (the parity figure)."""
    rows = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (run, reference)]
    losses = [{r["step"]: r["loss"] for r in rs} for rs in rows]
    common = losses[0].keys() & losses[1].keys()
    return max(abs(losses[0][k] - losses[1][k]) for k in common) if common else None


def tables(summaries: dict[str, dict], firsts: dict[str, float | None], parity: dict[str, float | None]) -> str:
    names = sorted(summaries)
    flags = sorted(
        {
            k
            for s in summaries.values()
            for k in s["config"]
            if k not in IGNORED_FLAGS and len({json.dumps(o["config"].get(k)) for o in summaries.values()}) > 1
        }
    )
    comm = any("comm_bytes_per_step" in s for s in summaries.values())
    head = [
        "run",
        "hardware",
        "steps",
        "first loss",
        "final loss",
        "eval loss",
        "tokens/s (median)",
        "step time s (median)",
    ]
    head += ["MFU (median)", "peak memory (measured)", "memory model total (when run)"]
    if comm:
        head += ["comm bytes/step", "collectives/step"]
    comm_tp = any("comm_tp_bytes_per_step" in s for s in summaries.values())
    if comm_tp:  # a 2-D mesh: `comm` is the dp dimension's, `comm_tp` the tp dimension's (sampled steps)
        head += ["TP comm bytes/step", "TP collectives/step"]
    if parity:
        head += [f"max \\|loss diff\\| vs `{REFERENCE}`"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in names:
        s = summaries[n]
        mfu = s.get("median_mfu")
        row = [
            f"`{n}`",
            hardware(s),
            fmt(s["steps_run"]),
            fmt(firsts[n]),
            fmt(s["final_loss"]),
            fmt(s.get("final_eval_loss")),
            fmt(s["median_tokens_per_s"], 5),
            fmt(s["median_step_time_s"], 3),
            f"{100 * mfu:.1f}%" if mfu is not None else "- (no GPU peak)",
            peak_memory(s),
            f"{s['memory_predicted']['total'] / 2**30:.3f} GiB",
        ]
        if comm:
            row += [fmt(s.get("comm_bytes_per_step")), fmt(s.get("comm_count_per_step"))]
        if comm_tp:
            row += [fmt(s.get("comm_tp_bytes_per_step")), fmt(s.get("comm_tp_count_per_step"))]
        if parity:
            row += ["-" if n == REFERENCE else f"{parity[n]:.1e}" if parity[n] is not None else "-"]
        lines.append("| " + " | ".join(row) + " |")
    out = "\n".join(lines)
    if flags:
        fhead = ["run", *[f"--{k.replace('_', '-')}" for k in flags]]
        flines = ["| " + " | ".join(fhead) + " |", "|" + "---|" * len(fhead)]
        for n in names:
            flines.append("| " + " | ".join([f"`{n}`", *[fmt(summaries[n]["config"].get(k)) for k in flags]]) + " |")
        out += "\n\nFlags that differ between these runs:\n\n" + "\n".join(flines)
    # One line per distinct software + platform: runs measured on other machines say so.
    setups: dict[str, list[str]] = {}
    for n in names:
        s = summaries[n]
        versions = ", ".join(f"{k} {v}" for k, v in s["versions"].items())
        setups.setdefault(f"{versions}. Platform: {s['hardware']['platform']}.", []).append(f"`{n}`")
    for setup, runs in setups.items():
        out += f"\n\nSoftware ({'every run' if len(setups) == 1 else ', '.join(runs)}): {setup}"
    out += (
        "\n\n`memory model total (when run)`: the prediction each run's summary recorded, by `ftkit/memory.py` as it"
        " was at the run's commit; the model has been revised since (see devlogs/runs/realscale/README.md)."
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("experiment")
    args = p.parse_args()
    runs = ROOT / "devlogs" / "runs" / args.experiment
    dirs = sorted(d for d in runs.glob("*/") if (d / "summary.json").exists())
    summaries = {d.name: json.loads((d / "summary.json").read_text()) for d in dirs}
    firsts = {d.name: first_loss(d) for d in dirs}
    # The parity figure, where the folder holds the single-process reference run with the same flags.
    parity = {d.name: max_loss_diff(d, runs / REFERENCE) for d in dirs} if (runs / REFERENCE).is_dir() else {}
    if not summaries:
        sys.exit(f"no run summaries under {runs}")
    devlog = ROOT / "devlogs" / f"{args.experiment}.md"
    text = devlog.read_text()
    if BEGIN not in text or END not in text:
        sys.exit(f"{devlog} has no {BEGIN} ... {END} section to fill")
    before, rest = text.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    devlog.write_text(f"{before}{BEGIN}\n{tables(summaries, firsts, parity)}\n{END}{after}")
    print(f"{devlog}: {len(summaries)} runs")


if __name__ == "__main__":
    main()
