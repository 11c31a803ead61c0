"""Save on N ranks, restore on M ranks, with real processes: N, M in 1..4.

Every world size saves once under each launcher and every checkpoint is restored on
every world size (tests/scripts/matrix.py does the work, checks every value bit for bit
and prints ``OK <rank>``); a launch both restores and saves where it can, since each
costs seconds on a small machine:

* ``mpiexec`` on 1..4 ranks saves ``mpi/n1..n4`` (``MPIComm``, torch started from MPI);
* ``torchrun --standalone`` on M = 1..4 ranks (``comm=None``, so ``auto()`` picks torch's
  group) restores all of ``mpi/``, then saves ``torchrun/nM``;
* ``mpiexec`` on M = 1..4 ranks restores all of ``torchrun/`` and of ``mpi/``;
* one plain process (no launcher at all, ``SingleComm``) restores all eight.

So each launcher's saves on every N are restored on every M, under ``mpiexec`` and (the
``mpi/`` ones) under ``torchrun``. Without mpiexec, the torchrun launches restore
``torchrun/`` in a second round instead.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.launch_util import (
    HAVE_MPIEXEC,
    SCRIPTS,
    assert_all_ok,
    needs_mpi,
    run_mpi_ranks,
    run_ranks,
    run_single,
)

SCRIPT = SCRIPTS / "matrix.py"
SIZES = (1, 2, 3, 4)
LAUNCH_TIMEOUT = 120  # seconds per launch (a loaded 2-core machine needs ~5-25 s)
#: distckpt's collective time-out in the jobs: a dead rank fails the launch, not the clock
JOB_ENV = {"DISTCKPT_TIMEOUT": "60"}
TEST_TIMEOUT = 10 * LAUNCH_TIMEOUT  # a test may also run both fixtures (8 launches)


def restore_args(*sets: Path) -> list[str]:
    """``restore DIR 1 2 3 4 [DIR2 1 2 3 4 ...]``."""
    args = ["restore"]
    for root in sets:
        args += [str(root), *(str(n) for n in SIZES)]
    return args


@pytest.fixture(scope="module")
def matrix_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("matrix")


@pytest.fixture(scope="module")
def mpi_saved(matrix_root: Path) -> Path:
    """Checkpoints n1..n4 saved under mpiexec on 1..4 ranks."""
    if not HAVE_MPIEXEC:
        pytest.skip("mpiexec not found (pip install mpich)")
    root = matrix_root / "mpi"
    for n in SIZES:
        assert_all_ok(
            run_mpi_ranks(n, SCRIPT, "save", str(root), timeout=LAUNCH_TIMEOUT, env=JOB_ENV), n
        )
    return root


@pytest.fixture(scope="module")
def torchrun_launches(
    request: pytest.FixtureRequest, matrix_root: Path
) -> dict[int, subprocess.CompletedProcess[str]]:
    """torchrun on M = 1..4 ranks: each restores the checkpoints saved under mpiexec (if
    there is an mpiexec), then saves ``torchrun/nM``; the launches, by M (each test
    checks its own). Without mpiexec, a second round restores ``torchrun/``."""
    root = matrix_root / "torchrun"
    mpi = request.getfixturevalue("mpi_saved") if HAVE_MPIEXEC else None
    launches = {}
    for m in SIZES:
        restore = restore_args(mpi) if mpi is not None else []
        args = [*restore, "save", str(root)]
        launches[m] = run_ranks(m, SCRIPT, *args, timeout=LAUNCH_TIMEOUT, env=JOB_ENV)
    if mpi is None:
        for m in SIZES:
            args = restore_args(root)
            again = run_ranks(m, SCRIPT, *args, timeout=LAUNCH_TIMEOUT, env=JOB_ENV)
            if launches[m].returncode == 0:
                launches[m] = again
    return launches


@pytest.fixture(scope="module")
def torch_saved(matrix_root: Path, torchrun_launches: dict[int, Any]) -> Path:
    """Checkpoints n1..n4 saved under torchrun on 1..4 ranks."""
    return matrix_root / "torchrun"


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("m", SIZES, ids=[f"M{m}" for m in SIZES])
def test_matrix_torchrun(torchrun_launches: dict[int, Any], m: int) -> None:
    """torchrun on M ranks restored the mpiexec saves of every N, and saved its own."""
    assert_all_ok(torchrun_launches[m], m)


@needs_mpi
@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("m", SIZES, ids=[f"M{m}" for m in SIZES])
def test_matrix_mpiexec(mpi_saved: Path, torch_saved: Path, m: int) -> None:
    """mpiexec on M ranks restores the torchrun and the mpiexec saves of every N."""
    args = restore_args(torch_saved, mpi_saved)
    assert_all_ok(run_mpi_ranks(m, SCRIPT, *args, timeout=LAUNCH_TIMEOUT, env=JOB_ENV), m)


@pytest.mark.timeout(TEST_TIMEOUT)
def test_single_process_restores_all(request: pytest.FixtureRequest, torch_saved: Path) -> None:
    """No launcher at all: one process restores every checkpoint, from either launcher."""
    sets = [torch_saved]
    if HAVE_MPIEXEC:
        sets.insert(0, request.getfixturevalue("mpi_saved"))
    proc = run_single(SCRIPT, *restore_args(*sets), timeout=LAUNCH_TIMEOUT, env=JOB_ENV)
    assert_all_ok(proc, 1)
