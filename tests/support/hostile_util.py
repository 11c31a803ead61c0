"""What the hostile-input tests share: the CLI run in-process within a time bound, and a
manager with a node-local tier."""

from __future__ import annotations

import io
import subprocess
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import torch

import distckpt
from distckpt.cli import main
from tests.support.launch_util import bounded

BOUND = 30  # seconds: nothing here may hang


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """``distckpt ARGS``, run in this process (bounded in time), as a finished process."""
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with bounded(BOUND, f"distckpt {' '.join(argv)}"), redirect_stdout(out), redirect_stderr(err):
        rc = main(argv)
    return subprocess.CompletedProcess(argv, rc, out.getvalue(), err.getvalue())


def local_manager(root: Path, ckpt: distckpt.Checkpoint) -> distckpt.CheckpointManager:
    """A manager of ``root/run`` that saves every step to the node-local tier in
    ``root/local`` and every tenth to the run directory."""
    return distckpt.CheckpointManager(
        ckpt,
        root / "run",
        step_counter=ckpt.step,
        checkpoint_interval=10,
        local=distckpt.LocalTier(str(root / "local"), interval=1),
    )


def run_model() -> distckpt.Checkpoint:
    """The model of :func:`run_manager`'s run: a step counter and a (40, 30) weight."""
    return distckpt.Checkpoint(step=torch.tensor(0), w=torch.zeros(40, 30))


def run_manager(root: Path, ckpt: distckpt.Checkpoint) -> distckpt.CheckpointManager:
    """The fuzzers' run: ``root/run`` keeps one checkpoint, saved every third step; every
    step goes to the node-local tier in ``root/local/<node>``, which keeps one."""
    return distckpt.CheckpointManager(
        ckpt,
        root / "run",
        max_to_keep=1,
        checkpoint_interval=3,
        step_counter=ckpt.step,
        local=distckpt.LocalTier(str(root / "local" / "{node}"), interval=1, max_to_keep=1),
    )
