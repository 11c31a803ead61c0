"""Incremental saves (:mod:`distckpt.engine.reuse`): a save built on an earlier
checkpoint takes the pieces whose bytes did not change, and never a stale byte.

The state is a LoRA-like one: a frozen base (several shards), adapters that change, a
small tensor (a plain chunk) and values. Each test changes something and checks what
the next save reused (the index says, the files are the same inode) and that the new
checkpoint loads bit for bit, alone: with its base deleted, with zarr-python too.
Stale bytes: one element changed through ``.data``, through a NumPy view (no version
counter moves), in the first or the last inner chunk; a dtype or a shape changed; a
base deleted, damaged in place, or replaced by another run's checkpoint, before the save
or in the middle of it (after the base was checked); this process's memory of the base
lost (a new process), where the base's index decides.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import zarr

import distckpt
from distckpt.comm import SingleComm
from distckpt.engine import reuse
from distckpt.tools.verify import verify
from tests.engine.test_single_process import index_of
from tests.support.launch_util import SCRIPTS, assert_all_ok, run_ranks
from tests.support.make_golden import assert_same_bits

pytestmark = pytest.mark.timeout(120)
COMM = SingleComm()
# Inner chunks of 16 KiB: several in every piece of the frozen base.
LAYOUT = {"small_bytes": 4096, "inner_bytes": 16 << 10}


def state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "base": {
            "w": torch.randn(256, 256, generator=g),  # 256 KiB: 16 inner chunks
            "w2": torch.randn(64, 256, generator=g),
            "emb": torch.randn(64, 256, generator=g),  # 64 KiB
        },
        "lora": {"a": torch.randn(256, 8, generator=g), "b": torch.zeros(8, 256)},
        "norm": torch.ones(16),  # a plain chunk
        "step": 1,
    }


def flat(s: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of a state by name (a Shard's local tensor)."""
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}{k}/", v)
        elif isinstance(node, distckpt.Shard):
            out[prefix[:-1]] = node.tensor
        elif isinstance(node, torch.Tensor):
            out[prefix[:-1]] = node

    walk("", s)
    return out


def blank_like(s: dict[str, Any]) -> dict[str, Any]:
    """A state of zeros of the same layout (to load into); a Shard's global tensor is
    loaded whole (this process holds only part of it)."""

    def zero(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: zero(v) for k, v in node.items()}
        if isinstance(node, distckpt.Shard):
            return distckpt.Shard(torch.zeros_like(node.tensor), node.global_shape, node.offsets)
        if isinstance(node, torch.Tensor):
            return torch.zeros_like(node)
        return None

    return zero(s)


def loads_as(path: Path, want: dict[str, Any]) -> None:
    """``path`` loads ``want`` bit for bit (every tensor and value)."""
    got = blank_like(want)
    distckpt.load(got, path, COMM)
    for name, tensor in flat(want).items():
        assert_same_bits(flat(got)[name], tensor, name)
    assert got["step"] == want["step"]


def reused_from(path: Path) -> dict[str, set[str | None]]:
    """Where each variable's pieces came from (None: written), from the index."""
    return {
        name: {p.get("reused") for p in entry["pieces"]}
        for name, entry in index_of(path)["variables"].items()
        if entry["kind"] == "tensor"
    }


def save(s: dict[str, Any], path: Path, **kw: Any) -> distckpt.SaveResult:
    return distckpt.save(s, path, COMM, **LAYOUT, **kw)


@pytest.fixture(autouse=True)
def fresh_memory() -> Any:
    reuse._known.clear()
    yield
    reuse._known.clear()


def test_unchanged_pieces_are_taken_and_every_checkpoint_stands_alone(tmp_path: Path) -> None:
    s = state()
    first = save(s, tmp_path / "c1")
    assert first.bytes_reused == first.pieces_reused == 0
    assert all(
        "digest" in p
        for e in index_of(tmp_path / "c1")["variables"].values()
        for p in e.get("pieces", [])
    )
    s["lora"]["b"].add_(1.0)
    s["step"] = 2
    second = save(s, tmp_path / "c2", base=tmp_path / "c1")
    changed = sum(p["size"] for p in index_of(tmp_path / "c2")["variables"]["lora/b"]["pieces"])
    assert second.bytes_written == changed  # only what changed, nothing more
    assert second.bytes_reused == first.bytes_written - changed
    assert second.pieces_reused == 5  # w, w2, emb, lora/a, norm: not lora/b
    assert reused_from(tmp_path / "c2") == {
        "base/w": {"c1"},
        "base/w2": {"c1"},
        "base/emb": {"c1"},
        "lora/a": {"c1"},
        "lora/b": {None},
        "norm": {"c1"},
    }
    for key in ("base/w/c.0.0", "norm/c.0"):  # the same file, not a copy of it
        assert os.stat(tmp_path / "c1" / key).st_ino == os.stat(tmp_path / "c2" / key).st_ino
    shutil.rmtree(tmp_path / "c1")  # the base goes: the new checkpoint stands alone
    loads_as(tmp_path / "c2", s)
    assert verify(tmp_path / "c2").ok
    distckpt.register_zarr_dtypes()
    emb = zarr.open_array(str(tmp_path / "c2" / "base" / "emb"), mode="r")[...]
    assert emb.tobytes() == s["base"]["emb"].numpy().tobytes()
    # Built on a checkpoint that itself reused: the pieces are taken again.
    s["lora"]["b"].add_(1.0)
    third = save(s, tmp_path / "c3", base=tmp_path / "c2")
    assert third.bytes_written == changed and third.pieces_reused == 5
    loads_as(tmp_path / "c3", s)


def test_incremental_off_writes_and_hashes_nothing(tmp_path: Path) -> None:
    s = state()
    save(s, tmp_path / "c1", incremental=False)
    assert not any(
        "digest" in p for p in index_of(tmp_path / "c1")["variables"]["base/emb"]["pieces"]
    )
    again = save(s, tmp_path / "c2", base=tmp_path / "c1")  # the base has no digests
    assert again.bytes_reused == 0
    third = save(s, tmp_path / "c3", base=tmp_path / "c2", incremental=False)
    assert third.bytes_reused == 0
    loads_as(tmp_path / "c3", s)


def _numpy_view(s: dict[str, Any], where: str) -> None:
    w = s["base"]["emb"]
    version = w._version
    row = 0 if where == "first" else -1
    w.numpy()[row, -1] += 1.0  # no version counter moves
    assert w._version == version


CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "data-first-chunk": lambda s: s["base"]["emb"].data[0, 0].add_(1.0),
    "data-last-chunk": lambda s: s["base"]["emb"].data[-1, -1].add_(1.0),
    "numpy-view-first": lambda s: _numpy_view(s, "first"),
    "numpy-view-last": lambda s: _numpy_view(s, "last"),
    "one-bit": lambda s: s["base"]["emb"].view(torch.int32)[31, 7].bitwise_xor_(1),
    "dtype": lambda s: s["base"].update(emb=s["base"]["emb"].to(torch.bfloat16)),
    "shape": lambda s: s["base"].update(emb=s["base"]["emb"].reshape(128, 128)),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_changed_piece_is_never_reused(tmp_path: Path, change: str) -> None:
    s = state()
    save(s, tmp_path / "c1")
    CHANGES[change](s)
    result = save(s, tmp_path / "c2", base=tmp_path / "c1")
    assert reused_from(tmp_path / "c2")["base/emb"] == {None}
    assert result.pieces_reused == 5  # everything else
    shutil.rmtree(tmp_path / "c1")
    loads_as(tmp_path / "c2", s)


def _flip_in_place(path: Path) -> None:
    """A byte of a shard's data changed in place (the file keeps its name and size)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _replace_by_another_run(base: Path) -> None:
    """The base's name now holds another run's checkpoint (other values, same layout)."""
    other = base.parent / "other-run"
    save(state(seed=7), other)
    shutil.rmtree(base)
    os.rename(other, base)


BASE_TROUBLE: dict[str, Callable[[Path], None]] = {
    "deleted": lambda base: shutil.rmtree(base),
    "piece-deleted": lambda base: os.unlink(base / "base" / "emb" / "c.0.0"),
    "damaged-in-place": lambda base: _flip_in_place(base / "base" / "emb" / "c.0.0"),
    "index-damaged": lambda base: (base / "zarr.json").write_text("{"),
    "replaced-by-another-run": _replace_by_another_run,
}


@pytest.mark.parametrize("memory", ["remembered", "forgotten"])
@pytest.mark.parametrize("when", ["before", "in-the-middle"])
@pytest.mark.parametrize("trouble", BASE_TROUBLE)
def test_a_base_gone_damaged_or_replaced_costs_a_write_not_a_byte(
    tmp_path: Path, trouble: str, when: str, memory: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``remembered``: this process wrote the base (it knows each file's inode and time);
    ``forgotten``: a new process, which knows the base from its index alone (a copy is
    then checked against the index: its size and checksum table)."""
    base = tmp_path / "c1"
    s = state()
    save(s, base)
    if memory == "forgotten":
        reuse._known.clear()
    s["lora"]["b"].add_(1.0)
    if when == "before":
        BASE_TROUBLE[trouble](base)
    else:  # once the save has checked the base, before it takes a piece
        check = reuse.check_base

        def check_then_trouble(comm: Any, store: Any) -> Any:
            known = check(comm, store)
            BASE_TROUBLE[trouble](base)
            return known

        monkeypatch.setattr(reuse, "check_base", check_then_trouble)
    result = save(s, tmp_path / "c2", base=base)
    if trouble == "deleted" or (trouble == "index-damaged" and when == "before"):
        assert result.bytes_reused == 0  # refused as a whole
    elif trouble != "index-damaged":  # (damaged once checked: its pieces are still whole)
        assert reused_from(tmp_path / "c2")["base/emb"] == {None}  # that piece was written
        # The other run's values differ but for its norm (ones), the same bytes: taken
        # when the base is known by its index, not when its files are known to be others.
        replaced = trouble == "replaced-by-another-run"
        assert result.pieces_reused == (int(memory == "forgotten") if replaced else 4)
    shutil.rmtree(base, ignore_errors=True)
    loads_as(tmp_path / "c2", s)
    assert verify(tmp_path / "c2").ok


def test_without_memory_the_base_index_decides(tmp_path: Path, caplog: Any) -> None:
    """A process that never saw the base (a new job): the index's digests decide, the
    whole piece hashed (no chunk digests to stop early at)."""
    s = state()
    save(s, tmp_path / "c1")
    reuse._known.clear()
    s["base"]["emb"].data[-1, -1].add_(1.0)
    result = save(s, tmp_path / "c2", base=tmp_path / "c1")
    assert reused_from(tmp_path / "c2")["base/emb"] == {None}
    assert result.pieces_reused == 5
    loads_as(tmp_path / "c2", s)


def test_a_checkpoint_and_a_manager_build_on_their_last_checkpoint(tmp_path: Path) -> None:
    s = state()
    tensors = flat(s)
    ckpt = distckpt.Checkpoint(**{k.replace("/", "_"): v for k, v in tensors.items()})
    with distckpt.CheckpointManager(
        ckpt, tmp_path / "run", max_to_keep=1, comm=COMM, **LAYOUT
    ) as mgr:
        first = mgr.save()
        tensors["lora/b"].add_(1.0)
        second = mgr.save()
        assert reused_from(Path(second))["base_emb"] == {Path(first).name}
        assert not Path(first).exists()  # retention removed the base; the new one stands
        expected = {k: v.clone() for k, v in tensors.items()}
    # A new job: restored, then saved again at once: nothing changed, nothing written.
    for v in tensors.values():
        v.zero_()
    with distckpt.CheckpointManager(
        ckpt, tmp_path / "run", max_to_keep=1, comm=COMM, **LAYOUT
    ) as mgr:
        assert mgr.restore_or_initialize() == second
        for k, v in tensors.items():
            assert_same_bits(v, expected[k], k)
        third = mgr.save()
    names = reused_from(Path(third))
    assert all(origin == {Path(second).name} for origin in names.values()), names
    # Checkpoint.save alone: its base is the checkpoint it last saved or restored.
    path = ckpt.save(tmp_path / "alone" / "ckpt", COMM, **LAYOUT)
    tensors["lora/a"].mul_(2.0)
    again = ckpt.save(tmp_path / "alone" / "ckpt", COMM, **LAYOUT)
    assert reused_from(Path(again))["lora_a"] == {None}
    assert reused_from(Path(again))["base_emb"] == {Path(path).name}


def test_inspect_says_what_was_reused(tmp_path: Path, capsys: Any) -> None:
    from distckpt import cli

    s = state()
    save(s, tmp_path / "c1")
    s["lora"]["b"].add_(1.0)
    save(s, tmp_path / "c2", base=tmp_path / "c1")
    assert cli.main(["inspect", str(tmp_path / "c2")]) == 0
    out = capsys.readouterr().out
    assert "reused from c1" in out
    line = next(line for line in out.splitlines() if line.lstrip().startswith("lora/b"))
    assert "reused" not in line


def test_on_an_object_store_a_server_side_copy(s3: Any, caplog: Any) -> None:
    s = state()
    first = save(s, f"{s3.url}/c1")  # type: ignore[arg-type]
    s["lora"]["b"].add_(1.0)
    second = save(s, f"{s3.url}/c2", base=f"{s3.url}/c1")  # type: ignore[arg-type]
    assert second.pieces_reused == 5
    assert second.bytes_written < first.bytes_written / 4
    from distckpt.storage.registry import open_store

    open_store(f"{s3.url}/c1").delete_tree()
    got = blank_like(s)
    distckpt.load(got, f"{s3.url}/c2", COMM)
    for name, tensor in flat(s).items():
        assert_same_bits(flat(got)[name], tensor, name)


RANKS = SCRIPTS / "incremental_ranks.py"


def _took(proc: Any) -> dict[int, tuple[int, int]]:
    """What each rank said it reused and wrote (``TOOK rank reused written``)."""
    found = {}
    for line in proc.stdout.splitlines():
        if line.startswith("TOOK "):
            _, rank, reused, written = line.split()
            found[int(rank)] = (int(reused), int(written))
    return found


@pytest.mark.timeout(400)
def test_ranks_take_their_own_pieces_and_a_resumed_job_writes_nothing_new(tmp_path: Path) -> None:
    """torchrun: 2 ranks save twice (the second save takes each rank's frozen rows);
    a new 2-rank job restores and saves at once: every piece is taken, nothing written;
    a 3-rank job restores resharded (its boxes are new pieces: written) bit for bit."""
    run = tmp_path / "run"
    saved = run_ranks(2, RANKS, "save", str(run), timeout=150)
    assert_all_ok(saved, 2)
    assert all(reused > 0 for reused, _ in _took(saved).values())
    resumed = run_ranks(2, RANKS, "resume", str(run), timeout=150)
    assert_all_ok(resumed, 2)
    assert _took(resumed) and all(written == 0 for _, written in _took(resumed).values())
    resharded = run_ranks(3, RANKS, "resume", str(run), timeout=150)
    assert_all_ok(resharded, 3)
