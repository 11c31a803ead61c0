"""``torch.distributed.checkpoint`` through distckpt (:mod:`distckpt.integrations.dcp`),
with the real DCP: 2 torchrun ranks save an FSDP2 model and its Adam state with
``dcp.save`` (to a directory and to S3), a plain state with DCP's planner options
changed, and a pickled object; 3 mpiexec ranks load them back, resharded, bit for bit,
with ``distckpt.load`` and with ``dcp.load`` (tests/scripts/dcp_ranks.py). What DCP wrote
is an ordinary distckpt checkpoint: ``distckpt verify`` passes on it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from launch_util import HAVE_MPIEXEC, SCRIPTS, assert_all_ok, run_mpi, run_torchrun

import distckpt
from distckpt.integrations.dcp import DistckptReader, DistckptWriter

dcp = pytest.importorskip("torch.distributed.checkpoint")


@pytest.mark.timeout(400)
def test_dcp_saves_and_loads_through_distckpt(tmp_path: Path, s3: Any) -> None:
    env = {**s3.env, "DISTCKPT_TIMEOUT": "120"}
    script = SCRIPTS / "dcp_ranks.py"
    saved = run_torchrun(2, script, "save", str(tmp_path), s3.url, env=env, timeout=180)
    assert_all_ok(saved, 2)
    for name in ("fsdp", "native", "plain", "objects"):
        proc = subprocess.run(
            [sys.executable, "-m", "distckpt", "verify", str(tmp_path / name)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
    launch = run_mpi if HAVE_MPIEXEC else run_torchrun
    loaded = launch(3, script, "load", str(tmp_path), s3.url, env=env, timeout=180)
    assert_all_ok(loaded, 3)


def test_one_process_without_a_process_group(tmp_path: Path) -> None:
    """DCP without torch.distributed: one process writes and reads; names that would
    collide as DCP keys are refused; a planner without a state is refused by name."""
    state = {"a": {"b": torch.arange(6.0)}, "n": 3}
    dcp.save(state, storage_writer=DistckptWriter(tmp_path / "one"))
    got: dict[str, Any] = {"a": {"b": torch.zeros(6)}, "n": 0}
    dcp.load(got, storage_reader=DistckptReader(tmp_path / "one"))
    assert torch.equal(got["a"]["b"], state["a"]["b"]) and got["n"] == 3
    distckpt.save({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, tmp_path / "clash")
    with pytest.raises(distckpt.ValidationError, match="both flatten to the DCP key 'a.b'"):
        DistckptReader(tmp_path / "clash").read_metadata()
