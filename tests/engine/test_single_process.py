"""One process, no launcher: round trips, bad input, corruption, full disk, staging gc.

Every failure case asserts the exact error type, that the message names what went wrong
(the variable, both shapes, the file), and that nothing was lost: committed checkpoints
keep their bytes, and no checkpoint or staging directory is left behind.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import distckpt
from distckpt.comm import SingleComm
from distckpt.commit.staging import OWNER_FILE, Staging, collect_garbage, leftovers
from distckpt.dtypes import SUPPORTED
from distckpt.errors import (
    CheckpointError,
    CheckpointExists,
    CheckpointNotFoundError,
    CommTimeoutError,
    CorruptCheckpointError,
    MissingVariablesError,
    ShapeMismatchError,
    UnsupportedFormatError,
    UnsupportedValueError,
)
from distckpt.format import shard_io
from distckpt.format.stored import Pieces
from distckpt.testing.hostile import reseal
from tests.support.make_golden import GOLDEN, assert_same_bits, assert_same_value, tensor_bytes

pytestmark = pytest.mark.timeout(120)

ALL_DTYPES = list(SUPPORTED)


# --------------------------------------------------------------------------- helpers


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (hidden ones too): file bytes, or None for a directory."""
    out: dict[str, bytes | None] = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = None if p.is_dir() else p.read_bytes()
    return out


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Arbitrary bit patterns of ``dtype`` (NaN payloads, subnormals...) plus, for floating
    types, NaN, +-inf and -0.0 at fixed places."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    t = raw.view(dtype).reshape(shape).clone()
    flat = t.view(-1)
    if dtype.is_floating_point or dtype.is_complex:
        specials = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0]
        for i, v in enumerate(specials):
            flat[i] = v
    return t


def save1(state: dict[str, Any], path: Path, **kw: Any) -> distckpt.SaveResult:
    return distckpt.save(state, path, SingleComm(), **kw)


def load1(state: dict[str, Any], path: Path, **kw: Any) -> distckpt.LoadResult:
    return distckpt.load(state, path, SingleComm(), **kw)


def index_of(ckpt: Path) -> dict[str, Any]:
    """A checkpoint's index, every entry's pieces listed (compact regular entries too)."""
    index = json.loads((ckpt / "zarr.json").read_bytes())["attributes"]["distckpt"]
    return listed(index)


def listed(index: dict[str, Any]) -> dict[str, Any]:
    """``index`` with each compact regular entry's shards listed as ``pieces``."""
    for name, entry in index["variables"].items():
        if entry.get("kind") == "tensor" and "chunks" in entry:
            entry["pieces"] = [p.to_json() for p in Pieces(entry, name)]
    return index


def piece(ckpt: Path, name: str, k: int = 0) -> dict[str, Any]:
    return index_of(ckpt)["variables"][name]["pieces"][k]


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def inner_chunk_offsets(path: Path, block: list[int], inner: list[int]) -> list[tuple[int, int]]:
    """(offset, length) of every inner chunk of a shard file, from its index (C order)."""
    n = math.prod(b // i for b, i in zip(block, inner, strict=True))
    raw = path.read_bytes()
    index = np.frombuffer(raw[len(raw) - (n * 16 + 4) : -4], dtype="<u8").reshape(n, 2)
    return [(int(o), int(ln)) for o, ln in index]


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("layout", ["small", "sharded"])
def test_every_dtype_round_trips_bit_exactly(tmp_path: Path, layout: str) -> None:
    shape = (37, 5)
    state = {
        str(d).removeprefix("torch."): random_tensor(d, shape, i) for i, d in enumerate(ALL_DTYPES)
    }
    kw = {"small_bytes": 0, "inner_bytes": 96} if layout == "sharded" else {}
    save1(state, tmp_path / "ck", **kw)
    stored = index_of(tmp_path / "ck")["variables"]
    want_layout = "regular" if layout == "sharded" else "small"
    assert {v["layout"] for v in stored.values()} == {want_layout}
    if layout == "sharded":  # several inner chunks per shard
        assert all(p["inner"] != p["block"] for v in stored.values() for p in v["pieces"])
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    result = load1(target, tmp_path / "ck")
    assert sorted(result.loaded) == sorted(state)
    for k in state:
        assert_same_bits(target[k], state[k], k)
    # the same checkpoint read into non-contiguous targets (a staged copy)
    target_t = {k: torch.zeros(shape[::-1], dtype=v.dtype).t() for k, v in state.items()}
    load1(target_t, tmp_path / "ck")
    for k in state:
        assert_same_bits(target_t[k].contiguous(), state[k], k)


def test_zero_d_and_empty_tensors_round_trip(tmp_path: Path) -> None:
    state: dict[str, Any] = {
        "scalar": torch.tensor(float("nan")),
        "empty": torch.zeros(0, 3),
        "empty_bf16": torch.zeros(4, 0, dtype=torch.bfloat16),
        "__reserved": torch.tensor([1, 2, 3]),
        "sl/ash": {"x%y": torch.tensor([True, False])},
    }
    save1(state, tmp_path / "ck")
    target = {
        "scalar": torch.tensor(0.0),
        "empty": torch.ones(0, 3),
        "empty_bf16": torch.ones(4, 0, dtype=torch.bfloat16),
        "__reserved": torch.zeros(3, dtype=torch.int64),
        "sl/ash": {"x%y": torch.zeros(2, dtype=torch.bool)},
    }
    load1(target, tmp_path / "ck")
    for k in ("scalar", "empty", "empty_bf16", "__reserved"):
        assert_same_bits(target[k], state[k], k)
    assert_same_bits(target["sl/ash"]["x%y"], state["sl/ash"]["x%y"])


PY_VALUES: dict[str, Any] = {
    "step": 10,
    "name": "héllo/wörld",
    "nothing": None,
    "flag": True,
    "neg_zero": -0.0,
    "one_float": 1.0,
    "huge": 2**70,
    "nan": float("nan"),
    "inf": float("inf"),
    "ninf": float("-inf"),
    "tuple": (1, 2.5, "x", None, (True, [])),
    "empty": {"l": [], "t": (), "d": {}},
    "int_keys": {1: "a", 2: {3: "b"}},
    "mixed_keys": {1: "int", "1": "str", False: "bool", None: "none", 2.5: "float"},
    "tuple_keys": {(1, "a"): 2, (): 3},
    "nested": [{"a": (1, [2, {"b": float("nan")}])}, [[[]]]],
    "tricky_map": {"float": "nan", "tuple": [1, 2], "map": {"dict": 1}},
}


def test_python_values_keep_their_types(tmp_path: Path) -> None:
    w = torch.arange(6.0)
    opt = {
        "state": {0: {"exp_avg": w * 2, "step": 3}},
        "param_groups": [{"lr": 0.1, "params": [0]}],
    }
    save1({"w": w, "opt": opt, **PY_VALUES}, tmp_path / "ck")
    target: dict[str, Any] = {k: None for k in PY_VALUES}
    target["w"] = torch.zeros(6)
    target["opt"] = {"state": {0: {"exp_avg": torch.zeros(6), "step": None}}, "param_groups": None}
    load1(target, tmp_path / "ck")
    for k, v in PY_VALUES.items():
        assert_same_value(target[k], v, k)
    assert_same_value(target["opt"]["param_groups"], [{"lr": 0.1, "params": [0]}])
    assert_same_value(target["opt"]["state"][0]["step"], 3)
    assert_same_bits(target["opt"]["state"][0]["exp_avg"], w * 2)
    names = [v.name for v in distckpt.list_variables(tmp_path / "ck")]
    assert "opt/state/0/exp_avg" in names and "opt/param_groups" in names


# --------------------------------------------------------------------------- bad input


class Opaque:
    pass


@pytest.mark.parametrize(
    "bad, name, words",
    [
        ({"bad": {1, 2}}, "bad", ["builtins.set"]),
        ({"obj": Opaque()}, "obj", ["Opaque"]),
        ({"cfg": {"x": [1, {2, 3}]}}, "cfg", ["builtins.set"]),
        ({"cfg": {frozenset(): 1}}, "cfg", ["frozenset"]),
        ({"m": torch.nn.Linear(2, 2)}, "m", ["state_dict()"]),
        ({"u16": torch.zeros(3, dtype=torch.uint16)}, "u16", ["uint16"]),
        ({"nest": {3.5: torch.zeros(2)}}, "nest", ["3.5"]),
        ({"sh": distckpt.Shard(torch.zeros(4), (6,), (3,))}, "sh", ["outside", "[6]"]),
        ({"pr": distckpt.PerRank(Opaque())}, "pr", ["Opaque"]),
    ],
    ids=[
        "set",
        "object",
        "nested-set",
        "frozenset-key",
        "module",
        "uint16",
        "float-key",
        "shard-outside",
        "per-rank-object",
    ],
)
def test_unsupported_values_write_nothing(
    tmp_path: Path, bad: dict, name: str, words: list[str]
) -> None:
    save1({"w": torch.ones(3), "kept": 1}, tmp_path / "old")
    before = snapshot(tmp_path)
    state = {"w": torch.ones(100_000), **bad}
    for path, overwrite in ((tmp_path / "new", False), (tmp_path / "old", True)):
        with pytest.raises(UnsupportedValueError) as ei:
            save1(state, path, overwrite=overwrite)
        msg = str(ei.value)
        assert name in msg, msg
        for word in words:
            assert word in msg, msg
        assert isinstance(ei.value, TypeError)
        assert snapshot(tmp_path) == before  # no new checkpoint, no staging, old one intact
    assert leftovers(tmp_path) == []


def test_second_save_raises_then_overwrite_replaces_atomically(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    old: dict[str, Any] = {
        "w": torch.arange(64.0).reshape(8, 8),
        "old_only": torch.ones(70_000),
        "step": 1,
    }
    new: dict[str, Any] = {
        "w": torch.arange(64.0).reshape(8, 8) * -1,
        "new_only": torch.full((5,), 7),
        "step": 2,
    }
    save1(old, ck, small_bytes=1024)
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointExists, match="overwrite=True") as ei:
        save1(new, ck)
    assert isinstance(ei.value, FileExistsError)
    assert str(ck) in str(ei.value)
    assert snapshot(tmp_path) == before
    save1(new, ck, overwrite=True, small_bytes=1024)
    assert os.listdir(tmp_path) == ["ck"]  # no staging, no trash
    assert [v.name for v in distckpt.list_variables(ck)] == ["new_only", "step", "w"]
    assert not (ck / "old_only").exists()  # no file of the old checkpoint survives
    target: dict[str, Any] = {
        "w": torch.zeros(8, 8),
        "new_only": torch.zeros(5, dtype=torch.int64),
        "step": None,
    }
    load1(target, ck)
    assert_same_bits(target["w"], new["w"])
    assert_same_bits(target["new_only"], new["new_only"])
    assert target["step"] == 2
    with pytest.raises(MissingVariablesError):
        load1({"old_only": torch.zeros(70_000)}, ck)


def test_save_never_touches_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    d = tmp_path / "precious"
    d.mkdir()
    (d / "notes.txt").write_text("keep me")
    before = snapshot(tmp_path)
    for overwrite in (False, True):
        with pytest.raises(CheckpointExists, match="not a distckpt checkpoint"):
            save1({"w": torch.ones(2)}, d, overwrite=overwrite)
        assert snapshot(tmp_path) == before


@pytest.fixture(scope="module")
def simple_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ck = tmp_path_factory.mktemp("simple") / "ck"
    save1({"w": torch.arange(20.0), "a": torch.ones(5), "b": torch.ones(2), "step": 7}, ck)
    return ck


def test_shape_mismatch_names_variable_and_both_shapes(simple_ckpt: Path) -> None:
    a = torch.zeros(5)
    state: dict[str, Any] = {"a": a, "w": torch.zeros(10), "b": torch.zeros(2), "step": None}
    with pytest.raises(ShapeMismatchError) as ei:
        load1(state, simple_ckpt)
    assert str(ei.value) == (
        "variable 'w': shape in the state [10] does not match the shape stored in checkpoint: [20]"
    )
    assert isinstance(ei.value, ValueError)
    # every leaf is checked before anything is read: nothing was restored half-way
    assert torch.equal(a, torch.zeros(5)) and state["step"] is None
    # a Shard target's global shape is what must match
    shard = distckpt.Shard(torch.zeros(5), (25,), (0,))
    with pytest.raises(ShapeMismatchError, match=r"'w'.*\[25\].*\[20\]"):
        load1({"w": shard}, simple_ckpt, strict=False)


def test_dtype_and_kind_mismatch(simple_ckpt: Path) -> None:
    with pytest.raises(ShapeMismatchError) as ei:
        load1({"w": torch.zeros(20, dtype=torch.float64)}, simple_ckpt, strict=False)
    assert str(ei.value) == (
        "variable 'w': dtype in the state float64 does not match the dtype stored in "
        "checkpoint: float32"
    )
    with pytest.raises(ShapeMismatchError, match="'step' is a tensor in the state but a value"):
        load1({"step": torch.zeros(1)}, simple_ckpt, strict=False)
    with pytest.raises(ShapeMismatchError, match="'a'.*per-rank in the state"):
        load1({"a": distckpt.PerRank(None)}, simple_ckpt, strict=False)


def test_strict_names_and_partial_restore(simple_ckpt: Path) -> None:
    with pytest.raises(MissingVariablesError) as ei:
        load1({"w": torch.zeros(20), "c": torch.zeros(1), "d": None}, simple_ckpt)
    err = ei.value
    assert err.missing == ["c", "d"] and err.unexpected == ["a", "b", "step"]
    assert "missing from the checkpoint: c, d" in str(err)
    assert "in the checkpoint but not in the state: a, b, step" in str(err)
    assert isinstance(err, KeyError)
    c = torch.full((1,), 5.0)
    w = torch.zeros(20)
    result = load1({"w": w, "c": c}, simple_ckpt, strict=False)
    assert result.loaded == ["w"] and result.missing == ["c"]
    assert result.unexpected == ["a", "b", "step"]
    assert_same_bits(w, torch.arange(20.0))
    assert_same_bits(c, torch.full((1,), 5.0))


def test_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    for path in (tmp_path / "missing", tmp_path / "empty", tmp_path / "file"):
        with pytest.raises(CheckpointNotFoundError) as ei:
            load1({"w": torch.zeros(1)}, path)
        assert str(path) in str(ei.value) and isinstance(ei.value, FileNotFoundError)
        with pytest.raises(CheckpointNotFoundError):
            distckpt.list_variables(path)
    # a zarr group that distckpt did not write: refused with a clear message
    (tmp_path / "group").mkdir()
    (tmp_path / "group" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
    with pytest.raises(CheckpointError, match="not a distckpt"):
        load1({"w": torch.zeros(1)}, tmp_path / "group")
    # an index that is not JSON
    shutil.copytree(GOLDEN / "v1-dtypes", tmp_path / "garbled")
    (tmp_path / "garbled" / "zarr.json").write_bytes(b'{"zarr_format": 3, "attri')
    with pytest.raises(CorruptCheckpointError, match="zarr.json"):
        load1({"w": torch.zeros(1)}, tmp_path / "garbled")


def test_a_save_id_is_recorded_and_checked(simple_ckpt: Path, tmp_path: Path) -> None:
    """Every save records its identity (its token) in the index and returns it; a stored
    one that is not hex digits is a corrupt index, not a value handed on."""
    result = save1({"w": torch.ones(3)}, tmp_path / "a")
    doc = json.loads((tmp_path / "a" / "zarr.json").read_bytes())
    assert doc["attributes"]["distckpt"]["save_id"] == result.save_id
    assert result.save_id and len(result.save_id) == 16
    ck = tmp_path / "ck"
    shutil.copytree(simple_ckpt, ck)
    doc = json.loads((ck / "zarr.json").read_bytes())
    doc["attributes"]["distckpt"]["save_id"] = "../../etc"
    (ck / "zarr.json").write_bytes(reseal(json.dumps(doc).encode()))
    with pytest.raises(CorruptCheckpointError, match="save id"):
        distckpt.list_variables(ck)


def test_newer_format_version_is_refused_clearly(simple_ckpt: Path, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(simple_ckpt, ck)
    doc = json.loads((ck / "zarr.json").read_bytes())
    doc["attributes"]["distckpt"]["format_version"] = 999
    (ck / "zarr.json").write_bytes(reseal(json.dumps(doc).encode()))
    for call in (
        lambda: load1({"w": torch.zeros(20)}, ck, strict=False),
        lambda: distckpt.list_variables(ck),
    ):
        with pytest.raises(UnsupportedFormatError) as ei:
            call()
        msg = str(ei.value)
        assert "format version 999" in msg and "up to 5" in msg and "upgrade" in msg, msg
    # still a committed checkpoint as far as save is concerned: not overwritten silently
    with pytest.raises(CheckpointExists):
        save1({"w": torch.zeros(2)}, ck)


def test_list_variables(tmp_path: Path) -> None:
    state = {
        "model": {"l1.weight": torch.zeros(3, 4), "emb": torch.zeros(2, dtype=torch.bfloat16)},
        "scalar": torch.tensor(1, dtype=torch.int8),
        "rng": distckpt.PerRank(torch.zeros(3, dtype=torch.uint8)),
        "it": distckpt.PerRank({"pos": 3}),
        "step": 5,
        "cfg": {"a": [1, 2]},
        "sh": distckpt.Shard(torch.zeros(2, 3), (2, 3), (0, 0)),
    }
    save1(state, tmp_path / "ck")
    got = distckpt.list_variables(tmp_path / "ck")
    assert got == [
        ("cfg", None, "value"),
        ("it", None, "per_rank"),
        ("model/emb", (2,), "bfloat16"),
        ("model/l1.weight", (3, 4), "float32"),
        ("rng", None, "per_rank"),
        ("scalar", (), "int8"),
        ("sh", (2, 3), "float32"),
        ("step", None, "value"),
    ]
    assert all(isinstance(v, distckpt.Variable) for v in got)
    assert got[3].name == "model/l1.weight" and got[3].shape == (3, 4) and got[3].dtype == "float32"


# --------------------------------------------------------------------------- corruption

BIG = torch.arange(16 * 64, dtype=torch.float32).reshape(16, 64) / 7  # 4 inner chunks of 4 rows
SMALL = torch.arange(10, dtype=torch.float32)
OTHER = torch.arange(8 * 32, dtype=torch.int64).reshape(8, 32)


@pytest.fixture(scope="module")
def corrupt_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ck = tmp_path_factory.mktemp("corrupt") / "ck"
    save1({"big": BIG, "small": SMALL, "other": OTHER}, ck, small_bytes=1024, inner_bytes=1024)
    var = index_of(ck)["variables"]
    assert var["big"]["layout"] == "regular" and var["small"]["layout"] == "small"
    assert var["big"]["pieces"][0]["inner"] == [4, 64]
    return ck


@pytest.fixture
def damaged(corrupt_template: Path, tmp_path: Path) -> Path:
    ck = tmp_path / "ck"
    shutil.copytree(corrupt_template, ck)
    return ck


def _damage(ck: Path, how: str) -> tuple[str, Path, str]:
    """Damage ``ck``; return (variable, file, expected words of the message)."""
    big = ck / "big" / "c.0.0"
    small = ck / "small" / "c.0"
    p = piece(ck, "big")
    chunks = inner_chunk_offsets(big, p["block"], p["inner"])
    if how == "flip-inner-data":
        flip_byte(big, chunks[2][0] + 100)
        return "big", big, "inner chunk (2, 0) fails its crc32c checksum"
    if how == "flip-inner-crc":
        flip_byte(big, chunks[1][0] + chunks[1][1] - 2)
        return "big", big, "inner chunk (1, 0) fails its crc32c checksum"
    if how == "flip-shard-index":
        flip_byte(big, big.stat().st_size - 20)
        return "big", big, "shard index fails its crc32c checksum"
    if how == "flip-small":
        flip_byte(small, 13)
        return "small", small, "chunk fails its crc32c checksum"
    if how == "truncate-shard-tail":
        big.write_bytes(big.read_bytes()[:-7])
        return "big", big, "shard index fails its crc32c checksum"
    if how == "truncate-shard":
        big.write_bytes(big.read_bytes()[:40])
        return "big", big, "shard is truncated (40 bytes)"
    if how == "truncate-small":
        small.write_bytes(small.read_bytes()[:-1])
        return "small", small, "chunk is 43 bytes, expected 44"
    if how == "delete-shard":
        big.unlink()
        return "big", big, "a file the index names is missing"
    if how == "delete-small":
        small.unlink()
        return "small", small, "a file the index names is missing"
    if how == "swap-shard":  # a valid shard of another save of the same shape
        save1({"big": BIG + 1}, ck.parent / "twin", small_bytes=1024, inner_bytes=1024)
        shutil.copyfile(ck.parent / "twin" / "big" / "c.0.0", big)
        return "big", big, "shard checksum table does not match the checkpoint index"
    if how == "flip-checksum-table":
        flip_byte(big, 1)
        return "big", big, "shard checksum table does not match the checkpoint index"
    raise AssertionError(how)


@pytest.mark.parametrize(
    "how",
    [
        "flip-inner-data",
        "flip-inner-crc",
        "flip-shard-index",
        "flip-small",
        "truncate-shard-tail",
        "truncate-shard",
        "truncate-small",
        "delete-shard",
        "delete-small",
        "swap-shard",
        "flip-checksum-table",
    ],
)
def test_corruption_is_detected_and_named(damaged: Path, how: str) -> None:
    name, file, words = _damage(damaged, how)
    target = {
        "big": torch.zeros(16, 64),
        "small": torch.zeros(10),
        "other": torch.zeros(8, 32, dtype=torch.int64),
    }
    with pytest.raises(CorruptCheckpointError) as ei:
        load1(target, damaged)
    msg = str(ei.value)
    assert f"variable {name!r}" in msg and str(file) in msg and words in msg, msg
    assert isinstance(ei.value, OSError)
    # the damage is local: the other variables still load bit-exactly
    other = torch.zeros(8, 32, dtype=torch.int64)
    load1({"other": other}, damaged, strict=False)
    assert_same_bits(other, OTHER)
    undamaged = "small" if name == "big" else "big"
    t = torch.zeros_like(dict(big=BIG, small=SMALL)[undamaged])
    load1({undamaged: t}, damaged, strict=False)
    assert_same_bits(t, dict(big=BIG, small=SMALL)[undamaged])


def test_checksums_are_per_inner_chunk(damaged: Path) -> None:
    """A resharded read that does not need the damaged inner chunk still succeeds."""
    _damage(damaged, "flip-inner-data")  # rows 8:12 (inner chunk 2)
    for start, length in ((0, 8), (12, 4), (2, 6)):
        t = torch.full((length, 64), -1.0)
        result = load1({"big": distckpt.Shard(t, (16, 64), (start, 0))}, damaged, strict=False)
        assert_same_bits(t, BIG[start : start + length])
        assert result.bytes_read < 16 * 64 * 4  # read only what it needed
    for start, length in ((8, 4), (10, 1), (6, 4)):
        t = torch.full((length, 64), -1.0)
        with pytest.raises(CorruptCheckpointError, match=r"'big': inner chunk \(2, 0\)"):
            load1({"big": distckpt.Shard(t, (16, 64), (start, 0))}, damaged, strict=False)


# --------------------------------------------------------------------------- zarr / tensorstore


def test_zarr_python_and_tensorstore_read_the_global_tensor(tmp_path: Path) -> None:
    import tensorstore as ts
    import zarr

    from distckpt.format import zarr_dtypes

    zarr_dtypes.register()
    f32 = random_tensor(torch.float32, (33, 20), 1)
    bf16 = random_tensor(torch.bfloat16, (33, 20), 2)
    state: dict[str, Any] = {"f32": f32, "nested": {"bf16": bf16}, "tiny": torch.arange(3.0)}
    save1(state, tmp_path / "ck", small_bytes=64, inner_bytes=256)
    layouts = {k: v["layout"] for k, v in index_of(tmp_path / "ck")["variables"].items()}
    assert layouts == {"f32": "regular", "nested/bf16": "regular", "tiny": "small"}
    for name, want in (("f32", f32), ("nested/bf16", bf16), ("tiny", state["tiny"])):
        arr: Any = zarr.open_array(str(tmp_path / "ck" / name), mode="r")[...]
        assert arr.shape == tuple(want.shape)
        assert np.ascontiguousarray(arr).tobytes() == tensor_bytes(want), name
        spec = {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": str(tmp_path / "ck" / name)},
        }
        got: Any = ts.open(spec, read=True).result().read().result()
        assert got.shape == tuple(want.shape)
        assert np.ascontiguousarray(got).tobytes() == tensor_bytes(want), name


# --------------------------------------------------------------------------- full disk


def _enospc(*_args: Any, **_kw: Any) -> Any:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["create", "second-pwritev", "write_plain"])
def test_full_disk_keeps_committed_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    old: dict[str, Any] = {
        "a": random_tensor(torch.float32, (64, 32), 3),
        "b": random_tensor(torch.int16, (4, 1000), 4),
        "c": torch.arange(5),
        "step": 1,
    }
    other = {"x": random_tensor(torch.bfloat16, (50, 10), 5)}
    new = {k: (v + 1 if isinstance(v, torch.Tensor) else 2) for k, v in old.items()}
    kw = {"small_bytes": 1024, "inner_bytes": 1024}
    save1(old, tmp_path / "ck", **kw)
    save1(other, tmp_path / "other", **kw)
    before = snapshot(tmp_path)
    if where == "second-pwritev":
        real = os.pwritev
        calls = []

        def pwritev(fd: int, buffers: Any, offset: int) -> int:
            calls.append(fd)
            if len(calls) >= 2:  # the first write is on disk, the second one fails
                _enospc()
            return real(fd, buffers, offset)

        monkeypatch.setattr(os, "pwritev", pwritev)
    elif where == "create":
        from distckpt.storage.posix import PosixStore

        monkeypatch.setattr(PosixStore, "create", _enospc)
    else:
        monkeypatch.setattr(shard_io, where, _enospc)
    for path, overwrite in ((tmp_path / "ck", True), (tmp_path / "new", False)):
        if where == "second-pwritev":
            calls.clear()
        with pytest.raises(OSError) as ei:
            save1(new, path, overwrite=overwrite, **kw)
        assert ei.value.errno == errno.ENOSPC
        assert not isinstance(ei.value, CheckpointError)
        if where == "second-pwritev":  # the file the disk refused is named
            assert str(path.name) in str(ei.value.filename), ei.value
        assert snapshot(tmp_path) == before  # byte for byte, and no staging left
        assert leftovers(tmp_path) == []
    monkeypatch.undo()
    for path, state in ((tmp_path / "ck", old), (tmp_path / "other", other)):
        target = {
            k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None)
            for k, v in state.items()
        }
        load1(target, path)
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                assert_same_bits(target[k], v, k)
            else:
                assert target[k] == v


def test_failure_in_commit_collective_removes_staging(tmp_path: Path) -> None:
    """A communicator failure in the commit phase (the gather of the write reports) must not
    leave this process's staging directory behind with a heartbeat that keeps beating: that
    directory would look alive to every later save's garbage collection for as long as the
    process lives."""

    class DiesAtCommit(SingleComm):
        gathers = 0

        def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
            self.gathers += 1
            if self.gathers == 2:  # describe/plan is the first gather, write reports the second
                raise CommTimeoutError("simulated: a rank died before the commit")
            return super().gather(obj, root)

    save1({"w": torch.ones(3)}, tmp_path / "ck")
    before = snapshot(tmp_path)
    with pytest.raises(CommTimeoutError):
        distckpt.save({"w": torch.zeros(3)}, tmp_path / "ck", DiesAtCommit(), overwrite=True)
    beating = [t for t in threading.enumerate() if t.name == "distckpt-heartbeat"]
    leftover = leftovers(tmp_path)
    for d in leftover:  # clean up for the next tests whatever the outcome
        shutil.rmtree(d)
    assert not leftover, f"staging left behind: {leftover}"
    assert not beating, "heartbeat thread still running after the save failed"
    assert snapshot(tmp_path) == before


# --------------------------------------------------------------------------- staging gc


def _fake_staging(parent: Path, name: str, token: str, *, pid: int, host: str, age: float) -> Path:
    d = parent / f".{name}.staging-{token}"
    (d / "w").mkdir(parents=True)
    (d / "w" / "c.0").write_bytes(b"\0" * 100)  # a piece, half written
    owner = d / OWNER_FILE
    owner.write_text(
        json.dumps(
            {
                "host": host,
                "pid": pid,
                "started": time.time() - age,
                "world_size": 2,
                "target": name,
            }
        )
    )
    t = time.time() - age
    os.utime(owner, (t, t))
    return d


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_garbage_collection_of_staging_dirs(tmp_path: Path) -> None:
    me, host, dead = os.getpid(), socket.gethostname(), _dead_pid()
    save1({"w": torch.ones(2)}, tmp_path / "ck")
    stale = _fake_staging(tmp_path, "ck", "a1", pid=me, host=host, age=3600)
    dead_owner = _fake_staging(tmp_path, "ck2", "b2", pid=dead, host=host, age=0)
    stale_remote = _fake_staging(tmp_path, "ck", "c3", pid=dead, host="elsewhere.invalid", age=3600)
    fresh = _fake_staging(tmp_path, "ck", "d4", pid=me, host=host, age=0)
    fresh_remote = _fake_staging(tmp_path, "ck3", "e5", pid=dead, host="elsewhere.invalid", age=0)
    trash = tmp_path / ".ck.trash-f6"
    shutil.copytree(tmp_path / "ck", trash)
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".ck.staging-nothex").mkdir()
    live = Staging(tmp_path / "ck4", "0123abcd", 2)  # a real one, with its heartbeat
    try:
        save1({"v": torch.zeros(3)}, tmp_path / "next")  # the next save into the same parent
        present = {p.name for p in tmp_path.iterdir()}
        for gone in (stale, dead_owner, stale_remote, trash):
            assert gone.name not in present, gone
        for kept in (fresh, fresh_remote, live.path):
            assert kept.name in present and (kept / OWNER_FILE).exists(), kept
        assert {"ck", "next", ".hidden", ".ck.staging-nothex"} <= present
        assert collect_garbage(tmp_path) == []
        load1({"w": torch.zeros(2)}, tmp_path / "ck")
        # once its heartbeat is old, the fresh one goes too
        t = time.time() - 3600
        os.utime(fresh / OWNER_FILE, (t, t))
        assert collect_garbage(tmp_path) == [fresh]
    finally:
        live.abort()
    assert not live.path.exists()


def test_gc_restores_a_checkpoint_from_an_interrupted_commit(tmp_path: Path) -> None:
    """A complete staging dir (index written, owner file removed) whose rename never happened
    is put back under its name, not deleted."""
    save1({"w": torch.arange(4.0)}, tmp_path / "ck")
    staged = tmp_path / ".ck.staging-abc123"
    os.rename(tmp_path / "ck", staged)
    t = time.time() - 3600
    os.utime(staged, (t, t))
    assert collect_garbage(tmp_path) == []
    w = torch.zeros(4)
    load1({"w": w}, tmp_path / "ck")
    assert_same_bits(w, torch.arange(4.0))
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda e: e.update(crc=e["crc"] + [1]), "crc column does not hold 4 entries"),
        (lambda e: e.update(size=["88"] * 4), "size column holds something other than counts"),
        (lambda e: e.update(crc="AAAA"), "crc column does not hold 4 entries"),
        (lambda e: e.update(crc="!" * 24), "crc column is not base64"),
        (lambda e: e.update(chunks=[0]), "chunks [0] are empty"),
        (lambda e: e.pop("size"), "size column does not hold 4 entries"),
    ],
)
def test_a_malformed_regular_entry_is_refused_before_any_read(
    tmp_path: Path, edit: Any, words: str
) -> None:
    """A compact regular entry (shard shape, crc and size columns) read from an untrusted
    index: every inconsistency is an error naming the variable, and nothing is read."""
    ck = tmp_path / "ck"
    save1({"w": torch.arange(4096.0), "a": torch.ones(3)}, ck, small_bytes=0, inner_bytes=1024)
    doc = json.loads((ck / "zarr.json").read_bytes())
    entry = doc["attributes"]["distckpt"]["variables"]["w"]
    assert entry["layout"] == "regular" and entry["chunks"] == [4096]
    entry["chunks"] = [1024]  # described as four shards of the one there is, then broken
    entry["crc"], entry["size"] = entry["crc"] * 4, entry["size"] * 4
    entry["digest"] = entry["digest"] * 4
    edit(entry)
    (ck / "zarr.json").write_bytes(reseal(json.dumps(doc).encode()))
    before = torch.full((3,), -1.0)
    with pytest.raises(CorruptCheckpointError, match="variable 'w'") as ei:
        load1({"a": before, "w": torch.zeros(4096)}, ck)
    assert words in str(ei.value)
    assert (before == -1).all()


def test_every_error_is_public() -> None:
    """Each error distckpt raises on purpose is importable from ``distckpt`` and is a
    CheckpointError (the storage seam's ConditionFailed and the lock's error included)."""
    import inspect

    from distckpt import errors
    from distckpt.storage import backend
    from distckpt.training import lock

    defined = {
        name
        for name, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, errors.CheckpointError) and cls.__module__ == errors.__name__
    }
    assert defined <= set(distckpt.__all__), defined - set(distckpt.__all__)
    assert {"ConditionFailed", "ConversionError", "DirectoryLockedError"} <= defined
    assert backend.ConditionFailed is distckpt.ConditionFailed
    assert lock.DirectoryLockedError is distckpt.DirectoryLockedError
    assert issubclass(distckpt.ConditionFailed, FileExistsError)
