"""The pipeline schedule as it ran: one row per rank, a box per forward (F), loss (L, the last stage's lm_head and
cross-entropy) and backward of each micro-batch: whole (B), or split by the zero-bubble schedules into the input
gradient (I) and the weight gradient (W), from a run's timeline.json (the last training step's actions, timed by
experiments/pp-ft/train.py); the white gaps are the bubble. With --devlog, also the measured-vs-theory bubble
table of the --table runs, written between the `<!-- bubble:begin -->` and `<!-- bubble:end -->` markers of the
devlog.

    uv run python assets/pp_timeline.py RUN_DIR... --out assets/pp_timeline.png \
        [--devlog devlogs/pp-ft.md --table RUN_DIR...]
    uv run python assets/pp_timeline.py      # the committed figure: FIGURE_RUNS, as assets/pp_runs.sh draws it

`panel(run_dir)` returns what one row of the figure shows (its boxes and its title's numbers), for
tests/test_figure_pp_timeline.py to check against the run's files without drawing.
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
RUNS = Path(__file__).resolve().parents[1] / "devlogs" / "runs" / "pp-ft"
# The committed figure's rows, top to bottom (assets/pp_runs.sh passes the same list): the runs blogs/pp.md compares,
# GPipe against 1F1B at m = 8, then ZBV against interleaved 1F1B at the same checkpointing (without, as the post's
# bubble and step-time comparison runs them; ZBV with it last).
FIGURE_RUNS = (
    "cpu-gpipe-m8",
    "cpu-1f1b-m8",
    "cpu-interleaved-m8",
    "cpu-interleaved-m8-no-ckpt",
    "cpu-zbv-m8-no-ckpt",
    "cpu-zbv-m8",
)


def panel(run_dir: Path) -> dict:
    """One row of the figure: a box per action of the run's last step (rank, kind, micro-batch, start and width in
    ms since the step's first action, drawn lighter on a rank's second stage) and its title's numbers (the
    summary's bubble and equal-cost theory, the schedule's layout, whether checkpointing was on)."""
    timeline = json.loads((run_dir / "timeline.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    events = timeline["events"]
    start = min(e[3] for rank in events for e in rank)
    boxes = [
        {
            "rank": rank,
            "stage": stage,
            "kind": kind,
            "microbatch": mb,
            "start_ms": (t0 - start) * 1e3,
            "width_ms": (t1 - t0) * 1e3,
            # Interleaved and V: the rank's second stage (a later model chunk) is drawn lighter.
            "alpha": 1.0 if stage < timeline["ranks"] else 0.55,
        }
        for rank, rank_events in enumerate(events)
        for stage, kind, mb, t0, t1 in rank_events
    ]
    pipe = summary["pipeline"]
    return {
        "run": run_dir.name,
        "ranks": len(events),
        "schedule": pipe["schedule"],
        "stages_per_rank": pipe["stages_per_rank"],
        "microbatches": pipe["microbatches"],
        "bubble": summary["bubble"],
        "bubble_theory": summary["bubble_theory"],
        "checkpointing": summary["config"].get("grad_checkpointing", True),
        "boxes": boxes,
    }


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
    p.add_argument(
        "runs", nargs="*", type=Path, help="run directories holding timeline.json and summary.json [FIGURE_RUNS]"
    )
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "pp_timeline.png")
    p.add_argument("--devlog", type=Path, default=None, help="devlog whose bubble table to rewrite")
    p.add_argument("--table", nargs="*", type=Path, default=[], help="run directories for the bubble table")
    args = p.parse_args()
    if args.devlog is not None and not args.table:  # an empty table would replace the devlog's rows
        p.error("--devlog rewrites the devlog's bubble table from the --table runs: give them (--table RUN_DIR...)")
    runs = args.runs or [RUNS / name for name in FIGURE_RUNS]
    if args.devlog is not None:
        write_table(args.devlog, args.table)
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.6 + 1.2 * len(runs)), squeeze=False)
    for ax, run_dir in zip(axes[:, 0], runs):
        row = panel(run_dir)
        for box in row["boxes"]:
            ax.barh(
                box["rank"],
                box["width_ms"],
                left=box["start_ms"],
                color=COLORS[box["kind"]],
                alpha=box["alpha"],
                edgecolor="black",
                linewidth=0.4,
            )
            ax.text(
                box["start_ms"] + box["width_ms"] / 2,
                box["rank"],
                f"{box['kind']}{box['microbatch']}",
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
        ax.set_yticks(range(row["ranks"]), [f"rank {r}" for r in range(row["ranks"])])
        ax.invert_yaxis()
        ax.set_title(
            f"{row['schedule']}: {row['ranks']} ranks x {row['stages_per_rank']} stage(s), m={row['microbatches']}"
            f" - bubble measured {row['bubble']:.2f} (median of steps 2..N, mean of ranks),"
            f" theory {row['bubble_theory']:.2f}"
            f"{'' if row['checkpointing'] else ', no activation checkpointing'}",
            fontsize=9,
        )
        ax.set_xlabel("ms since the step's first action (last step of the run)")
    hw = json.loads((runs[0] / "summary.json").read_text())["hardware"]
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
