"""Save on N ranks, restore on M ranks, with real processes: N, M in 1..4.

Checkpoints are saved once per module (one launch per world size and launcher, see the
fixtures), then every restore launch restores all four of them and checks every value
bit for bit (tests/scripts/matrix.py does the work and prints ``OK <rank>``).

* ``mpiexec``: saved and restored on 1..4 ranks (``MPIComm``, torch started from MPI);
* ``torchrun --standalone``: the same (``comm=None``, so ``auto()`` picks torch's group);
* across launchers: the torchrun restore on 3 ranks (``test_matrix_torchrun[M3+mpi-saved]``)
  also restores the checkpoints saved under ``mpiexec``, and the single-process restore
  restores both sets;
* one plain process (no launcher at all, ``SingleComm``) restores all eight.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.launch_util import (
    HAVE_MPIEXEC,
    SCRIPTS,
    assert_all_ok,
    needs_mpi,
    run_mpi,
    run_single,
    run_torchrun,
)

SCRIPT = SCRIPTS / "matrix.py"
SIZES = (1, 2, 3, 4)
LAUNCH_TIMEOUT = 120  # seconds per launch (a loaded 2-core machine needs ~5-25 s)
#: distckpt's collective time-out in the jobs: a dead rank fails the launch, not the clock
JOB_ENV = {"DISTCKPT_TIMEOUT": "60"}
TEST_TIMEOUT = 10 * LAUNCH_TIMEOUT  # a test may also run both fixtures (8 save launches)


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
        assert_all_ok(run_mpi(n, SCRIPT, "save", str(root), timeout=LAUNCH_TIMEOUT, env=JOB_ENV), n)
    return root


@pytest.fixture(scope="module")
def torch_saved(matrix_root: Path) -> Path:
    """Checkpoints n1..n4 saved under torchrun on 1..4 ranks."""
    root = matrix_root / "torchrun"
    for n in SIZES:
        assert_all_ok(
            run_torchrun(n, SCRIPT, "save", str(root), timeout=LAUNCH_TIMEOUT, env=JOB_ENV), n
        )
    return root


@needs_mpi
@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("m", SIZES, ids=[f"M{m}" for m in SIZES])
def test_matrix_mpiexec(mpi_saved: Path, m: int) -> None:
    proc = run_mpi(m, SCRIPT, *restore_args(mpi_saved), timeout=LAUNCH_TIMEOUT, env=JOB_ENV)
    assert_all_ok(proc, m)


#: On 3 ranks, torchrun also restores the checkpoints saved under mpiexec (cross-launcher),
#: folded into that launch to save one (launches cost seconds each on a small machine).
CROSS_M = 3


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize(
    "m", SIZES, ids=[f"M{m}+mpi-saved" if m == CROSS_M else f"M{m}" for m in SIZES]
)
def test_matrix_torchrun(request: pytest.FixtureRequest, torch_saved: Path, m: int) -> None:
    sets = [torch_saved]
    if m == CROSS_M and HAVE_MPIEXEC:  # saved under mpiexec, restored under torchrun
        sets.append(request.getfixturevalue("mpi_saved"))
    proc = run_torchrun(m, SCRIPT, *restore_args(*sets), timeout=LAUNCH_TIMEOUT, env=JOB_ENV)
    assert_all_ok(proc, m)


@pytest.mark.timeout(TEST_TIMEOUT)
def test_single_process_restores_all(request: pytest.FixtureRequest, torch_saved: Path) -> None:
    """No launcher at all: one process restores every checkpoint, from either launcher."""
    sets = [torch_saved]
    if HAVE_MPIEXEC:
        sets.insert(0, request.getfixturevalue("mpi_saved"))
    proc = run_single(SCRIPT, *restore_args(*sets), timeout=LAUNCH_TIMEOUT, env=JOB_ENV)
    assert_all_ok(proc, 1)
