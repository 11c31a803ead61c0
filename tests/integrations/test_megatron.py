"""Megatron-core's ``dist_checkpointing`` through the distckpt strategies
(:mod:`distckpt.integrations.megatron`), with megatron-core's own classes on CPU ranks
(gloo): a small GPT model of Megatron-core's layers (local spec, CPU initialisation) and
its Adam state (sharded by Megatron's ``optim_state_to_sharding_state``) saved on one
tensor/pipeline/data-parallel layout and loaded on others, every box bit for bit, plus a
``ShardedObject`` and a common value (tests/scripts/megatron_ranks.py). Megatron's
``DistributedOptimizer`` needs CUDA for its buffers and is not run here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.launch_util import SCRIPTS, assert_all_ok, run_torchrun

pytest.importorskip("megatron.core")

SCRIPT = SCRIPTS / "megatron_ranks.py"
ENV = {"DISTCKPT_TIMEOUT": "120"}


def _save(tmp_path: Path, world: int, tp: int, pp: int, *extra: str) -> tuple[Path, Path]:
    ckpt, ref = tmp_path / "ckpt", tmp_path / "ref"
    proc = run_torchrun(
        world, SCRIPT, "save", str(ckpt), str(ref), str(tp), str(pp), *extra, env=ENV, timeout=240
    )
    assert_all_ok(proc, world)
    config = json.loads((ckpt / "metadata.json").read_text())
    assert config["sharded_backend"] == "distckpt" and config["sharded_backend_version"] == 1
    assert (ckpt / "distckpt").is_dir()
    return ckpt, ref


def _load(ckpt: Path, ref: Path, world: int, tp: int, pp: int) -> None:
    proc = run_torchrun(
        world, SCRIPT, "load", str(ckpt), str(ref), str(tp), str(pp), env=ENV, timeout=240
    )
    assert_all_ok(proc, world)


@pytest.mark.timeout(900)
def test_tp2_save_loads_on_other_layouts(tmp_path: Path) -> None:
    ckpt, ref = _save(tmp_path, 2, 2, 1)
    _load(ckpt, ref, 2, 1, 1)  # TP 2 -> data parallel 2
    _load(ckpt, ref, 2, 1, 2)  # -> pipeline parallel 2
    _load(ckpt, ref, 1, 1, 1)  # -> one process


@pytest.mark.timeout(900)
def test_async_tp2_pp2_save_loads_on_other_layouts(tmp_path: Path) -> None:
    ckpt, ref = _save(tmp_path, 4, 2, 2, "async")
    _load(ckpt, ref, 2, 2, 1)
    _load(ckpt, ref, 1, 1, 1)


def test_registered_under_its_backend_name() -> None:
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.strategies.base import (
        StrategyAction,
        get_default_strategy,
    )

    from distckpt.integrations.megatron import DistckptLoadStrategy, DistckptSaveStrategy

    save = get_default_strategy(StrategyAction.SAVE_SHARDED, "distckpt", 1)
    load = get_default_strategy(StrategyAction.LOAD_SHARDED, "distckpt", 1)
    assert isinstance(save, DistckptSaveStrategy) and save.backend == "distckpt"
    assert isinstance(load, DistckptLoadStrategy)
    load.check_backend_compatibility("distckpt")
    load.check_version_compatibility(1)
    with pytest.raises(CheckpointingException):
        load.check_backend_compatibility("torch_dist")
    with pytest.raises(CheckpointingException):
        load.check_version_compatibility(2)
