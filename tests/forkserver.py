"""A fork server for the tests' runs: an interpreter that has imported torch, transformers, peft and bitsandbytes
once, and forks a child per run that starts as `python <script> args` (or `python -m module args`) would.

Importing that stack costs ~8-11 CPU-s per process on the 2-core CI machine, and a run of the tiny model a few
seconds more: most of a reference run, an infer run, a realscale check or a torchrun rank was the import. A forked
child starts with the modules loaded and everything else as a fresh `python` gives it: the run's argv, working
directory and environment, sys.path[0] (the script's folder, or the working directory for -m), -u or
PYTHONUNBUFFERED, stdin from /dev/null, stdout and stderr to files, a session of its own (so a run past its
timeout is stopped with everything it started), and the exit code the interpreter would return (SystemExit's
code, 1 after an uncaught exception's traceback).

Torchrun launches: the agent (`-m torch.distributed.run`) is forked from the server, and with "fork_workers" it
forks its workers too instead of starting `python -u script args` for each (fork_torchrun_workers). The agent
has threads by then (its rendezvous store's server, `pt_tcpstore_uv`, and an elastic thread); a worker forked
from it is what torchrun's own `--run-path --start-method fork` makes, and it touches neither.

What it cannot give: settings those libraries read from the environment when imported. The server is started
with the test session's environment and OPENBLAS_NUM_THREADS=1 (numpy's BLAS, which the scripts do not use,
would otherwise start a thread at import, and a process with threads must not fork the server's way); no test's
run changes such a variable except OMP_NUM_THREADS, which torchrun sets for its workers and a forked worker
applies with torch.set_num_threads. A run that must have its own imports uses a fresh interpreter
(`run_script(..., fresh=True)`); the README's `uv run` commands start fresh processes, as a reader's do.

Protocol, one JSON object per line: request {"argv", "cwd", "env", "stdout", "stderr", "fork_workers"}; replies
{"pid": ...} when the child has started, then {"returncode": ...} when it has ended."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import NoReturn

PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.utils.checkpoint",
    "safetensors.torch",
    "bitsandbytes",
    "transformers",
    "transformers.models.qwen3.modeling_qwen3",
    "peft",
)


def child(request: dict) -> NoReturn:
    """Become `python argv...` as the request describes it, and never return."""
    try:
        os.chdir(request["cwd"])
        redirect(0, os.open(os.devnull, os.O_RDONLY))
        files = {  # one file if stdout and stderr are the same path: 2>&1
            path: os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            for path in {request["stdout"], request["stderr"]}
        }
        become(request["env"], files[request["stdout"]], files[request["stderr"]])
        for fd in files.values():
            os.close(fd)
        sys.stdout = sys.__stdout__  # the server writes its replies only to the channel it was started with
        if request.get("fork_workers"):
            fork_torchrun_workers()
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    run_as_python(request["argv"])


def become(env: dict[str, str], stdout: int | None, stderr: int | None) -> None:
    """What a started subprocess gets: a session of its own, this environment, these fds as stdout and stderr
    (None: keep the parent's)."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    for fd, to in ((1, stdout), (2, stderr)):
        if to is not None:
            os.dup2(to, fd)


def redirect(fd: int, to: int) -> None:
    os.dup2(to, fd)
    os.close(to)


def run_as_python(argv: list[str]) -> NoReturn:
    """Run `python argv...` in this process: -u, a script or -m module, sys.path[0] as the interpreter sets it, and
    exit with the code it would (SystemExit's, or 1 after an uncaught exception's traceback)."""
    code = 1
    try:
        if argv[0] == "-u" or os.environ.get("PYTHONUNBUFFERED"):
            unbuffered()
        argv = argv[1:] if argv[0] == "-u" else argv
        import runpy

        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def unbuffered() -> None:
    """sys.stdout and sys.stderr as `python -u` (or PYTHONUNBUFFERED) makes them: every write reaches the file."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        raw = io.FileIO(fd, "w", closefd=False)
        setattr(sys, name, io.TextIOWrapper(raw, stream.encoding, stream.errors, write_through=True))


class ForkedWorker:
    """What torchrun's agent uses of a worker's subprocess.Popen (pid, poll, wait), for a worker it forked."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.01)
        return self.returncode


def fork_torchrun_workers() -> None:
    """Make this process's torchrun agent fork its workers instead of starting `python -u script args` for each:
    a worker then starts with the stack imported, and otherwise as torchrun's subprocess would (its environment,
    a session of its own, its output files, the signal dispositions of a fresh interpreter, the thread count
    OMP_NUM_THREADS asks for). A forked worker also keeps the agent's open file descriptors (the rendezvous
    store's sockets, the other workers' output files), as torchrun's own `--start-method fork` worker does: closing
    them under the objects that own them would have those close a reused descriptor later."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    def popen(handler, args: tuple, env: dict[str, str]) -> ForkedWorker:
        pid = os.fork()
        if pid:
            return ForkedWorker(pid)
        try:
            become(env, *(None if file is None else file.fileno() for file in (handler._stdout, handler._stderr)))
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
            if "OMP_NUM_THREADS" in env:  # read by the OpenMP runtime when torch was imported, here before it
                import torch

                torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        run_as_python(list(args[1:]))

    subprocess_handler.SubprocessHandler._popen = popen


def serve() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    # fork() copies one thread: a server that had started others (a thread pool) would hand its children locks
    # that nobody will release. Importing the stack starts none; if that changes, say so instead of hanging.
    threads = len(os.listdir("/proc/self/task"))
    replies = sys.stdout
    sys.stdout = sys.stderr  # nothing else may write to the reply channel
    print(json.dumps({"ready": threads == 1, "threads": threads}), file=replies, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(request)
        print(json.dumps({"pid": pid}), file=replies, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), file=replies, flush=True)


if __name__ == "__main__":
    serve()
