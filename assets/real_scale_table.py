"""The table of the fake-tensor runs at Qwen3-4B's shape recorded in devlogs/runs/realscale/ (ftkit.realscale's
JSON output), as markdown:

    uv run python assets/real_scale_table.py
"""

from __future__ import annotations

import json
from pathlib import Path

RUNS = Path(__file__).resolve().parents[1] / "devlogs" / "runs" / "realscale"
GIB = 2**30


def main() -> None:
    print(
        "| run | technique | world | global batch | micro-steps run | checkpointing | tracked peak GiB | predicted GiB "
        "| tracked / predicted | FLOPs counted / convention | with recompute / counted | bf16 share of matmul FLOPs |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for path in sorted(RUNS.glob("*.json")):
        r = json.loads(path.read_text())
        ratio = r["flops_counted_with_recompute"] / r["flops_counted"]
        cells = [
            path.stem,
            r["technique"],
            r["world_size"],
            r["config"]["batch_size"],
            f"{r['config']['micro_steps_run']} of {r['config']['accumulation_steps']}",
            r["config"]["grad_checkpointing"],
            f"{r['tracked_peak_bytes'] / GIB:.2f}",
            f"{r['predicted_bytes'] / GIB:.2f}",
            f"{r['tracked_over_predicted']:.3f}",
            f"{r['flops_counted_over_convention']:.3f}",
            f"{ratio:.3f}",
            f"{r['bf16_matmul_fraction']:.4f}",
        ]
        print("| " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
