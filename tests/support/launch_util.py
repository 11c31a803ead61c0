"""Launch test scripts as multi-process jobs (mpiexec, torchrun) or as one process.

Every launcher here:

* runs the interpreter of the test session (``sys.executable``) and, for MPI, the
  ``mpiexec`` installed next to it (the ``mpich`` wheel), else the one on ``PATH``;
* gives the job a clean environment: the inherited environment minus any launcher
  variables (``PMI_*``, ``PMIX_*``, ``OMPI_*``, ``HYDRA_*``, ``MPI_LOCAL*``, torchrun's
  ``RANK``/``WORLD_SIZE``/``MASTER_*``/``TORCHELASTIC_*`` ...), plus ``OMP_NUM_THREADS=1``,
  ``GLOO_SOCKET_IFNAME=lo``, the repository root on ``PYTHONPATH``, and
  :data:`WHOLE_LINES` too, so that each line a process prints is one write and the ranks'
  lines never run together (``PYTHONUNBUFFERED`` is dropped: it writes a ``print``'s
  newline apart from its text); then ``env`` (yours) on top;
* for ``mpiexec`` also ``HYDRA_LAUNCHER=fork`` (ranks are local processes, no ssh);
* captures stdout and stderr as text and returns the ``CompletedProcess`` without
  looking at the return code (see :func:`check`); :func:`start` and :func:`finish` do
  the same in two halves, for a test that acts on the job while it runs;
* on time-out kills the launcher and every process it started (hydra and torchrun put
  each rank in its own session, so the whole process tree is killed, not a process
  group), then raises AssertionError with the output captured so far.

Scripts print what the test checks (e.g. a final ``OK <rank>`` line per rank).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

# Jobs whose ranks are forked from a warm interpreter with torchrun's environment
# (tests/support/warm_ranks.py, which imports only the standard library at its top).
from tests.support.warm_ranks import run_ranks as run_ranks

#: The repository, tests/ and the rank scripts (tests/support/launch_util.py is here).
REPO_ROOT = Path(__file__).resolve().parents[2]
TESTS = REPO_ROOT / "tests"
SCRIPTS = TESTS / "scripts"
#: On every job's ``PYTHONPATH``: its ``sitecustomize`` makes stdout line buffered.
WHOLE_LINES = TESTS / "support" / "whole_lines"
#: What mpiexec starts for each rank of :func:`run_mpi_ranks`.
WARM_PROXY = TESTS / "support" / "warm_proxy.py"


def _find_mpiexec() -> str | None:
    local = Path(sys.executable).parent / "mpiexec"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("mpiexec")


MPIEXEC: str | None = _find_mpiexec()
HAVE_MPIEXEC: bool = MPIEXEC is not None
#: For mpiexec: start ranks as local processes, never over ssh (MPICH's hydra reads
#: HYDRA_LAUNCHER); let Open MPI, if that is the mpiexec found, run more ranks than cores.
MPI_LOCAL_ENV: dict[str, str] = {
    "HYDRA_LAUNCHER": "fork",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
}
needs_mpi = pytest.mark.skipif(not HAVE_MPIEXEC, reason="mpiexec not found (pip install mpich)")

_SCRUB_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPI_LOCAL", "MPIR_", "TORCHELASTIC_")
_SCRUB_NAMES = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_NAME",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    }
)


def whole_lines_path(pythonpath: str = "") -> str:
    """``pythonpath`` with the repository root and :data:`WHOLE_LINES` in front."""
    rest = [p for p in pythonpath.split(os.pathsep) if p]
    return os.pathsep.join([str(REPO_ROOT), str(WHOLE_LINES), *rest])


def job_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment every launcher here gives its job (see the module docstring)."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_SCRUB_PREFIXES) and k not in _SCRUB_NAMES
    }
    clean.pop("PYTHONUNBUFFERED", None)
    clean.update(
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        PYTHONPATH=whole_lines_path(clean.get("PYTHONPATH", "")),
    )
    clean.update(env or {})
    return clean


def _descendants(pid: int) -> list[int]:
    """``pid``'s descendant processes (Linux /proc; empty elsewhere), deepest last."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name (field 2) may hold spaces and parentheses: split after the last ')'
        fields = stat[stat.rfind(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_pid_tree(pid: int, ended: Callable[[], bool] = lambda: True) -> None:
    """SIGKILL ``pid`` and everything it started, collecting the tree before killing;
    ``ended`` says (and reaps) whether ``pid`` itself is gone, where it is our child."""
    for _ in range(3):  # again, in case something forked while we looked
        victims = [pid, *_descendants(pid)]
        for victim in victims:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(victim, signal.SIGKILL)
        if ended() and not _descendants(pid):
            break
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def kill_tree(proc: subprocess.Popen[str]) -> None:
    """SIGKILL ``proc`` and everything it started (:func:`kill_pid_tree`)."""
    kill_pid_tree(proc.pid, lambda: proc.poll() is not None)


def start(cmd: list[str], env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``cmd`` in the background in its own session, with :func:`job_env` ``(env)``,
    in the repository root, output captured; collect it with :func:`finish`.
    """
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=job_env(env),
        cwd=REPO_ROOT,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Wait for a job from :func:`start`; on time-out kill its tree and raise AssertionError."""
    cmd = [str(a) for a in proc.args] if isinstance(proc.args, list) else [str(proc.args)]
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a grandchild kept a pipe open
            out, err = "<unavailable>", "<unavailable>"
        raise AssertionError(
            f"{' '.join(cmd)} did not finish within {timeout} s (killed)\n"
            f"--- stdout ---\n{out}\n--- stderr ---\n{err}"
        ) from None
    except BaseException:
        kill_tree(proc)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _run(
    cmd: list[str], timeout: float, env: Mapping[str, str] | None
) -> subprocess.CompletedProcess[str]:
    return finish(start(cmd, env), timeout)


def mpiexec_command(nprocs: int, script: str | Path, *args: str) -> list[str]:
    """``mpiexec -n nprocs python script args`` (the mpiexec found, this interpreter)."""
    assert MPIEXEC is not None, "mpiexec not found"
    return [MPIEXEC, "-n", str(nprocs), sys.executable, str(script), *args]


def torchrun_command(nprocs: int, script: str | Path, *args: str) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N script args``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nprocs),
        str(script),
        *args,
    ]


def run_mpi(
    nprocs: int,
    script: str | Path,
    *args: str,
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``mpiexec -n nprocs python script args`` (see the module docstring)."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    cmd = mpiexec_command(nprocs, script, *args)
    return _run(cmd, timeout, {**MPI_LOCAL_ENV, **(env or {})})


def warm_mpi_rank(script: str | Path, *args: str) -> tuple[list[str], dict[str, str]]:
    """What mpiexec starts for a rank forked warm (``tests/support/warm_proxy.py``, which
    hands the rank's MPI connection and pipes to a fork of the warm server), and the
    variable that names the server, for the job's environment."""
    from tests.support.warm_ranks import SOCKET_VARIABLE, server_socket

    argv = [sys.executable, str(WARM_PROXY), str(script), *args]
    return argv, {SOCKET_VARIABLE: server_socket()}


def run_mpi_ranks(
    nprocs: int,
    script: str | Path,
    *args: str,
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """:func:`run_mpi` with each rank forked from a warm interpreter that has torch loaded
    (:func:`warm_mpi_rank`): a job whose subject is distckpt, not the launcher."""
    (_, proxy, *rest), warm = warm_mpi_rank(script, *args)
    return run_mpi(nprocs, proxy, *rest, timeout=timeout, env={**warm, **(env or {})})


def run_torchrun(
    nprocs: int,
    script: str | Path,
    *args: str,
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m torch.distributed.run --standalone --nproc-per-node N script args``."""
    cmd = torchrun_command(nprocs, script, *args)
    return _run(cmd, timeout, env)


def run_single(
    script: str | Path,
    *args: str,
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python script args`` as one process, with the same environment handling."""
    return _run([sys.executable, str(script), *args], timeout, env)


def output(proc: subprocess.CompletedProcess[str]) -> str:
    """stdout and stderr of a finished job, labelled, for assertion messages."""
    return f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"


def check(proc: subprocess.CompletedProcess[str]) -> None:
    """Assert the job exited with 0; the message holds the command and all its output."""
    cmd = proc.args if isinstance(proc.args, str) else " ".join(map(str, proc.args))
    assert proc.returncode == 0, f"{cmd}\nexited with {proc.returncode}\n{output(proc)}"


def assert_all_ok(proc: subprocess.CompletedProcess[str], nprocs: int) -> None:
    """Assert the job exited with 0, printed no ``FAIL`` line and ``OK <rank>`` for every
    one of its ``nprocs`` ranks (the scripts' convention)."""
    check(proc)
    assert "FAIL " not in proc.stdout, output(proc)
    ranks = sorted(int(m) for m in re.findall(r"^OK (\d+)$", proc.stdout, re.MULTILINE))
    assert ranks == list(range(nprocs)), f"ranks that finished: {ranks}\n{output(proc)}"


def cases(proc: subprocess.CompletedProcess[str]) -> dict[str, dict[int, dict[str, Any]]]:
    """The ``CASE {json}`` records a job's ranks printed, by case and rank."""
    found: dict[str, dict[int, dict[str, Any]]] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CASE "):
            record = json.loads(line[5:])
            found.setdefault(record["case"], {})[record["rank"]] = record
    return found


def load_script(path: Path, name: str) -> ModuleType:
    """A script of ``SCRIPTS`` imported as module ``name`` (its values and helpers), not
    run. Its folder is first on ``sys.path`` while it is imported, as when it runs, so
    that its own imports (``rank``) are found."""
    loaded = sys.modules.get(name)
    if loaded is not None and Path(loaded.__file__ or "") == Path(path):
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    folder = str(Path(path).resolve().parent)
    sys.path.insert(0, folder)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.path.remove(folder)
    return module


def hydra_keeps_survivors() -> bool:
    """The mpiexec found is MPICH's hydra, which can leave the other ranks running when
    one ends without MPI_Finalize (``-disable-auto-cleanup``)."""
    if MPIEXEC is None:
        return False
    usage = subprocess.run([MPIEXEC, "-h"], capture_output=True, text=True, timeout=30)
    return "-disable-auto-cleanup" in usage.stdout + usage.stderr


def run_mpi_survivors(
    nprocs: int, script: str | Path, *args: str, timeout: float, env: Mapping[str, str]
) -> subprocess.CompletedProcess[str]:
    """``mpiexec -disable-auto-cleanup``: the other ranks live on when one ends without
    MPI_Finalize (but not when a signal kills it: hydra then SIGKILLs every rank)."""
    cmd = mpiexec_command(nprocs, script, *args)
    cmd.insert(1, "-disable-auto-cleanup")
    return finish(start(cmd, {**MPI_LOCAL_ENV, **env}), timeout)


@contextlib.contextmanager
def bounded(seconds: int, what: str = "this") -> Iterator[None]:
    """Fail with TimeoutError (raised in the main thread, interrupting a blocking call)
    if the block takes more than ``seconds``: a hang becomes a failure."""

    def expired(signum: int, frame: Any) -> None:
        raise TimeoutError(f"{what} took more than {seconds} s")

    # An outer time-out (pytest-timeout's, on the same timer) is kept: restored after
    # the block with what is left of it, or left alone if it comes first.
    began = time.monotonic()
    old = signal.signal(signal.SIGALRM, expired)
    outer, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    if 0 < outer < seconds:
        signal.setitimer(signal.ITIMER_REAL, outer, interval)
        signal.signal(signal.SIGALRM, old)
    try:
        yield
    finally:
        if not 0 < outer < seconds:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
            if outer > 0:
                left = max(outer - (time.monotonic() - began), 0.001)
                signal.setitimer(signal.ITIMER_REAL, left, interval)
