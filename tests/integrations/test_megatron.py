"""Megatron-core's ``dist_checkpointing`` through the distckpt strategies
(:mod:`distckpt.integrations.megatron`), with megatron-core's own classes on CPU ranks
(gloo): a small GPT model of Megatron-core's layers (local spec, CPU initialisation) and
its Adam state (sharded by Megatron's ``optim_state_to_sharding_state``) saved on one
tensor/pipeline/data-parallel layout and loaded on others, every box bit for bit, plus a
``ShardedObject``, a common value, and a bucket of optimizer state cut as the
distributed optimizer's ``dp_reshardable`` format cuts it (several boxes of one tensor per
rank) (tests/scripts/megatron_ranks.py). Megatron's ``DistributedOptimizer`` needs CUDA
for its buffers and is not run here."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.launch_util import SCRIPTS, assert_all_ok, job_env, run_ranks

pytest.importorskip("megatron.core")

SCRIPT = SCRIPTS / "megatron_ranks.py"
ENV = {"DISTCKPT_TIMEOUT": "120"}


def _save(tmp_path: Path, world: int, tp: int, pp: int, *extra: str) -> tuple[Path, Path]:
    ckpt, ref = tmp_path / "ckpt", tmp_path / "ref"
    proc = run_ranks(
        world, SCRIPT, "save", str(ckpt), str(ref), str(tp), str(pp), *extra, env=ENV, timeout=240
    )
    assert_all_ok(proc, world)
    config = json.loads((ckpt / "metadata.json").read_text())
    assert config["sharded_backend"] == "distckpt" and config["sharded_backend_version"] == 1
    assert (ckpt / "distckpt").is_dir()
    return ckpt, ref


def _load(world: int, *layouts: tuple[Path, Path, int, int]) -> None:
    """One launch on ``world`` ranks loads each checkpoint under its layout (TP, PP)."""
    args = [str(a) for layout in layouts for a in layout]
    proc = run_ranks(world, SCRIPT, "load", *args, env=ENV, timeout=240)
    assert_all_ok(proc, world)
    for ckpt, _, tp, pp in layouts:
        done = re.findall(
            rf"^rank \d+: LOADED \d+ boxes of {re.escape(str(ckpt))} under TP {tp} PP {pp} ",
            proc.stdout,
            re.M,
        )
        assert len(done) == world, proc.stdout


@pytest.mark.timeout(900)
def test_tp2_and_async_tp2_pp2_saves_load_on_other_layouts(tmp_path: Path) -> None:
    """A TP 2 save on 2 ranks and an async TP 2 x PP 2 save on 4, each loaded under other
    layouts; a launch loads every checkpoint its number of ranks has a layout for."""
    tp2 = _save(tmp_path / "tp2", 2, 2, 1)
    tp2pp2 = _save(tmp_path / "tp2pp2", 4, 2, 2, "async")
    # TP 2 -> data parallel 2 and -> pipeline parallel 2; TP 2 x PP 2 -> TP 2
    _load(2, (*tp2, 1, 1), (*tp2, 1, 2), (*tp2pp2, 2, 1))
    _load(1, (*tp2, 1, 1), (*tp2pp2, 1, 1))  # -> one process


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


def test_save_state_maps_megatron_leaves() -> None:
    """What one rank writes: main replicas only, a stacked tensor as one tensor per
    layer, a ShardedObject as its serialised bytes, several boxes of one tensor as the box
    they make; a flattened range is refused."""
    import dataclasses

    import torch
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    import distckpt
    from distckpt.integrations.megatron.leaves import _object_value, save_state, unjoined

    weight = torch.arange(8.0).reshape(2, 4)
    layers = [torch.full((3,), float(i)) for i in range(2)]
    state = {
        "w": ShardedTensor.from_rank_offsets("w", weight, (1, 1, 2)),  # columns 4..7 of 8
        "replica": ShardedTensor.from_rank_offsets("r", weight, replica_id=(0, 1, 0)),
        "layers": [
            ShardedTensor.from_rank_offsets("stack", t, (0, i, 2), prepend_axis_num=1)
            for i, t in enumerate(layers)
        ],
        "obj": ShardedObject("obj", {"a": 1}, (2,), (1,)),
        "obj_replica": ShardedObject("obj2", {"a": 1}, (1,), (0,), replica_id=1),
    }
    out = save_state(state)
    assert set(out["tensors"]) == {"w", "stack"}
    w = out["tensors"]["w"]
    assert isinstance(w, distckpt.Shard) and w.global_shape == (2, 8) and w.offsets == (0, 4)
    stack = out["tensors"]["stack"]  # the layers as one tensor, the stacked axis leading
    assert stack.global_shape == (2, 3) and stack.offsets == (0, 0)
    assert torch.equal(stack.tensor, torch.stack(layers))
    # Keys some rank holds in boxes that make no one box are stored one variable per layer.
    apart_layers = [
        state["layers"][0],
        state["layers"][0].__class__.from_rank_offsets(
            "stack", layers[1], (0, 2, 3), prepend_axis_num=1
        ),
    ]
    assert unjoined({"layers": apart_layers}) == ["stack"]
    layered = save_state({"layers": apart_layers}, layered=["stack"])["tensors"]["stack"]
    assert sorted(layered) == ["0", "2"] and layered["2"].global_shape == (3,)
    assert torch.equal(layered["2"].tensor, layers[1])
    assert list(out["objects"]) == ["obj/shard_1_2"]
    assert _object_value(out["objects"]["obj/shard_1_2"].tensor, "obj") == {"a": 1}

    flat = ShardedTensor.from_rank_offsets("f", weight)
    object.__setattr__(flat, "flattened_range", slice(0, 4))  # megatron-core refuses it too
    with pytest.raises(CheckpointingException, match="flattened_range"):
        save_state({"f": flat})
    # Several boxes of one tensor that follow one another (the distributed optimizer's
    # dp_reshardable buckets) are saved as the one box they make, in their order.
    rows = [ShardedTensor.from_rank_offsets("rows", weight[i : i + 1], (0, i, 2)) for i in (1, 0)]
    joined = save_state({"rows": rows})["tensors"]["rows"]
    assert joined.offsets == (0, 0) and joined.global_shape == (2, 4)
    assert torch.equal(joined.tensor, weight)
    # Boxes that do not make one box are refused, naming the tensor.
    twice = ShardedTensor.from_rank_offsets("w", weight)
    with pytest.raises(CheckpointingException, match="w: this rank holds 2 boxes"):
        save_state({"a": twice, "b": dataclasses.replace(twice)})
    apart = [ShardedTensor.from_rank_offsets("gap", weight[:1], (0, i, 3)) for i in (0, 2)]
    with pytest.raises(CheckpointingException, match="do not join"):
        save_state({"gap": apart})


def test_a_tensor_that_allows_a_shape_mismatch_loads_what_overlaps(tmp_path: Path) -> None:
    """One process, the strategies alone: a (6, 4) embedding loaded as (8, 4) and as rows
    4..7 of (8, 4) (a vocabulary padded for another tensor-parallel size) gets the stored
    rows it shares and zeros elsewhere, as Megatron's own strategies give; as (4, 4) its
    first rows; without ``allow_shape_mismatch`` the shapes must agree."""
    import dataclasses

    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    import distckpt
    from distckpt.integrations.megatron import DistckptLoadStrategy, DistckptSaveStrategy

    weight = torch.arange(24.0).reshape(6, 4)
    (tmp_path / "ckpt").mkdir()
    DistckptSaveStrategy().save(
        {"emb": ShardedTensor.from_rank_offsets("emb", weight)}, tmp_path / "ckpt"
    )

    def load(sh: ShardedTensor) -> torch.Tensor:
        return DistckptLoadStrategy().load({"emb": sh}, tmp_path / "ckpt")["emb"]

    def asked(data: torch.Tensor, *rank_offsets: tuple[int, int, int]) -> ShardedTensor:
        sh = ShardedTensor.from_rank_offsets("emb", data, *rank_offsets)
        return dataclasses.replace(sh, allow_shape_mismatch=True)

    padded = load(asked(torch.full((8, 4), float("nan"))))
    assert torch.equal(padded[:6], weight) and torch.equal(padded[6:], torch.zeros(2, 4))
    second_half = load(asked(torch.full((4, 4), float("nan")), (0, 1, 2)))  # rows 4..7 of 8
    assert torch.equal(second_half[:2], weight[4:]) and torch.equal(
        second_half[2:], torch.zeros(2, 4)
    )
    beyond = load(asked(torch.full((6, 4), float("nan")), (0, 2, 3)))  # rows 12..17 of 18
    assert torch.equal(beyond, torch.zeros(6, 4))
    cut = load(asked(torch.full((4, 4), float("nan"))))
    assert torch.equal(cut, weight[:4])
    with pytest.raises(distckpt.ShapeMismatchError, match="tensors/emb.*does not match"):
        load(ShardedTensor.from_rank_offsets("emb", torch.zeros(8, 4)))
    # megatron-core's callers catch its own exception (Megatron-LM's test_tensor_shape_mismatch)
    from megatron.core.dist_checkpointing.core import CheckpointingException

    for rows in (4, 8):
        with pytest.raises(CheckpointingException, match="tensors/emb.*does not match"):
            load(ShardedTensor.from_rank_offsets("emb", torch.zeros(rows, 4)))


def test_a_leaf_the_checkpoint_lacks_raises_what_torch_dist_raises(tmp_path: Path) -> None:
    """One process, the strategies alone: a load asking for a tensor and an object the
    checkpoint does not hold (what Megatron's ``StrictHandling.ASSUME_OK_UNEXPECTED``
    leaves to the strategy) raises torch's ``CheckpointException``, as megatron-core's
    ``torch_dist`` load does (Megatron-LM's
    ``test_unexpected_keys_handling_during_validation``), which is also megatron-core's
    ``CheckpointingException`` and distckpt's ``MissingVariablesError``, and travels
    between ranks intact; without them the same leaves load bit for bit."""
    import pickle

    import torch
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from torch.distributed.checkpoint import CheckpointException

    import distckpt
    from distckpt.integrations.megatron import DistckptLoadStrategy, DistckptSaveStrategy

    weight = torch.randn(3, 5, dtype=torch.float64)
    (tmp_path / "ckpt").mkdir()
    saved = {
        "TenA": ShardedTensor.from_rank_offsets("TenA", weight),
        "ObjA": ShardedObject("ObjA", [1, 2.5, "x"], (1,), (0,)),
    }
    DistckptSaveStrategy().save(saved, tmp_path / "ckpt")

    def asked() -> dict[str, Any]:
        return {
            "TenA": ShardedTensor.from_rank_offsets("TenA", torch.full((3, 5), torch.nan).double()),
            "ObjA": ShardedObject("ObjA", None, (1,), (0,)),
        }

    extra = asked()
    extra["TenD"] = ShardedTensor.from_rank_offsets("UnexpectedTenD", torch.zeros(3))
    extra["ObjD"] = ShardedObject("UnexpectedObjD", None, (1,), (0,))
    with pytest.raises(CheckpointException) as caught:
        DistckptLoadStrategy().load(extra, tmp_path / "ckpt")
    error = caught.value
    assert isinstance(error, CheckpointingException)
    assert isinstance(error, distckpt.MissingVariablesError)
    assert error.missing == ["objects/UnexpectedObjD%2Fshard_0_1", "tensors/UnexpectedTenD"]
    assert "UnexpectedTenD" in str(error) and "UnexpectedObjD" in str(error)
    assert list(error.failures) == [0] and isinstance(error.failures[0][0], KeyError)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
    assert again.missing == error.missing and list(again.failures) == [0]

    loaded = DistckptLoadStrategy().load(asked(), tmp_path / "ckpt")
    assert loaded["TenA"].dtype == torch.float64
    assert torch.equal(loaded["TenA"].view(torch.int64), weight.view(torch.int64))
    assert loaded["ObjA"] == [1, 2.5, "x"]


def test_a_view_of_a_large_tensor_saves_its_elements_alone(tmp_path: Path) -> None:
    """One process, the strategies alone: leaves that are small views of a 4 MB tensor
    write their own elements, not the storage they view (what Megatron-LM's
    ``test_cpu_tensors_dont_take_too_much_space`` checks of ``torch_dist``'s files), and
    load back bit for bit."""
    import os

    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from distckpt.integrations.megatron import DistckptLoadStrategy, DistckptSaveStrategy

    large = torch.randn(1_000_000)
    (tmp_path / "ckpt").mkdir()
    saved = {
        "a": ShardedTensor.from_rank_offsets("keyA", large[:10]),
        "b": ShardedTensor.from_rank_offsets("keyB", large[500_000:500_010]),
    }
    DistckptSaveStrategy().save(saved, tmp_path / "ckpt")
    written = sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(tmp_path / "ckpt")
        for name in names
    )
    assert written < 10_000, written
    asked = {
        "a": ShardedTensor.from_rank_offsets("keyA", torch.full((10,), torch.nan)),
        "b": ShardedTensor.from_rank_offsets("keyB", torch.full((10,), torch.nan)),
    }
    loaded = DistckptLoadStrategy().load(asked, tmp_path / "ckpt")
    assert torch.equal(loaded["a"].view(torch.int32), large[:10].view(torch.int32))
    assert torch.equal(loaded["b"].view(torch.int32), large[500_000:500_010].view(torch.int32))


def test_a_tensor_asked_for_in_another_dtype_loads_cast(tmp_path: Path) -> None:
    """One process, the strategies alone: a tensor stored as int64 or float64 and asked for
    as float32 (whole, as rows of a padded shape with ``allow_shape_mismatch``, as two
    boxes) loads cast to float32, as megatron-core's ``torch_dist`` load copies into the
    leaf's tensor (Megatron-LM's ``test_tensor_shape_mismatch``): bit for bit what
    ``Tensor.to`` gives."""
    import dataclasses

    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from distckpt.integrations.megatron import DistckptLoadStrategy, DistckptSaveStrategy

    stored = {
        "ints": torch.arange(24).reshape(6, 4),
        "doubles": torch.randn(6, 4, dtype=torch.float64),
    }
    (tmp_path / "ckpt").mkdir()
    DistckptSaveStrategy().save(
        {k: ShardedTensor.from_rank_offsets(k, v) for k, v in stored.items()}, tmp_path / "ckpt"
    )
    for key, value in stored.items():
        want = value.to(torch.float32)
        whole = ShardedTensor.from_rank_offsets(key, torch.full((6, 4), torch.nan))
        halves = [
            ShardedTensor.from_rank_offsets(key, torch.full((3, 4), torch.nan), (0, i, 2))
            for i in range(2)
        ]
        padded = dataclasses.replace(
            ShardedTensor.from_rank_offsets(key, torch.full((8, 4), torch.nan)),
            allow_shape_mismatch=True,
        )
        got = DistckptLoadStrategy().load({"whole": whole, "halves": halves}, tmp_path / "ckpt")
        got.update(DistckptLoadStrategy().load({"padded": padded}, tmp_path / "ckpt"))
        assert got["whole"].dtype == torch.float32
        assert torch.equal(got["whole"].view(torch.int32), want.view(torch.int32)), key
        joined = torch.cat(got["halves"])
        assert torch.equal(joined.view(torch.int32), want.view(torch.int32)), key
        assert torch.equal(got["padded"][:6].view(torch.int32), want.view(torch.int32)), key
        assert torch.equal(got["padded"][6:], torch.zeros(2, 4)), key


def test_stored_layer_names_that_are_not_offsets_are_refused(tmp_path: Path) -> None:
    """A checkpoint's names as storage may hold them: a stacked tensor's layer that is not
    named by its offsets, layers naming different numbers of axes, or a layer's offset
    that makes a shape no tensor can have, are reported as a damaged checkpoint naming the
    variable, when Megatron asks for the tensors' metadata."""
    import torch

    import distckpt
    from distckpt.integrations.megatron import DistckptLoadStrategy, checkpoint_path

    for i, layers in enumerate((["0", "x1"], ["0", "0.1"], ["0", str(2**62)])):
        ckpt = tmp_path / str(i)
        state = {"tensors": {"stack": {name: torch.zeros(2) for name in layers}}}
        distckpt.save(state, checkpoint_path(ckpt))
        with pytest.raises(distckpt.CorruptCheckpointError, match="tensors/stack/"):
            DistckptLoadStrategy().load_tensors_metadata(ckpt)


def test_without_megatron_core_the_module_imports_and_its_use_names_the_extra() -> None:
    code = (
        "import sys\n"
        "sys.modules['megatron'] = None  # any import of it fails\n"
        "import distckpt.integrations.megatron as megatron\n"
        "print('IMPORTED', flush=True)\n"
        "megatron.DistckptLoadStrategy()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 1
    assert "ImportError: distckpt.integrations.megatron needs megatron-core" in done.stderr
    assert "pip install 'distckpt[megatron]'" in done.stderr
    assert done.stdout == "IMPORTED\n"  # the import itself passed


STACKING = SCRIPTS / "megatron_stacking.py"


@pytest.mark.timeout(900)
def test_any_stacking_loads_under_any_other_on_other_world_sizes(tmp_path: Path) -> None:
    """One tensor saved on 2 ranks plain, stacked (one prepended axis), interleaved
    (layers that make no one box on a rank) and in the per-layer layout of earlier saves;
    each loaded on 3 ranks and on one as plain, stacked and stacked with two prepended
    axes, bit for bit (tests/scripts/megatron_stacking.py)."""
    assert_all_ok(run_ranks(2, STACKING, "save", str(tmp_path), env=ENV, timeout=240), 2)
    for world in (3, 1):
        proc = run_ranks(world, STACKING, "load", str(tmp_path), env=ENV, timeout=240)
        assert_all_ok(proc, world)


def _old_layout(path: Path, layers: dict[str, Any]) -> None:
    """A checkpoint as saves before the whole layout wrote a stacked tensor: one
    variable per layer, ``tensors/<key>/<layer>``."""
    import distckpt
    from distckpt.integrations.megatron import checkpoint_path

    distckpt.save({"tensors": {"B": layers}}, checkpoint_path(path))


def test_stackings_load_each_other_in_one_process(tmp_path: Path) -> None:
    """The strategies alone, one process: a plain (4, 5, 8) tensor loads as 4 stacked
    layers of (5, 8) and as 20 rows of (8,) under two prepended axes, and back; the
    per-layer layout of earlier saves (one and two stacked axes) loads plain and
    stacked; a shape that does not fit the stored layers is refused, naming both."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    import distckpt
    from distckpt.integrations.megatron import DistckptLoadStrategy, DistckptSaveStrategy

    whole = torch.arange(160, dtype=torch.float32).reshape(4, 5, 8)

    def plain(data: torch.Tensor) -> list[ShardedTensor]:
        return [ShardedTensor.from_rank_offsets("B", data)]

    def stacked(data: torch.Tensor) -> list[ShardedTensor]:
        return [
            ShardedTensor.from_rank_offsets("B", data[i], (0, i, 4), prepend_axis_num=1)
            for i in range(4)
        ]

    def stacked2(data: torch.Tensor) -> list[ShardedTensor]:
        return [
            ShardedTensor.from_rank_offsets(
                "B", data[i, j], (0, i, 4), (1, j, 5), prepend_axis_num=2
            )
            for i in range(4)
            for j in range(5)
        ]

    def check(ckpt: Path) -> None:
        for how in (plain, stacked, stacked2):
            got = DistckptLoadStrategy().load({"B": how(torch.full_like(whole, -1.0))}, ckpt)["B"]
            for a, b in zip(got, how(whole), strict=True):
                assert torch.equal(a, b.data), (ckpt.name, how.__name__)

    for how in (plain, stacked, stacked2):
        ckpt = tmp_path / how.__name__
        ckpt.mkdir()
        DistckptSaveStrategy().save({"B": how(whole)}, ckpt)
        assert [v.name for v in distckpt.list_variables(ckpt / "distckpt")] == ["tensors/B"]
        check(ckpt)
    _old_layout(tmp_path / "old", {str(i): whole[i].clone() for i in range(4)})
    check(tmp_path / "old")
    rows = {f"{i}.{j}": whole[i, j].clone() for i in range(4) for j in range(5)}
    _old_layout(tmp_path / "old2", rows)
    check(tmp_path / "old2")
    with pytest.raises(distckpt.ShapeMismatchError, match=r"B: stored with shape \[4, 5, 8\]"):
        DistckptLoadStrategy().load({"B": plain(torch.zeros(4, 5, 9))}, tmp_path / "old")
    # megatron-core's callers catch its own exception (Megatron-LM's test_tensor_shape_mismatch)
    from megatron.core.dist_checkpointing.core import CheckpointingException

    with pytest.raises(CheckpointingException, match=r"B: stored with shape \[4, 5, 8\]"):
        DistckptLoadStrategy().load({"B": plain(torch.zeros(4, 5, 9))}, tmp_path / "old")


BUILD_TWICE = """
import torch
import torch.distributed as dist

from gpt_tiny import build, whole

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
first = whole(build(tp=1, seed=0))
again = whole(build(tp=1, seed=0))
other = whole(build(tp=1, seed=1))
assert sorted(first) == sorted(again) == sorted(other)
assert all(torch.equal(first[k], again[k]) for k in first)
assert any(not torch.equal(first[k], other[k]) for k in first)
dist.destroy_process_group()
print("OK")
"""


@pytest.mark.timeout(240)
def test_the_pages_gpt_tiny_builds_twice_in_one_process(tmp_path: Path) -> None:
    """``gpt_tiny.build`` of docs/integrations/megatron.md may be called again in one
    process (Megatron's parallel state is set up once per build, not twice): the same
    seed gives the same weights, another seed others."""
    from tests.docs.blocks import DOCS, read

    (tiny,) = [
        b
        for b in read(DOCS / "integrations" / "megatron.md")
        if b.kind == "file" and b.arg == "gpt_tiny.py"
    ]
    (tmp_path / "gpt_tiny.py").write_text(tiny.code)
    (tmp_path / "twice.py").write_text("import sys\n" + BUILD_TWICE)
    proc = subprocess.run(
        [sys.executable, "twice.py", str(tmp_path / "pg")],
        cwd=tmp_path,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr
