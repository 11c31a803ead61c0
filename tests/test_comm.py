"""Communicator conformance under every launcher, and no hang when a rank dies.

Each test launches tests/scripts/comm_conformance.py (many checks per launch) and
asserts every rank printed ``OK <rank>``. The pytest process never imports mpi4py.MPI.
"""

from __future__ import annotations

import re
import subprocess
import time

import pytest
from launch_util import (
    SCRIPTS,
    check,
    needs_mpi,
    output,
    run_mpi,
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


@needs_mpi
@pytest.mark.timeout(120)
def test_mpi_bootstraps_torch() -> None:
    """init_torch_from_mpi, a DTensor on a CPU DeviceMesh, then TorchComm and MPIComm."""
    assert_all_ok(run_mpi(2, SCRIPT, "mpi-torch", "--size", "2", timeout=100), 2)


DIE_TIMEOUT = "4"  # DISTCKPT_TIMEOUT for the jobs below


def _run_dying(
    launcher: str, mode: str, nprocs: int
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the --die job: the last rank dies or hangs before a collective; return quickly."""
    env = {"DISTCKPT_TIMEOUT": DIE_TIMEOUT}
    run = run_mpi if launcher == "mpi" else run_torchrun
    start = time.monotonic()
    proc = run(nprocs, SCRIPT, "auto", "--die", mode, timeout=90, env=env)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, output(proc)
    assert "OK " not in proc.stdout and "AWOKE" not in proc.stdout, output(proc)
    assert len(re.findall(r"^READY \d", proc.stdout, re.MULTILINE)) == nprocs, output(proc)
    # well before the sleeping rank would wake up (120 s) or the subprocess time-out
    assert elapsed < 80, f"took {elapsed:.1f} s\n{output(proc)}"
    return proc, elapsed


@pytest.mark.timeout(100)
@pytest.mark.parametrize("launcher", [pytest.param("mpi", marks=needs_mpi), "torchrun"])
def test_killed_rank_does_not_hang(launcher: str) -> None:
    _run_dying(launcher, "kill", 3)


@pytest.mark.timeout(100)
@pytest.mark.parametrize("launcher", [pytest.param("mpi", marks=needs_mpi), "torchrun"])
def test_hung_rank_times_out(launcher: str) -> None:
    proc, _ = _run_dying(launcher, "hang", 2)
    timed_out = re.findall(r"^TIMEOUT (\d) after ([\d.]+) s", proc.stdout, re.MULTILINE)
    assert timed_out, output(proc)
    for _, seconds in timed_out:
        assert float(DIE_TIMEOUT) - 0.5 <= float(seconds) < float(DIE_TIMEOUT) + 10, output(proc)
