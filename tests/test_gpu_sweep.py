"""assets/gpu_sweep.py, the one-process sweep for a lent GPU, on CPU with its --smoke stand-ins: one sweep end to end
(a subset of the rungs, --only: each compiled graph costs seconds here), the same sweep killed outright part-way
(the lines it finished must all be there, whole, in order), and its refusal without CUDA and without --smoke. Every
run is forked from the fork server (tests/forkserver.py: torch and the rest imported once), the sweep's HF baseline
runs too (PYTHON=tests/forkclient.py)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, fork_server

SCRIPT = "assets/gpu_sweep.py"
# Every stage: the whole eager ladder (its liger rung skipped here, saying why), and of the compiled one the rung
# today's scripts run (each compiled rung compiles a graph of its own: dynamo's capture, 1-3 s each here); the stock
# HF baseline (3-4 s here).
ONLY = "host-ops,attention,gemm,packed-m2,padded-*,tokens-*,compiled-packed-m2,profile,hf-stock"
STAGES = ["env", "host-ops", "attention", "gemm", "model"]
# The HF run's python: forked, on one thread (as the sweep's --smoke runs itself): a forked child keeps the server's
# two, and two OpenMP threads on this loaded 2-core machine made its 0.3 s steps take 6-11 s.
ONE_THREAD = "import runpy, sys, torch; torch.set_num_threads(1); sys.argv[:] = sys.argv[1:]; " + (
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)
FORKED_PYTHON = shlex.join([sys.executable, str(ROOT / "tests" / "forkclient.py"), "-c", ONE_THREAD])


def start(tmp: Path, *args: str, socket: Path) -> tuple:
    """The sweep, forked, with its HF runs forked too and their run directories under tmp."""
    env = {**os.environ, "PYTHON": FORKED_PYTHON}
    env |= {"FORKSERVER_SOCKET": str(socket), "RUN_ROOT": str(tmp / "runs"), "TOKENIZERS_PARALLELISM": "false"}
    argv = [SCRIPT, "--out", str(tmp / "out"), *args]
    return fork_server().start(argv, env, tmp / "stdout", tmp / "stderr"), tmp / "out" / "sweep.jsonl"


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def output(tmp: Path) -> str:
    return "".join(f"--- {n}\n{(tmp / n).read_text()[-3000:]}\n" for n in ("stdout", "stderr") if (tmp / n).exists())


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, fork_socket) -> list[dict]:
    tmp = tmp_path_factory.mktemp("sweep")
    child, path = start(tmp, "--smoke", "--only", ONLY, socket=fork_socket)
    assert child.wait(180) == 0, output(tmp)
    return lines(path)


def test_every_stage_writes_its_line(sweep):
    by_name = {line["name"]: line for line in sweep}
    names = [line["name"] for line in sweep]
    assert names[:5] == STAGES and names[-2:] == ["profile", "hf-stock"]
    assert by_name["env"]["versions"]["torch"] and by_name["env"]["device"] == "cpu"
    assert all("error" not in line for line in sweep), [line for line in sweep if "error" in line]
    assert by_name["gemm"]["128"]["tflops"] > 0 and by_name["host-ops"]["add"]["host_us"] > 0
    assert by_name["attention"]["sdpa-causal"]["ms"] > 0
    rungs = [line for line in sweep if "losses" in line and "layout" in line]
    assert [r["name"] for r in rungs] == [
        "packed-m2",
        "tokens-512-nockpt",
        "tokens-512-nockpt-dropout0",
        "padded-m4",
        "tokens-512-nockpt-dropout0-unfused",
        "compiled-packed-m2",
    ]
    for r in rungs:
        assert r["steps"] == 3 and len(r["step_s"]) == 3 and r["tokens_per_s"] > 0 and r["peak_rss"] > 0
        assert r["tokens"] == rungs[0]["tokens"]  # the same global batches, whatever the layout
    assert [r["micro_steps"][0] for r in rungs[:4]] == [2, 1, 1, 1]  # 2 rows of 128 x 2; one row of 512; the batch
    assert "liger_kernel" in by_name["tokens-512-nockpt-dropout0-liger"]["skipped"]
    profiled = by_name["profile"]
    assert profiled["rungs"]["baseline"] == "compiled-packed-m2"
    assert all(Path(f).read_text().count("\n") > 10 for f in profiled["files"])
    assert by_name["hf-stock"]["rc"] == 0 and by_name["hf-stock"]["summary"]["status"] == "completed"


def test_rungs_compute_the_same_losses(sweep):
    """Each rung starts from the same LoRA weights with a fresh optimizer: at step 1 the adapters' B is zero and the
    warmup's learning rate 0, so steps 1 and 2 are the base model's loss on the same batches in every rung, the HF
    baseline's included; the dropout-0 rungs agree at every step (fp32), and a compiled rung with its eager one."""
    rungs = {line["name"]: line["losses"] for line in sweep if "losses" in line}
    first = rungs["packed-m2"]
    for name, losses in rungs.items():
        assert losses[:2] == pytest.approx(first[:2], abs=1e-5), name
    same = [losses for name, losses in rungs.items() if "dropout0" in name]
    assert len(same) == 2
    for losses in same:
        assert losses == pytest.approx(same[0], abs=1e-5)
    assert rungs["compiled-packed-m2"] == pytest.approx(first, abs=1e-5)


def test_a_killed_sweep_keeps_its_finished_lines(tmp_path, fork_socket, sweep):
    child, path = start(tmp_path, "--smoke", "--only", ONLY, socket=fork_socket)
    deadline = time.monotonic() + 120
    while len(lines(path)) < 6 and child.poll() is None and time.monotonic() < deadline:  # after the first rung
        time.sleep(0.05)
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(60) == -signal.SIGKILL, output(tmp_path)
    names = [line["name"] for line in lines(path)]  # each line parses whole
    assert len(names) >= 6 and names == [line["name"] for line in sweep][: len(names)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_refuses_a_cpu_without_smoke(tmp_path):
    child = fork_server().start(
        [SCRIPT, "--out", str(tmp_path / "out")], dict(os.environ), tmp_path / "o", tmp_path / "e"
    )
    assert child.wait(60) == 2
    err = (tmp_path / "e").read_text()
    assert "error: no usable CUDA device" in err and "--smoke" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key", ["h100-sxm", "h200"])
def test_the_committed_predictions_are_the_planners(key):
    """devlogs/runs/plan-sweep/predictions-<gpu>.json, committed before any GPU runs the sweep, is what the planner
    gives for every rung (`--predict`): each rung's memory and tokens/s, the tokens-N rungs at --fit auto's N."""
    import argparse
    import runpy

    from ftkit import hardware

    module = runpy.run_path(str(ROOT / SCRIPT))
    args, gpu = module["ftkit_args"](argparse.Namespace(smoke=False, steps=6)), hardware.gpu(key)
    committed = json.loads((ROOT / "devlogs" / "runs" / "plan-sweep" / f"predictions-{key}.json").read_text())
    assert json.loads(json.dumps(module["predictions"](args, gpu, gpu.memory_bytes))) == committed
    assert module["prediction_table"](committed) in (ROOT / "devlogs" / "single-gpu-ft.md").read_text()
    names = [r["name"] for r in committed[1:]]
    assert names == [r.name for r in module["ladder"](args, committed[0]["tokens_row"]["tokens"])] + [
        r.name for r in module["ladder"](args, committed[0]["tokens_row"]["tokens"], compiled=True)
    ]
