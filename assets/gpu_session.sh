#!/usr/bin/env bash
# What a GPU lent for a short while should measure, in priority order, within its time budget.
#
#   bash assets/gpu_session.sh PART... [--out DIR] [--pack DIR] [--smoke] [--dry-run]
#
# For one H100 or H200 without internet access (so `--model qwen3-4b-shape`: random init, Qwen3-4B's exact config,
# no download), 10 minutes per command and about 25 minutes in all, model building included. Each part is one
# invocation that ends within PART_BUDGET_S (570 s): every run gets a `timeout` of what is left of it, a run
# that would start with less than MIN_CMD_S (60 s) left is skipped and recorded, and a run cut off keeps the
# per-step rows it wrote. In priority order:
#   a    every experiments/*/train.py at world 1 under `torchrun --nproc_per_node=1`, CUDA + NCCL, 3 steps each
#        (the NCCL code paths, crash or not: exit code and the end of stderr recorded, the next script runs
#        anyway); each script at most A_CMD_TIMEOUT_S (360 s), in the order ddp-ft fsdp-ft tp-ft tp-sp-ft
#        fsdp-tp-ft pp-ft cp-ft single-gpu-ft (the last has no collective), then fsdp-ft-nf4 (fsdp-ft --quant nf4,
#        whose per-step losses are compared with single-gpu-ft's QLoRA: fsdp-ft-nf4-vs-single-gpu-ft.txt).
#        fsdp-tp-ft gets --mesh-shape 1,1; pp-ft refuses a world of 1 (recorded as "refused").
#        SCRIPTS="tp-ft pp-ft" runs some of them, in that order.
#   b1   single-gpu-ft, bf16 LoRA (--quant none), 20 steps each: packed + compiled (the default), padded eager
#        (--no-packing --no-compile, the layout before packing), packed eager (--no-compile)
#   b2   the same three with QLoRA (--quant nf4)        (b = b1 then b2; CONFIGS="padded-eager" runs some)
#   c    assets/hf_baseline.py, --collator padded and flatten, 20 steps each (skipped, saying so, if absent)
#   d    one profiled step (--profile-steps 3:3, after compiling and warm-up) of the fastest configuration the b
#        parts in the same --out measured (tokens/s over steps 2..N; PROFILE_CONFIG=lora-packed-eager names one):
#        the profiler's op table, the trace only if it gzips to TRACE_MAX_MB (8) or less
#   all  a b1 b2 c d (several parts in one command: SESSION_BUDGET_S, 1500 s, in all); table: every part's table
# Measured on an H200 (devlogs/runs/gpu-session-2026-11-26-gpu/): a bf16 run of 6 eager steps takes 44-48 s from
# start to exit, its random weights drawn in a few seconds; compiling adds its first step's compile. The lent
# machines' own packages are older than the lock's (torch 2.11, transformers 5.17, no bitsandbytes): carry a
# transformers >= 5.23 wheel (WHEELS=DIR); without bitsandbytes the QLoRA runs are skipped, saying so, and part a
# runs ddp-ft and single-gpu-ft with --quant none.
#
# For a machine lent ~15 minutes in all (one command of <= 10 minutes after its start-up), part b's configurations
# are better run by assets/gpu_sweep.py: ONE process builds the model once (each run above: 44-48 s, ~21 s outside
# its steps) and switches layout, checkpointing, LoRA dropout, the optimizer, Liger and compiled layers in place, one
# JSON line per configuration fsynced as it ends (env, micro-benchmarks, the eager and compiled ladders, a profile,
# the HF rows):
#   python3 assets/gpu_sweep.py --out $OUT/sweep      (its docstring: the wheels, --budget-s, --only; --smoke on CPU)
#
# Files: each part writes a new folder <part>-<what>-<device>[-N] under --out (GPU_SESSION_OUT; default
# devlogs/runs/gpu-session-<date>-gpu/, with --smoke runs/gpu-session-<date>-smoke/), never into an existing one:
#   env.txt      date, git commit, `nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv`, the torch
#                build (`python -c 'import torch; print(torch.__version__, torch.version.cuda)'`), package versions
#   runs.tsv     name, status (ok, refused, crashed, timed out, skipped), exit code, seconds, run directory
#   report.md    the compact table (steps, step time, tokens/s, MFU, peak memory, padding) and, for each run that
#                did not finish, the end of its stderr; printed at the end of the part
#   <run>/       summary.json and metrics.jsonl (what the run wrote; cut-off runs: metrics only), command.txt,
#                stderr.txt (its last 300 lines), stdout.txt (last 100); d: the profiler's ops-*.txt
# The run directories themselves (adapters, checkpoints, full logs) go under RUN_ROOT (runs/gpu-session/).
# `--out` is not read from $OUT, which some job runners set to their own, small, return folder. `--pack DIR`
# writes each part's folder as DIR/<folder>.tgz as well (one file to bring back from a lent machine), to be
# unpacked with `tar -xzf DIR/<folder>.tgz -C devlogs/runs/gpu-session-<date>-gpu/`.
#
# --smoke (or SMOKE=1): the same parts as CPU stand-ins (the tiny model, gloo, 2 steps, --max-length 128, batch 4,
# any GPU unused, nvidia-smi recorded if present); tests/test_gpu_session.py runs it. --dry-run (DRY_RUN=1):
# print each part's commands, create nothing.
# Environment: PYTHON (default `uv run python`; e.g. python3 where torch came with the machine: the repository
# goes on PYTHONPATH, so ftkit imports without an install), GPU_SESSION_OUT, GPU_SESSION_PACK, PART_BUDGET_S,
# SESSION_BUDGET_S, MIN_CMD_S, A_CMD_TIMEOUT_S, A_STEPS (3), B_STEPS (20), PROFILE_STEP (3), SCRIPTS, CONFIGS,
# PROFILE_CONFIG, EXTRA_FLAGS (added to every run, e.g. "--max-length 1024"), RUN_ROOT, TRACE_MAX_MB, WHEELS (a
# folder of wheels installed first, with `pip --target` into a temporary folder put first on PYTHONPATH: for a
# machine whose own transformers is too old), BITSANDBYTES (auto: whether it imports, except under --smoke; 0 or 1 to say).
set -uo pipefail # not -e: a run that fails is a measurement; it is recorded and the part goes on
CALLER=$PWD # folders given by the caller are read from where it called; the defaults from the repository
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
from_caller() { case $1 in /* | '') printf '%s\n' "$1" ;; *) printf '%s\n' "$CALLER/$1" ;; esac; }

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

PARTS=()
OUT_DIR=${GPU_SESSION_OUT:-}
PACK=${GPU_SESSION_PACK:-}
SMOKE=${SMOKE:-0}
DRY_RUN=${DRY_RUN:-0}
while [ $# -gt 0 ]; do
    case $1 in
    --smoke) SMOKE=1 ;;
    --dry-run) DRY_RUN=1 ;;
    --out | --pack)
        [ $# -ge 2 ] || { echo "gpu_session.sh: $1 needs a folder" >&2 && exit 2; }
        if [ "$1" = --out ]; then OUT_DIR=$2; else PACK=$2; fi
        shift
        ;;
    --out=*) OUT_DIR=${1#*=} ;;
    --pack=*) PACK=${1#*=} ;;
    -h | --help) usage && exit 0 ;;
    a | b1 | b2 | c | d | table) PARTS+=("$1") ;;
    b) PARTS+=(b1 b2) ;;
    all) PARTS+=(a b1 b2 c d) ;;
    *)
        echo "gpu_session.sh: unknown argument '$1' (parts: a b b1 b2 c d all table; --help)" >&2
        exit 2
        ;;
    esac
    shift
done
if [ ${#PARTS[@]} -eq 0 ]; then
    usage >&2
    exit 2
fi
OUT_DIR=$(from_caller "$OUT_DIR")
PACK=$(from_caller "$PACK")
if [ -n "${RUN_ROOT:-}" ]; then RUN_ROOT=$(from_caller "$RUN_ROOT"); fi

read -r -a PY <<<"${PYTHON:-uv run python}"
if command -v python3 >/dev/null 2>&1; then HPY=(python3); else HPY=("${PY[@]}"); fi # the report: stdlib only
read -r -a EXTRA <<<"${EXTRA_FLAGS:-}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" # ftkit for an interpreter that did not install it
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TOKENIZERS_PARALLELISM=false
if [ -n "${WHEELS:-}" ] && [ "$DRY_RUN" != 1 ]; then # before anything imports the packages they replace
    SITE=$(mktemp -d) && "${PY[@]}" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
        "$(from_caller "$WHEELS")"/*.whl || {
        echo "gpu_session.sh: could not install the wheels in WHEELS=$WHEELS" >&2
        exit 2
    }
    export PYTHONPATH="$SITE:$PYTHONPATH"
fi
BITSANDBYTES=${BITSANDBYTES:-auto}
if [ "$BITSANDBYTES" = auto ]; then # QLoRA needs it; a machine without it still measures the bf16 runs
    BITSANDBYTES=1
    if [ "$DRY_RUN" != 1 ] && [ "$SMOKE" != 1 ] && ! "${PY[@]}" -c 'import bitsandbytes' >/dev/null 2>&1; then
        BITSANDBYTES=0
    fi
fi
TODAY=$(date +%Y-%m-%d)
STAMP=$(date +%Y%m%d-%H%M%S)-$$
RUN_ROOT=${RUN_ROOT:-runs/gpu-session}/$STAMP
SESSION_START=$(date +%s)
PART_BUDGET_S=${PART_BUDGET_S:-570}
SESSION_BUDGET_S=${SESSION_BUDGET_S:-1500}
RESERVE_S=${RESERVE_S:-15} # kept back from each part's budget for the copies and the report
A_CMD_TIMEOUT_S=${A_CMD_TIMEOUT_S:-360}
# The collectives first; single-gpu-ft has none (it only runs under torchrun here), pp-ft refuses a world of 1.
SCRIPTS=${SCRIPTS:-ddp-ft fsdp-ft tp-ft tp-sp-ft fsdp-tp-ft pp-ft cp-ft single-gpu-ft fsdp-ft-nf4}
CONFIGS=${CONFIGS:-packed-compiled padded-eager packed-eager}
TRACE_MAX_MB=${TRACE_MAX_MB:-8}
if [ "$SMOKE" = 1 ]; then
    # The CPU stand-ins: the tiny model, fp32, gloo; short sequences and few steps, evals and saves only at the end.
    COMMON=(--smoke --max-length 128 --batch-size 4 --micro-batch-size 2 --eval-every 1000 --save-every 1000
        --eval-examples 2 --no-progress)
    A_STEPS=${A_STEPS:-2} B_STEPS=${B_STEPS:-2} PROFILE_STEP=${PROFILE_STEP:-2} MIN_CMD_S=${MIN_CMD_S:-5}
    OUT_DIR=${OUT_DIR:-runs/gpu-session-$TODAY-smoke}
else
    # The reference configuration (global batch 16, micro-batch 2, 2048 tokens) at Qwen3-4B's shape; the final
    # eval on 8 examples instead of 64, no checkpoint before the end; --fit off keeps that layout on the GPU.
    COMMON=(--model qwen3-4b-shape --fit off --eval-every 1000 --save-every 1000 --eval-examples 8 --no-progress)
    A_STEPS=${A_STEPS:-3} B_STEPS=${B_STEPS:-20} PROFILE_STEP=${PROFILE_STEP:-3} MIN_CMD_S=${MIN_CMD_S:-60}
    OUT_DIR=${OUT_DIR:-devlogs/runs/gpu-session-$TODAY-gpu}
fi

# ---- the device, named in every folder
gpu_name() {
    command -v nvidia-smi >/dev/null 2>&1 &&
        timeout 30 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1
}
slug() { tr '[:upper:]' '[:lower:]' | sed -E 's/^nvidia //; s/[^a-z0-9]+/-/g; s/^-+//; s/-+$//'; }
if [ "$SMOKE" = 1 ]; then
    DEVICE=smoke-cpu
else
    name=$(gpu_name)
    if [ -z "$name" ] && [ "$DRY_RUN" != 1 ]; then
        name=$("${PY[@]}" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' \
            2>/dev/null | tail -n 1)
    fi
    DEVICE=$(printf '%s' "$name" | slug)
    if [ -z "$DEVICE" ]; then
        if [ "$DRY_RUN" != 1 ] && [ "${PARTS[*]}" != table ]; then
            echo "gpu_session.sh: no CUDA GPU here (nvidia-smi and torch see none); --smoke runs the CPU stand-ins" >&2
            exit 2
        fi
        DEVICE=no-gpu
    fi
fi

# ---- helpers
new_dir() { # new_dir BASE: create BASE, or BASE-2, BASE-3, ... if taken (mkdir is atomic), and print it
    local d=$1 n=1
    mkdir -p "$(dirname "$1")" || return 1
    until mkdir "$d" 2>/dev/null; do
        n=$((n + 1))
        d=$1-$n
        [ $n -lt 1000 ] || return 1
    done
    printf '%s\n' "$d"
}

record_env() { # the machine and software a part measured with
    {
        echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "command: bash assets/gpu_session.sh $PART (smoke=$SMOKE) on $DEVICE"
        echo "git: $(git rev-parse HEAD 2>/dev/null || echo 'not a git checkout')," \
            "$(git status --porcelain 2>/dev/null | wc -l) paths modified"
        echo "cpu cores: $(nproc 2>/dev/null)"
        echo "budget: this part until $(date -u -d "@$DEADLINE" +%H:%M:%SZ 2>/dev/null || echo "+$PART_BUDGET_S s")" \
            "(PART_BUDGET_S=$PART_BUDGET_S), each script of part a at most ${A_CMD_TIMEOUT_S} s"
        echo "--- nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv"
        if command -v nvidia-smi >/dev/null 2>&1; then
            timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 ||
                echo "(nvidia-smi failed: exit $?)"
        else
            echo "(no nvidia-smi on this machine)"
        fi
        echo "--- ${PY[*]} -c 'import torch; print(torch.__version__, torch.version.cuda)'; then versions"
        timeout 120 "${PY[@]}" -c '
import importlib.metadata as md, platform, torch
print(torch.__version__, torch.version.cuda)
print("python", platform.python_version())
for name in ("transformers", "peft", "bitsandbytes", "accelerate", "triton"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
print("cuda available", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
' 2>&1 || echo "(python failed: exit $?)"
    } >"$PART_DIR/env.txt"
}

status_of() { # status_of RC STDERR_FILE
    local rc=$1 msg
    if [ "$rc" = 0 ]; then
        echo ok
    elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        echo "timed out"
    elif msg=$(grep -m 1 -E '^(\[[^]]*\]:? ?)?error: ' "$2" 2>/dev/null) && [ -n "$msg" ]; then
        echo refused # the scripts' own refusal (ranks.fail): one line, exit 2
    else
        echo crashed
    fi
}

run_one() { # run_one NAME CAP_S COMMAND...: run it within the part's budget (and CAP_S if > 0), keep its files
    local name=$1 cap=$2 left t0 rc=0 status secs
    shift 2
    local dir=$RUN_ROOT/$PART/$name dest=$PART_DIR/$name
    left=$((DEADLINE - $(date +%s) - RESERVE_S))
    if [ "$cap" -gt 0 ] && [ "$cap" -lt "$left" ]; then left=$cap; fi
    if [ "$DRY_RUN" = 1 ]; then
        printf '[%s] %s (timeout %s s): %s --output-dir %s\n' "$PART" "$name" "$left" "$*" "$dir"
        return 0
    fi
    mkdir -p "$dest" "$(dirname "$dir")"
    printf '%q ' "$@" --output-dir "$dir" >"$dest/command.txt"
    echo >>"$dest/command.txt"
    if [ "$left" -lt "$MIN_CMD_S" ]; then
        printf '%s\tskipped\t\t0\t%s\n' "$name" "$dir" >>"$PART_DIR/runs.tsv"
        echo "not run: ${left} s left of the part's budget, under MIN_CMD_S=${MIN_CMD_S}" >"$dest/stderr.txt"
        echo "[$PART] $name: skipped (${left} s left of the budget)"
        return 0
    fi
    echo "[$PART] $name: running, timeout ${left} s"
    t0=$(date +%s)
    timeout -k 20 "$left" "$@" --output-dir "$dir" >"$dir.stdout" 2>"$dir.stderr" || rc=$?
    secs=$(($(date +%s) - t0))
    status=$(status_of "$rc" "$dir.stderr")
    for f in summary.json metrics.jsonl; do
        if [ -f "$dir/$f" ]; then cp "$dir/$f" "$dest/"; fi
    done
    tail -n 300 "$dir.stderr" >"$dest/stderr.txt"
    tail -n 100 "$dir.stdout" >"$dest/stdout.txt"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$secs" "$dir" >>"$PART_DIR/runs.tsv"
    echo "[$PART] $name: $status (exit $rc, $secs s)"
}

skip_one() { # skip_one NAME WHY: recorded as skipped, with why
    if [ "$DRY_RUN" = 1 ]; then
        echo "[$PART] $1: skipped ($2)"
        return 0
    fi
    mkdir -p "$PART_DIR/$1"
    echo "not run: $2" >"$PART_DIR/$1/stderr.txt"
    printf '%s\tskipped\t\t0\t\n' "$1" >>"$PART_DIR/runs.tsv"
    echo "[$PART] $1: skipped ($2)"
}

config_flags() { # the single-gpu-ft flags of a configuration of part b
    case $1 in
    padded-eager) echo "--no-packing --no-compile" ;;
    packed-eager) echo "--no-compile" ;;
    packed-compiled) echo "--compile" ;; # the default on CUDA; said here because --smoke turns it off
    *) return 1 ;;
    esac
}

report() { # report [--write PART_DIR] DIR...: the table (python, standard library only)
    "${HPY[@]}" - "$@" <<'PY'
import json, statistics, sys
from pathlib import Path

args = sys.argv[1:]
write = None
if args and args[0] == "--write":
    write, args = Path(args[1]), args[2:]
parts = [Path(a) for a in args]


def runs_of(part):
    """(name, status, rc, seconds) per run, in the order run, from runs.tsv."""
    tsv = part / "runs.tsv"
    rows = [line.split("\t") for line in tsv.read_text().splitlines() if line.strip()] if tsv.exists() else []
    return [(r[0], r[1], r[2], r[3]) for r in rows]


def numbers(d):
    """What the table shows for one run, from summary.json, else from the per-step rows a cut-off run left."""
    summary, rows = {}, []
    try:
        summary = json.loads((d / "summary.json").read_text())
    except (OSError, ValueError):
        pass
    try:
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        pass
    rows = [r for r in rows if "step_time_s" in r]
    if not summary and not rows:
        return None
    med = lambda key: statistics.median(v) if (v := [r[key] for r in rows if r.get(key) is not None]) else None
    late = [r for r in rows if r.get("step", 0) >= 2] or rows  # after the first step (compile, warm-up)
    time = sum(r["step_time_s"] for r in late)
    peak = summary.get("max_peak_allocated") or max((r.get("peak_allocated") or 0 for r in rows), default=0)
    rss = summary.get("max_peak_rss") or max((r.get("peak_rss") or 0 for r in rows), default=0)
    return {
        "steps": summary.get("steps_run", len(rows)),
        "step_s": summary.get("median_step_time_s", med("step_time_s")),
        "tok_s": summary.get("median_tokens_per_s", med("tokens_per_s")),
        "tok_s_late": sum(r.get("tokens", 0) for r in late) / time if time > 0 else None,
        "mfu": summary.get("median_mfu", med("mfu")),
        "peak": f"{peak / 2**30:.2f} GiB" if peak else (f"{rss / 2**30:.2f} GiB RSS" if rss else "-"),
        "pad": med("padding_fraction"),
        "micro": med("micro_batches"),
        "complete": summary.get("status") == "completed",
    }


def stderr_end(path, n=15):
    """The last lines of a run's stderr before torchrun's failure box (which only names the rank and its exit
    code: kept as one line), and the scripts' own `error:` line wherever it is."""
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    box = next((i - 1 for i, l in enumerate(lines) if i and l.endswith(" FAILED") and set(lines[i - 1]) == {"="}), None)
    code = [l.strip() for l in lines[box or 0:] if l.strip().startswith("exitcode")] if box is not None else []
    body = lines[:box] if box is not None else lines
    if body and ("ChildFailedError" in body[-1] or "SignalException" in body[-1]):  # the agent's own traceback
        body = body[: max((i for i, l in enumerate(body) if l.startswith("Traceback")), default=len(body))]
    errors = [l for l in body if l.lstrip("[]rank0123456789: ").startswith("error: ")]
    end = body[-n:]
    return [l for l in errors if l not in end] + end + [f"(torchrun: {c})" for c in code[:1]]


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


table, notes, hf = [], [], None
for part in parts:
    for name, status, rc, secs in runs_of(part):
        n = numbers(part / name)
        table.append((part.name, name, status, rc, secs, n))
        if n and name == "hf-padded" and n["tok_s_late"]:
            hf = n["tok_s_late"]
        if status != "ok":
            notes.append(f"### {part.name}/{name}: {status} (exit {rc or '-'}, {secs} s)\n\n```\n" + "\n".join(
                stderr_end(part / name / "stderr.txt")) + "\n```\n")

out = []
for part in parts:
    env = part / "env.txt"
    if env.exists():
        lines = env.read_text(errors="replace").splitlines()
        keep = [l for l in lines if l.startswith(("date:", "git:"))]
        for i, l in enumerate(lines):  # the GPU line (under nvidia-smi's CSV header) and the torch build line
            after = [x for x in lines[i + 1:i + 3] if not x.startswith("--- ")]
            if l.startswith("--- nvidia-smi") and after:
                keep.append("gpu: " + after[-1])
            if l.startswith("--- ") and "import torch" in l and after:
                keep.append("torch, cuda: " + after[0])
        out.append(f"{part.name}: " + "; ".join(keep))
out.append("")
cols = ["part", "run", "status", "s", "steps", "median step s", "median tok/s", "tok/s steps 2..N", "MFU",
        "peak memory", "padding", "micro-steps"]
if hf:
    cols.append("x HF padded")
out.append("| " + " | ".join(cols) + " |")
out.append("|" + "---|" * len(cols))
for part, name, status, rc, secs, n in table:
    n = n or {}
    cells = [part, name, status if n.get("complete", status != "ok") else status + " (no summary)", secs,
             n.get("steps", "-"), fmt(n.get("step_s"), ".3f"), fmt(n.get("tok_s"), ",.1f"),
             fmt(n.get("tok_s_late"), ",.1f"), "-" if n.get("mfu") is None else f"{100 * n['mfu']:.1f}%",
             n.get("peak", "-"), fmt(n.get("pad"), ".3f"), fmt(n.get("micro"), "g")]
    if hf:  # the baseline's job: parts b and c (a runs 3 steps, d under the profiler)
        ratio = n["tok_s_late"] / hf if part.startswith(("b1-", "b2-", "c-")) and n.get("tok_s_late") else None
        cells.append(fmt(ratio, ".2f"))
    out.append("| " + " | ".join(str(c) for c in cells) + " |")
out.append("")
out.append("tok/s: real (non-pad) tokens per second; median over steps, and all tokens over all time of steps 2..N "
           "(after the first step's compile and warm-up). MFU: the scripts' convention (summary.json mfu_convention). "
           "peak memory: CUDA peak allocated (CPU: peak RSS). Runs cut off by the budget have no summary.json: their "
           "numbers come from the steps they logged.")
if notes:
    out.append("")
    out.append("## Runs that did not finish\n")
    out.extend(notes)
text = "\n".join(out)
if write:
    (write / "report.md").write_text(text + "\n")
print(text)
PY
}

fastest() { # fastest DIR: the quickest run of the b parts under DIR (tokens/s over steps 2..N), as NAME
    "${HPY[@]}" - "$1" <<'PY'
import json, sys
from pathlib import Path

best = None
for tsv in sorted(Path(sys.argv[1]).glob("b[12]-*/runs.tsv")):
    for line in tsv.read_text().splitlines():
        name, status = line.split("\t")[:2]
        if status != "ok":
            continue
        try:
            rows = [json.loads(l) for l in (tsv.parent / name / "metrics.jsonl").read_text().splitlines() if l.strip()]
        except (OSError, ValueError):
            continue
        late = [r for r in rows if r.get("step", 0) >= 2] or rows
        time = sum(r["step_time_s"] for r in late)
        if time > 0 and (best is None or sum(r["tokens"] for r in late) / time > best[0]):
            best = (sum(r["tokens"] for r in late) / time, name, tsv.parent.name)
if best:
    print(f"{best[1]}\t{best[2]}\t{best[0]:.1f}")
PY
}

# ---- the parts
part_a() {
    local s script extra
    for s in $SCRIPTS; do
        script=${s%-nf4}
        if [ ! -f "experiments/$script/train.py" ]; then
            echo "[a] $s: no experiments/$script/train.py" >&2
            continue
        fi
        extra=()
        case $s in
        fsdp-tp-ft) extra=(--mesh-shape '1,1') ;; # a 1 x 1 mesh: FSDP over 1, TP over 1
        fsdp-ft-nf4) extra=(--quant nf4) ;;       # QLoRA with the 4-bit base under FSDP2
        esac
        if [ "$BITSANDBYTES" = 0 ]; then
            case $s in
            fsdp-ft-nf4) skip_one "$s" "QLoRA: bitsandbytes does not import here" && continue ;;
            ddp-ft | single-gpu-ft) extra=(--quant none) ;; # their default is QLoRA; the collectives are the same
            esac
        fi
        run_one "$s" "$A_CMD_TIMEOUT_S" "${PY[@]}" -m torch.distributed.run --standalone --nproc_per_node=1 \
            "experiments/$script/train.py" "${COMMON[@]}" --max-steps "$A_STEPS" "${extra[@]}" "${EXTRA[@]}"
    done
    # fsdp-ft --quant nf4 against single-gpu-ft (QLoRA, its default) on the same steps: per-step losses, and the
    # bytes FSDP2 holds of the 4-bit base (a group of one gathers nothing, so its shards are the whole model)
    local q=$PART_DIR/fsdp-ft-nf4 r=$PART_DIR/single-gpu-ft
    if [ "$DRY_RUN" != 1 ] && [ -f "$q/metrics.jsonl" ] && [ -f "$r/metrics.jsonl" ]; then
        "${PY[@]}" - "$q" "$r" >"$PART_DIR/fsdp-ft-nf4-vs-single-gpu-ft.txt" <<'PYEOF'
import json, sys
q, r = ([json.loads(x) for x in open(f"{d}/metrics.jsonl") if x.strip()] for d in sys.argv[1:3])
diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(q, r)]
print(f"steps compared: {len(diffs)}; max |loss(fsdp-ft --quant nf4) - loss(single-gpu-ft)|: {max(diffs):.3e}")
try:
    s = json.load(open(f"{sys.argv[1]}/summary.json"))
    print(f"param_shard_bytes {s['param_shard_bytes']:,}; largest_unit_bytes {s['largest_unit_bytes']:,}")
except (OSError, KeyError):
    print("no summary.json: the fsdp-ft run did not finish")
PYEOF
        cat "$PART_DIR/fsdp-ft-nf4-vs-single-gpu-ft.txt"
    fi
    if [ "$DRY_RUN" != 1 ]; then
        local rest
        rest=$(awk -F'\t' '$2 == "skipped" || $2 == "timed out" {printf "%s ", $1}' "$PART_DIR/runs.tsv")
        if [ -n "$rest" ]; then
            echo "[a] not finished in the budget; the rest: SCRIPTS='${rest% }' bash assets/gpu_session.sh a"
        fi
    fi
}

part_b() { # part_b QUANT LABEL
    local quant=$1 label=$2 c flags
    for c in $CONFIGS; do
        if ! flags=$(config_flags "$c"); then
            echo "[$PART] unknown configuration $c (padded-eager, packed-eager, packed-compiled)" >&2
            continue
        fi
        if [ "$quant" = nf4 ] && [ "$BITSANDBYTES" = 0 ]; then
            skip_one "$label-$c" "QLoRA: bitsandbytes does not import here"
            continue
        fi
        # shellcheck disable=SC2086 # $flags: words
        run_one "$label-$c" 0 "${PY[@]}" experiments/single-gpu-ft/train.py "${COMMON[@]}" --quant "$quant" \
            --max-steps "$B_STEPS" $flags "${EXTRA[@]}"
    done
}

part_c() {
    local col
    if [ ! -f assets/hf_baseline.py ]; then
        echo "[c] skipped: assets/hf_baseline.py is not in this tree"
        if [ "$DRY_RUN" != 1 ]; then
            echo "skipped: assets/hf_baseline.py is not in this tree" >"$PART_DIR/skipped.txt"
        fi
        return 0
    fi
    for col in padded flatten; do
        run_one "hf-$col" 0 "${PY[@]}" assets/hf_baseline.py "${COMMON[@]}" --collator "$col" --max-steps "$B_STEPS" \
            "${EXTRA[@]}"
    done
}

part_d() {
    local pick name why quant c flags prof f
    pick=${PROFILE_CONFIG:-}
    if [ -n "$pick" ]; then
        why="PROFILE_CONFIG=$pick"
    elif pick=$(fastest "$OUT_DIR") && [ -n "$pick" ]; then
        why=$(printf '%s' "$pick" | awk -F'\t' '{print $2 "/" $1 ", " $3 " tok/s over steps 2..N"}')
        why="the fastest of the b parts in $OUT_DIR: $why"
        pick=${pick%%$'\t'*}
    else
        pick=lora-packed-compiled
        [ "$SMOKE" = 1 ] && pick=lora-packed-eager # compiling on a CPU takes minutes
        why="no finished b run in $OUT_DIR: the default $pick"
    fi
    case $pick in
    qlora-*) quant=nf4 c=${pick#qlora-} ;;
    lora-*) quant=none c=${pick#lora-} ;;
    *) quant='' c='' ;;
    esac
    if ! flags=$(config_flags "$c") || [ -z "$quant" ]; then
        echo "[d] unknown configuration $pick (lora-|qlora- + padded-eager, packed-eager, packed-compiled)" >&2
        return 1
    fi
    echo "[d] profiling $pick ($why)"
    if [ "$DRY_RUN" != 1 ]; then echo "$why" >"$PART_DIR/choice.txt"; fi
    name=profile-$pick
    # shellcheck disable=SC2086 # $flags: words
    run_one "$name" 0 "${PY[@]}" experiments/single-gpu-ft/train.py "${COMMON[@]}" --quant "$quant" \
        --max-steps "$PROFILE_STEP" --profile-steps "$PROFILE_STEP:$PROFILE_STEP" $flags "${EXTRA[@]}"
    [ "$DRY_RUN" = 1 ] && return 0
    prof=$RUN_ROOT/$PART/$name/profile
    [ -d "$prof" ] || return 0
    for f in "$prof"/*; do
        [ -f "$f" ] || continue
        case $f in
        *.txt) cp "$f" "$PART_DIR/$name/" ;;
        *.json) # the trace: kept if it packs small, else only named
            gzip -c "$f" >"$PART_DIR/$name/$(basename "$f").gz"
            if [ "$(stat -c %s "$PART_DIR/$name/$(basename "$f").gz")" -gt $((TRACE_MAX_MB * 1048576)) ]; then
                rm "$PART_DIR/$name/$(basename "$f").gz"
                echo "$(basename "$f"): $(stat -c %s "$f") bytes, not kept (over ${TRACE_MAX_MB} MB gzipped)" \
                    >>"$PART_DIR/$name/profile-files.txt"
            fi
            ;;
        *) echo "$(basename "$f"): $(stat -c %s "$f") bytes, not kept" >>"$PART_DIR/$name/profile-files.txt" ;;
        esac
    done
}

declare -A WHAT=([a]=world1 [b1]=lora [b2]=qlora [c]=hf-baseline [d]=profile)

for PART in "${PARTS[@]}"; do
    if [ "$PART" = table ]; then
        mapfile -t dirs < <(find "$OUT_DIR" -mindepth 2 -maxdepth 2 -name runs.tsv -printf '%h\n' 2>/dev/null | sort)
        if [ ${#dirs[@]} -eq 0 ]; then
            echo "no parts under $OUT_DIR" >&2
            exit 1
        fi
        report "${dirs[@]}"
        continue
    fi
    DEADLINE=$(($(date +%s) + PART_BUDGET_S))
    if [ ${#PARTS[@]} -gt 1 ] && [ $((SESSION_START + SESSION_BUDGET_S)) -lt "$DEADLINE" ]; then
        DEADLINE=$((SESSION_START + SESSION_BUDGET_S))
    fi
    if [ "$DRY_RUN" = 1 ]; then
        PART_DIR="$OUT_DIR/$PART-${WHAT[$PART]}-$DEVICE"
        echo "[$PART] dry run: would write $PART_DIR (or $PART_DIR-N if taken)"
    else
        PART_DIR=$(new_dir "$OUT_DIR/$PART-${WHAT[$PART]}-$DEVICE") || {
            echo "gpu_session.sh: cannot create a folder under $OUT_DIR" >&2
            exit 2
        }
        : >"$PART_DIR/runs.tsv"
        echo "[$PART] writing $PART_DIR"
        record_env
    fi
    case $PART in
    a) part_a ;;
    b1) part_b none lora ;;
    b2) part_b nf4 qlora ;;
    c) part_c ;;
    d) part_d ;;
    esac
    if [ "$DRY_RUN" != 1 ]; then
        echo
        report --write "$PART_DIR" "$PART_DIR"
        if [ -n "$PACK" ]; then
            base=$(basename "$PART_DIR")
            mkdir -p "$PACK" && tar -czf "$PACK/$base.tgz" -C "$(dirname "$PART_DIR")" "$base" &&
                echo "[$PART] packed: $PACK/$base.tgz"
        fi
    fi
done
