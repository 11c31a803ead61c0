"""Elastic resume, end to end: preempted under mpiexec on 4 ranks, resumed under torchrun.

``examples/train_sharded.py`` trains deterministically with a global batch of 12 samples
(divisible by 2, 3 and 4). The reference is an uninterrupted 4-rank run. Then:

1. 4 ranks (mpiexec): SIGTERM to *one* rank at a random step; every rank saves at the
   next step boundary and the job exits with ``EXIT_PREEMPTED``; the marker file names
   the saved step, which is also the newest checkpoint's.
2. a copy of that run directory resumes on 4 ranks to the end: bit-identical to the
   reference (same world size).
3. the original resumes on 2 ranks (torchrun), is preempted again at a random step (exit
   code lost by torchrun, the marker file tells), then resumes on 3 ranks to the end:
   within 1e-6 of the reference, relative to the parameters' norm.

Each resumed run must start from the saved step. The random steps are drawn from a seed
printed in every assertion message.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.support.launch_util import (
    MPI_LOCAL_ENV,
    MPIEXEC,
    REPO_ROOT,
    _descendants,
    job_env,
    kill_tree,
    mpiexec_command,
    torchrun_command,
)

EXAMPLE = REPO_ROOT / "examples" / "train_sharded.py"
STEPS, EVERY, BATCH = 48, 4, 12
EXIT_PREEMPTED = 75
SEED = int(os.environ.get("DISTCKPT_TEST_SEED", random.randrange(1 << 30)))


def _command(launcher: str, nprocs: int, run_dir: Path, *extra: str) -> list[str]:
    args = [str(EXAMPLE), "--dir", str(run_dir), "--steps", str(STEPS), "--every", str(EVERY)]
    args += ["--global-batch", str(BATCH), *extra]
    if launcher == "mpiexec":
        return mpiexec_command(nprocs, *args)
    return torchrun_command(nprocs, *args)


class Job:
    """A launch with its output in files, so the test can watch it while it runs."""

    def __init__(self, tmp: Path, label: str, cmd: list[str], marker: Path) -> None:
        self.out = tmp / f"{label}.out"
        self.err = tmp / f"{label}.err"
        self.label = label
        env = {**MPI_LOCAL_ENV, "DISTCKPT_PREEMPTED_FILE": str(marker)}
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=job_env(env),
                cwd=REPO_ROOT,
                start_new_session=True,
            )

    def output(self) -> str:
        return f"[{self.label}, seed {SEED}]\n--- stdout ---\n{self.out.read_text()}\n" + (
            f"--- stderr ---\n{self.err.read_text()[-6000:]}"
        )

    def wait_for_step(self, step: int, timeout: float) -> int:
        """Block until the job reports a step >= ``step``; return the step it reported."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [int(m) for m in re.findall(r"^step (\d+):", self.out.read_text(), re.M)]
            if found and max(found) >= step:
                return max(found)
            if self.proc.poll() is not None:
                raise AssertionError(f"the job ended before step {step}\n{self.output()}")
            time.sleep(0.05)
        kill_tree(self.proc)
        raise AssertionError(f"no step {step} within {timeout} s\n{self.output()}")

    def signal_one_rank(self, sig: int) -> int:
        """Send ``sig`` to one training process (not the launcher); return its pid."""
        ranks = []
        for pid in _descendants(self.proc.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(arg.endswith(b"train_sharded.py") for arg in cmdline) and b"-m" not in cmdline:
                ranks.append(pid)
        assert ranks, f"no training process found\n{self.output()}"
        victim = random.Random(SEED).choice(sorted(ranks))
        os.kill(victim, sig)
        return victim

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc)
            raise AssertionError(f"did not finish within {timeout} s\n{self.output()}") from None


def _run(tmp: Path, label: str, cmd: list[str], marker: Path, timeout: float = 240) -> Job:
    job = Job(tmp, label, cmd, marker)
    code = job.finish(timeout)
    assert code == 0, f"exit code {code}\n{job.output()}"
    return job


def _preempt(tmp: Path, label: str, cmd: list[str], marker: Path, at: int) -> tuple[Job, int]:
    """Run until step ``at``, SIGTERM one rank; return the job and the step it saved."""
    marker.unlink(missing_ok=True)
    job = Job(tmp, label, cmd, marker)
    job.wait_for_step(at, timeout=180)
    job.signal_one_rank(signal.SIGTERM)
    code = job.finish(120)
    if label.startswith("mpiexec"):
        assert code == EXIT_PREEMPTED, f"exit code {code}\n{job.output()}"
    else:
        assert code != 0, f"torchrun exited 0 after a preemption\n{job.output()}"
    assert marker.exists(), f"no preemption marker\n{job.output()}"
    info = json.loads(marker.read_text())
    saved = int(info["step"])
    assert at <= saved < STEPS, f"saved step {saved}, signal after step {at}\n{job.output()}"
    assert info["signal"] == "SIGTERM" and info["checkpoint"], info
    assert f"step {saved}: preempted; saved" in job.out.read_text(), job.output()
    return job, saved


def _resumed_from(job: Job) -> int:
    match = re.search(r"Restored from \S+ at step (\d+)", job.out.read_text())
    assert match, job.output()
    return int(match.group(1))


def _relative_error(got: dict[str, object], ref: dict[str, object]) -> float:
    worst = 0.0
    for key, value in ref.items():
        if not torch.is_tensor(value):
            assert got[key] == value, key
            continue
        other = got[key]
        assert torch.is_tensor(other) and other.shape == value.shape, key
        if key.startswith("param:"):
            scale = float(value.double().norm()) or 1.0
            worst = max(worst, float((other.double() - value.double()).norm()) / scale)
    return worst


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install mpich)")
def test_preempted_on_4_ranks_resumes_on_4_and_on_2_then_3(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    marker = tmp_path / "preempted.json"
    ref_dump = tmp_path / "ref.pt"
    _run(
        tmp_path,
        "reference",
        _command("mpiexec", 4, tmp_path / "ref", "--dump", str(ref_dump)),
        marker,
    )
    reference = torch.load(ref_dump, weights_only=True)
    assert reference["step"] == STEPS

    run = tmp_path / "run"
    _, saved4 = _preempt(
        tmp_path, "mpiexec-4", _command("mpiexec", 4, run), marker, at=rng.randrange(8, 24)
    )
    latest = json.loads((run / "latest").read_text())["latest"]
    assert (run / latest).is_dir()

    # Same world size: bit-identical to the uninterrupted run.
    same = tmp_path / "same"
    shutil.copytree(run, same)
    same_dump = tmp_path / "same.pt"
    job = _run(
        tmp_path, "mpiexec-4-resume", _command("mpiexec", 4, same, "--dump", str(same_dump)), marker
    )
    assert _resumed_from(job) == saved4, job.output()
    got = torch.load(same_dump, weights_only=True)
    assert sorted(got) == sorted(reference)
    for key, value in reference.items():
        if torch.is_tensor(value):
            assert torch.equal(got[key], value), f"{key} differs (seed {SEED})"
        else:
            assert got[key] == value, key

    # 4 -> 2 (preempted again) -> 3.
    job, saved2 = _preempt(
        tmp_path,
        "torchrun-2",
        _command("torchrun", 2, run),
        marker,
        at=rng.randrange(saved4 + EVERY, saved4 + 4 * EVERY),
    )
    assert _resumed_from(job) == saved4, job.output()
    final_dump = tmp_path / "final.pt"
    job = _run(
        tmp_path, "torchrun-3", _command("torchrun", 3, run, "--dump", str(final_dump)), marker
    )
    assert _resumed_from(job) == saved2, job.output()
    assert f"Done: step {STEPS} on 3 rank(s)." in job.out.read_text(), job.output()
    final = torch.load(final_dump, weights_only=True)
    assert final["step"] == STEPS
    error = _relative_error(final, reference)
    assert error <= 1e-6, f"parameters differ by {error:.3g} of their norm (seed {SEED})"
