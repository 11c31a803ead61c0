"""Which ``accelerate launch`` command runs 2 processes on CPUs, and the warning when a
launch meant for several runs one.

Without a configuration file, ``accelerate launch --cpu --num_processes 2`` takes
Accelerate's simple launcher, which starts ONE process (it sets ``MASTER_ADDR`` for more,
but starts several only under ``--mpirun_hostfile``); ``--multi_gpu --num_processes 2``
starts 2 through torchrun, and with ``cpu=True`` they join one gloo group. The
documented command (docs/integrations/accelerate.md) saves a checkpoint of 2 processes;
the other two cases are warned about by DistckptAccelerator.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launch_util import SCRIPTS, job_env

pytest.importorskip("accelerate")

from distckpt.format.index import read_index  # noqa: E402

SCRIPT = SCRIPTS / "accelerate_launch_job.py"
TIMEOUT = 150  # seconds, per launch
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))


def launch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``accelerate launch ARGS`` with no configuration file of the user's."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = job_env({"HOME": str(home), "HF_HOME": str(home / "hf")})
    env["PATH"] = str(Path(sys.executable).parent) + ":" + env.get("PATH", "")
    return subprocess.run(
        [ACCELERATE, "launch", *args],
        env=env,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def said(stdout: str) -> list[str]:
    """What the script's processes said (``PROCESS R OF N``), wherever it stands in the
    output: libraries Accelerate imports may print too (DeepSpeed, where installed, names
    the accelerator it picked), and two processes writing into one pipe may run their
    lines together."""
    return re.findall(r"PROCESS \d+ OF \d+", stdout)


@pytest.mark.timeout(TIMEOUT + 30)
def test_the_documented_launch_saves_on_2_processes(tmp_path: Path) -> None:
    done = launch(tmp_path, "--multi_gpu", "--num_processes", "2", str(SCRIPT), "ckpt")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(said(done.stdout)) == ["PROCESS 0 OF 2", "PROCESS 1 OF 2"]
    assert read_index(tmp_path / "ckpt")["world_size"] == 2
    assert "runs this one alone" not in done.stderr and "runs alone" not in done.stderr


@pytest.mark.timeout(TIMEOUT + 30)
def test_launch_cpu_runs_one_process_and_is_warned(tmp_path: Path) -> None:
    done = launch(tmp_path, "--cpu", "--num_processes", "2", str(SCRIPT), "ckpt")
    assert done.returncode == 0, done.stdout + done.stderr
    assert said(done.stdout) == ["PROCESS 0 OF 1"]
    assert read_index(tmp_path / "ckpt")["world_size"] == 1
    assert "it starts ONE process whatever --num_processes says" in done.stderr, done.stderr
    assert "accelerate launch --multi_gpu --num_processes N" in done.stderr


@pytest.mark.timeout(TIMEOUT + 30)
def test_processes_that_accelerate_runs_alone_are_warned(tmp_path: Path) -> None:
    """``--multi_gpu`` on a machine without GPUs, without cpu=True: torchrun starts 2
    processes, and Accelerate runs each alone."""
    done = launch(tmp_path, "--multi_gpu", "--num_processes", "2", str(SCRIPT), "unused", "no-cpu")
    assert done.returncode == 0, done.stdout + done.stderr
    assert said(done.stdout) == ["PROCESS 0 OF 1"] * 2
    warning = "the launcher started 2 processes (WORLD_SIZE=2) but Accelerate runs this one alone"
    assert done.stderr.count(warning) == 2, done.stderr
    assert "cpu=True" in done.stderr
