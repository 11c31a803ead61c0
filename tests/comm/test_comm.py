"""Communicator conformance under every launcher, and no hang when a rank dies.

Each test launches tests/scripts/comm_conformance.py (many checks per launch) and
asserts every rank printed ``OK <rank>``. The pytest process never imports mpi4py.MPI.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.launch_util import (
    MPIEXEC,
    SCRIPTS,
    check,
    hydra_keeps_survivors,
    needs_mpi,
    output,
    run_mpi,
    run_mpi_survivors,
    run_single,
    run_torchrun,
)

SCRIPT = SCRIPTS / "comm_conformance.py"


def assert_all_ok(proc: subprocess.CompletedProcess[str], nprocs: int) -> None:
    check(proc)
    ranks = sorted(int(m) for m in re.findall(r"^OK (\d+)$", proc.stdout, re.MULTILINE))
    assert ranks == list(range(nprocs)), f"ranks that finished: {ranks}\n{output(proc)}"


@pytest.mark.timeout(120)
def test_single_process() -> None:
    """SingleComm, and auto() outside any launcher, without ever importing mpi4py.MPI."""
    assert_all_ok(run_single(SCRIPT, "single", "--expect", "SingleComm", timeout=100), 1)


@needs_mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("nprocs", "mode"), [(1, "auto"), (3, "mpi"), (4, "mpi")])
def test_mpi(nprocs: int, mode: str) -> None:
    """MPIComm (and auto() picking it) on COMM_WORLD and on a split of it."""
    args = [mode, "--size", str(nprocs), "--expect", "MPIComm"]
    assert_all_ok(run_mpi(nprocs, SCRIPT, *args, timeout=100), nprocs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nprocs", [2, 3])
def test_torchrun(nprocs: int) -> None:
    """TorchComm from auto(): the world group, a side group, a subgroup with and without."""
    args = ["torch", "--size", str(nprocs), "--expect", "TorchComm"]
    assert_all_ok(run_torchrun(nprocs, SCRIPT, *args, timeout=100), nprocs)


@pytest.mark.timeout(150)
def test_every_thread_distckpt_starts_is_gone_before_the_interpreter_finalizes(
    tmp_path: Path,
) -> None:
    """A save, a background save and a load on the program's own gloo world group (never
    destroyed, as Accelerate leaves it): distckpt's collectives ran on groups of its own,
    destroyed at exit, so no gloo thread of distckpt's is left when the interpreter
    finalizes (where freeing a collective's tensors can abort the process)."""
    proc = run_torchrun(2, SCRIPTS / "clean_exit.py", str(tmp_path), timeout=120)
    check(proc)
    ranks = sorted(int(m) for m in re.findall(r"^CLEAN (\d+)$", proc.stdout, re.MULTILINE))
    assert ranks == [0, 1], output(proc)


@needs_mpi
@pytest.mark.timeout(120)
def test_mpi_bootstraps_torch() -> None:
    """init_torch_from_mpi, a DTensor on a CPU DeviceMesh, then TorchComm and MPIComm."""
    assert_all_ok(run_mpi(2, SCRIPT, "mpi-torch", "--size", "2", timeout=100), 2)


DIE_TIMEOUT = "4"  # DISTCKPT_TIMEOUT for the jobs below


def _run_dying(
    launcher: str, mode: str, nprocs: int, markers: Path | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the --die job: the last rank dies or hangs before a collective; return quickly."""
    env = {"DISTCKPT_TIMEOUT": DIE_TIMEOUT}
    args = ["auto", "--die", mode, *(["--markers", str(markers)] if markers else [])]
    start = time.monotonic()
    if launcher == "mpi-survivors":
        proc = run_mpi_survivors(nprocs, SCRIPT, *args, timeout=90, env=env)
    else:
        run = run_mpi if launcher == "mpi" else run_torchrun
        proc = run(nprocs, SCRIPT, *args, timeout=90, env=env)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, output(proc)
    assert "OK " not in proc.stdout and "AWOKE" not in proc.stdout, output(proc)
    assert len(re.findall(r"^READY \d", proc.stdout, re.MULTILINE)) == nprocs, output(proc)
    # well before the sleeping rank would wake up (120 s) or the subprocess time-out
    assert elapsed < 80, f"took {elapsed:.1f} s\n{output(proc)}"
    return proc, elapsed


@needs_mpi
@pytest.mark.timeout(100)
def test_killed_rank_ends_the_job_mpi() -> None:
    """Under plain mpiexec a SIGKILLed rank takes the job down at once (hydra kills the
    others), so no survivor can be seen giving up: what this shows is that the job ends
    promptly and hydra reports the killed rank. The survivors' own time-out is shown by
    the next test."""
    proc, _ = _run_dying("mpi", "kill", 3)
    assert "Killed (signal 9)" in proc.stdout + proc.stderr, output(proc)


@pytest.mark.timeout(100)
@pytest.mark.parametrize("launcher", [pytest.param("mpi-survivors", marks=needs_mpi), "torchrun"])
def test_the_peers_of_a_dead_rank_give_up_in_time(launcher: str, tmp_path: Path) -> None:
    """The last rank dies before a collective; every other rank is seen to give up by
    itself with CommTimeoutError within DISTCKPT_TIMEOUT (and a margin). Under torchrun
    (SIGKILL; the others carry on through torchrun's SIGTERM) and ``mpiexec
    -disable-auto-cleanup`` (the rank exits without MPI_Finalize: a signal would make
    hydra kill every rank)."""
    if launcher == "mpi-survivors" and not hydra_keeps_survivors():
        pytest.fail(f"{MPIEXEC} is not MPICH's hydra (no -disable-auto-cleanup)")
    nprocs = 3
    proc, _ = _run_dying(launcher, "exit" if launcher != "torchrun" else "kill", nprocs, tmp_path)
    assert_gave_up(proc, tmp_path, list(range(nprocs - 1)))
    assert_aborted(launcher, proc, tmp_path)


def assert_gave_up(
    proc: subprocess.CompletedProcess[str], markers: Path, ranks: list[int], *, hung: bool = False
) -> None:
    """Exactly ``ranks`` left a marker of their CommTimeoutError, each in time: before
    DISTCKPT_TIMEOUT and a margin (a dead peer may be noticed at once: gloo sees its
    connection reset), and, for a ``hung`` peer, not before DISTCKPT_TIMEOUT."""
    gave_up = {
        int(p.name.removeprefix("timeout-")): p.read_text() for p in markers.glob("timeout-*")
    }
    assert sorted(gave_up) == ranks, f"{gave_up}\n{output(proc)}"
    for line in gave_up.values():
        seconds = float(line.split()[3])
        earliest = float(DIE_TIMEOUT) - 0.5 if hung else 0.0
        assert earliest <= seconds < float(DIE_TIMEOUT) + 10, output(proc)


@pytest.mark.timeout(100)
@pytest.mark.parametrize("launcher", [pytest.param("mpi", marks=needs_mpi), "torchrun"])
def test_hung_rank_times_out(launcher: str, tmp_path: Path) -> None:
    """The last rank sleeps in place of a collective: the other one gives up in time."""
    proc, _ = _run_dying(launcher, "hang", 2, tmp_path)
    assert_gave_up(proc, tmp_path, [0], hung=True)
    assert_aborted(launcher, proc, tmp_path)


def assert_aborted(launcher: str, proc: subprocess.CompletedProcess[str], markers: Path) -> None:
    """Under MPI the ranks that gave up exit normally, and MPIComm's abort at exit ends
    the job (the hung or any other rank too), not the launcher's clean-up. The rank's own
    word of it is read from its log in ``markers`` as well: hydra, tearing the job down,
    may drop what the aborting rank wrote last."""
    if launcher.startswith("mpi"):
        said = proc.stdout + proc.stderr
        logs = "".join(p.read_text() for p in markers.glob("log-*"))
        assert "aborting the MPI job" in said + logs, output(proc)
        # MPICH's own line comes from the aborting rank too; the job's exit status is
        # MPI_Abort's code (1; a rank that only gave up exits with 3, the dead one with 9)
        aborted = "application called MPI_Abort(MPI_COMM_WORLD, 1)" in said
        assert aborted or proc.returncode == 1, output(proc)
