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
  joined, ``atexit`` handlers run, MPI finalized if it was used, exit status from
  ``SystemExit`` or 1 for an exception), but for the teardown of its modules;
* as torchrun does, when a rank fails the launcher sends SIGTERM to the others, then
  SIGKILL after a grace period; the job's exit status is 0 if every rank's was, else 1;
* stdout and stderr of all ranks are collected (line buffered, one write per line, as
  under ``tests/support/whole_lines``) and returned in a ``CompletedProcess``; on
  time-out the launcher and its ranks are killed and AssertionError carries the output.

A ``plain`` job is one process with the job's environment alone (a page of the docs,
a script a test runs once). Under ``mpiexec`` the server forks each rank for the proxy
mpiexec started in its place (``tests/support/warm_proxy.py``, which hands over its
environment, pipes and MPI connection): ``launch_util.run_mpi_ranks``.

What this does not cover is the launchers themselves: torchrun's agent, restarts and
signal handling, hydra's clean-up. The tests of those (``tests/training/test_elastic.py``,
``tests/cluster``, the kill cases of ``tests/engine/test_failures.py``,
``tests/comm/test_comm.py``, the multi-node torchrun of ``tests/local``) launch the real
``torchrun`` and ``mpiexec``; ``tests/comm/test_launchers.py`` holds this module to them.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import io
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
from typing import Any, cast

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


def _install(fds: dict[int, int], closing: list[Any]) -> None:
    """Close ``closing`` and put each fd of ``fds`` at its number (the values are the
    numbers it must have), whatever numbers they have now."""
    high = {target: fcntl.fcntl(fd, fcntl.F_DUPFD, 256) for fd, target in fds.items()}
    for fd in fds:
        os.close(fd)
    for thing in closing:
        thing.close()
    for target, fd in high.items():
        os.dup2(fd, target)
        os.close(fd)


class RankExit(BaseException):
    """Raised in a forked rank once its script has run, to leave the server's frames and
    end at the top (:func:`_end_rank`)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def _run_rank(
    request: dict[str, Any], env: dict[str, str], closing: list[Any], fds: dict[int, int]
) -> int:
    """In a forked child: become the rank and run the script; its exit status. ``fds``:
    the descriptors to install (by the numbers they get), else stdout and stderr go to
    the request's files."""
    try:
        os.setsid()
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if not fds:
            fds = {
                os.open(os.devnull, os.O_RDONLY): 0,
                os.open(request["out"], os.O_WRONLY | os.O_APPEND): 1,
                os.open(request["err"], os.O_WRONLY | os.O_APPEND): 2,
            }
        _install(fds, closing)
        cast(io.TextIOWrapper, sys.stdout).reconfigure(line_buffering=True, write_through=False)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        script = os.path.abspath(request["script"])
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:1] = [os.path.dirname(script), *(p for p in extra if p not in sys.path)]
        sys.argv = [script, *request["args"]]
        import runpy

        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as error:
        return _exit_status(error)
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
        return 1


def _torchrun_env(request: dict[str, Any], port: int) -> dict[str, str]:
    """What torchrun adds to a worker's environment, but for the rank's own numbers."""
    nprocs = str(request["nprocs"])
    env = dict(request["env"])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=nprocs,
        LOCAL_WORLD_SIZE=nprocs,
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        ROLE_NAME="default",
        ROLE_WORLD_SIZE=nprocs,
        TORCHELASTIC_RUN_ID=uuid.uuid4().hex,
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    return env


def _signal_all(ranks: dict[int, int], codes: dict[int, int], sig: int) -> None:
    for pid, rank in ranks.items():
        if rank not in codes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def _wait(conn: socket.socket, ranks: dict[int, int]) -> list[int]:
    """Wait for the ranks (pid: rank) and return their exit statuses by rank. As torchrun
    does, the first failure sends SIGTERM to the others, and SIGKILL after :data:`GRACE`.
    A message on ``conn`` (``{"signal": n}``) is passed to the ranks; ``conn`` closed (the
    one who asked is gone) kills them."""
    codes: dict[int, int] = {}
    pidfds = {os.pidfd_open(pid): pid for pid in ranks}
    deadline: float | None = None
    while len(codes) < len(ranks):
        wait = None if deadline is None else max(deadline - time.monotonic(), 0)
        waiting: list[Any] = [conn, *pidfds]
        readable, _, _ = select.select(waiting, [], [], wait)
        if deadline is not None and time.monotonic() >= deadline:
            _signal_all(ranks, codes, signal.SIGKILL)
            deadline = None
        if conn in readable:
            message = conn.recv(4096)
            if not message:
                _signal_all(ranks, codes, signal.SIGKILL)
            for line in message.splitlines():
                _signal_all(ranks, codes, int(json.loads(line)["signal"]))
        for fd in [fd for fd in readable if fd in pidfds]:
            pid = pidfds.pop(fd)
            os.close(fd)
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            codes[ranks[pid]] = code
            if code != 0 and deadline is None and len(codes) < len(ranks):
                deadline = time.monotonic() + GRACE
                _signal_all(ranks, codes, signal.SIGTERM)
    return [codes[rank] for rank in range(len(ranks))]


def _launch(
    conn: socket.socket, request: dict[str, Any], fds: dict[int, int], closing: list[Any]
) -> None:
    """In a forked child: the job's launcher, in a session of its own. Forks the ranks,
    sends ``{"pid": launcher}``, waits for them (:func:`_wait`), sends ``{"codes":
    [...]}`` and ends; a rank leaves by :class:`RankExit`. For a ``torchrun`` job it hosts
    the TCPStore its ranks find at ``MASTER_ADDR:MASTER_PORT``, as torchrun's agent does."""
    try:
        os.setsid()
        mode = request["mode"]
        nprocs = int(request["nprocs"]) if mode == "torchrun" else 1
        listener = socket.create_server(("127.0.0.1", 0)) if mode == "torchrun" else None
        base = dict(request["env"])
        if listener is not None:
            base = _torchrun_env(request, listener.getsockname()[1])
        sys.stdout.flush()
        sys.stderr.flush()
        ranks: dict[int, int] = {}
        for rank in range(nprocs):
            env = base
            if mode == "torchrun":
                env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
            pid = os.fork()
            if pid == 0:
                raise RankExit(
                    _run_rank(request, env, [*closing, conn, *filter(None, [listener])], fds)
                )
            ranks[pid] = rank
        for fd in fds:
            os.close(fd)
        if listener is not None:
            import torch.distributed as dist

            store = dist.TCPStore(  # noqa: F841 (serves the ranks while this process lives)
                "127.0.0.1",
                listener.getsockname()[1],
                nprocs,
                is_master=True,
                wait_for_workers=False,
                master_listen_fd=listener.detach(),
            )
        conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
        codes = _wait(conn, ranks)
        with contextlib.suppress(OSError):  # gone: the ranks were killed, no one to tell
            conn.sendall(json.dumps({"codes": codes}).encode() + b"\n")
    except RankExit:
        raise
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    os._exit(0)


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One request: a JSON line, and the descriptors sent with it."""
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, more, _, _ = socket.recv_fds(conn, 1 << 16, 16)
        if not chunk:
            raise EOFError("the request ended early")
        data += chunk
        fds += more
    return json.loads(data), fds


def serve(path: str) -> None:
    """The server: preload, then fork a launcher for each request on the socket at
    ``path``; ends when its stdin closes (the pytest process that started it is gone).
    A request (one JSON line) names its ``mode``:

    * ``torchrun``: ``nprocs`` ranks with torchrun's environment, output to the files
      ``out`` and ``err``;
    * ``plain``: one process, the job's environment as it is, output to the files;
    * ``proxy``: one process in place of the one that asks (``warm_proxy.py``, started by
      mpiexec): with its environment, and its descriptors (``fds``: their numbers there,
      sent along) at the same numbers.
    """
    _preload()
    threads = os.listdir("/proc/self/task")
    assert len(threads) == 1, f"the server must fork from one thread, not {len(threads)}"
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
        with conn:
            try:
                request, received = _receive(conn)
            except (OSError, EOFError, ValueError):
                continue
            numbers = request.get("fds", [])
            fds = dict(zip(received, numbers, strict=True)) if numbers else {}
            if os.fork() == 0:
                _launch(conn, request, fds, [server])
            for fd in received:
                os.close(fd)


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


#: Names the socket of a warm server to the processes a test starts (the documentation
#: pages' runner, mpiexec's proxies), which then ask that server for their own jobs.
SOCKET_VARIABLE = "TESTS_WARM_RANKS_SOCKET"


def server_socket() -> str:
    """The socket of the warm server: the one ``$TESTS_WARM_RANKS_SOCKET`` names, else
    this process's own (started if it is not running)."""
    return os.environ.get(SOCKET_VARIABLE) or _the_server().path


def run_ranks(
    nprocs: int,
    script: str | Path,
    *args: str,
    timeout: float = 120,
    env: Mapping[str, str] | None = None,
    plain: bool = False,
    cwd: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``script args`` on ``nprocs`` ranks forked from the warm server, with
    torchrun's environment (see the module docstring), or (``plain``) as one process
    with the job's environment alone; returns a ``CompletedProcess`` (exit status 0 if
    every rank's was 0, else 1) without looking at the status. The job's environment is
    :func:`~tests.support.launch_util.job_env` ``(env)``, or ``environ`` as it is; it
    runs in ``cwd`` (the repository root if None)."""
    from tests.support.launch_util import REPO_ROOT, job_env
    from tests.support.launch_util import kill_pid_tree as _kill_launcher

    assert not plain or nprocs == 1, "a plain job is one process"
    cmd = ["warm-ranks", "--nproc-per-node", str(nprocs), str(script), *map(str, args)]
    with tempfile.TemporaryDirectory(prefix="warm-job-") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        out.touch()
        err.touch()
        request = {
            "mode": "plain" if plain else "torchrun",
            "script": str(script),
            "args": [str(a) for a in args],
            "nprocs": nprocs,
            "env": dict(environ) if environ is not None else job_env(env),
            "cwd": str(cwd or REPO_ROOT),
            "out": str(out),
            "err": str(err),
        }
        deadline = time.monotonic() + timeout
        launcher: int | None = None
        answer: dict[str, Any] = {}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(server_socket())
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
                except TimeoutError:
                    if launcher is not None:
                        _kill_launcher(launcher)
                    raise AssertionError(
                        f"{' '.join(cmd)} did not finish within {timeout} s (killed)\n"
                        f"--- stdout ---\n{out.read_text()}\n--- stderr ---\n{err.read_text()}"
                    ) from None
                except BaseException:
                    if launcher is not None:
                        _kill_launcher(launcher)
                    raise
        codes = answer["codes"]
        stderr = err.read_text()
        failed = [(rank, code) for rank, code in enumerate(codes) if code != 0]
        if failed:
            stderr += "".join(f"warm-ranks: rank {r} exited with {c}\n" for r, c in failed)
        return subprocess.CompletedProcess(cmd, 1 if failed else 0, out.read_text(), stderr)


def _end_rank(status: int) -> None:
    """End a rank as an interpreter ends, but for the teardown of its modules (two thirds
    of a second with torch loaded): join the non-daemon threads, run the ``atexit``
    handlers, finalize MPI if the script used it (mpi4py does that at exit), then, if it
    did, the C library's ``exit`` (its own handlers: MPICH's tells the launcher this rank
    is done)."""
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
        status = status or 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    if mpi is None:
        os._exit(status)  # torch's static destructors cost a fifth of a second, for nothing
    ctypes.PyDLL(None).exit(status)  # holds the GIL: a C handler may call into Python


if __name__ == "__main__":
    try:
        serve(sys.argv[1])
    except RankExit as done:
        _end_rank(done.status)
