"""launch/: mpirun.sh, torchrun.sh and relaunch.sh, driving a stub trainer.

tests/scripts/stub_trainer.py keeps the preemption contract in plain Python (no torch),
50 ms a step, so each job takes about a second (torchrun's start: a few more):

* a normal finish exits 0;
* SIGTERM or SIGUSR1 sent to the launch script reaches every rank, which exits with 75
  and leaves the preempted file; the script exits with 75, under torchrun too, which
  itself reports 1;
* the scripts parse, and shellcheck finds nothing in them (where it is installed);
* relaunch.sh runs attempts on 4, then 2, then 3 processes while they are preempted and
  stops at the first success; a real failure (exit code 3) is not relaunched; after
  MAX_ATTEMPTS preempted attempts it gives up with 75; a signal to relaunch.sh reaches
  the running attempt and starts no other.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.launch_util import (
    MPI_LOCAL_ENV,
    MPIEXEC,
    REPO_ROOT,
    SCRIPTS,
    finish,
    kill_tree,
    needs_mpi,
    output,
    start,
)

LAUNCH = REPO_ROOT / "launch"
STUB = SCRIPTS / "stub_trainer.py"
TIMEOUT = 60  # seconds, per job
EXIT_PREEMPTED = 75
SHELL_SCRIPTS = sorted([*LAUNCH.glob("*.sh"), *LAUNCH.glob("slurm/*.sbatch")])


def _env(run_dir: Path, **extra: str) -> dict[str, str]:
    env = {
        **MPI_LOCAL_ENV,
        "PYTHON": sys.executable,
        "TRAIN_SCRIPT": str(STUB),
        "RUN_DIR": str(run_dir),
        **extra,
    }
    if MPIEXEC is not None:
        env["MPIEXEC"] = MPIEXEC
    return env


def _run(script: str, run_dir: Path, *args: str, **env: str):
    return finish(start(["bash", str(LAUNCH / script), *args], _env(run_dir, **env)), TIMEOUT)


def _state(run_dir: Path) -> dict:
    return json.loads((run_dir / "stub_state.json").read_text())


def _wait_for_step(run_dir: Path, step: int, proc, timeout: float = 30) -> None:
    """Wait until rank 0 of the stub has recorded ``step`` (the ranks run their loop)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads((run_dir / "stub_progress.json").read_text())["step"] >= step:
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        if proc.poll() is not None:
            done = finish(proc, 5)
            raise AssertionError(f"the job ended before step {step}\n{output(done)}")
        time.sleep(0.05)
    kill_tree(proc)
    done = finish(proc, 10)
    raise AssertionError(f"step {step} not reached within {timeout} s\n{output(done)}")


def _preempted_ranks(out: str, world: int, sig: str) -> None:
    for rank in range(world):
        assert f"rank {rank}/{world} preempted at step " in out and f"by {sig}" in out, out


# ---------------------------------------------------------------- all scripts


def test_scripts_parse() -> None:
    assert len(SHELL_SCRIPTS) >= 5, SHELL_SCRIPTS
    for script in SHELL_SCRIPTS:
        proc = subprocess.run(
            ["bash", "-n", str(script)], capture_output=True, text=True, timeout=10
        )
        assert proc.returncode == 0, f"{script}: {proc.stderr}"


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_scripts_are_shellcheck_clean() -> None:
    proc = subprocess.run(
        ["shellcheck", "--external-sources", *map(str, SHELL_SCRIPTS)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------- mpirun.sh


@needs_mpi
def test_mpirun_normal_finish(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _run("mpirun.sh", run_dir, "--steps", "8", NPROCS="3")
    assert proc.returncode == 0, output(proc)
    assert _state(run_dir) == {"step": 8, "worlds": [3], "restart_counts": ["-"]}
    assert not (run_dir / "preempted.json").exists()
    for rank in range(3):
        assert f"rank {rank}/3 done at step 8" in proc.stdout, output(proc)


@needs_mpi
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=lambda s: s.name)
def test_mpirun_forwards_signal(tmp_path: Path, sig: signal.Signals) -> None:
    run_dir = tmp_path / "run"
    marker = tmp_path / "marker.json"
    marker.write_text("left over from an earlier attempt")
    job = start(
        ["bash", str(LAUNCH / "mpirun.sh"), "--steps", "100000"],
        _env(run_dir, NPROCS="2", DISTCKPT_PREEMPTED_FILE=str(marker)),
    )
    _wait_for_step(run_dir, 3, job)
    job.send_signal(sig)  # to the script only, not to its process group
    proc = finish(job, TIMEOUT)
    assert proc.returncode == EXIT_PREEMPTED, output(proc)
    _preempted_ranks(proc.stdout, 2, sig.name)
    report = json.loads(marker.read_text())
    assert report["signal"] == sig.name
    assert report["step"] == _state(run_dir)["step"] >= 3
    assert f"got {sig.name}; forwarding it to mpiexec" in proc.stderr, output(proc)


@needs_mpi
def test_mpirun_failure_keeps_exit_code(tmp_path: Path) -> None:
    proc = _run("mpirun.sh", tmp_path / "run", "--steps", "8", "--fail-at", "2", NPROCS="2")
    assert proc.returncode == 3, output(proc)


# ---------------------------------------------------------------- torchrun.sh


def test_torchrun_normal_finish(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _run("torchrun.sh", run_dir, "--steps", "5", NPROCS="2")
    assert proc.returncode == 0, output(proc)
    assert _state(run_dir)["step"] == 5 and _state(run_dir)["worlds"] == [2]


def test_torchrun_preempted_by_marker(tmp_path: Path) -> None:
    """torchrun reports the workers' 75 as 1 (and dies of SIGUSR1 itself): the script
    sends the signal to the workers and reads the preempted file.
    """
    run_dir = tmp_path / "run"
    job = start(
        ["bash", str(LAUNCH / "torchrun.sh"), "--steps", "100000"], _env(run_dir, NPROCS="2")
    )
    _wait_for_step(run_dir, 3, job)
    job.send_signal(signal.SIGUSR1)
    proc = finish(job, TIMEOUT)
    assert proc.returncode == EXIT_PREEMPTED, output(proc)
    assert "preempted (torchrun exited with 1)" in proc.stderr, output(proc)
    _preempted_ranks(proc.stdout, 2, "SIGUSR1")
    assert json.loads((run_dir / "preempted.json").read_text())["step"] >= 3


# ---------------------------------------------------------------- relaunch.sh


@needs_mpi
def test_relaunch_changes_world_size_until_done(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _run(
        "relaunch.sh", run_dir, "--steps", "10", "--preempt-after", "4",
        NPROCS_SEQUENCE="4 2 3",
    )  # fmt: skip
    assert proc.returncode == 0, output(proc)
    assert _state(run_dir) == {"step": 10, "worlds": [4, 2, 3], "restart_counts": ["-"] * 3}
    for world, step in ((4, 0), (2, 4), (3, 8)):
        assert f"rank {world - 1}/{world} start at step {step}" in proc.stdout, output(proc)
    assert "attempt 3 finished" in proc.stderr, output(proc)


@needs_mpi
def test_relaunch_does_not_repeat_a_failure(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _run("relaunch.sh", run_dir, "--steps", "10", "--fail-at", "2", NPROCS_SEQUENCE="2 3")
    assert proc.returncode == 3, output(proc)
    assert _state(run_dir)["worlds"] == [2], output(proc)
    assert "failed with exit code 3; not relaunching" in proc.stderr, output(proc)


@needs_mpi
def test_relaunch_gives_up_after_max_attempts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _run(
        "relaunch.sh", run_dir, "--steps", "100", "--preempt-after", "2",
        MAX_ATTEMPTS="2", NPROCS_COMMAND="echo 3",
    )  # fmt: skip
    assert proc.returncode == EXIT_PREEMPTED, output(proc)
    assert _state(run_dir) == {"step": 4, "worlds": [3, 3], "restart_counts": ["-"] * 2}


@needs_mpi
def test_relaunch_stops_when_signalled(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = start(
        ["bash", str(LAUNCH / "relaunch.sh"), "--steps", "100000"],
        _env(run_dir, NPROCS_SEQUENCE="2"),
    )
    _wait_for_step(run_dir, 3, job)
    job.send_signal(signal.SIGTERM)
    proc = finish(job, TIMEOUT)
    assert proc.returncode == EXIT_PREEMPTED, output(proc)
    _preempted_ranks(proc.stdout, 2, "SIGTERM")
    assert _state(run_dir)["worlds"] == [2], output(proc)
