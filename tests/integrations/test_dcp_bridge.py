"""``torch.distributed.checkpoint`` through distckpt (:mod:`distckpt.integrations.dcp`),
with the real DCP: 2 torchrun ranks save an FSDP2 model and its Adam state with
``dcp.save`` (to a directory and to S3), a plain state with DCP's planner options
changed, and a pickled object; 3 mpiexec ranks load them back, resharded, bit for bit,
with ``distckpt.load`` and with ``dcp.load`` (tests/scripts/dcp_ranks.py). What DCP wrote
is an ordinary distckpt checkpoint: ``distckpt verify`` passes on it."""

from __future__ import annotations

import dataclasses
import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import distckpt
from distckpt.integrations.dcp import DistckptReader, DistckptWriter
from distckpt.tools.catalog import open_catalog
from tests.support.launch_util import HAVE_MPIEXEC, SCRIPTS, assert_all_ok, run_mpi_ranks, run_ranks

dcp = pytest.importorskip("torch.distributed.checkpoint")


@pytest.mark.timeout(400)
def test_dcp_saves_and_loads_through_distckpt(tmp_path: Path, s3: Any) -> None:
    env = {**s3.env, "DISTCKPT_TIMEOUT": "120"}
    script = SCRIPTS / "dcp_ranks.py"
    saved = run_ranks(2, script, "save", str(tmp_path), s3.url, env=env, timeout=180)
    assert_all_ok(saved, 2)
    for name in ("fsdp", "native", "plain", "objects"):
        proc = subprocess.run(
            [sys.executable, "-m", "distckpt", "verify", str(tmp_path / name)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
    launch = run_mpi_ranks if HAVE_MPIEXEC else run_ranks
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


@pytest.mark.timeout(300)
def test_process_groups_no_dist_and_per_rank_saves(tmp_path: Path) -> None:
    """DCP's ``process_group``, ``no_dist`` and ``use_collectives=False`` decide who saves
    together (3 ranks: a group of two and one alone, one-rank replica groups, rank 0 alone,
    each rank its own); ``async_save`` in thread mode; a legacy ShardedTensor; values that
    differ between ranks refused (tests/scripts/dcp_groups.py). Before: every save ran over
    the whole world, so one path stayed empty, ``no_dist`` on one rank waited for the
    others until the time-out, and a ShardedTensor failed inside the write."""
    env = {"DISTCKPT_TIMEOUT": "60"}
    proc = run_ranks(3, SCRIPTS / "dcp_groups.py", str(tmp_path), env=env, timeout=240)
    assert_all_ok(proc, 3)


def _fs_and_bridge(tmp_path: Path, name: str) -> list[tuple[Any, Any]]:
    """A writer and reader pair of DCP's own storage and of the bridge, at ``name``."""
    fs, ours = tmp_path / f"fs-{name}", tmp_path / f"distckpt-{name}"
    return [
        (dcp.FileSystemWriter(fs), dcp.FileSystemReader(fs)),
        (DistckptWriter(ours), DistckptReader(ours)),
    ]


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_load_casts_into_the_destination_dtype(tmp_path: Path) -> None:
    """An fp32 checkpoint loads into a bf16 model, and into the fp16 buffer a LoadPlanner
    hands over, exactly as with DCP's own storage. Before: ShapeMismatchError."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class Staging(DefaultLoadPlanner):
        """Hands DCP an fp16 buffer for ``w`` and copies it into the state on commit."""

        def resolve_tensor(self, read_item: Any) -> torch.Tensor:
            self.buffer = torch.empty(read_item.lengths, dtype=torch.float16)
            return self.buffer

        def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
            self.state_dict[read_item.dest_index.fqn].copy_(tensor)

    saved = {"w": torch.randn(64, generator=torch.Generator().manual_seed(3))}
    results = []
    for writer, reader in _fs_and_bridge(tmp_path, "cast"):
        dcp.save(saved, storage_writer=writer)
        bf16 = {"w": torch.zeros(64, dtype=torch.bfloat16)}
        dcp.load(bf16, storage_reader=reader)
        staged = {"w": torch.zeros(64)}
        reader.reset()
        dcp.load(staged, storage_reader=reader, planner=Staging())
        results.append((_bits(bf16["w"]), _bits(staged["w"])))
    assert results[0] == results[1]
    assert results[1][0] == _bits(saved["w"].bfloat16())
    assert results[1][1] == _bits(saved["w"].half().float())


def test_save_planner_decides_what_is_written(tmp_path: Path) -> None:
    """Items a SavePlanner drops are not written, and ``resolve_data`` (here the FP16
    planner of SavePlanner's docstring) decides the bytes, as with DCP's own storage.
    Before: the planner's whole state was written, in fp32."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class FP16Without(DefaultSavePlanner):
        def create_local_plan(self) -> Any:
            plan = super().create_local_plan()
            kept = [item for item in plan.items if item.index.fqn != "scratch"]
            return dataclasses.replace(plan, items=kept)

        def resolve_data(self, write_item: Any) -> Any:
            data = super().resolve_data(write_item)
            return data.half() if isinstance(data, torch.Tensor) else data

    state = {"w": torch.linspace(0, 1, 9), "scratch": torch.ones(4), "step": 7}
    for writer, reader in _fs_and_bridge(tmp_path, "plan"):
        dcp.save(state, storage_writer=writer, planner=FP16Without())
        metadata = reader.read_metadata()
        assert "scratch" not in metadata.state_dict_metadata
        got: dict[str, Any] = {"w": torch.zeros(9, dtype=torch.float16), "step": 0}
        dcp.load(got, storage_reader=reader)
        assert _bits(got["w"]) == _bits(state["w"].half()) and got["step"] == 7
    catalog = open_catalog(tmp_path / "distckpt-plan")
    assert {n: v.dtype for n, v in catalog.tensors.items()} == {"w": "float16"}


def test_metadata_is_dcps(tmp_path: Path) -> None:
    """``read_metadata`` gives DCP's version, ``planner_data`` and the storage's ids, so
    ``_load_state_dict_from_keys`` rebuilds the nested state (all of it, or some keys), as
    from DCP's own files. Before: ``planner_data=None``, ``version=None``, a flat result."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    state = {"model": {"a": torch.ones(2), "b": {"c": torch.arange(3)}}, "step": 5}
    got = []
    for writer, reader in _fs_and_bridge(tmp_path, "keys"):
        dcp.save(state, storage_writer=writer)
        metadata = reader.read_metadata()
        assert metadata.version == "1.0.0"
        assert metadata.planner_data["model.b.c"] == ("model", "b", "c")
        assert metadata.storage_meta.load_id
        whole = _load_state_dict_from_keys(storage_reader=reader)
        some = _load_state_dict_from_keys({"model.b"}, storage_reader=reader)
        got.append((whole, some))
    for whole, some in got:
        assert sorted(whole) == ["model", "step"] and whole["step"] == 5
        assert torch.equal(whole["model"]["b"]["c"], torch.arange(3))
        assert list(some) == ["model"] and list(some["model"]) == ["b"]
    writer = DistckptWriter(tmp_path / "ids")
    first = writer.storage_meta()
    writer.reset()
    assert first is not None and first.save_id and first.save_id != writer.storage_meta().save_id
    # The save's identity is the one its index records, read back as DCP's own is.
    dcp.save({"a": torch.zeros(2)}, storage_writer=writer)
    reader = DistckptReader(tmp_path / "ids")
    meta = reader.read_metadata().storage_meta
    assert meta.save_id == writer.save_id and meta.load_id == reader.load_id


def test_bytes_are_typed_values(tmp_path: Path) -> None:
    """``bytes`` and ``io.BytesIO`` (a data loader's state, a blob) are stored without
    pickle and read back without ``allow_pickle``. Before: they were stored pickled and
    refused on load."""
    state = {"w": torch.ones(2), "blob": b"\x00\xffdata", "loader": io.BytesIO(b"pos=17")}
    dcp.save(state, storage_writer=DistckptWriter(tmp_path / "b"))
    index = (tmp_path / "b" / "zarr.json").read_text()
    assert '"pickle"' not in index and '"bytesio"' in index
    got: dict[str, Any] = {"w": torch.zeros(2), "blob": b"", "loader": io.BytesIO()}
    dcp.load(got, storage_reader=DistckptReader(tmp_path / "b"))
    assert got["blob"] == b"\x00\xffdata" and got["loader"].getvalue() == b"pos=17"


def test_overwrite_is_dcps_default_and_atomic(tmp_path: Path) -> None:
    """A save over an existing checkpoint replaces it (DCP's default), atomically; with
    ``overwrite=False`` it is refused with a ``FileExistsError`` inside DCP's
    ``CheckpointException`` and the checkpoint is left as it was."""
    from torch.distributed.checkpoint.api import CheckpointException

    path = tmp_path / "o"
    dcp.save({"w": torch.zeros(3)}, storage_writer=DistckptWriter(path))
    dcp.save({"w": torch.ones(3)}, storage_writer=DistckptWriter(path))
    with pytest.raises(CheckpointException) as caught:
        dcp.save({"w": torch.full((3,), 2.0)}, storage_writer=DistckptWriter(path, overwrite=False))
    (wrapped,) = caught.value.failures.values()
    failure = wrapped[0]  # DCP keeps each rank's exception with its traceback
    assert isinstance(failure, FileExistsError) and isinstance(failure, distckpt.CheckpointExists)
    got = {"w": torch.zeros(3)}
    dcp.load(got, storage_reader=DistckptReader(path))
    assert torch.equal(got["w"], torch.ones(3))


def test_refused_overwrite_speaks_as_dcps_writer(tmp_path: Path) -> None:
    """``overwrite=False`` over a checkpoint fails as ``FileSystemWriter``'s does: DCP's
    ``CheckpointException`` says "Checkpoint already exists" (what PyTorch's DCP tests look
    for), and the rank's error is the ``RuntimeError`` DCP raises as well as distckpt's
    ``CheckpointExists``. A directory that is not a checkpoint keeps distckpt's words."""
    from torch.distributed.checkpoint.api import CheckpointException

    from distckpt.integrations.dcp import CheckpointAlreadyExists

    path = tmp_path / "o"
    dcp.save({"w": torch.zeros(3)}, storage_writer=DistckptWriter(path))
    with pytest.raises(CheckpointException) as caught:
        dcp.save({"w": torch.ones(3)}, storage_writer=DistckptWriter(path, overwrite=False))
    assert "Checkpoint already exists" in str(caught.value)
    (wrapped,) = caught.value.failures.values()
    failure = wrapped[0]
    assert isinstance(failure, CheckpointAlreadyExists)
    assert isinstance(failure, RuntimeError) and isinstance(failure, distckpt.CheckpointExists)
    assert str(path) in str(failure)
    other = tmp_path / "other"
    (other / "x").mkdir(parents=True)
    with pytest.raises(CheckpointException) as caught:
        dcp.save({"w": torch.ones(3)}, storage_writer=DistckptWriter(other, overwrite=False))
    (wrapped,) = caught.value.failures.values()
    assert "not a distckpt checkpoint" in str(wrapped[0])
    assert not isinstance(wrapped[0], CheckpointAlreadyExists)


def test_filesystem_writer_arguments(tmp_path: Path) -> None:
    """A script written for ``FileSystemWriter``/``FileSystemReader`` runs with the bridge
    unchanged: ``thread_count`` is ``io_workers``, ``_extensions=[ZStandard()]`` is zstd,
    the layout settings are taken and change nothing; another extension is refused."""
    from torch.distributed.checkpoint._extension import ZStandard

    writer = DistckptWriter(
        tmp_path / "z",
        thread_count=2,
        sync_files=False,
        single_file_per_rank=False,
        per_thread_copy_ahead=1,
        _extensions=[ZStandard.__new__(ZStandard)],  # its module (zstandard) is not needed
    )
    assert writer.options.io_workers == 2 and writer.options.compression == "zstd"
    state = {"w": torch.zeros(4096)}
    dcp.save(state, storage_writer=writer)
    got = {"w": torch.ones(4096)}
    dcp.load(got, storage_reader=DistckptReader(tmp_path / "z", _extension_registry=None))
    assert torch.equal(got["w"], state["w"])
    with pytest.raises(ValueError, match="has no distckpt equivalent"):
        DistckptWriter(tmp_path / "x", _extensions=[object()])
    assert DistckptWriter(tmp_path / "x", _extensions=[object()], ignore_extensions=True)


_OVERLAPPING = """
import json, sys, torch, distckpt
import torch.distributed.checkpoint as dcp
from distckpt.integrations.dcp import DistckptReader
from distckpt.testing.hostile import Crafted
path = sys.argv[1]
distckpt.save({"w": torch.arange(8.0)}, path)
def overlap(variables):
    pieces = variables["w"]["pieces"]
    pieces.append(json.loads(json.dumps(pieces[0])))  # the one piece listed twice
Crafted(path).edit_index(overlap)
try:
    dcp.load({"w": torch.zeros(8)}, storage_reader=DistckptReader(path))
except BaseException as exc:
    (wrapped,) = exc.failures.values()
    print(type(exc).__name__, type(wrapped[0]).__name__)
    raise
"""


def test_a_damaged_index_is_the_one_error_dcp_raises(tmp_path: Path) -> None:
    """An index whose pieces overlap (resealed as an attacker would): DCP's load catches
    the reader's refusal, logs it and falls back to a per-rank checkpoint at
    ``path/rank-0``; the reader answers that fallback with the refusal itself. What DCP
    raises wraps the CorruptCheckpointError, and nothing printed speaks of a missing
    ``rank-0``. Before: a traceback ending ``CheckpointNotFoundError: no checkpoint at
    .../rank-0``, then DCP's AssertionError quoting both."""
    run = subprocess.run(
        [sys.executable, "-c", _OVERLAPPING, str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1 and run.stdout.split() == [
        "CheckpointException",
        "CorruptCheckpointError",
    ], (run.stdout, run.stderr[-3000:])
    cause = "variable 'w': its pieces do not tile its shape [8] exactly once: pieces w/c.0"
    last = run.stderr.strip().splitlines()[-1]  # what the traceback ends with
    assert last.startswith("distckpt.errors.CorruptCheckpointError: ") and cause in last, last
    assert "overlap" in last
    for absent in ("rank-0", "CheckpointNotFoundError", "AssertionError", "metadata is None"):
        assert absent not in run.stderr, (absent, run.stderr[-3000:])


def test_no_checkpoint_anywhere_is_dcps_own_error(tmp_path: Path) -> None:
    """With no checkpoint at the path nor at ``path/rank-0``, DCP's report names both."""
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as caught:
        dcp.load({"w": torch.zeros(2)}, storage_reader=DistckptReader(tmp_path / "none"))
    (wrapped,) = caught.value.failures.values()
    text = str(wrapped[0])
    assert "global metadata read failed: no checkpoint at" in text and "rank-0" in text
