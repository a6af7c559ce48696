"""The pipeline schedule as it ran: one row per rank, a box per forward (F), loss (L, the last stage's lm_head and
cross-entropy) and backward of each micro-batch: whole (B), or split by the zero-bubble schedules into the input
gradient (I) and the weight gradient (W), from a run's timeline.json (the last training step's actions, timed by
experiments/pp-ft/train.py); the white gaps are the bubble. With --devlog, also the measured-vs-theory bubble
table of the --table runs, written between the `<!-- bubble:begin -->` and `<!-- bubble:end -->` markers of the
devlog.

    uv run python assets/pp_timeline.py RUN_DIR... --out assets/pp_timeline.png \
        [--devlog devlogs/pp-ft.md --table RUN_DIR...]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# forward, loss (last stage), backward; its input-gradient and weight-gradient halves
COLORS = {"F": "#4C72B0", "L": "#55A868", "B": "#DD8452", "I": "#C44E52", "W": "#8172B3"}


def bubble_table(runs: list[Path]) -> str:
    lines = [
        "| run | schedule | ranks x stages/rank | micro-batches m | bubble theory | theory, measured F/I/W times "
        "| bubble measured (median, steps 2..N) | per rank | busy s/step (per rank) | idle s/step (per rank) "
        "| ms per action, last step (mean) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run_dir in runs:
        s = json.loads((run_dir / "summary.json").read_text())
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
        rows = rows[1:] if len(rows) > 1 else rows  # the steps the summary's bubble is the median of
        pipe = s["pipeline"]
        with_costs = s.get("bubble_theory_measured_costs")  # multi-stage schedules only
        with_costs = "-" if with_costs is None else f"{with_costs:.3f}"
        spans: dict[str, list[float]] = {}
        for rank in json.loads((run_dir / "timeline.json").read_text())["events"]:
            for _, kind, _, t0, t1 in rank:
                spans.setdefault(kind, []).append(t1 - t0)
        per_action = " / ".join(f"{k} {sum(spans[k]) / len(spans[k]) * 1e3:.2f}" for k in "FLBIW" if k in spans)
        busy = [statistics.median(r["busy_s"][k] for r in rows) for k in range(pipe["ranks"])]
        idle = [statistics.median(r["idle_s"][k] for r in rows) for k in range(pipe["ranks"])]
        lines.append(
            f"| `{run_dir.name}` | {pipe['schedule']} | {pipe['ranks']} x {pipe['stages_per_rank']} "
            f"| {pipe['microbatches']} | {s['bubble_theory']:.3f} | {with_costs} "
            f"| {s['bubble']:.3f} "
            f"| {' / '.join(f'{b:.3f}' for b in s['bubble_per_rank'])} | {' / '.join(f'{b:.3f}' for b in busy)} "
            f"| {' / '.join(f'{b:.3f}' for b in idle)} | {per_action} |"
        )
    return "\n".join(lines)


def write_table(devlog: Path, runs: list[Path]) -> None:
    text = devlog.read_text()
    begin, end = "<!-- bubble:begin -->", "<!-- bubble:end -->"
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    devlog.write_text(f"{head}{begin}\n{bubble_table(runs)}\n{end}{tail}")
    print(f"rewrote the bubble table of {devlog}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories holding timeline.json and summary.json")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "pp_timeline.png")
    p.add_argument("--devlog", type=Path, default=None, help="devlog whose bubble table to rewrite")
    p.add_argument("--table", nargs="*", type=Path, default=[], help="run directories for the bubble table")
    args = p.parse_args()
    if args.devlog is not None:
        write_table(args.devlog, args.table)
    fig, axes = plt.subplots(len(args.runs), 1, figsize=(11, 1.6 + 1.2 * len(args.runs)), squeeze=False)
    for ax, run_dir in zip(axes[:, 0], args.runs):
        timeline = json.loads((run_dir / "timeline.json").read_text())
        summary = json.loads((run_dir / "summary.json").read_text())
        events = timeline["events"]
        start = min(e[3] for rank in events for e in rank)
        for rank, rank_events in enumerate(events):
            for stage, kind, mb, t0, t1 in rank_events:
                # Interleaved: the rank's second stage (a later model chunk) is drawn lighter.
                alpha = 1.0 if stage < timeline["ranks"] else 0.55
                ax.barh(
                    rank,
                    (t1 - t0) * 1e3,
                    left=(t0 - start) * 1e3,
                    color=COLORS[kind],
                    alpha=alpha,
                    edgecolor="black",
                    linewidth=0.4,
                )
                ax.text(
                    (t0 + t1) / 2 * 1e3 - start * 1e3,
                    rank,
                    f"{kind}{mb}",
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white",
                )
        ax.set_yticks(range(len(events)), [f"rank {r}" for r in range(len(events))])
        ax.invert_yaxis()
        pipe = summary["pipeline"]
        ax.set_title(
            f"{pipe['schedule']}: {pipe['ranks']} ranks x {pipe['stages_per_rank']} stage(s), m={pipe['microbatches']}"
            f" - bubble measured {summary['bubble']:.2f} (median of steps 2..N, mean of ranks),"
            f" theory {summary['bubble_theory']:.2f}"
            f"{'' if summary['config'].get('grad_checkpointing', True) else ', no activation checkpointing'}",
            fontsize=9,
        )
        ax.set_xlabel("ms since the step's first action (last step of the run)")
    hw = json.loads((args.runs[0] / "summary.json").read_text())["hardware"]
    fig.suptitle(
        f"Pipeline schedules as measured: tiny Qwen3 on CPU ({hw['cpu_count']} cores, gloo); F forward, L loss, "
        "B backward = I input + W weight gradient (darker: a rank's first stage)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
