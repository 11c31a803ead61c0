"""A hostile peer of the node-local tier: another node of the job, or whoever can write
a node's local directory, stores marks and manifests that lie (every checksum
recomputed), or sends a replica whose announced lengths and manifest lie. A restore ends
with the right values, bit for bit, or one clear CheckpointError (the manager then
restores the shared directory), within a deadline, without allocating for a size that
no stored byte backs; a save refuses what a peer sends before writing it.

(``tests/hostile/test_hostile_local_tier.py`` races a live restore;
``tests/hostile/test_hostile_coverage.py`` covers manifests whose boxes overlap.)
"""

from __future__ import annotations

import json
import re
import shutil
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import distckpt
from distckpt import CorruptCheckpointError
from distckpt.comm.single import SingleComm
from distckpt.local import files
from distckpt.local.choose import choose
from distckpt.local.messages import MANIFEST_BYTES, MESSAGE_BYTES, checked_plans
from distckpt.local.restore import LocalStep
from distckpt.local.save import _Layout, _replicate
from distckpt.pipeline.options import CheckpointOptions
from distckpt.storage.registry import open_store
from distckpt.testing.hostile import crc32c, reseal
from distckpt.training.tiers import RUN_FILE
from tests.support.hostile_util import local_manager
from tests.support.launch_util import bounded

BOUND = 20  # seconds: a restore of a few bytes, whatever the files say


def saved(root: Path) -> None:
    """Step 1 in the run directory (w = 1), step 2 in the local tier only (w = 2)."""
    ckpt = distckpt.Checkpoint(step=torch.tensor(0), w=torch.zeros(8, 4))
    with local_manager(root, ckpt) as m:
        for step in (1, 2):
            ckpt.step.fill_(step)
            ckpt.w.fill_(step)
            m.save()


def restored(root: Path) -> tuple[distckpt.Restored, torch.Tensor]:
    ckpt = distckpt.Checkpoint(step=torch.tensor(0), w=torch.zeros(8, 4))
    with bounded(BOUND, "the restore"), local_manager(root, ckpt) as m:
        m.restore_or_initialize()
        assert m.restored is not None
        return m.restored, ckpt.w.clone()


def step_files(root: Path, pattern: str) -> Path:
    (found,) = (root / "local" / "step-2").glob(pattern)
    return found


def edit(path: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    doc = json.loads(path.read_bytes())
    change(doc)
    path.write_bytes(reseal(json.dumps(doc).encode()))


def stray_owner(root: Path) -> None:
    """Files of saved rank 1 in a step saved by one rank: a manifest whose box of w
    overlaps rank 0's (its data right, its crc32c right)."""
    manifest = step_files(root, "o0.*.json")
    token = manifest.name.split(".")[1]
    shutil.copy(manifest.with_suffix(".data"), manifest.parent / f"o1.{token}.data")
    doc = json.loads(manifest.read_bytes())
    doc["owner"] = 1
    for t in doc["tensors"]:
        if t["name"] == "w":
            t["box"] = [[0, 0], [4, 4]]
            t["nbytes"] //= 2
            data = manifest.with_suffix(".data").read_bytes()
            t["crc"] = crc32c(data[t["offset"] : t["offset"] + t["nbytes"]])
    (manifest.parent / f"o1.{token}.json").write_bytes(reseal(json.dumps(doc).encode()))


#: attack -> (the craft, the tier restored, words of the reason)
ATTACKS: dict[str, tuple[Callable[[Path], None], str, str]] = {
    # A mark claiming a world of 10**15 ranks: counting the ranks held hung the restore.
    "mark-world-huge": (
        lambda r: edit(step_files(r, "done.*"), lambda d: d.update(world=10**15)),
        "persistent",
        "holds no committed step",
    ),
    # The largest world a mark may name: the ranks missing are found, not listed all.
    "mark-world-largest": (
        lambda r: edit(step_files(r, "done.*"), lambda d: d.update(world=files.MAX_WORLD)),
        "persistent",
        "lacks the partitions of saved rank(s) 1, 2, 3, 4, 5, 6, 7, 8, ...",
    ),
    "mark-world-bool": (
        lambda r: edit(step_files(r, "done.*"), lambda d: d.update(world=True)),
        "persistent",
        "holds no committed step",
    ),
    # A manifest of another run or world under the token of this save's mark.
    "manifest-of-another-run": (
        lambda r: edit(step_files(r, "o0.*.json"), lambda d: d.update(run="0" * 32)),
        "persistent",
        "manifest of run '00000000",
    ),
    "manifest-of-another-world": (
        lambda r: edit(step_files(r, "o0.*.json"), lambda d: d.update(world=2)),
        "persistent",
        "saved by 2 rank(s), not of run",
    ),
    # Files of a rank the save did not have: ignored, not read into the step (their box,
    # overlapping rank 0's, failed the whole step).
    "owner-beyond-the-world": (stray_owner, "local", "held whole"),
    # A piece beyond the end of its data file: refused before a buffer is made for it.
    "piece-beyond-its-file": (
        lambda r: edit(
            step_files(r, "o0.*.json"), lambda d: d["tensors"][-1].update(offset=10**12)
        ),
        "persistent",
        "its manifest places pieces up to",
    ),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_lying_mark_or_manifest_is_one_clear_outcome(tmp_path: Path, attack: str) -> None:
    craft, tier, words = ATTACKS[attack]
    saved(tmp_path)
    craft(tmp_path)
    restored_from, w = restored(tmp_path)
    assert restored_from.tier == tier, restored_from
    assert words in restored_from.reason, restored_from.reason
    want = 2.0 if tier == "local" else 1.0
    assert torch.equal(w, torch.full((8, 4), want))  # bit for bit, of the tier restored


def test_a_piece_declared_larger_than_its_file_allocates_nothing(tmp_path: Path) -> None:
    """A manifest declares w a 4 GiB tensor held whole by one piece, its data file holds
    192 bytes; a rank restores one row of it (a box of the piece, read through a copy
    of the piece). The copy was allocated for the declared 4 GiB before reading."""
    saved(tmp_path)
    rows, cols = 1 << 20, 1 << 10

    def huge(doc: dict[str, Any]) -> None:
        (w,) = [t for t in doc["tensors"] if t["name"] == "w"]
        w.update(shape=[rows, cols], box=[[0, 0], [rows, cols]], nbytes=rows * cols * 4)

    edit(step_files(tmp_path, "o0.*.json"), huge)
    store = open_store(tmp_path / "local")
    run = (tmp_path / "run" / RUN_FILE).read_text().strip()
    comm = SingleComm()
    choice = choose(comm, store, run, None).choice
    assert choice is not None
    row = distckpt.Shard(torch.zeros(1, cols), (rows, cols), (0, 0))
    tracemalloc.start()
    try:  # (refused when the step is opened: its one copy is shorter than declared)
        with bounded(BOUND), pytest.raises(CorruptCheckpointError, match="places pieces up to"):
            step = LocalStep.open(store, choice, comm)
            step.load({"w": row}, comm, CheckpointOptions(strict=False))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak} bytes allocated for a piece of 192 stored bytes"


# ---------------------------------------------------------------- what a peer sends


class Peer:
    """This rank (1 of 2) receives a replica from rank 0, which announces ``length``
    bytes of manifest and sends ``manifest``."""

    rank, size = 1, 2

    def __init__(self, length: int, manifest: bytes) -> None:
        self.length = length
        self.manifest = manifest

    def sendrecv(self, sends: list[Any], recvs: list[tuple[int, np.ndarray]]) -> None:
        for _, buffer in recvs:
            if buffer.dtype == np.int64:
                buffer[0] = self.length
            else:
                buffer[:] = np.frombuffer(self.manifest[: buffer.size], np.uint8)


def replica(length: int | None, change: Callable[[dict[str, Any]], Any] | None) -> Any:
    """What :func:`_replicate` makes of a peer's manifest, changed by ``change``, that
    announces ``length`` bytes (None: its own)."""
    ours = {"format": files.FORMAT, "version": files.VERSION, "run": "r", "step": 3}
    ours.update(token="ab", world=2, owner=1, tensors=[], values={}, per_rank_values={})
    theirs = {**ours, "owner": 0}
    if change is not None:
        change(theirs)
    raw = json.dumps(theirs).encode()
    layout = _Layout(manifest=ours)
    peer = Peer(len(raw) if length is None else length, raw)
    return _replicate(peer, layout, [[], []], [], [0], {}, None, [])  # type: ignore[arg-type]


LIES: dict[str, tuple[int | None, Callable[[dict[str, Any]], Any] | None, str]] = {
    "length-huge": (1 << 40, None, "announced a manifest of"),
    "length-negative": (-5, None, "announced a manifest of"),
    "length-zero": (0, None, "announced a manifest of"),
    "another-owner": (None, lambda d: d.update(owner=1), "manifest of another save"),
    "another-step": (None, lambda d: d.update(step=2), "manifest of another save"),
    "another-run": (None, lambda d: d.update(run="x"), "manifest of run 'x'"),
    "another-world": (None, lambda d: d.update(world=9), "saved by 9 rank(s)"),
    "not-a-manifest": (None, lambda d: d.update(format="zip"), "not a distckpt local-tier"),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_replica_whose_manifest_lies_is_refused_before_it_is_written(lie: str) -> None:
    length, change, words = LIES[lie]
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match=re.escape(words)):
            replica(length, change)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MANIFEST_BYTES // 64


def test_an_honest_replica_manifest_is_taken() -> None:
    (got,) = replica(None, None).values()
    assert got["owner"] == 0


@pytest.mark.parametrize(
    "plan",
    [
        [[(0, MESSAGE_BYTES + 1)]],
        [[(-1, 8)]],
        [[(0, 0)]],
        [[(1 << 62, 8)]],
        [[(True, 8)]],
        [[(0, 8, 1)]],
        [["0", 8]],
        [None],
    ],
)
def test_plans_a_peer_shares_are_checked_alike_on_every_rank(plan: list[Any]) -> None:
    with pytest.raises(CorruptCheckpointError, match="rank 1"):
        checked_plans([[(0, 64), (64, 8)], *plan])
    assert checked_plans([[(0, 64), (64, 8)], []]) == [[(0, 64), (64, 8)], []]


def test_links_in_the_tier_are_removed_never_followed(tmp_path: Path) -> None:
    """Held: steps that are links out, and links in a step the tier removes, are
    unlinked when the tier drops or retires them; what they lead to is left alone."""
    saved(tmp_path)
    outside = tmp_path / "outside"
    shutil.copytree(tmp_path / "local" / "step-2", outside / "step-9")
    (outside / "file").write_bytes(b"precious")
    local = tmp_path / "local"
    (local / "step-9").symlink_to(outside / "step-9")  # newer: dropped by the restore
    (local / "step-0").symlink_to(outside)  # older: retired by the saves
    (local / "step-2" / "out").symlink_to(outside / "file")
    (local / "step-2" / "dir").symlink_to(outside)
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in outside.rglob("*") if p.is_file()}
    ckpt = distckpt.Checkpoint(step=torch.tensor(0), w=torch.zeros(8, 4))
    with bounded(BOUND), local_manager(tmp_path, ckpt) as m:
        m.restore_or_initialize()
        assert m.restored is not None and m.restored.tier == "local", m.restored
        for step in (3, 4, 5, 6):
            ckpt.step.fill_(step)
            m.save()
    after = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in outside.rglob("*") if p.is_file()}
    assert after == before
    assert sorted(p.name for p in local.iterdir()) == ["step-4", "step-5", "step-6"]
