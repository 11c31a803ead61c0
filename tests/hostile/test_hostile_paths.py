"""Paths that cannot be fooled: a directory of a checkpoint (or a save's staging
directory) swapped for a link after distckpt has looked at it is refused at the next
use, never read or written through (distckpt.storage.beneath). First deterministic
recipes, each the exact interleaving of a race (the store has used the directory, then
it becomes a link to an outside copy), for every operation of the POSIX store; then a
bounded real race of a thread swapping directories for links while loads and saves run.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import distckpt
from distckpt import CheckpointError, UnsafePathError
from distckpt.commit.staging import OWNER_FILE
from distckpt.storage import beneath
from distckpt.storage.fsutil import exchange
from distckpt.storage.posix import PosixStore
from distckpt.storage.registry import open_store
from distckpt.testing.hostile import reseal
from tests.support.launch_util import bounded

BOUND = 60  # seconds: nothing here may hang


@pytest.fixture(params=["openat2", "walk"])
def resolution(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of resolving: openat2 where the kernel has it, and the walk of
    directory descriptors that replaces it elsewhere."""
    if request.param == "openat2" and beneath.openat2 is None:
        pytest.skip("this kernel (or its seccomp filter) refuses openat2")
    if request.param == "walk":
        monkeypatch.setattr(beneath, "openat2", None)
    return str(request.param)


def snapshot(tree: Path) -> dict[str, tuple[int, int, bytes | None]]:
    """Every entry under ``tree``: (mode, mtime, bytes of a file): what a write changes."""
    found: dict[str, tuple[int, int, bytes | None]] = {}
    for path in [tree, *sorted(tree.rglob("*"))]:
        st = path.lstat()
        data = path.read_bytes() if path.is_file() and not path.is_symlink() else None
        found[str(path.relative_to(tree))] = (st.st_mode, st.st_mtime_ns, data)
    return found


def swap_for_link(directory: Path, target: Path) -> None:
    """``directory`` becomes a link to ``target`` (its contents are moved aside)."""
    directory.rename(directory.with_name(directory.name + ".moved"))
    directory.symlink_to(target, target_is_directory=True)


def after_staging_prepared(
    monkeypatch: pytest.MonkeyPatch, action: Callable[[Path], object]
) -> list[Path]:
    """Once a save has made its staging directory and every directory it will write in,
    ``action(staging directory)``, once; returns the list that records it."""
    real_prepare = PosixStore.prepare
    done: list[Path] = []

    def prepare_then_act(store: PosixStore, keys: Any) -> None:
        keys = list(keys)
        real_prepare(store, keys)
        if ".staging-" in store.name and OWNER_FILE not in keys and not done:
            path = Path(store.url)
            action(path)
            done.append(path)

    monkeypatch.setattr(PosixStore, "prepare", prepare_then_act)
    return done


def reseal_index(ck: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    doc = json.loads((ck / "zarr.json").read_bytes())
    edit(doc["attributes"]["distckpt"]["variables"])
    (ck / "zarr.json").write_bytes(reseal(json.dumps(doc).encode()))


def crc(ck: Path, name: str) -> int:
    doc = json.loads((ck / "zarr.json").read_bytes())
    return int(doc["attributes"]["distckpt"]["variables"][name]["pieces"][0]["crc"])


@pytest.fixture
def checkpoints(tmp_path: Path) -> tuple[Path, Path]:
    """``ck`` holds b = zeros; ``outside`` (beside it), b = 7.0, whose piece the index
    of ``ck`` now vouches for: read through a link, it would load without an error."""
    ck, outside = tmp_path / "ck", tmp_path / "outside"
    distckpt.save({"b": torch.zeros(4), "c": torch.ones(2)}, ck)
    distckpt.save({"b": torch.full((4,), 7.0)}, outside)
    reseal_index(ck, lambda v: v["b"]["pieces"][0].update(crc=crc(outside, "b")))
    return ck, outside


# ---------------------------------------------------------------- loads


def test_a_variable_directory_swapped_for_a_link_after_it_was_read_is_refused(
    checkpoints: tuple[Path, Path], resolution: str
) -> None:
    ck, outside = checkpoints
    store = open_store(ck)
    assert store.read("b/zarr.json")  # the store has been through ck/b
    swap_for_link(ck / "b", outside / "b")
    b = torch.full((4,), -1.0)
    with bounded(BOUND), pytest.raises(UnsafePathError, match="symbolic link") as info:
        distckpt.load({"b": b, "c": torch.zeros(2)}, store)
    assert str(ck / "b") in str(info.value)
    assert torch.equal(b, torch.full((4,), -1.0))  # nothing read from outside


def test_a_checkpoint_swapped_inside_its_run_directory_is_refused(
    tmp_path: Path, resolution: str
) -> None:
    """Below the run directory, a checkpoint's own directory is not the user's path:
    swapped for a link to a whole other checkpoint (w = 5) once a store of the run
    directory has read it, it is refused."""
    run, other = tmp_path / "run", tmp_path / "other"
    for where, value in ((run, 0.0), (other, 5.0)):
        with distckpt.CheckpointManager(distckpt.Checkpoint(w=torch.full((4,), value)), where) as m:
            m.save()
    store = open_store(run)
    assert store.read("ckpt-1/zarr.json")
    swap_for_link(run / "ckpt-1", other / "ckpt-1")
    w = torch.ones(4)
    with bounded(BOUND), pytest.raises(UnsafePathError, match="symbolic link"):
        distckpt.load({"w": w}, store.child("ckpt-1"), strict=False)
    assert torch.equal(w, torch.ones(4))


# ---------------------------------------------------------------- saves


def test_a_staging_directory_swapped_for_a_link_is_never_written_through(
    tmp_path: Path, resolution: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interleaving of the race: the save has made its staging directory (and
    looked at every directory it will write in), then the directory is a link to an
    outside one. Nothing of the save lands there; the save fails naming the link."""
    run, sentinel = tmp_path / "run", tmp_path / "sentinel"
    sentinel.mkdir()
    (sentinel / "keep").write_bytes(b"untouched")
    before = snapshot(sentinel)
    swapped = after_staging_prepared(monkeypatch, lambda path: swap_for_link(path, sentinel))
    with bounded(BOUND), pytest.raises(UnsafePathError, match="symbolic link"):
        distckpt.save({"net": {"w": torch.arange(6.0), "b": torch.ones(3)}}, run / "ck")
    assert swapped
    assert snapshot(sentinel) == before  # not a byte, not an entry, not an mtime
    assert not (run / "ck").exists()


def test_a_staging_directory_moved_away_fails_the_save_with_a_checkpoint_error(
    tmp_path: Path, resolution: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The staging directory renamed away by another process (its name missing for a
    while): the save's next use of the name fails; that is a StorageError saying what
    happened (a raw FileNotFoundError escaped before), and nothing is committed."""
    run = tmp_path / "run"
    moved = after_staging_prepared(monkeypatch, lambda path: path.rename(tmp_path / "elsewhere"))
    with bounded(BOUND), pytest.raises(distckpt.StorageError, match="moved or replaced"):
        distckpt.save({"net": {"w": torch.arange(6.0), "b": torch.ones(3)}}, run / "ck")
    assert moved and not (run / "ck").exists()


OPERATIONS: dict[str, Callable[[PosixStore], object]] = {
    "read": lambda s: s.read("d/f"),
    "open": lambda s: s.open("d/f").read(0, 1),
    "write": lambda s: s.write("d/f", b"mine"),
    "write-new-dir": lambda s: s.write("d/new/f", b"mine"),
    "create": lambda s: s.create("d/g").finish(),
    "put_new": lambda s: s.put_new("d/g", b"mine"),
    "put_if": lambda s: s.put_if("d/f", b"mine", s.read_versioned("f")[1]),
    "exists": lambda s: s.exists("d/f"),
    "is_dir": lambda s: s.is_dir("d/sub"),
    "age": lambda s: s.age("d/f"),
    "stamp": lambda s: s.stamp("d/f"),
    "list": lambda s: s.list("d"),
    "list-below": lambda s: s.list("d/sub"),
    "walk": lambda s: s.walk("d"),
    "delete": lambda s: s.delete("d/f"),
    "delete_tree": lambda s: s.delete_tree("d/sub"),
    "rename": lambda s: s.rename("d/sub", "moved"),
    "rename-into": lambda s: s.rename("other", "d/other"),
    "exchange": lambda s: s.exchange("d/sub", "other"),
    "touch": lambda s: s.touch("d/f"),
    "prepare": lambda s: s.prepare(["d/new/f"]),
    "persist": lambda s: s.persist(["d/f"]),
    "child": lambda s: s.child("d").read("f"),
    "copy-from": lambda s: s.copy(s, "d/f", "copied"),
    "copy-into": lambda s: s.copy(s, "f", "d/copied"),
}


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_no_store_operation_goes_through_a_directory_swapped_for_a_link(
    tmp_path: Path, resolution: str, operation: str
) -> None:
    root, sentinel = tmp_path / "store", tmp_path / "sentinel"
    store = PosixStore(root)
    for key in ("d/f", "d/sub/x", "f", "other/y"):
        store.write(key, b"original")
    for key in ("d/f", "d/sub/x"):  # every directory used once: "checked"
        assert store.read(key) == b"original"
    assert store.list("d/sub") == ["x"]
    sentinel.mkdir()
    for key in ("f", "sub/x", "copied"):
        (sentinel / key).parent.mkdir(exist_ok=True)
        (sentinel / key).write_bytes(b"outside")
    os.mkdir(sentinel / "new")
    (sentinel / "new" / "f").write_bytes(b"outside")
    before = snapshot(sentinel)
    swap_for_link(root / "d", sentinel)
    with bounded(BOUND), pytest.raises(UnsafePathError, match="symbolic link") as info:
        OPERATIONS[operation](store)
    assert str(root / "d") in str(info.value)
    assert snapshot(sentinel) == before
    assert (root / "d").is_symlink()


def test_a_link_in_place_of_a_file_is_refused_and_left_alone(
    tmp_path: Path, resolution: str
) -> None:
    store = PosixStore(tmp_path / "store")
    store.write("f", b"mine")
    outside = tmp_path / "outside"
    outside.write_bytes(b"outside")
    (tmp_path / "store" / "f").unlink()
    (tmp_path / "store" / "f").symlink_to(outside)
    for op in (
        lambda: store.read("f"),
        lambda: store.open("f"),
        lambda: store.list("f"),
        lambda: store.put_if("f", b"x", "v"),
        lambda: store.write("f", b"new"),
        lambda: store.create("f").finish(),
    ):
        with pytest.raises(UnsafePathError, match="symbolic link"):
            op()
    store.touch("f")  # the link's own time, never the target's
    assert not store.is_dir("f") and store.exists("f")
    store.delete("f")  # the link, not its target
    assert outside.read_bytes() == b"outside" and not store.exists("f")


# ---------------------------------------------------------------- the top and its descriptor


def test_the_root_is_the_users_path_and_is_followed(tmp_path: Path, resolution: str) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    store = PosixStore(tmp_path / "alias" / "run")
    store.write("a/b", b"1")
    assert (tmp_path / "real" / "run" / "a" / "b").read_bytes() == b"1"
    assert store.child("a").read("b") == b"1" and store.list() == ["a"]


def test_a_root_removed_and_made_again_is_found_again(tmp_path: Path, resolution: str) -> None:
    store = PosixStore(tmp_path / "ck")
    store.write("a/b", b"1")
    shutil.rmtree(tmp_path / "ck")  # by someone else: the store holds the old directory
    (tmp_path / "ck" / "a").mkdir(parents=True)
    (tmp_path / "ck" / "a" / "b").write_bytes(b"2")
    assert store.read("a/b") == b"2"
    store.write("a/c", b"3")
    assert (tmp_path / "ck" / "a" / "c").read_bytes() == b"3"
    store.delete_tree()
    store.write("x", b"4")
    assert (tmp_path / "ck" / "x").read_bytes() == b"4"


def open_descriptors() -> int:
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_saves_and_loads_leave_no_descriptor_open(tmp_path: Path, resolution: str) -> None:
    state = {"net": {f"w{i}": torch.full((3, 5), float(i)) for i in range(20)}, "step": 3}
    distckpt.save(state, tmp_path / "warm")  # imports, thread pools: started once
    distckpt.load(state, tmp_path / "warm")
    before = open_descriptors()
    for k in range(3):
        distckpt.save(state, tmp_path / f"ck{k}")
        distckpt.save(state, tmp_path / f"ck{k}", overwrite=True)
        target = {"net": {f"w{i}": torch.zeros(3, 5) for i in range(20)}, "step": 0}
        distckpt.load(target, tmp_path / f"ck{k}")
        assert torch.equal(target["net"]["w7"], torch.full((3, 5), 7.0))
    ckpt = distckpt.Checkpoint(w=torch.ones(3))
    with distckpt.CheckpointManager(ckpt, tmp_path / "run", max_to_keep=1) as manager:
        for _ in range(3):
            manager.save()
    del manager, ckpt
    assert open_descriptors() == before


def test_a_forked_child_uses_the_store_it_inherited(tmp_path: Path, resolution: str) -> None:
    store = PosixStore(tmp_path / "s")
    store.write("a", b"parent")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            store.write("b", store.read("a") + b"+child")
            os._exit(0)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.read("b") == b"parent+child"


# ---------------------------------------------------------------- a real race, bounded

SWAPS = 2000


def swapper(directory: Path, link: Path, stop: threading.Event, swaps: list[int]) -> None:
    """Exchange ``directory`` with ``link`` (atomically, so the name always holds one
    or the other) until ``stop``, at most :data:`SWAPS` times."""
    for _ in range(SWAPS):
        if stop.is_set():
            break
        try:
            exchange(directory, link)
            exchange(directory, link)
        except OSError:
            continue
        swaps[0] += 1


def can_exchange(where: Path) -> bool:
    (where / "x").mkdir()
    (where / "y").symlink_to("x")
    try:
        return exchange(where / "x", where / "y")
    finally:
        (where / "x").unlink() if (where / "x").is_symlink() else (where / "x").rmdir()
        (where / "y").unlink() if (where / "y").is_symlink() else (where / "y").rmdir()


@pytest.mark.timeout(120)
def test_loads_racing_a_directory_swapped_for_a_link_never_read_outside(
    tmp_path: Path, resolution: str
) -> None:
    """While a thread swaps ck/b for a link to an outside copy (b = 7.0) and back, loads
    through one store end with the right values or an UnsafePathError: never the
    outside values, never a checksum error (which would mean outside bytes were read)."""
    if not can_exchange(tmp_path):
        pytest.skip("no renameat2(RENAME_EXCHANGE) here")
    ck, outside = tmp_path / "ck", tmp_path / "outside"
    distckpt.save({"b": torch.zeros(4), "c": torch.ones(2)}, ck)
    distckpt.save({"b": torch.full((4,), 7.0)}, outside)
    (ck / ".b-link").symlink_to(outside / "b", target_is_directory=True)
    store = open_store(ck)
    stop, swaps = threading.Event(), [0]
    thread = threading.Thread(target=swapper, args=(ck / "b", ck / ".b-link", stop, swaps))
    outcomes = {"ok": 0, "refused": 0}
    thread.start()
    try:
        with bounded(BOUND):
            for _ in range(200):
                b = torch.full((4,), -1.0)
                try:
                    distckpt.load({"b": b, "c": torch.zeros(2)}, store)
                except UnsafePathError:
                    outcomes["refused"] += 1
                    continue
                assert torch.equal(b, torch.zeros(4)), b
                outcomes["ok"] += 1
    finally:
        stop.set()
        thread.join()
    assert swaps[0] > 0, (swaps, outcomes)


@pytest.mark.timeout(180)
def test_saves_racing_a_staging_directory_swapped_for_a_link_never_write_outside(
    tmp_path: Path, resolution: str
) -> None:
    """While a thread swaps each save's staging directory for a link to a sentinel
    directory and back, every save either commits the right values or fails with a
    CheckpointError; the sentinel is never written (its entries and times unchanged)."""
    run, sentinel = tmp_path / "run", tmp_path / "sentinel"
    if not can_exchange(tmp_path):
        pytest.skip("no renameat2(RENAME_EXCHANGE) here")
    run.mkdir()
    sentinel.mkdir()
    (sentinel / "keep").write_bytes(b"untouched")
    before = snapshot(sentinel)
    stop, swaps = threading.Event(), [0]

    def swap_staging() -> None:
        """Each staging directory seen of an even-numbered save: exchanged with a fresh
        link to the sentinel, and back (a save that failed meanwhile may have removed
        the link: its directory is left under the link's name). The odd-numbered saves
        race the even ones' failures but are not swapped, so that the run is never
        empty of commits on a loaded machine."""
        n = 0
        while not stop.is_set() and swaps[0] < SWAPS:
            for name in os.listdir(run):
                if ".staging-" not in name or int(name.split(".")[1].removeprefix("ck-")) % 2:
                    continue
                n += 1
                link = run / f".swap-link-{n}"
                link.symlink_to(sentinel, target_is_directory=True)
                try:
                    exchange(run / name, link)
                    exchange(run / name, link)
                except OSError:
                    pass
                swaps[0] += 1
                if link.is_symlink():
                    link.unlink()

    thread = threading.Thread(target=swap_staging)
    committed, failed = [], 0
    thread.start()
    try:
        with bounded(BOUND * 2):
            for k in range(40):
                state = {"w": torch.full((64,), float(k)), "net": {"b": torch.arange(8.0) + k}}
                try:
                    distckpt.save(state, run / f"ck-{k}", io_workers=2)
                except CheckpointError:
                    failed += 1
                    continue
                committed.append(k)
    finally:
        stop.set()
        thread.join()
    assert snapshot(sentinel) == before
    for k in committed:
        got = {"w": torch.zeros(64), "net": {"b": torch.zeros(8)}}
        distckpt.load(got, open_store(run).child(f"ck-{k}"))
        assert torch.equal(got["w"], torch.full((64,), float(k)))
        assert torch.equal(got["net"]["b"], torch.arange(8.0) + k)
    assert committed, (swaps, failed)


# ---------------------------------------------------------------- Hugging Face weights


def test_hf_weights_swapped_for_a_link_after_they_were_checked_are_refused(
    tmp_path: Path, resolution: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weights directory is checked once (where each file leads); a file swapped for
    a link to an outside one of the same layout afterwards is refused when read."""
    from safetensors.torch import save_file

    from distckpt.hf import load as hf_load

    weights, outside = tmp_path / "weights", tmp_path / "outside.safetensors"
    weights.mkdir()
    save_file({"w": torch.zeros(4)}, str(weights / "model.safetensors"))
    save_file({"w": torch.full((4,), 7.0)}, str(outside))
    real_open = hf_load.open_weights

    def open_then_swap(path: Any) -> Any:
        found = real_open(path)
        (weights / "model.safetensors").unlink()
        (weights / "model.safetensors").symlink_to(outside)
        return found

    monkeypatch.setattr(hf_load, "open_weights", open_then_swap)
    w = torch.full((4,), -1.0)
    with bounded(BOUND), pytest.raises(UnsafePathError, match="symbolic link"):
        distckpt.load_hf({"w": w}, weights)
    assert torch.equal(w, torch.full((4,), -1.0))


def test_hf_files_being_written_are_never_written_through_a_link(
    tmp_path: Path, resolution: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator has created the temporary files; one is then a link to an outside
    file: the rank writing it refuses, and the outside file keeps its bytes."""
    from distckpt.hf import save as hf_save

    weights, outside = tmp_path / "weights", tmp_path / "victim"
    outside.write_bytes(b"victim's bytes")
    real_prepare = hf_save.Target.prepare

    def prepare_then_swap(target: Any, plan: Any, overwrite: bool) -> None:
        real_prepare(target, plan, overwrite)
        (temp,) = weights.glob(".model.safetensors.tmp-*")
        temp.unlink()
        temp.symlink_to(outside)

    monkeypatch.setattr(hf_save.Target, "prepare", prepare_then_swap)
    with bounded(BOUND), pytest.raises(UnsafePathError, match="symbolic link"):
        distckpt.save_hf({"w": torch.ones(4)}, weights)
    assert outside.read_bytes() == b"victim's bytes"
    assert not (weights / "model.safetensors").exists()


def test_a_checkpoint_swapped_for_a_link_while_it_is_removed_is_not_marked(
    tmp_path: Path, resolution: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``remove`` has seen a directory; then it is a link to another run's checkpoint.
    The mark that says "being deleted" (which that run's manager would act on) is not
    written through the link, and the other checkpoint keeps every entry."""
    run, other = tmp_path / "run", tmp_path / "other"
    distckpt.save({"w": torch.ones(4)}, run / "ck")
    distckpt.save({"w": torch.full((4,), 7.0)}, other / "ck")
    before = snapshot(other)
    real_is_dir = PosixStore.is_dir

    def is_dir_then_swap(store: PosixStore, key: str) -> bool:
        found = real_is_dir(store, key)
        if key == "ck" and Path(store.url) == run and not (run / "ck").is_symlink():
            swap_for_link(run / "ck", other / "ck")
        return found

    monkeypatch.setattr(PosixStore, "is_dir", is_dir_then_swap)
    with bounded(BOUND), pytest.raises(UnsafePathError, match="symbolic link"):
        distckpt.remove(run / "ck")
    assert snapshot(other) == before
