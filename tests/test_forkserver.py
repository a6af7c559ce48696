"""The fork server the tests start their single-process runs and torchrun agents from (tests/forkserver.py) gives a
script what `python script args` from the repository root would: argv, working directory, environment,
sys.path[0], __name__, stdin, output, exit code, and a stop at the timeout, with whatever the run started."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from conftest import ROOT, fork_server, run_script

PROBE = """
import json, os, sys
print(json.dumps({
    "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
    "env": os.environ.get("PROBE_VALUE"), "stdin": sys.stdin.read(), "pid": os.getpid(), "sid": os.getsid(0),
}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def probe(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    return script


def test_a_forked_run_is_what_a_fresh_interpreter_gives(probe, monkeypatch):
    fork_server()  # started before the variable is set: the run must see the environment it is given
    monkeypatch.setenv("PROBE_VALUE", "set after the server started")
    forked = run_script(str(probe), "3", "x y")
    fresh = run_script(str(probe), "3", "x y", fresh=True)
    assert forked.returncode == fresh.returncode == 3
    assert forked.stderr == fresh.stderr == "to stderr\n"
    seen, expected = json.loads(forked.stdout), json.loads(fresh.stdout)
    assert seen["pid"] == seen["sid"] != expected["pid"]  # a session of its own, so a timeout stops all of it
    for key in ("pid", "sid"):
        del seen[key], expected[key]
    assert (
        seen
        == expected
        == {
            "argv": [str(probe), "3", "x y"],
            "cwd": str(ROOT),
            "path0": str(probe.parent),
            "name": "__main__",
            "env": "set after the server started",
            "stdin": "",
        }
    )


def test_module_runs_and_failures_exit_as_python_does(tmp_path):
    crash = tmp_path / "crash.py"
    crash.write_text("raise ValueError('no good')\n")
    failed = run_script(str(crash))
    assert failed.returncode == 1 and "ValueError: no good" in failed.stderr and "Traceback" in failed.stderr
    message = tmp_path / "message.py"
    message.write_text("import sys\nsys.exit('stopped: why')\n")
    stopped = run_script(str(message))
    assert stopped.returncode == 1 and stopped.stderr == "stopped: why\n"
    module = run_script("-m", "json.tool", "--help")
    assert module.returncode == 0 and "json.tool" in module.stdout


def test_a_run_past_its_timeout_is_stopped(tmp_path):
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text(
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "time.sleep(60)\n"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        run_script(str(sleeper), timeout=3)
    deadline = time.monotonic() + 10  # SIGKILL is delivered at once; the processes may take a moment to go
    while left := [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).endswith("time.sleep(60)")]:
        assert time.monotonic() < deadline, f"the process the timed-out run started is still running: {left}"
        time.sleep(0.1)
    assert run_script("-m", "json.tool", "--help").returncode == 0  # the server serves the next run


def _cmdline(pid: str) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


WORKER_PROBE = """
import json, os, signal, sys, torch
print(json.dumps({
    "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__, "rank": os.environ["RANK"],
    "env": os.environ.get("PROBE_VALUE"), "threads": torch.get_num_threads(), "stdin": sys.stdin.read(),
    "session_leader": os.getpid() == os.getsid(0), "parent": os.getppid(),
    "unbuffered": sys.stdout.write_through and sys.stderr.write_through,
    "signals": {s.name: repr(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)},
}))
print("to stderr", file=sys.stderr)
"""


@pytest.mark.slow
def test_forked_torchrun_workers_are_what_torchrun_starts(tmp_path, monkeypatch):
    """parity.torchrun's agent forks its workers (forkserver.fork_torchrun_workers); each must see what the
    `python -u script args` torchrun would start sees. (Every rank exits 0: a rank that failed first would have
    torchrun stop the other, maybe before it printed.)"""
    import conftest
    import parity

    script = tmp_path / "worker_probe.py"
    script.write_text(WORKER_PROBE)
    # A server of this test's own, started without PYTHONUNBUFFERED (which a shell may have set), so that its
    # workers are unbuffered only if the forked child makes them so, as `python -u` does.
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    server = conftest.ForkServer()
    monkeypatch.setattr(conftest, "_fork_server", server)
    monkeypatch.setenv("PROBE_VALUE", "set after the server started")
    launches, out = {}, tmp_path / "run"  # the probe writes nothing there; torchrun's logs go beside it
    for fork_workers in (True, False):
        launches[fork_workers] = parity.torchrun(str(script), "--output-dir", str(out), fork_workers=fork_workers)
    server.stop()
    forked, fresh = launches[True], launches[False]
    assert forked.returncode == fresh.returncode == 0, forked.report()
    for rank in (0, 1):
        seen, expected = (json.loads(launch.ranks[rank]["stdout"]) for launch in (forked, fresh))
        assert seen.pop("parent") == forked.pid and expected.pop("parent") == fresh.pid
        assert seen == expected, (rank, seen, expected)
        assert seen["rank"] == str(rank) and seen["threads"] == 1 and seen["unbuffered"] and seen["session_leader"]
        assert forked.ranks[rank]["stderr"] == fresh.ranks[rank]["stderr"] == "to stderr\n"
