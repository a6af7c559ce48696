"""Shared fixtures: the AMI data the tests run on, a private model/tokenizer cache, and script launching."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ftkit.data import SHIPPED_DIR

ROOT = Path(__file__).resolve().parents[1]
# The AMI meetings the package ships (QMSum's, gzipped): real text in any clone, offline.
DATA = SHIPPED_DIR


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """Tiny tokenizers and random-init checkpoints go to a cache of this test session, not the user's."""
    if "FTKIT_CACHE" not in os.environ:
        os.environ["FTKIT_CACHE"] = str(tmp_path_factory.mktemp("ftkit-cache"))
    yield


@pytest.fixture(scope="session", autouse=True)
def count_host_syncs():
    """Every training run of the tests counts, per optimizer step, the .item()/.tolist()-like calls its own code
    makes (ftkit.metrics.HostSyncCounter; `host_syncs` in metrics.jsonl), for the tests to bound."""
    os.environ["FTKIT_COUNT_HOST_SYNCS"] = "1"
    yield


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA


@pytest.fixture(scope="session")
def short_data_dir(tmp_path_factory) -> Path:
    """The shipped meetings with every span query's transcript cut to its first 1-8 turns (the number from the
    query's hash) and no whole-meeting query: examples of 88-512 tiny-tokenizer tokens (median ~220) instead of
    ones trimmed to --max-length, so that a packed row of 512 holds several and packing differs from padding."""
    import gzip
    import zlib

    out = tmp_path_factory.mktemp("short-spans")
    for path in sorted(DATA.glob("*/*.json.gz")):
        meeting = json.loads(gzip.decompress(path.read_bytes()))
        for q in meeting["specific_query_list"]:
            start = int(q["relevant_text_span"][0][0])
            turns = 1 + zlib.crc32(q["query"].encode()) % 8
            q["relevant_text_span"] = [[str(start), str(min(start + turns, len(meeting["meeting_transcripts"])) - 1)]]
        meeting["general_query_list"] = []
        (out / path.parent.name).mkdir(exist_ok=True)
        (out / path.parent.name / path.name.removesuffix(".gz")).write_text(json.dumps(meeting))
    return out


class Forked:
    """A run the fork server started: what the tests use of subprocess.Popen (pid, poll, wait), its output in files.
    The child leads a session of its own, so os.killpg(pid, ...) stops it with everything it started."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None and self.server.ready(0):
            self.returncode = self.server.reply(0)["returncode"]
        return self.returncode

    def wait(self, timeout: float) -> int:
        if self.returncode is None:
            self.returncode = self.server.reply(timeout)["returncode"]
        return self.returncode


class ForkServer:
    """The client of tests/forkserver.py: started on the first run, stopped with the test session. One run at a
    time, as the tests run; other processes' runs go through a socket server forked from it (`listen`) and
    tests/forkclient.py."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "forkserver.py")],
            cwd=ROOT,
            # numpy's OpenBLAS starts a worker thread when imported; one BLAS thread keeps the server single-threaded
            env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = self.reply(timeout=120)
        assert ready["ready"], f"the fork server has {ready['threads']} threads before forking; it needs one"

    def ready(self, timeout: float) -> bool:
        return bool(select.select([self.proc.stdout], [], [], timeout)[0])

    def reply(self, timeout: float) -> dict:
        if not self.ready(timeout):
            raise subprocess.TimeoutExpired(self.proc.args, timeout)
        line = self.proc.stdout.readline()
        assert line, f"the fork server ended (exit {self.proc.poll()})"
        return json.loads(line)

    def start(self, args: list[str], env: dict, stdout: Path, stderr: Path, fork_workers: bool = False) -> Forked:
        request = {
            "argv": args,
            "cwd": str(ROOT),
            "env": env,
            "stdout": str(stdout),
            "stderr": str(stderr),
            "fork_workers": fork_workers,
        }
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return Forked(self, self.reply(timeout=60)["pid"])

    def listen(self, socket: Path) -> int:
        """A socket server at `socket` (forkserver.listen), forked from this one: no second import. Its pid."""
        self.proc.stdin.write(json.dumps({"listen": str(socket)}) + "\n")
        self.proc.stdin.flush()
        return self.reply(timeout=60)["pid"]

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


_fork_server: ForkServer | None = None


def fork_server() -> ForkServer:
    global _fork_server
    if _fork_server is None:
        _fork_server = ForkServer()
        atexit.register(_fork_server.stop)
    return _fork_server


@pytest.fixture(scope="session")
def fork_socket(tmp_path_factory) -> Path:
    """The socket of a fork server that processes the tests start reach (FORKSERVER_SOCKET, with
    `python tests/forkclient.py` as their python): one for the session, forked from the pipe server (`fork_server`),
    with the stack imported already; it ends with the pipe server."""
    path = tmp_path_factory.mktemp("forkserver") / "socket"
    fork_server().listen(path)
    return path


def run_script(
    *args: str, timeout: int = 300, env: dict | None = None, fresh: bool = False
) -> subprocess.CompletedProcess:
    """Run a repository script (or `-m module`) with this interpreter, as `python *args` from the repository root;
    its output is returned for the assertions and shown when a test fails. Forked from the fork server
    (tests/forkserver.py: torch and the rest already imported), unless `fresh` or `env` asks for an interpreter
    of its own, whose imports see that environment."""
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    if fresh or env:
        proc = subprocess.run(
            [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env
        )
    else:
        with tempfile.TemporaryDirectory(prefix="forked-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            child = fork_server().start(list(args), full_env, out, err)
            try:
                child.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait(60)
                raise
            proc = subprocess.CompletedProcess(
                [sys.executable, *args], child.returncode, out.read_text(), err.read_text()
            )
    print(f"$ {' '.join(args)}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return proc
