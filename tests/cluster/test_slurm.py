"""launch/slurm/train.sbatch on a real (single-node, throwaway) SLURM cluster.

The job runs ``mpiexec -n 2`` (``torchrun --nproc-per-node 2`` in one case) inside a
one-task allocation. It is preempted while it trains, requeued, started again, resumes
from its checkpoint and finishes:

* the stub trainer, preempted the way ``--signal=B:USR1@60`` does it (SIGUSR1 to the
  batch shell only, by ``scancel --signal=USR1 --batch``): the batch script forwards it,
  the ranks exit with 75, the script requeues the job itself;
* the stub trainer, preempted the way SLURM's own preemption and ``scontrol requeue`` do
  it (SIGTERM to every process of the job): the ranks save within the grace time;
* examples/train_sharded.py, once distckpt has its preemption support
  (``distckpt.preemption``), preempted like the first.

A requeued job waits for its begin time: ``cred_expire`` seconds, 120 by default and 5
on this cluster (``scontrol update jobid=J starttime=now`` alone races with slurmd, which
refuses to relaunch a job whose credential it revoked within that time). The cluster is
skipped (with the reason) where SLURM is not installed, the tests do not run as root, or
the daemons do not come up within 30 s.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.launch_util import MPI_LOCAL_ENV, MPIEXEC, REPO_ROOT, SCRIPTS, needs_mpi
from tests.support.slurm_cluster import ClusterUnavailable, SlurmCluster, start_cluster

SBATCH = REPO_ROOT / "launch" / "slurm" / "train.sbatch"
STUB = SCRIPTS / "stub_trainer.py"
TRAIN = REPO_ROOT / "examples" / "train_sharded.py"

pytestmark = [needs_mpi, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    try:
        cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    except ClusterUnavailable as e:
        pytest.skip(f"no SLURM cluster: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()


def _submit(
    slurm: SlurmCluster, tmp_path: Path, script: Path, *args: str, launcher: str = "mpirun"
) -> tuple[str, Path]:
    """Submit train.sbatch (2 ranks in one task); return (job id, log file)."""
    log = tmp_path / "job.out"
    env = {
        **MPI_LOCAL_ENV,
        "REPO_DIR": str(REPO_ROOT),
        "PYTHON": sys.executable,
        "MPIEXEC": str(MPIEXEC),
        "LAUNCHER": launcher,
        "NPROCS": "2",
        "TRAIN_SCRIPT": str(script),
        "RUN_DIR": str(tmp_path / "run"),
    }
    job_id = slurm.submit(
        "--ntasks=1", f"--output={log}", f"--chdir={tmp_path}", str(SBATCH), *args, env=env
    )
    return job_id, log


def _wait_for(what: str, ready: Callable[[], bool], timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.1)
    text = log.read_text() if log.exists() else "<no job output>"
    raise AssertionError(f"{what}: not within {timeout} s\n--- job output ---\n{text}")


def _stub_step(tmp_path: Path) -> int:
    try:
        return json.loads((tmp_path / "run" / "stub_progress.json").read_text())["step"]
    except (FileNotFoundError, json.JSONDecodeError):
        return -1


def _requeued_and_done(slurm: SlurmCluster, job_id: str, log: Path, timeout: float) -> str:
    """Wait for the requeue and for the job to run again and complete; the job log.

    The cluster's ``cred_expire=5`` makes a requeued job eligible after about 5 s; moving
    its start to now (``scontrol update jobid=J starttime=now``) is not enough, since
    slurmd refuses to relaunch a job whose credential it revoked less than that ago.
    """
    slurm.wait_job(
        job_id,
        lambda j: j.get("Restarts") == "1" and j.get("JobState") == "PENDING",
        timeout=20,
        what="requeued",
    )
    job = slurm.wait_job(
        job_id,
        lambda j: j.get("JobState") not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING"),
        timeout=timeout,
        what="finished after the requeue",
    )
    text = log.read_text()
    assert job.get("JobState") == "COMPLETED" and job.get("ExitCode") == "0:0", (
        f"{job}\n{text}\n{slurm.logs(60)}"
    )
    assert job.get("Restarts") == "1", f"{job}\n{text}"
    assert "(restart count 0)" in text and "(restart count 1)" in text, text
    return text


@pytest.mark.parametrize("launcher", ["mpirun", "torchrun"])
def test_requeued_after_usr1_to_batch_shell(
    slurm: SlurmCluster, tmp_path: Path, launcher: str
) -> None:
    job_id, log = _submit(slurm, tmp_path, STUB, "--steps", "80", launcher=launcher)
    _wait_for("stub at step 5", lambda: _stub_step(tmp_path) >= 5, 30, log)
    slurm.check("scancel", "--signal=USR1", "--batch", job_id)
    text = _requeued_and_done(slurm, job_id, log, timeout=60)

    state = json.loads((tmp_path / "run" / "stub_state.json").read_text())
    assert state["step"] == 80 and state["worlds"] == [2, 2], text
    assert state["restart_counts"] == ["-", "1"], text  # SLURM sets it from the first requeue
    resumed = re.search(r"rank 0/2 start at step (\d+)", text.split("(restart count 1)")[1])
    assert resumed and 5 <= int(resumed.group(1)) < 80, text
    assert f"rank 0/2 preempted at step {resumed.group(1)} by SIGUSR1" in text, text
    assert "rank 1/2 preempted at step" in text, text
    assert "[train.sbatch] got SIGUSR1; forwarding it to the launcher" in text, text
    assert f"preempted; requeueing job {job_id}" in text, text


def test_requeued_by_scontrol(slurm: SlurmCluster, tmp_path: Path) -> None:
    """``scontrol requeue`` (like preemption by SLURM) signals every process of the job
    with SIGTERM; the ranks stop at a step boundary well within KillWait.
    """
    job_id, log = _submit(slurm, tmp_path, STUB, "--steps", "80")
    _wait_for("stub at step 5", lambda: _stub_step(tmp_path) >= 5, 30, log)
    slurm.check("scontrol", "requeue", job_id)
    text = _requeued_and_done(slurm, job_id, log, timeout=60)

    state = json.loads((tmp_path / "run" / "stub_state.json").read_text())
    assert state["step"] == 80 and state["worlds"] == [2, 2], text
    assert "rank 0/2 preempted at step" in text and "by SIGTERM" in text, text
    resumed = re.search(r"rank 0/2 start at step (\d+)", text.split("(restart count 1)")[1])
    assert resumed and int(resumed.group(1)) >= 5, text


def test_train_sharded_requeued_and_resumed(slurm: SlurmCluster, tmp_path: Path) -> None:
    steps = 300
    job_id, log = _submit(
        slurm, tmp_path, TRAIN, "--steps", str(steps), "--every", "20", "--global-batch", "12"
    )
    first = tmp_path / "run" / "ckpt-1"
    _wait_for("the first checkpoint", first.exists, 60, log)
    slurm.check("scancel", "--signal=USR1", "--batch", job_id)
    text = _requeued_and_done(slurm, job_id, log, timeout=60)

    before, after = text.split("(restart count 1)", 1)
    preempted = re.search(r"step (\d+): preempted; saved", before)
    restored = re.search(r"Restored from \S+ at step (\d+) onto 2 rank\(s\)", after)
    assert preempted and restored, text
    assert 20 <= int(restored.group(1)) == int(preempted.group(1)) < steps, text
    assert f"Done: step {steps} on 2 rank(s)." in after, text
    assert f"preempted; requeueing job {job_id}" in text, text
