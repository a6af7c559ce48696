"""The FSDP-specific table of devlogs/fsdp-ft.md, from the run summaries committed beside it.

    uv run python assets/fsdp_devlog.py

reads every `devlogs/runs/fsdp-ft/<run>/{summary.json,metrics.jsonl}` and rewrites the part of
`devlogs/fsdp-ft.md` between `<!-- fsdp:begin -->` and `<!-- fsdp:end -->`: per run, what each rank holds, what
FSDP2 sent per step (measured, and what theory says), the loss against the single-process reference, and the
symptoms of the silent failures (adapter updates rounded away, KV-cache bytes). A QLoRA run (--quant nf4) is
compared with the QLoRA reference. Numbers are never typed by hand.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "devlogs" / "runs" / "fsdp-ft"
DEVLOG = ROOT / "devlogs" / "fsdp-ft.md"
BEGIN, END = "<!-- fsdp:begin -->", "<!-- fsdp:end -->"
REFERENCE = "cpu-smoke-reference"


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]


def per_step(summary: dict, kind: str, key: str) -> str:
    entry = summary.get("comm", {}).get(kind)
    return f"{entry[key] / summary['steps_run']:,.0f}" if entry else "-"


def reference(summary: dict) -> list[dict] | None:
    """The single-process run with the same flags: the QLoRA one (`-qlora`) for a --quant nf4 run."""
    run = RUNS / (REFERENCE + ("-qlora" if summary["config"].get("quant") == "nf4" else ""))
    return rows(run) if run.is_dir() else None


def table() -> str:
    lines = [
        "| run | units | param shard bytes/rank | largest unit bytes | all-gather bytes/step (theory) "
        "| all-gathers/step | reduce-scatter bytes/step (theory) | max \\|loss - reference\\| "
        "| adapter updates lost (mean) | KV-cache bytes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in sorted(p for p in RUNS.iterdir() if (p / "summary.json").exists() and REFERENCE not in p.name):
        s = json.loads((run / "summary.json").read_text())
        metrics, ref = rows(run), reference(s)
        diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(metrics, ref)) if ref else None
        # Step 1 runs at lr 0 (the warmup starts there) and can lose nothing. The step number says so, not the
        # logged lr: runs from before 2a33c74 log the next step's.
        lost = [r["lost_update_fraction"] for r in metrics if r["step"] > 1 and "lost_update_fraction" in r]
        lines.append(
            f"| `{run.name}` | {s['fsdp_units']} | {s['param_shard_bytes']:,} | {s['largest_unit_bytes']:,} "
            f"| {per_step(s, 'all_gather', 'bytes')} ({s['theory_all_gather_bytes']:,}) "
            f"| {per_step(s, 'all_gather', 'count')} "
            f"| {per_step(s, 'reduce_scatter', 'bytes')} ({s['theory_reduce_scatter_bytes']:,}) "
            f"| {diff:.2e} | {f'{sum(lost) / len(lost):.2%}' if lost else '-'} | {s.get('kv_cache_bytes', '-')} |"
        )
    return "\n".join(lines)


def main() -> None:
    text = DEVLOG.read_text()
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    DEVLOG.write_text(f"{head}{BEGIN}\n{table()}\n{END}{tail}")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
