"""Run a test script's ranks as processes forked from an interpreter that has torch loaded.

A rank that starts as a new interpreter spends about two CPU seconds importing torch
before it runs a line of its script; most of the suite's multi-process jobs are a few
seconds of work each, so on a two-core machine those imports were half of the suite's
CPU. Here each pytest process starts one *warm* server (``python -m
tests.support.warm_ranks``), which imports torch, torch.distributed, NumPy, zarr and
distckpt once and then forks every rank of every job it is asked for. The ranks are
real, separate processes talking gloo over loopback, exactly as under torchrun:

* every rank gets torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``,
  ``TORCHELASTIC_RUN_ID``, ...) on top of the job's own (:func:`job_env`), and, as
  torchrun's workers do, finds the job's TCPStore hosted by its launcher (one forked
  process per job, in its own session, which waits for the ranks);
* the script runs as ``__main__`` with its folder first on ``sys.path`` and its
  arguments in ``sys.argv``; the process ends as an interpreter does (non-daemon threads
  joined, ``atexit`` handlers run, exit status from ``SystemExit`` or 1 for an
  exception);
* as torchrun does, when a rank fails the launcher sends SIGTERM to the others, then
  SIGKILL after a grace period; the job's exit status is 0 if every rank's was, else 1;
* stdout and stderr of all ranks are collected (line buffered, one write per line, as
  under ``tests/support/whole_lines``) and returned in a ``CompletedProcess``; on
  time-out the launcher and its ranks are killed and AssertionError carries the output.

What this does not cover is torchrun itself: its agent, restarts and signal handling.
The tests of those (``tests/training/test_elastic.py``, ``tests/cluster``, the kill
cases of ``tests/engine/test_failures.py``, ``tests/comm/test_comm.py``) launch the real
``torchrun`` with :func:`~tests.support.launch_util.run_torchrun`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: How long the launcher lets the other ranks end after SIGTERM (torchrun waits 30 s).
GRACE = 30.0
#: What the server imports before it forks anything.
PRELOAD = (
    "numpy",
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.device_mesh",
    "zarr",
    "numcodecs",
    "distckpt",
)


# ----------------------------------------------------------------------------- the server


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    import distckpt

    for name in distckpt.__all__:  # the lazily imported public names, and their engine
        getattr(distckpt, name)


def _exit_status(error: SystemExit) -> int:
    """The process status an interpreter gives for ``sys.exit(code)``."""
    code = error.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run_rank(request: dict[str, Any], env: dict[str, str], closing: list[Any]) -> None:
    """In a forked child: become the rank and run the script; never returns."""
    status = 1
    try:
        os.setsid()
        for thing in closing:
            thing.close()
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["out"], os.O_WRONLY | os.O_APPEND)
        err = os.open(request["err"], os.O_WRONLY | os.O_APPEND)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdout.reconfigure(line_buffering=True, write_through=False)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        script = os.path.abspath(request["script"])
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:1] = [os.path.dirname(script), *(p for p in extra if p not in sys.path)]
        sys.argv = [script, *request["args"]]
        import runpy

        try:
            runpy.run_path(script, run_name="__main__")
            status = 0
        except SystemExit as error:
            status = _exit_status(error)
        except BaseException:
            traceback.print_exc()
            status = 1
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()  # as an interpreter does at exit: join the non-daemon threads
        atexit._run_exitfuncs()
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(status)


def _launch(conn: socket.socket, request: dict[str, Any], closing: list[Any]) -> None:
    """In a forked child: the job's launcher. Hosts its store, forks its ranks, waits for
    them (as torchrun does on a failure: SIGTERM to the others, SIGKILL after
    :data:`GRACE`) and sends their exit statuses; never returns."""
    try:
        os.setsid()
        import torch.distributed as dist

        nprocs = int(request["nprocs"])
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        base = dict(request["env"])
        base.setdefault("OMP_NUM_THREADS", "1")
        base.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(nprocs),
            LOCAL_WORLD_SIZE=str(nprocs),
            GROUP_RANK="0",
            GROUP_WORLD_SIZE="1",
            ROLE_NAME="default",
            ROLE_WORLD_SIZE=str(nprocs),
            TORCHELASTIC_RUN_ID=uuid.uuid4().hex,
            TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_MAX_RESTARTS="0",
            TORCHELASTIC_USE_AGENT_STORE="True",
        )
        sys.stdout.flush()
        sys.stderr.flush()
        ranks: dict[int, int] = {}
        for rank in range(nprocs):
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
            pid = os.fork()
            if pid == 0:
                _run_rank(request, env, [*closing, conn, listener])
            ranks[pid] = rank
        store = dist.TCPStore(  # noqa: F841 (serves the ranks while this process lives)
            "127.0.0.1",
            port,
            nprocs,
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )
        conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
        codes: dict[int, int] = {}
        deadline: float | None = None
        while len(codes) < nprocs:
            if deadline is not None and time.monotonic() > deadline:
                for pid in ranks:
                    if ranks[pid] not in codes:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                deadline = None
            pid, status = os.waitpid(-1, os.WNOHANG if deadline is not None else 0)
            if pid == 0:
                time.sleep(0.05)
                continue
            if pid not in ranks:
                continue
            code = os.waitstatus_to_exitcode(status)
            codes[ranks[pid]] = code
            if code != 0 and deadline is None and len(codes) < nprocs:
                deadline = time.monotonic() + GRACE
                for other, rank in ranks.items():
                    if rank not in codes:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(other, signal.SIGTERM)
        conn.sendall(json.dumps({"codes": [codes[r] for r in range(nprocs)]}).encode() + b"\n")
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        os._exit(0)


def serve(path: str) -> None:
    """The server: preload, then fork a launcher for each request on the socket at
    ``path``; ends when its stdin closes (the pytest process that started it is gone)."""
    _preload()
    alive = threading.active_count()
    assert alive == 1, f"the server must fork from one thread, not {alive}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    while True:
        readable, _, _ = select.select([server, sys.stdin], [], [], 1.0)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            return
        if server not in readable:
            continue
        conn, _ = server.accept()
        with conn, conn.makefile("rb") as lines:
            request = json.loads(lines.readline())
            sys.stdout.flush()
            if os.fork() == 0:
                _launch(conn, request, [server, lines])


# ----------------------------------------------------------------------------- the client


class _Server:
    """This process's warm server, started on first use."""

    def __init__(self) -> None:
        from tests.support.launch_util import REPO_ROOT, job_env

        self.dir = tempfile.mkdtemp(prefix="warm-ranks-")
        self.path = os.path.join(self.dir, "socket")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.warm_ranks", self.path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=job_env(),
            cwd=REPO_ROOT,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        line = self.proc.stdout.readline() if ready else ""
        if line != "READY\n":
            self.proc.kill()
            raise AssertionError(f"the warm rank server did not start: {line!r}")
        atexit.register(self.close)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(self.dir)


_server: _Server | None = None


def _the_server() -> _Server:
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = _Server()
    return _server


def _kill_job(pid: int) -> None:
    from tests.support.launch_util import _descendants

    for _ in range(3):
        for victim in [pid, *_descendants(pid)]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(victim, signal.SIGKILL)
        if not _descendants(pid):
            return
        time.sleep(0.05)


def run_ranks(
    nprocs: int,
    script: str | Path,
    *args: str,
    timeout: float = 120,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``script args`` on ``nprocs`` ranks forked from the warm server, with
    torchrun's environment (see the module docstring); returns a ``CompletedProcess``
    (exit status 0 if every rank's was 0, else 1) without looking at the status."""
    from tests.support.launch_util import REPO_ROOT, job_env

    cmd = ["warm-ranks", "--nproc-per-node", str(nprocs), str(script), *map(str, args)]
    with tempfile.TemporaryDirectory(prefix="warm-job-") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        out.touch()
        err.touch()
        request = {
            "script": str(script),
            "args": [str(a) for a in args],
            "nprocs": nprocs,
            "env": job_env(env),
            "cwd": str(REPO_ROOT),
            "out": str(out),
            "err": str(err),
        }
        server = _the_server()
        deadline = time.monotonic() + timeout
        launcher: int | None = None
        answer: dict[str, Any] = {}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(server.path)
            conn.sendall(json.dumps(request).encode() + b"\n")
            with conn.makefile("rb") as lines:
                try:
                    while "codes" not in answer:
                        conn.settimeout(max(deadline - time.monotonic(), 0.001))
                        line = lines.readline()
                        if not line:
                            raise AssertionError(f"{' '.join(cmd)}: the launcher ended early")
                        answer = json.loads(line)
                        launcher = answer.get("pid", launcher)
                except (TimeoutError, socket.timeout):
                    if launcher is not None:
                        _kill_job(launcher)
                    raise AssertionError(
                        f"{' '.join(cmd)} did not finish within {timeout} s (killed)\n"
                        f"--- stdout ---\n{out.read_text()}\n--- stderr ---\n{err.read_text()}"
                    ) from None
                except BaseException:
                    if launcher is not None:
                        _kill_job(launcher)
                    raise
        codes = answer["codes"]
        stderr = err.read_text()
        failed = [(rank, code) for rank, code in enumerate(codes) if code != 0]
        if failed:
            stderr += "".join(f"warm-ranks: rank {r} exited with {c}\n" for r, c in failed)
        return subprocess.CompletedProcess(cmd, 1 if failed else 0, out.read_text(), stderr)


if __name__ == "__main__":
    serve(sys.argv[1])
