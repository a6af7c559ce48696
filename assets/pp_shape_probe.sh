#!/usr/bin/env bash
# The paired probe behind devlogs/pp-ft.md's "Shapes given, no inference inside the step": pp-ft under 1F1B with
# m = 8, 8 steps, an eval after every second step, run three times from the commit before the stages were given
# their shapes (BEFORE: it infers them at step 1 and after every eval) and three times from this tree, alternating;
# then the medians the devlog quotes: step 1, the steps right after an eval (3, 5, 7), the other steps (2, 4, 6, 8).
#   bash assets/pp_shape_probe.sh [BEFORE]     runs (BEFORE: a commit, default ddc900e), then the medians
#   bash assets/pp_shape_probe.sh --summary    the medians of the committed runs only
# Runs go to devlogs/runs/pp-ft-shape-inference/{before,after}-{1,2,3}/ (summary.json, metrics.jsonl).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-uv run python}
OUT=devlogs/runs/pp-ft-shape-inference
if [ "${1:-}" != "--summary" ]; then
    BEFORE=${1:-ddc900e}
    old=$(mktemp -d)
    git archive "$BEFORE" ftkit experiments/pp-ft | tar -x -C "$old"  # run with its own ftkit (PYTHONPATH)
    STAMP=$(date +%Y%m%d-%H%M%S)
    for i in 1 2 3; do
        for side in before after; do
            root=$([ "$side" = before ] && echo "$old" || pwd)
            dir=runs/devlog/pp-ft-shape-inference/$side-$i-$STAMP
            PYTHONPATH=$root $PY -m torch.distributed.run --standalone --nproc_per_node=2 \
                "$root/experiments/pp-ft/train.py" --smoke --max-steps 8 --max-length 256 --batch-size 8 \
                --microbatches 8 --schedule 1f1b --eval-every 2 --save-every 100 --eval-examples 8 --no-progress \
                --output-dir "$dir"
            mkdir -p "$OUT/$side-$i"
            cp "$dir/summary.json" "$dir/metrics.jsonl" "$OUT/$side-$i/"
        done
    done
    rm -rf "$old"
fi
$PY - "$OUT" <<'EOF'
import json, statistics, sys
from pathlib import Path

for side in ("before", "after"):
    runs = [[json.loads(line) for line in (p / "metrics.jsonl").read_text().splitlines()]
            for p in sorted(Path(sys.argv[1]).glob(f"{side}-*"))]
    groups = {
        "step 1": [rows[0] for rows in runs],
        "after an eval (3, 5, 7)": [r for rows in runs for r in rows if r["step"] in (3, 5, 7)],
        "other steps (2, 4, 6, 8)": [r for rows in runs for r in rows if r["step"] in (2, 4, 6, 8)],
    }
    cells = [f"{statistics.median(r['step_time_s'] for r in rows):.3f} s, bubble "
             f"{statistics.median(r['bubble'] for r in rows):.3f}" for rows in groups.values()]
    print(f"{side} ({len(runs)} runs, medians): " + "; ".join(f"{k}: {c}" for k, c in zip(groups, cells)))
EOF
