#!/usr/bin/env bash
# The figures the parity tests print (each technique's largest differences from the single-process reference,
# measured SP savings, bubbles, host syncs), kept as run files for the posts and devlogs that quote them:
# devlogs/runs/test-printouts/<test file>.txt, one line per printed figure, headed by the command and commit.
#
#   bash assets/test_printouts.sh                  # test_fsdp, test_tp, test_pp: ~12 minutes on 2 cores
#   bash assets/test_printouts.sh test_tp          # one file
set -euo pipefail
cd "$(dirname "$0")/.."
out=devlogs/runs/test-printouts
mkdir -p "$out"
for t in "${@:-test_fsdp test_tp test_pp}"; do
    for name in $t; do
        log=$(mktemp)
        uv run pytest -s -q -p no:cacheprovider "tests/$name.py" >"$log" 2>&1 || { tail -20 "$log"; exit 1; }
        {
            echo "# uv run pytest -s -q tests/$name.py at $(git rev-parse --short HEAD), $(date -u +%F), CPU/gloo, fp32"
            # What the tests print: "<run>: max |...| ...", "<run>: <n> LoRA gradients, ...", "layer 1 per rank: ...",
            # "bubble measured: ...", "<run>: host syncs ...", without pytest's progress dots.
            sed 's/^[.]*//' "$log" | grep -E '^[A-Za-z0-9_ ]+: .*(max \||LoRA gradients|bubble|host syncs)|^layer 1 per rank|^bubble measured' || true
            grep -E '^[0-9]+ passed' "$log"
        } >"$out/$name.txt"
        rm -f "$log"
    done
done
