"""``benchmarks/megatron_conformance.py`` and its plugin, without Megatron-LM: a checkout
made here, holding what the runner takes from one (the helpers it copies and a
``dist_checkpointing`` folder) with a few tests written as Megatron-LM's are: an NCCL
process group and CUDA tensors (the plugin's gloo and CPU), ``initialize_model_parallel``,
saves through megatron-core's default strategy (the swap), a reshard on load, the
unexpected key that ``StrictHandling.ASSUME_OK_UNEXPECTED`` leaves to the strategy,
Megatron's fully parallel wrappers, and a test that needs ``megatron.training`` (skipped).
Run on 2 ranks in both modes, every test must have the same outcome both ways, and each
mode must have saved with its own strategy. Megatron-LM's own suite, which this stands
for in CI, runs by hand (docs/integrations/megatron.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launch_util import job_env

pytest.importorskip("megatron.core")

RUNNER = Path(__file__).resolve().parents[2] / "benchmarks" / "megatron_conformance.py"

UTILITIES = """
import os

import torch
from megatron.core import parallel_state


class Utils:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("LOCAL_RANK", "0"))

    @staticmethod
    def initialize_model_parallel(tp=1, pp=1):
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", Utils.rank))
        parallel_state.initialize_model_parallel(tp, pp)

    @staticmethod
    def destroy_model_parallel():
        torch.distributed.barrier()
        parallel_state.destroy_model_parallel()
"""

UNIT_CONFTEST = """
import os
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def tmp_path_dist_ckpt():
    return Path(os.environ["TMPDIR"]) / "dist_ckpt"  # the same on every rank


@pytest.fixture(scope="session", autouse=True)
def cleanup():
    yield
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
"""

SUITE_CONFTEST = """
from unittest import mock

import pytest

from megatron.core.dist_checkpointing.strategies.base import StrategyAction, get_default_strategy


@pytest.fixture(scope="session", autouse=True)
def set_default_dist_ckpt_strategy():
    def torch_dist():
        return get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1)

    with mock.patch(
        "megatron.core.dist_checkpointing.serialization.get_default_save_sharded_strategy",
        new=torch_dist,
    ) as patched:
        yield patched
"""

TESTS = """
import pytest
import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.dist_checkpointing.strategies.base import StrategyAction, get_default_strategy
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.validation import StrictHandling
from torch.distributed.checkpoint import CheckpointException

from tests.unit_tests.test_utilities import Utils

WHOLE = torch.arange(48, dtype=torch.float64).reshape(8, 6) / 7


def ckpt_dir(root, name):
    path = root / name
    if Utils.rank == 0:
        path.mkdir(parents=True)
    torch.distributed.barrier()
    return path


class TestTiny:
    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_save_reshards_on_load(self, tmp_path_dist_ckpt):
        Utils.initialize_model_parallel(2, 1)
        tp, tp_size = parallel_state.get_tensor_model_parallel_rank(), 2
        rows = WHOLE.cuda().chunk(tp_size)[tp].clone()
        state = {
            "w": ShardedTensor.from_rank_offsets(
                "w", rows, (0, tp, tp_size), replica_id=parallel_state.get_data_parallel_rank()
            ),
            "o": ShardedObject("o", {"step": 7}, (1,), (0,), replica_id=Utils.rank),
        }
        path = ckpt_dir(tmp_path_dist_ckpt, "reshard")
        dist_checkpointing.save(state, path)
        columns = torch.full((8, 3), torch.nan, device="cuda", dtype=torch.float64)
        asked = {
            "w": ShardedTensor.from_rank_offsets(
                "w", columns, (1, Utils.rank % 2, 2), replica_id=Utils.rank // 2
            ),
            "o": ShardedObject("o", None, (1,), (0,), replica_id=Utils.rank),
        }
        loaded = dist_checkpointing.load(asked, path)
        expected = WHOLE[:, 3 * (Utils.rank % 2) : 3 * (Utils.rank % 2) + 3]
        assert torch.equal(loaded["w"].view(torch.int64), expected.view(torch.int64))
        assert loaded["o"] == {"step": 7}

    def test_an_unexpected_key_raises_torch_exception(self, tmp_path_dist_ckpt):
        Utils.initialize_model_parallel(1, 1)
        path = ckpt_dir(tmp_path_dist_ckpt, "unexpected")
        state = {"a": ShardedTensor.from_rank_offsets("a", torch.arange(3), replica_id=Utils.rank)}
        dist_checkpointing.save(state, path)
        asked = torch.zeros(3, dtype=torch.int64)
        state = {"a": ShardedTensor.from_rank_offsets("a", asked, replica_id=Utils.rank)}
        state["d"] = ShardedTensor.from_rank_offsets(
            "UnexpectedD", torch.zeros(3), replica_id=Utils.rank
        )
        with pytest.raises(CheckpointException):
            dist_checkpointing.load(state, path, strict=StrictHandling.ASSUME_OK_UNEXPECTED)

    def test_fully_parallel_save_and_load(self, tmp_path_dist_ckpt):
        Utils.initialize_model_parallel(1, 1)
        group = parallel_state.get_data_parallel_group()
        path = ckpt_dir(tmp_path_dist_ckpt, "fully_parallel")

        def state(data):
            return {
                f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", data[i], replica_id=Utils.rank)
                for i in range(4)
            }

        save = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), group)
        dist_checkpointing.save(state(WHOLE[:4].clone()), path, save)
        load = FullyParallelLoadStrategyWrapper(
            get_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1), group
        )
        loaded = dist_checkpointing.load(state(torch.full((4, 6), torch.nan).double()), path, load)
        for i in range(4):
            assert torch.equal(loaded[f"t{i}"].view(torch.int64), WHOLE[i].view(torch.int64))

    def test_needs_megatron_training(self):
        Utils.initialize_model_parallel(1, 1)
        from megatron.training.arguments import parse_args

        parse_args()
"""


def _checkout(root: Path) -> Path:
    files = {
        "tests/__init__.py": "",
        "tests/unit_tests/__init__.py": "",
        "tests/unit_tests/conftest.py": UNIT_CONFTEST,
        "tests/unit_tests/test_utilities.py": UTILITIES,
        "tests/unit_tests/dist_checkpointing/__init__.py": "",
        "tests/unit_tests/dist_checkpointing/conftest.py": SUITE_CONFTEST,
        "tests/unit_tests/dist_checkpointing/test_tiny.py": TESTS,
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


@pytest.mark.timeout(1200)
def test_the_runner_runs_a_megatron_style_suite_both_ways(tmp_path: Path) -> None:
    checkout = _checkout(tmp_path / "Megatron-LM")
    report = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(checkout), "--ranks", "2", "--timeout", "300"]
        + ["--json", str(report)],
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=1100,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = json.loads(report.read_text())["runs"]
    prefix = "tests/unit_tests/dist_checkpointing/test_tiny.py::TestTiny::test_"
    expected = {
        "save_reshards_on_load": "passed",
        "an_unexpected_key_raises_torch_exception": "passed",
        "fully_parallel_save_and_load": "passed",
        "needs_megatron_training": "skipped",
    }
    saver = {"torch_dist": "TorchDistSaveShardedStrategy", "distckpt": "DistckptSaveStrategy"}
    for mode, strategy in saver.items():
        tests = runs[mode]["test_tiny.py"]["tests"]
        got = {name.removeprefix(prefix): test["outcome"] for name, test in tests.items()}
        assert got == expected, (mode, {n: t["error"] for n, t in tests.items()}, proc.stdout)
        for name in ("save_reshards_on_load", "fully_parallel_save_and_load"):
            assert f"save:{strategy}" in tests[prefix + name]["strategies"], (mode, name)
