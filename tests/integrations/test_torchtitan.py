"""torchtitan's checkpoint component on distckpt
(:class:`distckpt.integrations.torchtitan.DistckptCheckpointManager`), driven with
torchtitan's own classes (its ``OptimizersContainer``, ``LRSchedulersContainer`` and
config ``build``) around a tiny FSDP2 model: 2 torchrun ranks train 4 steps with a
checkpoint at each (``keep_latest_k=2``, zstd), once with ``async_mode="disabled"`` and
once with ``"async"`` (``dcp.async_save`` through distckpt); 3 mpiexec ranks resume from
the newest committed step of each, model, optimizer, scheduler, data position, step and
RNG bit for bit
(tests/scripts/titan_ranks.py). torchtitan's full trainer needs a GPU for its models and
is not run here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.launch_util import HAVE_MPIEXEC, SCRIPTS, assert_all_ok, run_mpi_ranks, run_ranks

pytest.importorskip("torchtitan")

from distckpt.integrations.torchtitan import DistckptCheckpointManager, with_distckpt  # noqa: E402


@pytest.mark.timeout(300)
def test_torchtitan_saves_and_resumes_through_distckpt(tmp_path: Path) -> None:
    script = SCRIPTS / "titan_ranks.py"
    env = {"DISTCKPT_TIMEOUT": "120"}
    assert_all_ok(run_ranks(2, script, "save", str(tmp_path), env=env, timeout=150), 2)
    for folder in ("ckpt", "ckpt-async"):
        assert sorted(p.name for p in (tmp_path / folder).iterdir()) == ["step-3", "step-4"]
        proc = subprocess.run(
            [sys.executable, "-m", "distckpt", "verify", str(tmp_path / folder / "step-4")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
    # A step that never committed is not resumed from.
    (tmp_path / "ckpt" / "step-9").mkdir()
    launch = run_mpi_ranks if HAVE_MPIEXEC else run_ranks
    assert_all_ok(launch(3, script, "load", str(tmp_path), env=env, timeout=150), 3)


def test_config_is_torchtitans_with_distckpt() -> None:
    """with_distckpt keeps every checkpoint setting of a trainer config (whose models
    need a GPU to import: a stand-in holding torchtitan's checkpoint config here)."""
    from torchtitan.components.checkpointer import CheckpointManager

    trainer = SimpleNamespace(
        checkpoint=CheckpointManager.Config(interval=10, last_save_model_only=False)
    )
    config = with_distckpt(trainer, compression="zstd")
    assert isinstance(config.checkpoint, DistckptCheckpointManager.Config)
    assert config.checkpoint.interval == 10 and config.checkpoint.compression == "zstd"
    assert config.checkpoint.last_save_model_only is False  # kept from the original
