"""The fork server the tests start their single-process runs and torchrun agents from (tests/forkserver.py) gives a
script what `python script args` from the repository root would: argv, working directory, environment,
sys.path[0], __name__, stdin, output, exit code, and a stop at the timeout, with whatever the run started. And
tests/forkclient.py, as the `python` of a process the tests start, gives it what `python args` would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
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


# tests/forkclient.py: the fork server's socket (`listen`) reached from processes other than the test session's


def client(fork_socket, *args: str, **kwargs) -> subprocess.Popen:
    """`python tests/forkclient.py args...`: `python args...` forked from the session's socket fork server."""
    env = {**kwargs.pop("env", os.environ), "FORKSERVER_SOCKET": str(fork_socket)}
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / "forkclient.py"), *args], env=env, **kwargs)


def both(fork_socket, args: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """`python args` forked through the client, and the same in a fresh interpreter: (forked, fresh)."""
    stdin = kwargs.pop("input", None)
    runs = []
    for proc in (
        client(fork_socket, *args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs),
        subprocess.Popen(
            [sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs
        ),
    ):
        out, err = proc.communicate(stdin, timeout=60)
        runs.append(subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), err.decode()))
    return runs[0], runs[1]


CLIENT_PROBE = """
import json, os, sys
import ftkit, probe_lib
print(json.dumps({
    "argv": sys.argv, "cwd": os.getcwd(), "path": sys.path, "name": __name__, "globals": sorted(globals()),
    "env": os.environ.get("PROBE_VALUE"), "stdin": sys.stdin.read(), "ftkit": ftkit.__file__,
    "lib": probe_lib.__file__, "pid": os.getpid(), "sid": os.getsid(0),
    "streams": [(s.write_through, s.line_buffering) for s in (sys.stdout, sys.stderr)],
}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("how", ["-c", "-u -c", "-"])
def test_a_client_run_is_what_a_fresh_interpreter_gives(fork_socket, tmp_path, how):
    """-c, -u, - (the script on stdin): argv, working directory, sys.path (PYTHONPATH's folders, the installed
    ftkit), __main__'s names, environment, stdin, buffering, stderr and exit code, in a session of its own."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "probe_lib.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered unless -u says otherwise
    env |= {"PROBE_VALUE": "the client's", "PYTHONPATH": f"{tmp_path / 'lib'}{os.pathsep}{ROOT}"}
    if how == "-":
        args, stdin = ["-", "3", "x y"], CLIENT_PROBE
    else:
        args, stdin = [*how.split(), CLIENT_PROBE, "3", "x y"], "from stdin"
    forked, fresh = both(fork_socket, args, input=stdin.encode(), cwd=tmp_path, env=env)
    assert forked.returncode == fresh.returncode == 3, forked.stderr
    assert forked.stderr == fresh.stderr == "to stderr\n"
    seen, expected = json.loads(forked.stdout), json.loads(fresh.stdout)
    assert seen["pid"] == seen["sid"] != expected["sid"]  # a session of its own: the client stops all of it
    for key in ("pid", "sid"):
        del seen[key], expected[key]
    assert seen == expected
    assert seen["path"][:3] == ["", str(tmp_path / "lib"), str(ROOT)]
    assert seen["ftkit"] == str(ROOT / "ftkit" / "__init__.py")
    assert seen["streams"] == ([[True, False]] * 2 if how == "-u -c" else [[False, False], [False, True]])


@pytest.mark.parametrize(
    "code",
    [
        "import sys; sys.exit('stopped: why')",
        "raise ValueError('no good')",
        "raise KeyboardInterrupt",
        "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
        "import sys; sys.exit(7)",
    ],
)
def test_a_client_exits_as_python_does(fork_socket, code):
    forked, fresh = both(fork_socket, ["-c", code])
    assert forked.returncode == fresh.returncode, (forked.stderr, fresh.stderr)
    assert forked.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:]  # the message, the exception's line


REDIRECTIONS = """
PY=($PYTHON)
"${PY[@]}" -c 'import sys; print("out 1", flush=True); print("err 1", file=sys.stderr); print("out 2")' >both.txt 2>&1
"${PY[@]}" - here doc <<'EOF' 2>err.txt | tr a-z A-Z
import sys
print(sys.argv[1:], sys.stdin.read())
print("to err", file=sys.stderr)
EOF
echo "captured: $("${PY[@]}" -c 'import sys; print(sys.stdin.read().strip())' <both.txt | tr '\\n' ' ')"
echo "exit $("${PY[@]}" -c 'import sys; sys.exit(4)'; echo $?)"
"""


def test_a_client_run_has_the_clients_stdin_stdout_and_stderr(fork_socket, tmp_path):
    """What a script's redirections give `python`, here-documents and pipes included, the client's child gets: its
    fds 0, 1 and 2 are the client's own."""
    outputs = {}
    for name, python in (("fresh", sys.executable), ("forked", f"{sys.executable} {ROOT / 'tests' / 'forkclient.py'}")):
        (tmp_path / name).mkdir()
        env = {**os.environ, "PYTHON": python, "FORKSERVER_SOCKET": str(fork_socket)}
        proc = subprocess.run(
            ["bash", "-c", REDIRECTIONS], cwd=tmp_path / name, env=env, capture_output=True, text=True, timeout=60
        )
        files = {f.name: f.read_text() for f in (tmp_path / name).iterdir()}
        outputs[name] = (proc.returncode, proc.stdout, proc.stderr, files)
    assert outputs["forked"] == outputs["fresh"]
    rc, stdout, stderr, files = outputs["forked"]
    assert stdout == "['HERE', 'DOC'] \ncaptured: out 1 err 1 out 2 \nexit 4\n" and rc == 0 and stderr == ""
    assert files == {"both.txt": "out 1\nerr 1\nout 2\n", "err.txt": "to err\n"}


STARTS_AND_SLEEPS = """
import os, signal, sys, time
started = os.fork()  # in the run's process group, as a subprocess it started would be
if started == 0:
    time.sleep(60)
    os._exit(0)
def stop(*_):
    print("stopping", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print(os.getpid(), started, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killing_the_client_kills_its_run_and_what_it_started(fork_socket, sig):
    """SIGTERM (timeout's) is passed on to the run's process group, whose run may handle it as it would in the
    client's group; after SIGKILL, the server kills that group."""
    proc = client(fork_socket, "-c", STARTS_AND_SLEEPS, stdout=subprocess.PIPE, text=True)
    pids = [int(pid) for pid in proc.stdout.readline().split()]
    assert len(pids) == 2 and all(_alive(pid) for pid in pids)
    proc.send_signal(sig)
    assert proc.wait(10) == (0 if sig == signal.SIGTERM else -sig)  # the run's own exit, or the client's
    deadline = time.monotonic() + 10
    while left := [pid for pid in pids if _alive(pid)]:
        assert time.monotonic() < deadline, f"still running after the client's {sig.name}: {left}"
        time.sleep(0.05)
    assert proc.stdout.read() == ("stopping\n" if sig == signal.SIGTERM else "")


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_clients_are_served_at_once(fork_socket):
    """A run that waits does not hold up another client's; each gets its own streams and exit code."""
    code = "import sys; print('waiting', flush=True); print(sys.stdin.read().upper()); sys.exit(3)"
    waiting = client(fork_socket, "-c", code, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert waiting.stdout.readline() == "waiting\n"  # its run has started, and waits for its stdin
    other = client(fork_socket, "-c", "import sys; print('other'); sys.exit(5)", stdout=subprocess.PIPE, text=True)
    assert other.communicate(timeout=30) == ("other\n", None) and other.returncode == 5
    assert waiting.communicate("its own input", timeout=30) == ("ITS OWN INPUT\n", None) and waiting.returncode == 3


def test_a_client_torchrun_forks_its_workers(fork_socket, tmp_path):
    """`-m torch.distributed.run` through the client: the worker is forked from the agent (the stack already
    imported), and the launch fails as the worker does."""
    script = tmp_path / "worker.py"
    script.write_text("import os, sys\nprint(os.environ['RANK'], 'transformers' in sys.modules)\nsys.exit(6)\n")
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(script)]
    proc = client(fork_socket, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    assert out == "0 True\n" and proc.returncode == 1 and "exitcode  : 6" in err, err
