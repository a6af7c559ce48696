"""A fork server for the tests' single-process script runs: an interpreter that has imported torch, transformers,
peft and bitsandbytes once, and forks a child per run that starts the script as `python <script> args` would.

Importing that stack costs ~8-11 CPU-s per process on the 2-core CI machine, and a run of the tiny model a few
seconds more: most of a reference run, an infer run or a realscale check was the import. A forked child starts
with the modules loaded and everything else as a fresh `python` gives it: the run's argv, working directory and
environment, sys.path[0] (the script's folder, or the working directory for -m), stdin from /dev/null, stdout and
stderr to files, a session of its own (so a run past its timeout is stopped with everything it started), and the
exit code the interpreter would return (SystemExit's code, 1 after an uncaught exception's traceback).

What it cannot give: settings those libraries read from the environment when imported. The server is started
with the test session's environment and OPENBLAS_NUM_THREADS=1 (numpy's BLAS, which the scripts do not use,
would otherwise start a thread at import, and a process with threads must not fork); no test's run changes such a
variable; a run that must have its own
imports uses a fresh interpreter (`run_script(..., fresh=True)`). Torchrun launches and the README's `uv run`
commands always start fresh processes, as a reader's do.

Protocol, one JSON object per line: request {"argv", "cwd", "env", "stdout", "stderr"}; replies {"pid": ...} when
the child has started, then {"returncode": ...} when it has ended."""

from __future__ import annotations

import json
import os
import sys
import traceback

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


def child(request: dict) -> None:
    """Become `python argv...` and never return."""
    code = 1
    try:
        os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        files = {
            path: os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            for path in {request["stdout"], request["stderr"]}
        }
        os.dup2(files[request["stdout"]], 1)
        os.dup2(files[request["stderr"]], 2)  # the same file as stdout, if asked: 2>&1
        sys.stdout = sys.__stdout__  # the server writes its replies only to the channel it was started with
        import runpy

        argv = request["argv"]
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
