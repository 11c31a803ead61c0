"""Hostile checkpoints, coverage: listed pieces (or a local step's boxes) whose element
counts add up to the shape but that overlap, repeat or leave a gap are refused by every
reader, naming the variable; none fills the gap with whatever memory held. Each index is
edited as an attacker would (every checksum recomputed: the pieces' crc32c, then the
document through :func:`distckpt.testing.hostile.reseal`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import distckpt
from distckpt import CorruptCheckpointError
from distckpt.format.shard_io import crc32c
from distckpt.testing.hostile import reseal
from tests.hostile.test_hostile import BOUND, cli, one_error_line
from tests.support.hostile_util import local_manager
from tests.support.launch_util import bounded

#: Listed pieces of ``b`` (shape [8]) whose element counts add up to 8, yet leave a gap.
LAYOUTS: dict[str, list[tuple[int, int]]] = {
    "overlap": [(0, 5), (2, 3)],  # [0:5] and [2:5]: [5:8] is never read
    "duplicate": [(0, 4), (0, 4)],  # [0:4] twice: [4:8] is never read
    "shifted": [(3, 4), (0, 4)],  # [0:4] and [3:7]: [7:8] is never read
}
#: A window of ``b`` (start, length) in which the counts add up too (a resharded load).
WINDOWS = {"overlap": (3, 4), "duplicate": (2, 4), "shifted": (3, 5)}
SAVED = np.arange(8, dtype=np.float32) + 100  # what ``b`` holds: the pieces hold its parts


def index_path(ck: Path) -> Path:
    return ck / "zarr.json"


def edit_variables(ck: Path, edit: Any) -> None:
    doc = json.loads(index_path(ck).read_bytes())
    edit(doc["attributes"]["distckpt"]["variables"])
    index_path(ck).write_bytes(reseal(json.dumps(doc).encode()))


def plain_pieces(ck: Path, folder: str, runs: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """Listed pieces of a 1-d float32 variable, one file each (its bytes and their
    crc32c, as a plain chunk), holding ``SAVED[start : start + length]``."""
    pieces = []
    for k, (start, length) in enumerate(runs):
        data = SAVED[start : start + length].tobytes()
        crc = crc32c(np.frombuffer(data, np.uint8))
        (ck / folder / f"p{k}").write_bytes(data + crc.to_bytes(4, "little"))
        pieces.append(
            {
                "file": f"{folder}/p{k}",
                "box": [[start], [length]],
                "block": [length],
                "inner": None,
                "crc": crc,
                "size": len(data) + 4,
            }
        )
    return pieces


def crafted(tmp_path: Path, layout: str, per_rank: bool = False) -> Path:
    """A checkpoint of ``b`` (or per-rank ``b``) with the pieces of ``layout``."""
    ck = tmp_path / "ck"
    value = torch.from_numpy(SAVED.copy())
    distckpt.save({"b": distckpt.PerRank(value) if per_rank else value}, ck)
    folder = "b/r0" if per_rank else "b"
    pieces = plain_pieces(ck, folder, LAYOUTS[layout])

    def edit(variables: dict[str, Any]) -> None:
        entry = variables["b"]["ranks"]["0"] if per_rank else variables["b"]
        entry["pieces"] = pieces

    edit_variables(ck, edit)
    return ck


def refused(run: Any) -> None:
    """``run()`` raises CorruptCheckpointError naming ``b`` and what is wrong."""
    with bounded(BOUND), pytest.raises(CorruptCheckpointError, match="variable 'b'") as caught:
        run()
    assert any(w in str(caught.value) for w in ("overlap", "listed twice", "no piece covers"))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_pieces_that_add_up_but_leave_a_gap_are_refused_by_every_reader(
    tmp_path: Path, layout: str
) -> None:
    ck = crafted(tmp_path, layout)
    target = torch.full((8,), -1.0)
    refused(lambda: distckpt.load({"b": target}, ck))
    refused(lambda: distckpt.Checkpoint(b=target).restore(ck))
    start, length = WINDOWS[layout]
    shard = torch.full((length,), -1.0)
    refused(lambda: distckpt.load({"b": distckpt.Shard(shard, (8,), (start,))}, ck))
    assert torch.equal(target, torch.full((8,), -1.0))
    assert torch.equal(shard, torch.full((length,), -1.0))
    one_error_line(cli("export", ck, tmp_path / "out.safetensors"), "variable 'b'")
    assert not (tmp_path / "out.safetensors").exists()
    checked = cli("verify", ck)  # a coverage problem is reported, as damage is: exit 1
    assert checked.returncode == 1, (checked.stdout, checked.stderr)
    assert "variable 'b'" in checked.stderr and "1 problem(s)" in checked.stdout


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_per_rank_pieces_that_leave_a_gap_are_refused(tmp_path: Path, layout: str) -> None:
    ck = crafted(tmp_path, layout, per_rank=True)
    target = distckpt.PerRank(torch.full((8,), -1.0))
    refused(lambda: distckpt.load({"b": target}, ck))
    assert torch.equal(target.value, torch.full((8,), -1.0))
    checked = cli("verify", ck)
    assert checked.returncode == 1 and "variable 'b/rank0'" in checked.stderr, checked


def test_the_dcp_reader_refuses_pieces_that_leave_a_gap(tmp_path: Path) -> None:
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from distckpt.integrations.dcp import DistckptReader

    ck = crafted(tmp_path, "overlap")
    refused(lambda: DistckptReader(ck).read_metadata())
    target = {"b": torch.full((8,), -1.0)}
    # DCP gathers what a storage reader raises into a CheckpointException (a
    # BaseException) that carries its text.
    with bounded(BOUND), pytest.raises(BaseException, match="variable 'b'.*overlap"):
        dcp.load(target, storage_reader=DistckptReader(ck))
    assert torch.equal(target["b"], torch.full((8,), -1.0))


def test_the_manager_falls_back_from_pieces_that_leave_a_gap(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    ckpt = distckpt.Checkpoint(b=torch.from_numpy(SAVED.copy()))
    with distckpt.CheckpointManager(ckpt, run) as manager:
        manager.save()
        manager.save()
    ck = run / "ckpt-2"
    pieces = plain_pieces(ck, "b", LAYOUTS["overlap"])
    edit_variables(ck, lambda v: v["b"].update(pieces=pieces))
    fresh = distckpt.Checkpoint(b=torch.full((8,), -1.0))
    with (
        bounded(BOUND),
        caplog.at_level(logging.WARNING, "distckpt"),
        distckpt.CheckpointManager(fresh, run) as manager,
    ):
        assert manager.restore_or_initialize() == str(run / "ckpt-1")
    assert torch.equal(fresh.b, torch.from_numpy(SAVED))
    assert f"{ck} is unreadable" in caplog.text and "variable 'b'" in caplog.text


def test_pieces_that_tile_in_any_order_still_load(tmp_path: Path) -> None:
    """The check refuses what overlaps or leaves a gap, nothing else."""
    ck = tmp_path / "ck"
    distckpt.save({"b": torch.zeros(8)}, ck)
    pieces = plain_pieces(ck, "b", [(5, 3), (0, 2), (2, 3)])
    edit_variables(ck, lambda v: v["b"].update(pieces=pieces))
    target = torch.zeros(8)
    distckpt.load({"b": target}, ck)
    assert torch.equal(target, torch.from_numpy(SAVED))
    assert cli("verify", ck).returncode == 0


# ---------------------------------------------------------------- the node-local tier


def local_job(tmp_path: Path) -> tuple[Any, Path]:
    """A run of ``w`` [8, 4]: step 1 persistent, step 2 in the local tier; a factory of
    managers of it, and step 2's manifest."""

    def manager(ckpt: distckpt.Checkpoint) -> distckpt.CheckpointManager:
        return local_manager(tmp_path, ckpt)

    ckpt = distckpt.Checkpoint(step=torch.tensor(0), w=torch.zeros(8, 4))
    with manager(ckpt) as m:
        for step in (1, 2):
            ckpt.step.fill_(step)
            ckpt.w.copy_(w_at(step))
            m.save()
    (manifest,) = (tmp_path / "local" / "step-2").glob("o0.*.json")
    return manager, manifest


def w_at(step: int) -> torch.Tensor:
    return torch.arange(32.0).reshape(8, 4) + 100 * step


def edit_manifest(manifest: Path, edit: Any) -> None:
    doc = json.loads(manifest.read_bytes())
    data = manifest.with_suffix(".data").read_bytes()
    (entry,) = [t for t in doc["tensors"] if t["name"] == "w"]
    doc["tensors"].remove(entry)
    for box, skip in edit(entry):  # pieces of w: its box, and where in w's bytes it starts
        offset = entry["offset"] + skip
        nbytes = 4 * int(np.prod(box[1]))
        crc = crc32c(np.frombuffer(data[offset : offset + nbytes], np.uint8))
        doc["tensors"].append({**entry, "box": box, "offset": offset, "nbytes": nbytes, "crc": crc})
    manifest.write_bytes(reseal(json.dumps(doc).encode()))


def test_a_local_step_whose_boxes_overlap_is_not_held_whole(tmp_path: Path) -> None:
    manager, manifest = local_job(tmp_path)
    # Rows [0:5] and [2:5]: 32 elements as the shape has, but rows 5 to 7 held by none.
    edit_manifest(manifest, lambda e: [([[0, 0], [5, 4]], 0), ([[2, 0], [3, 4]], 32)])
    fresh = distckpt.Checkpoint(step=torch.tensor(0), w=torch.zeros(8, 4))
    with bounded(BOUND), manager(fresh) as m:
        m.restore_or_initialize()
        restored = m.restored
    assert restored is not None and restored.tier == "persistent", restored
    assert "restoring local step 2 failed" in restored.reason
    assert "variable 'w'" in restored.reason and "overlap" in restored.reason
    assert int(fresh.step) == 1 and torch.equal(fresh.w, w_at(1))


def test_a_local_step_whose_replicas_share_a_box_is_read(tmp_path: Path) -> None:
    """Replicas of one box (HSDP) are one piece, not an overlap."""
    manager, manifest = local_job(tmp_path)
    edit_manifest(manifest, lambda e: [(e["box"], 0), (e["box"], 0)])
    fresh = distckpt.Checkpoint(step=torch.tensor(0), w=torch.zeros(8, 4))
    with bounded(BOUND), manager(fresh) as m:
        m.restore_or_initialize()
        assert m.restored is not None and m.restored.tier == "local", m.restored
    assert int(fresh.step) == 2 and torch.equal(fresh.w, w_at(2))


def test_a_regular_entry_tiles_its_shape_by_construction() -> None:
    """A regular entry lists no boxes: its grid is ``ceil(shape / chunks)`` chunks, the last
    of each dimension cut at the shape, and its columns must hold that many pieces. No
    edit of shape or chunks makes it cover less (or more) than its shape."""
    from distckpt.format.stored import Pieces, regular_entry
    from distckpt.slices import Box
    from distckpt.tiling import tiling_problem

    rng = np.random.default_rng(32)
    for _ in range(300):
        ndim = int(rng.integers(0, 4))
        shape = tuple(int(n) for n in rng.integers(0, 9, ndim))
        chunks = tuple(int(n) for n in rng.integers(1, 11, ndim))
        count = int(np.prod([-(-n // c) for n, c in zip(shape, chunks, strict=True)]))
        entry = regular_entry(
            "float32",
            shape,
            "w",
            chunks,
            None,
            None,
            np.zeros(count, np.uint32),
            np.full(count, 4 * int(np.prod(chunks)) + 4, np.uint64),
        )
        boxes = [p.box for p in Pieces(entry, "w")]
        assert tiling_problem(boxes, Box.full(shape)) is None, (shape, chunks)
        for edit in ({"chunks": [c + 1 for c in chunks]}, {"shape": [n + 1 for n in shape]}):
            changed = {**entry, **edit}
            grid = [-(-n // c) for n, c in zip(changed["shape"], changed["chunks"], strict=True)]
            if int(np.prod(grid)) != count:  # the columns no longer fit the grid
                with pytest.raises(CorruptCheckpointError, match="column"):
                    Pieces(changed, "w")
