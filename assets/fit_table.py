"""What --fit auto chooses for single-gpu-ft on 24, 40, 80 and 141 GB cards: the planner's prediction (ftkit/fit.py),
for bf16 LoRA (--quant none) and QLoRA (the default), each GPU's memory as torch reports it, the reference flags
otherwise.

    uv run python assets/fit_table.py        # writes devlogs/runs/plan-fit/fit-table.json, prints the devlog's table

A prediction, not a measurement: the memory model with the planner's margin, the step time on the calibrated host."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ftkit import cli, fit, hardware
from ftkit.memory import GIB

OUT = Path(__file__).resolve().parents[1] / "devlogs" / "runs" / "plan-fit" / "fit-table.json"
GPUS = ("rtx4090", "a100-40gb", "h100-sxm", "h200")
QUANTS = ("none", "nf4")


def reference_args(quant: str):
    """single-gpu-ft's resolved flags on a GPU (the reference configuration), with --quant `quant`."""
    parser = cli.common_parser("fit table", experiment="single-gpu-ft")
    parser.add_argument("--quant", default="nf4")
    return cli.resolve(parser.parse_args(["--model", "qwen3-4b-shape", "--quant", quant, "--compile"]))


def main() -> dict:
    rows = []
    for quant in QUANTS:
        args = reference_args(quant)
        for key in GPUS:
            gpu = hardware.gpu(key)
            choice = fit.choose_for(args, gpu, gpu.memory_bytes, 1, {})
            rows.append({"gpu": key, "memory_bytes": gpu.memory_bytes, "quant": quant, **choice})
    result = {"note": "PREDICTED by ftkit.plan through ftkit/fit.py: a model, not a measurement", "rows": rows}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    return result


def table(result: dict) -> str:
    lines = [
        "| GPU | base | chosen | predicted memory (with margin) | predicted tokens/s | 2 rows, all checkpointed |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        base = "bf16 LoRA" if r["quant"] == "none" else "QLoRA"
        if "chosen" not in r:
            lines.append(f"| {r['gpu']} ({r['memory_bytes'] / GIB:.2f} GiB) | {base} | {r['off']} | | | |")
            continue
        c, p = r["chosen"], r["predicted"]
        layout = f"{c['micro_batch_tokens']} tokens" if c["micro_batch_tokens"] else "2 rows"
        reference = f"{r['reference_tokens_per_s']:,.0f}" if r["reference_tokens_per_s"] else "does not fit"
        lines.append(
            f"| {r['gpu']} ({r['memory_bytes'] / GIB:.2f} GiB) | {base} | {layout}, checkpointing {c['checkpointing']} "
            f"| {p['memory_bytes'] / GIB:.1f} GiB ({p['required_bytes'] / GIB:.1f}) | {p['tokens_per_s']:,.0f} "
            f"| {reference} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(table(main()))
