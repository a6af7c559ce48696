"""A fork server for the tests' runs: an interpreter that has imported torch, transformers, peft and bitsandbytes
once, and forks a child per run that starts as `python <script> args` (or `python -m module args`) would.

Importing that stack costs ~8-11 CPU-s per process on the 2-core CI machine, and a run of the tiny model a few
seconds more: most of a reference run, an infer run, a realscale check or a torchrun rank was the import. A forked
child starts with the modules loaded and everything else as a fresh `python` gives it: the run's argv, working
directory and environment, sys.path (the script's folder, the working directory for -m, '' for -c and -, then
PYTHONPATH's folders and the installed ones), sys.stdin, sys.stdout and sys.stderr as -u or PYTHONUNBUFFERED
make them, stdin from /dev/null, stdout and stderr to files, the default dispositions of the signals that stop a
process, a session of its own (so a run past its timeout is stopped with everything it started), and the exit
code the interpreter would return (SystemExit's code, 1 after an uncaught exception's traceback, SIGINT after a
KeyboardInterrupt's).

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
{"pid": ...} when the child has started, then {"returncode": ...} when it has ended.

`{"listen": PATH}`: the same server for processes other than the one that started it, on a Unix socket at PATH,
forked from this one (conftest's `fork_socket`, `listen`), which replies with its pid and goes on; it ends when
this server does. tests/forkclient.py, given as `python`, is its client. Each connection is one run: the request
{"argv", "cwd", "env", "fork_workers", "ignored", "affinity"} ("ignored": the stopping signals the client ignores,
which a child of its would inherit; "affinity": the cores it may run on, which a child inherits too) with the
client's fds 0, 1 and 2 passed along (SCM_RIGHTS), so that the child reads and writes the client's own stdin,
stdout and stderr (redirections, pipes, here-documents); the same two replies. Connections are served at once, each
by a handler forked for it, which forks the run and waits for it; if the client goes away first (killed outright:
a signal it can catch, it passes on itself), the handler kills the run's process group. The environment caveat
holds for the client's environment: a variable read when the stack is imported (OMP_NUM_THREADS, HF_HUB_OFFLINE, a
PYTHONPATH naming another transformers) keeps the value the server started with; PYTHONPATH's folders do go on
sys.path, for the modules not imported yet (ftkit)."""

from __future__ import annotations

import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable
from typing import NoReturn

STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
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


def python_path(environ: dict[str, str]) -> list[str]:
    """PYTHONPATH's folders, as the interpreter puts them on sys.path (absolute)."""
    value = environ.get("PYTHONPATH", "")
    return [os.path.abspath(p) for p in value.split(os.pathsep)] if value else []


# sys.path after its first entry, less the server's own PYTHONPATH: the installed folders, behind a run's PYTHONPATH
INSTALLED_PATH = [p for p in sys.path[1:] if p not in python_path(os.environ)]


def child(request: dict, streams: list[int] | None = None) -> NoReturn:
    """Become `python argv...` as the request describes it, and never return: with `streams` (the client's stdin,
    stdout and stderr, socket mode) as fds 0, 1 and 2, or stdin from /dev/null and the request's output files."""
    try:
        os.chdir(request["cwd"])
        if streams is None:
            files = {  # one file if stdout and stderr are the same path: 2>&1
                path: os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                for path in {request["stdout"], request["stderr"]}
            }
            streams = [os.open(os.devnull, os.O_RDONLY), files[request["stdout"]], files[request["stderr"]]]
        redirect(0, streams[0])
        become(request["env"], streams[1], streams[2])
        for fd in set(streams[1:]):
            os.close(fd)
        fresh_signals(request.get("ignored", ()))
        if request.get("affinity"):  # the client's cores (taskset, a Slurm step's binding), which a child inherits
            os.sched_setaffinity(0, request["affinity"])
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


def fresh_signals(ignored: Iterable[int] = ()) -> None:
    """The dispositions a fresh interpreter starts with for the signals that stop a process, whatever the server's
    or the agent's are: ignored if its parent ignores them (`ignored`), else KeyboardInterrupt for SIGINT and the
    default for the others."""
    for sig in STOPPING:
        if sig in ignored:
            signal.signal(sig, signal.SIG_IGN)
        else:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def redirect(fd: int, to: int) -> None:
    os.dup2(to, fd)
    os.close(to)


def run_as_python(argv: list[str]) -> NoReturn:
    """Run `python argv...` in this process: -u, then a script, -m module, -c code or - (the script on stdin),
    sys.path as the interpreter sets it, and end as it would: SystemExit's code, 1 after an uncaught exception's
    traceback, SIGINT after a KeyboardInterrupt's."""
    code = 1
    try:
        std_streams(unbuffered=argv[:1] == ["-u"] or bool(os.environ.get("PYTHONUNBUFFERED")))
        argv = argv[1:] if argv[:1] == ["-u"] else argv
        import runpy

        if not argv or (argv[0].startswith("-") and argv[0] not in ("-m", "-c", "-")):
            raise SystemExit(f"forkserver: python {' '.join(argv)}: only [-u] SCRIPT, -m, -c or - is forked")
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            set_path(os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            set_path("")
            run_main(argv[1], "<string>")
        elif argv[0] == "-":
            sys.argv = list(argv)
            set_path("")
            run_main(sys.stdin.buffer.read(), "<stdin>", __file__="<stdin>", __cached__=None)
        else:
            sys.argv = list(argv)
            set_path(os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:  # the interpreter ends on one by SIGINT itself, after the traceback
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def set_path(first: str) -> None:
    """sys.path as a fresh interpreter started with this environment has it: `first`, PYTHONPATH, the installed."""
    sys.path[:] = [first, *dict.fromkeys(python_path(os.environ) + INSTALLED_PATH)]


def run_main(source: str | bytes, filename: str, **names: object) -> None:
    """Run code as a fresh interpreter runs -c or - : in a new __main__ module, with the names it gives that one."""
    import builtins
    import importlib.machinery
    import types

    main = types.ModuleType("__main__")
    main.__dict__.update(
        __builtins__=builtins, __loader__=importlib.machinery.BuiltinImporter, __annotations__={}, **names
    )
    sys.modules["__main__"] = main
    exec(compile(source, filename, "exec"), main.__dict__)


def std_streams(unbuffered: bool) -> None:
    """sys.stdin, sys.stdout and sys.stderr over fds 0, 1 and 2 as a fresh interpreter makes them, not the
    server's: with -u (PYTHONUNBUFFERED) every write reaches the file; otherwise writes are buffered, stdout's by
    line on a terminal, stderr's always."""
    for name, fd in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
        if fd and unbuffered:
            stream = io.TextIOWrapper(raw, old.encoding, old.errors, newline="\n", write_through=True)
        else:
            buffered = io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw)
            line = fd == 2 or raw.isatty()
            stream = io.TextIOWrapper(buffered, old.encoding, old.errors, newline="\n", line_buffering=line)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


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
            fresh_signals()
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
    import importlib.util

    for name in PRELOAD:
        # bitsandbytes is optional (the GPU machines' environment has none, .ci/gpu-machine-env): preloaded where
        # installed; a run that needs it fails at its own import, as a fresh `python` would
        if name != "bitsandbytes" or importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
    # fork() copies one thread: a server that had started others (a thread pool) would hand its children locks
    # that nobody will release. Importing the stack starts none; if that changes, say so instead of hanging.
    threads = len(os.listdir("/proc/self/task"))
    replies = sys.stdout
    sys.stdout = sys.stderr  # nothing else may write to the reply channel
    print(json.dumps({"ready": threads == 1, "threads": threads}), file=replies, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if "listen" in request:  # {"listen": PATH}: the socket server, forked from this one (no second import)
            print(json.dumps({"pid": listen(request["listen"])}), file=replies, flush=True)
            continue
        pid = os.fork()
        if pid == 0:
            child(request)
        print(json.dumps({"pid": pid}), file=replies, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), file=replies, flush=True)


def listen(path: str) -> int:
    """Fork a socket server at `path` from this pipe server and return its pid. It stops when this server ends: the
    write end of its stop pipe, kept here (and in this server's runs, forked with it open), closes."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)  # before the reply: a client may connect as soon as the pid is known
    listener.listen()
    stop, keep = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(keep)
        os.close(0)  # the pipe server's requests are not its
        serve_socket(listener, stop)
        os._exit(0)
    os.close(stop)
    listener.close()
    return pid


def serve_socket(listener: socket.socket, stop: int) -> None:
    """Fork a handler per connection (the server keeps its one thread) until `stop` closes, reaping the handlers
    that have ended."""
    while True:
        readable = select.select([listener, stop], [], [])[0]
        if stop in readable and not os.read(stop, 1 << 16):
            break
        if listener in readable:
            conn, _ = listener.accept()
            if os.fork() == 0:
                listener.close()
                handle(conn)
            conn.close()
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:  # no handler left
            pass
    os.unlink(listener.getsockname())
    listener.close()


def handle(conn: socket.socket) -> NoReturn:
    """Serve one connection, in a process forked for it, and never return: read the request and the client's
    fds, fork the run, reply its pid, wait for it, reply its exit code."""
    try:
        data, streams, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        while not data.endswith(b"\n"):
            more = conn.recv(1 << 16)
            if not more:
                raise ConnectionError("the client left before the end of its request")
            data += more
        request = json.loads(data)
        pid = os.fork()
        if pid == 0:
            conn.close()
            child(request, streams)
        for fd in streams:  # the run's now: kept open here, a pipe the client was given would outlive the run
            os.close(fd)
        send(conn, {"pid": pid})
        send(conn, {"returncode": wait_for(pid, conn)})
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def send(conn: socket.socket, reply: dict) -> None:
    try:
        conn.sendall((json.dumps(reply) + "\n").encode())
    except OSError:  # the client has gone; wait_for kills its run
        pass


def wait_for(pid: int, conn: socket.socket) -> int:
    """The run's exit code (waitstatus_to_exitcode's); if the client's connection closes first, SIGKILL the run's
    process group: the run and what it started."""
    run = os.pidfd_open(pid)
    watched = [run, conn]
    # The client sends nothing after its request: its end readable means it closed.
    while run not in select.select(watched, [], [])[0]:
        kill_run(pid, signal.SIGKILL)
        watched = [run]
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def kill_run(pid: int, sig: int) -> None:
    """Send sig to the run's process group; to the run alone if it has not yet made its session (setsid)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        os.kill(pid, sig)


if __name__ == "__main__":
    serve()
    os._exit(0)  # not the interpreter's teardown of the stack (~2 s, waited for by the tests): nothing is left to flush
