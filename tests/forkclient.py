"""`python`, for a process the test session starts (a shell script's `"${PY[@]}" args`): `python tests/forkclient.py
ARGS...` has the fork server listening on $FORKSERVER_SOCKET (tests/forkserver.py, `listen`) fork `python ARGS...`
(a script, -m module, -c code or -, after an optional -u) with this process's working directory, environment,
stdin, stdout and stderr, and exits as that child does: its exit code, or the signal that ended it. A torchrun
agent (`-m torch.distributed.run`) forks its workers too. A signal that stops a process (timeout's SIGTERM,
SIGINT, ...) is passed on to the child's process group, as it would reach a child in this process's group; if
this process is killed outright (SIGKILL), the server kills that group. A signal that comes before the child has
started kills this process, and with it the child. The child runs on this process's cores (its CPU affinity).
Standard library only: it starts in a few tens of ms."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def main(argv: list[str]) -> int:
    path = os.environ.get("FORKSERVER_SOCKET")
    if not path:
        print("forkclient: FORKSERVER_SOCKET names no fork server (conftest.fork_socket)", file=sys.stderr)
        return 2
    args = argv[1:] if argv[:1] == ["-u"] else argv
    request = {
        "argv": argv,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "fork_workers": args[:2] == ["-m", "torch.distributed.run"],
        "ignored": [sig for sig in STOPPING if signal.getsignal(sig) == signal.SIG_IGN],  # a child keeps ignoring them
        "affinity": sorted(os.sched_getaffinity(0)),  # and runs on the same cores (taskset, a Slurm step's binding)
    }
    data = (json.dumps(request) + "\n").encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        try:
            conn.connect(path)
        except OSError as e:
            print(f"forkclient: no fork server at {path}: {e}", file=sys.stderr)
            return 2
        conn.sendall(data[socket.send_fds(conn, [data], [0, 1, 2]) :])
        replies = conn.makefile()
        started = replies.readline()
        if started:
            pid = json.loads(started)["pid"]
            for sig in set(STOPPING) - set(request["ignored"]):
                signal.signal(sig, lambda sig, _: pass_on(pid, sig))
        ended = replies.readline()
    if not ended:
        print("forkclient: the fork server ended before the run did", file=sys.stderr)
        return 2
    returncode = json.loads(ended)["returncode"]
    if returncode >= 0:
        return returncode
    # Ended by a signal: end by it too, so that the shell or `timeout` sees what a child python's end would be.
    if -returncode != signal.SIGKILL:  # its handler cannot be set: it is always the default
        signal.signal(-returncode, signal.SIG_DFL)
    os.kill(os.getpid(), -returncode)
    return 128 - returncode  # the shell's code for it, should the signal not end this process


def pass_on(pid: int, sig: int) -> None:
    """Send sig to the run's process group; to the run alone if it has not yet made its session (setsid), and to
    nothing if it has ended."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
