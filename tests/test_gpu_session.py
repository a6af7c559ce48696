"""assets/gpu_session.sh, the GPU session's script, end to end on CPU with its --smoke stand-ins (the tiny model,
gloo, 2 steps of 128 tokens): part a with two scripts (SCRIPTS=...; all seven world-1 runs would take minutes
here), part b1 with one of its three configurations (CONFIGS=...: each costs a run, and compiling on a CPU
minutes), a second invocation (whose budget is spent) that must not touch the first's folder, the table over every
part, and the GPU plan (--dry-run) under a stand-in nvidia-smi."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "assets" / "gpu_session.sh"
BASH = shutil.which("bash")


def session(tmp: Path, *args: str, path_first: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """bash assets/gpu_session.sh ARGS --out tmp/out, with this interpreter and run directories under tmp."""
    environ = {**os.environ, "PYTHON": sys.executable, "RUN_ROOT": str(tmp / "runs"), **env}
    settings = ("GPU_SESSION_OUT", "SMOKE", "DRY_RUN", "SCRIPTS", "CONFIGS", "PROFILE_CONFIG", "EXTRA_FLAGS")
    for name in (*settings, "WHEELS", "BITSANDBYTES"):
        if name not in env:
            environ.pop(name, None)
    if path_first is not None:
        environ["PATH"] = f"{path_first}{os.pathsep}{environ['PATH']}"
    proc = subprocess.run(
        [BASH, str(SCRIPT), *args, "--out", str(tmp / "out")],
        env=environ,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp,
    )
    return proc


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def runs_tsv(part: Path) -> dict[str, list[str]]:
    return {line.split("\t")[0]: line.split("\t") for line in (part / "runs.tsv").read_text().splitlines()}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, fork_socket):
    tmp = tmp_path_factory.mktemp("gpu-session")
    out = tmp / "out"
    # Every `python` of the script (env.txt's, each torchrun agent and its worker, the loss comparison, the b run)
    # is forked from a fork server that imported torch and the rest once (tests/forkclient.py), not a fresh
    # interpreter importing them again: the four invocations take ~15 s instead of ~60.
    forked = {"PYTHON": f"{sys.executable} {ROOT / 'tests' / 'forkclient.py'}", "FORKSERVER_SOCKET": str(fork_socket)}
    # pp-ft first: it refuses a world of 1, and the next script runs all the same.
    a = session(tmp, "a", "--smoke", SCRIPTS="pp-ft single-gpu-ft fsdp-ft-nf4", **forked)
    assert a.returncode == 0, a.stdout + a.stderr
    b = session(tmp, "b1", SMOKE="1", CONFIGS="packed-eager", **forked)
    assert b.returncode == 0, b.stdout + b.stderr
    first = digest(out / "a-world1-smoke-cpu")
    # The same part again, into the same --out, with its budget spent before its first run: a new folder, the run
    # recorded as skipped, nothing started.
    spent = session(tmp, "a", "--smoke", SCRIPTS="single-gpu-ft", PART_BUDGET_S="1", **forked)
    assert spent.returncode == 0, spent.stdout + spent.stderr
    table = session(tmp, "table", "--smoke", **forked)
    assert table.returncode == 0, table.stdout + table.stderr
    return {"tmp": tmp, "out": out, "a": a, "b": b, "spent": spent, "table": table, "first": first}


def test_part_a_runs_each_script_under_torchrun_and_records_it(smoke):
    part = smoke["out"] / "a-world1-smoke-cpu"
    runs = runs_tsv(part)
    assert list(runs) == ["pp-ft", "single-gpu-ft", "fsdp-ft-nf4"]
    assert runs["single-gpu-ft"][1:3] == ["ok", "0"]
    run = part / "single-gpu-ft"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps_run"] == 2
    assert summary["hardware"]["world_size"] == 1 and summary["config"]["smoke"] is True
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    command = (run / "command.txt").read_text()
    assert "torch.distributed.run" in command and "--nproc_per_node=1" in command
    assert "experiments/single-gpu-ft/train.py" in command and "--max-steps 2" in command
    env = (part / "env.txt").read_text()
    assert "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv" in env
    import torch

    assert f"{torch.__version__} {torch.version.cuda}" in env  # the torch build line, as `python -c` prints it
    report = (part / "report.md").read_text()
    assert "| a-world1-smoke-cpu | single-gpu-ft | ok |" in report
    assert "| a-world1-smoke-cpu | single-gpu-ft | ok |" in smoke["a"].stdout  # printed at the end, too


def test_part_a_compares_fsdp_qlora_with_single_gpu_qlora(smoke):
    """fsdp-ft --quant nf4 at world 1 against single-gpu-ft's QLoRA on the same steps (fp32 here: equal)."""
    part = smoke["out"] / "a-world1-smoke-cpu"
    assert runs_tsv(part)["fsdp-ft-nf4"][1:3] == ["ok", "0"]
    assert "--quant nf4" in (part / "fsdp-ft-nf4" / "command.txt").read_text()
    text = (part / "fsdp-ft-nf4-vs-single-gpu-ft.txt").read_text()
    steps, diff = re.search(
        r"steps compared: (\d+); max \|loss\(fsdp-ft --quant nf4\) - loss\(single-gpu-ft\)\|: (\S+)", text
    ).groups()
    assert int(steps) == 2 and float(diff) <= 1e-5, text
    assert "param_shard_bytes" in text


def test_a_refusal_is_recorded_with_its_message(smoke):
    part = smoke["out"] / "a-world1-smoke-cpu"
    name, status, rc = runs_tsv(part)["pp-ft"][:3]
    assert status == "refused" and rc != "0", (status, rc)
    assert "at least 2 ranks" in (part / "pp-ft" / "stderr.txt").read_text()
    report = (part / "report.md").read_text()
    assert "## Runs that did not finish" in report and "error: a pipeline needs at least 2 ranks" in report


def test_a_second_invocation_writes_a_new_folder(smoke):
    out = smoke["out"]
    assert digest(out / "a-world1-smoke-cpu") == smoke["first"]  # the first run's files, untouched
    part = out / "a-world1-smoke-cpu-2"
    assert (part / "env.txt").exists() and runs_tsv(part)["single-gpu-ft"][1] == "skipped"  # the budget was spent
    assert not (part / "single-gpu-ft" / "metrics.jsonl").exists()
    assert "SCRIPTS='single-gpu-ft' bash assets/gpu_session.sh a" in smoke["spent"].stdout


def test_part_b_copies_each_configuration_and_prints_the_table(smoke):
    part = smoke["out"] / "b1-lora-smoke-cpu"
    assert list(runs_tsv(part)) == ["lora-packed-eager"]
    for name in ("lora-packed-eager",):
        summary = json.loads((part / name / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["config"]["quant"] == "none"
        assert summary["median_tokens_per_s"] > 0
        rows = [json.loads(line) for line in (part / name / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 2
    command = (part / "lora-packed-eager" / "command.txt").read_text()
    assert "--no-compile" in command and "--no-packing" not in command and "--quant none" in command
    for text in (smoke["b"].stdout, (part / "report.md").read_text()):
        assert "| b1-lora-smoke-cpu | lora-packed-eager | ok |" in text
        assert "median tok/s" in text and "tok/s steps 2..N" in text and "MFU" in text


def test_table_covers_every_part(smoke):
    text = smoke["table"].stdout
    for row in (
        "| a-world1-smoke-cpu | single-gpu-ft | ok |",
        "| a-world1-smoke-cpu | pp-ft | refused |",
        "| a-world1-smoke-cpu-2 | single-gpu-ft | skipped |",
        "| b1-lora-smoke-cpu | lora-packed-eager | ok |",
    ):
        assert row in text, text


def test_part_d_profiles_the_fastest_b_run(smoke):
    def rate(name):
        rows = [json.loads(line) for line in (smoke["out"] / "b1-lora-smoke-cpu" / name / "metrics.jsonl").open()]
        late = [r for r in rows if r["step"] >= 2]
        return sum(r["tokens"] for r in late) / sum(r["step_time_s"] for r in late)

    fastest = max(("lora-packed-eager",), key=rate)  # the one b run the fixture makes
    proc = session(smoke["tmp"], "d", "--smoke", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert f"[d] profiling {fastest} (the fastest of the b parts" in proc.stdout
    assert "--profile-steps 2:2" in proc.stdout and "--quant none" in proc.stdout
    assert not list(smoke["out"].glob("d-*"))  # a dry run creates nothing


def fake_smi(tmp: Path, name: str, rc: int = 0) -> Path:
    d = tmp / f"bin-{rc}"
    d.mkdir(exist_ok=True)
    smi = d / "nvidia-smi"
    smi.write_text(f"#!{BASH}\n" + (f"echo '{name}'\n" if name else "") + f"exit {rc}\n")
    smi.chmod(0o755)
    return d


def test_gpu_plan_under_a_stand_in_nvidia_smi(tmp_path):
    proc = session(tmp_path, "all", "--dry-run", path_first=fake_smi(tmp_path, "NVIDIA H100 80GB HBM3"))
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for part in ("a-world1", "b1-lora", "b2-qlora", "c-hf-baseline", "d-profile"):
        assert f"{tmp_path / 'out' / part}-h100-80gb-hbm3 " in text, part
    lines = text.splitlines()
    world1 = [line for line in lines if line.startswith("[a] ") and "torch.distributed.run" in line]
    assert len(world1) == 9 and all("--nproc_per_node=1" in line and "--max-steps 3" in line for line in world1)
    assert "experiments/fsdp-ft/train.py" in world1[-1] and "--quant nf4" in world1[-1]  # fsdp-ft-nf4, last
    assert all("--model qwen3-4b-shape" in line for line in lines if "--output-dir" in line)
    assert "--mesh-shape 1,1" in next(line for line in world1 if "fsdp-tp-ft" in line)
    b = [line for line in lines if line.startswith(("[b1] ", "[b2] ")) and "--output-dir" in line]
    assert len(b) == 6 and all("--max-steps 20" in line for line in b)
    assert sum("--no-packing --no-compile" in line for line in b) == 2
    assert sum("--quant nf4" in line for line in b) == 3
    if (ROOT / "assets" / "hf_baseline.py").exists():
        assert "--collator padded" in text and "--collator flatten" in text
    assert "--profile-steps 3:3" in text
    assert not (tmp_path / "out").exists()


def test_without_bitsandbytes_the_qlora_runs_are_skipped_and_the_rest_run_bf16(tmp_path):
    """The lent GPU machines have no bitsandbytes: QLoRA runs would crash after the data is encoded. Part a runs
    ddp-ft and single-gpu-ft (QLoRA by default) with --quant none and skips fsdp-ft-nf4; b2 skips all three."""
    smi = fake_smi(tmp_path, "NVIDIA H200")
    proc = session(tmp_path, "a", "b2", "--dry-run", path_first=smi, BITSANDBYTES="0")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    runs = {line.split()[1]: line for line in lines if "--output-dir" in line}
    assert "--quant none" in runs["ddp-ft"] and "--quant none" in runs["single-gpu-ft"]
    assert "--quant" not in runs["fsdp-ft"]  # its default is bf16 LoRA already
    skipped = [line for line in lines if "skipped (QLoRA: bitsandbytes does not import here)" in line]
    assert [line.split()[1] for line in skipped] == [
        "fsdp-ft-nf4:",
        "qlora-packed-compiled:",
        "qlora-padded-eager:",
        "qlora-packed-eager:",
    ]
    assert "fsdp-ft-nf4" not in runs and not any(name.startswith("qlora") for name in runs)
    with_bnb = session(tmp_path, "a", "--dry-run", path_first=smi, BITSANDBYTES="1")
    assert "--quant none" not in with_bnb.stdout and "fsdp-ft-nf4 (timeout" in with_bnb.stdout


def test_without_a_gpu_it_refuses_unless_smoke(tmp_path):
    proc = session(tmp_path, "a", path_first=fake_smi(tmp_path, "", rc=9), PYTHON="false")
    assert proc.returncode == 2 and "--smoke runs the CPU stand-ins" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_the_h200_sessions_table_is_its_runs_summaries():
    """devlogs/runs/gpu-session-2026-11-26-gpu/README.md's table: each number from the run's summary.json and
    metrics.jsonl, as report.md computes them (median step, median tokens/s, tokens/s over steps 2..N, MFU, peak)."""
    folder = ROOT / "devlogs" / "runs" / "gpu-session-2026-11-26-gpu"
    rows = {}
    for line in (folder / "README.md").read_text().splitlines():
        if line.startswith(("| padded (", "| packed (")):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0].split()[0]] = cells[1:]
    assert set(rows) == {"padded", "packed"}
    for name, cells in rows.items():
        run = folder / "b1-lora-h200-2" / f"lora-{name}-eager"
        s = json.loads((run / "summary.json").read_text())
        late = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()][1:]
        late_tok_s = sum(r["tokens"] for r in late) / sum(r["step_time_s"] for r in late)
        assert s["hardware"]["gpu"] == "NVIDIA H200" and s["versions"]["torch"] == "2.11.0"
        assert cells == [
            f"{s['median_step_time_s']:.2f} s",
            f"{s['median_tokens_per_s']:,.0f}",
            f"{late_tok_s:,.0f}",
            f"{s['median_mfu']:.1%}",
            f"{s['max_peak_allocated'] / 2**30:.2f} GiB",
        ]
