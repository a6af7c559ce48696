"""The table of the fake-tensor runs at Qwen3-4B's shape recorded in devlogs/runs/realscale/ (ftkit.realscale's
JSON output), as markdown, and what is covered: for every technique at world sizes 1, 2, 4 and 8, the runs'
tracked / predicted peak (checkpointing on and off), ftkit.realscale's refusal, or that it has not been run. The
FLOPs columns divide the counted FLOPs by `metrics.step_flops` with the lm_head at every token (the MFU convention
until 2026-11-25) and with the lm_head at the positions the step computes logits at (the MFU convention since), and
the last the counted FLOPs less the work the convention leaves out as repeated (SDPA backward's recompute of the
scores; TP's lm_head and whole adapter halves computed on every rank: `realscale.report.flops_repeated`) by the MFU
convention:

    uv run python assets/real_scale_table.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RUNS = Path(__file__).resolve().parents[1] / "devlogs" / "runs" / "realscale"
GIB = 2**30


WORLDS = (1, 2, 4, 8)


def coverage(runs: list[dict]) -> None:
    """Technique x world size: each committed run's tracked / predicted, or why the command refuses that world."""
    from ftkit import realscale
    from ftkit.realscale import command

    print("| technique | " + " | ".join(f"world {w}" for w in WORLDS) + " |")
    print("|---" * (len(WORLDS) + 1) + "|")
    for technique in realscale.SCRIPTS:
        cells = []
        for world in WORLDS:
            found = [r for r in runs if r["technique"] == technique and r["world_size"] == world]
            if found:
                cells.append("; ".join(describe(r) for r in found))
            else:
                why = command.refusal(["--technique", technique, "--world", str(world)])
                cells.append(f"refused: {why}" if why else "not run yet")
        print(f"| {technique} | " + " | ".join(cells) + " |")


def describe(r: dict) -> str:
    c = r["config"]
    notes = ["checkpointing" if c["grad_checkpointing"] else "no checkpointing"]
    notes += ["NF4"] if c["quant"] == "nf4" else []
    notes += [f"batch {c['batch_size']}"] if c["batch_size"] != 16 else []
    notes += [f"{c['max_length']:,} tokens"] if c["max_length"] != 2048 else []
    if r["technique"] == "pp":  # 1F1B's stage 0, the busiest, unless it says otherwise
        notes += ["GPipe"] if c["schedule"] == "gpipe" else []
        notes += ["last stage"] if c["stage"] == r["world_size"] - 1 else []
    return f"{r['tracked_over_predicted']:.3f} ({', '.join(notes)})"


def main() -> None:
    from ftkit.realscale.report import model_flops_over_convention

    runs = []
    print(
        "| run | technique | world | global batch | micro-steps run | checkpointing | tracked peak GiB | predicted GiB "
        "| tracked / predicted | FLOPs counted / convention with the lm_head at every token "
        "| counted / MFU convention (the lm_head at the logits computed) "
        "| with recompute / counted | bf16 share of matmul FLOPs | counted less repeated work / MFU convention |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for path in sorted(RUNS.glob("*.json")):
        r = json.loads(path.read_text())
        runs.append(r)
        ratio = r["flops_counted_with_recompute"] / r["flops_counted"]
        c = r["config"]
        technique = r["technique"] + (" QLoRA (NF4)" if c["quant"] == "nf4" else "")
        if r["technique"] == "pp":
            technique += f", {c['schedule']}, stage {c['stage']} of {r['world_size']}"
        if c["max_length"] != 2048:  # cp-ft's whole meetings
            technique += f", {c['micro_batch_size']} x {c['max_length']:,} tokens"
        cells = [
            path.stem,
            technique,
            r["world_size"],
            r["config"]["batch_size"],
            f"{r['config']['micro_steps_run']} of {r['config']['accumulation_steps']}",
            r["config"]["grad_checkpointing"],
            f"{r['tracked_peak_bytes'] / GIB:.2f}",
            f"{r['predicted_bytes'] / GIB:.2f}",
            f"{r['tracked_over_predicted']:.3f}",
            f"{r['flops_counted_over_convention']:.3f}",
            f"{r['flops_counted_over_convention_at_logits']:.3f}",
            f"{ratio:.3f}",
            f"{r['bf16_matmul_fraction']:.4f}",
            f"{model_flops_over_convention(r):.3f}",
        ]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    print()
    coverage(runs)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
