"""The warm launchers of the test suite give a job what torchrun and mpiexec give it.

Most multi-process tests fork their ranks from an interpreter that has torch loaded
(``tests/support/warm_ranks.py``); these tests hold that launcher to the real ones: the
same variables as torchrun's workers, the script run as ``__main__``, gloo and MPI
collectives across the ranks, a failing rank ending the job as under torchrun, a hung
job killed at its deadline, MPI exit statuses, kills and signals passed through the
proxy as mpiexec passes them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from tests.support.launch_util import (
    MPI_LOCAL_ENV,
    MPIEXEC,
    SCRIPTS,
    finish,
    needs_mpi,
    output,
    run_mpi_ranks,
    run_ranks,
    run_torchrun,
    start,
    warm_mpi_rank,
)

SCRIPT = SCRIPTS / "launcher_probe.py"
#: torchrun's variables that the warm ranks do not set: where torchrun's agent writes a
#: failed worker's error (``torch.distributed.elastic``'s ``@record``), and the signals
#: the agent handles. No script of the suite reads either.
AGENT_ONLY = {"TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE"}
#: Values that differ between two launches of any launcher.
PER_LAUNCH = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}


def seen(stdout: str) -> dict[int, dict]:
    found = {}
    for line in stdout.splitlines():
        if line.startswith("ENV "):
            rank, record = line[4:].split(" ", 1)
            found[int(rank)] = json.loads(record)
    return found


@pytest.mark.timeout(200)
def test_warm_ranks_see_what_torchrun_workers_see() -> None:
    real = run_torchrun(3, SCRIPT, "env", "a b", timeout=150)
    warm = run_ranks(3, SCRIPT, "env", "a b", timeout=150)
    for proc in (real, warm):
        assert proc.returncode == 0, output(proc)
        assert sorted(int(m) for m in re.findall(r"^OK (\d)$", proc.stdout, re.M)) == [0, 1, 2]
    by_torchrun, by_warm = seen(real.stdout), seen(warm.stdout)
    assert sorted(by_warm) == [0, 1, 2], output(warm)
    for rank in range(3):
        torchrun_env, warm_env = by_torchrun[rank].pop("env"), by_warm[rank].pop("env")
        assert set(torchrun_env) - AGENT_ONLY <= set(warm_env), (torchrun_env, warm_env)
        for name in set(torchrun_env) - AGENT_ONLY - PER_LAUNCH:
            assert warm_env[name] == torchrun_env[name], (name, torchrun_env, warm_env)
        # argv, __main__, the script's folder first on sys.path, and the all_reduce
        assert (
            by_warm[rank]
            == by_torchrun[rank]
            == {
                "argv": ["env", "a b"],
                "name": "__main__",
                "path0": str(SCRIPTS),
                "sum": 6,
            }
        )


@pytest.mark.timeout(120)
def test_a_failing_rank_ends_the_others_and_the_job_as_under_torchrun() -> None:
    proc = run_ranks(3, SCRIPT, "fail", timeout=100)
    assert proc.returncode == 1, output(proc)
    assert "rank 1 exited with 3" in proc.stderr, output(proc)
    # the others, stuck in a barrier, were sent SIGTERM
    assert "rank 0 exited with -15" in proc.stderr, output(proc)
    assert "rank 2 exited with -15" in proc.stderr, output(proc)


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True  # dead, not yet reaped
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(120)
def test_a_hung_job_is_killed_at_its_deadline() -> None:
    with pytest.raises(AssertionError, match=r"did not finish within 5 s \(killed\)") as hung:
        run_ranks(2, SCRIPT, "hang", timeout=5)
    pids = [int(p) for p in re.findall(r"^PID \d (\d+)$", str(hung.value), re.M)]
    assert len(pids) == 2, str(hung.value)
    assert all(_gone(pid, 30) for pid in pids), pids


@needs_mpi
@pytest.mark.timeout(150)
def test_mpi_ranks_through_the_proxy() -> None:
    proc = run_mpi_ranks(3, SCRIPT, "mpi", timeout=100)
    assert proc.returncode == 0, output(proc)
    assert sorted(re.findall(r"^MPI (\d) 3 6$", proc.stdout, re.M)) == ["0", "1", "2"]

    exited = run_mpi_ranks(3, SCRIPT, "mpi-exit", timeout=100)
    assert exited.returncode == 5, output(exited)  # mpiexec's status: the rank's

    killed = run_mpi_ranks(3, SCRIPT, "mpi-kill", timeout=100)
    assert killed.returncode != 0, output(killed)
    assert "signal 9" in killed.stdout + killed.stderr, output(killed)


@needs_mpi
@pytest.mark.timeout(150)
def test_a_signal_to_mpiexec_reaches_the_ranks() -> None:
    rank, warm = warm_mpi_rank(SCRIPT, "mpi-signal")
    assert MPIEXEC is not None
    job = start([MPIEXEC, "-n", "2", *rank], {**MPI_LOCAL_ENV, **warm})
    assert job.stdout is not None
    ready = 0
    while ready < 2:
        line = job.stdout.readline()
        assert line, "the ranks ended before they were ready"
        ready += line.startswith("READY ")
    os.kill(job.pid, signal.SIGUSR1)  # hydra passes it to each rank's process
    done = finish(job, timeout=100)
    assert done.returncode == 0, output(done)
    assert sorted(re.findall(r"^OK (\d)$", done.stdout, re.M)) == ["0", "1"], output(done)
