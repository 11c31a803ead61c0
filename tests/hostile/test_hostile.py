"""Hostile checkpoints: what an index, a pointer, a manifest or a weights index names must
stay inside its checkpoint (or run directory); damaged metadata is one clear error; only
regular files are opened. Each test is a recipe that misled or crashed distckpt before.
(``tests/hostile/test_fuzz.py`` searches for more.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import distckpt
from distckpt import CheckpointError, CorruptCheckpointError, UnsafePathError
from distckpt.testing.hostile import reseal
from tests.support.hostile_util import BOUND, cli, local_manager
from tests.support.launch_util import bounded


def cli_process(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """``distckpt ARGS`` as its own process: all it prints, logging included."""
    return subprocess.run(
        [sys.executable, "-m", "distckpt", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=BOUND * 2,
    )


def one_error_line(run: subprocess.CompletedProcess[str], *words: str) -> str:
    """The CLI failed with exit 2 and one line on stderr holding ``words``."""
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2, (run.returncode, run.stdout, run.stderr)
    assert len(lines) == 1 and lines[0].startswith("distckpt "), lines
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def index_of(ck: Path) -> dict[str, Any]:
    return json.loads((ck / "zarr.json").read_bytes())


def edit_index(ck: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    doc = index_of(ck)
    edit(doc["attributes"]["distckpt"]["variables"])
    (ck / "zarr.json").write_bytes(reseal(json.dumps(doc).encode()))


@pytest.fixture
def two(tmp_path: Path) -> tuple[Path, Path]:
    """``ck`` holds b = zeros, ``other`` (beside it) b = 7.0."""
    ck, other = tmp_path / "ck", tmp_path / "other"
    distckpt.save({"b": torch.zeros(4)}, ck)
    distckpt.save({"b": torch.full((4,), 7.0)}, other)
    return ck, other


def crc_of(ck: Path) -> int:
    return int(index_of(ck)["attributes"]["distckpt"]["variables"]["b"]["pieces"][0]["crc"])


# ---------------------------------------------------------------- 1. paths out of a checkpoint


@pytest.mark.parametrize("file", ["../other/b/c.0", "ABSOLUTE", "b/../../other/b/c.0", "b//c.0"])
def test_an_index_cannot_point_a_load_outside_its_checkpoint(
    two: tuple[Path, Path], file: str
) -> None:
    ck, other = two
    target = str(other / "b" / "c.0") if file == "ABSOLUTE" else file

    def point(variables: dict[str, Any]) -> None:
        variables["b"]["pieces"][0].update(file=target, crc=crc_of(other))

    edit_index(ck, point)
    b = torch.full((4,), -1.0)
    with pytest.raises(UnsafePathError, match="variable 'b'") as ei:
        distckpt.load({"b": b}, ck)
    assert isinstance(ei.value, CorruptCheckpointError) and str(ck) in str(ei.value)
    assert torch.equal(b, torch.full((4,), -1.0))  # nothing read
    one_error_line(cli_process("verify", ck), "variable 'b'", "outside")
    one_error_line(cli("export", ck, ck.parent / "x.safetensors"), "variable 'b'")
    one_error_line(cli("inspect", ck), "variable 'b'")


@pytest.mark.parametrize("what", ["file", "directory", "inside"])
def test_links_in_a_checkpoint_are_never_followed(two: tuple[Path, Path], what: str) -> None:
    ck, other = two
    edit_index(ck, lambda v: v["b"]["pieces"][0].update(crc=crc_of(other)))
    if what == "file":  # the very bytes of the other checkpoint, through a link
        (ck / "b" / "c.0").unlink()
        (ck / "b" / "c.0").symlink_to(other / "b" / "c.0")
    elif what == "directory":
        shutil.rmtree(ck / "b")
        (ck / "b").symlink_to(other / "b")
    else:  # a link that stays inside is refused too: a checkpoint holds no links
        shutil.copytree(other / "b", ck / "copy")
        (ck / "b" / "c.0").unlink()
        (ck / "b" / "c.0").symlink_to(ck / "copy" / "c.0")
    with pytest.raises(UnsafePathError, match="symbolic link"):
        distckpt.load({"b": torch.zeros(4)}, ck)
    assert cli("verify", ck).returncode in (1, 2)


def test_a_checkpoint_named_through_a_link_by_the_user_is_read(two: tuple[Path, Path]) -> None:
    """The location the user gives is followed as the operating system does."""
    ck, _ = two
    (ck.parent / "alias").symlink_to(ck)
    b = torch.ones(4)
    distckpt.load({"b": b}, ck.parent / "alias")
    assert torch.equal(b, torch.zeros(4))


def test_an_s3_index_cannot_leave_its_prefix(s3: Any) -> None:
    from distckpt.storage.registry import open_store

    ck, other = f"{s3.url}/ck", f"{s3.url}/other"
    distckpt.save({"b": torch.zeros(4)}, ck)
    distckpt.save({"b": torch.full((4,), 7.0)}, other)
    store = open_store(ck)
    doc = json.loads(store.read("zarr.json"))
    piece = doc["attributes"]["distckpt"]["variables"]["b"]["pieces"][0]
    other_doc = json.loads(open_store(other).read("zarr.json"))
    piece["crc"] = other_doc["attributes"]["distckpt"]["variables"]["b"]["pieces"][0]["crc"]
    piece["file"] = "../other/b/c.0"
    store.write("zarr.json", reseal(json.dumps(doc).encode()))
    with pytest.raises(UnsafePathError, match="variable 'b'"):
        distckpt.load({"b": torch.zeros(4)}, ck)


# ---------------------------------------------------------------- 2. retention stays home


def run_with_victim(tmp_path: Path) -> tuple[Path, Path]:
    victim = tmp_path / "victim"
    distckpt.save({"w": torch.full((4,), 9.0)}, victim)
    run = tmp_path / "run"
    ckpt = distckpt.Checkpoint(w=torch.ones(4))
    with distckpt.CheckpointManager(ckpt, run, max_to_keep=1) as manager:
        manager.save()
    return run, victim


@pytest.mark.parametrize("where", ["latest", "all", "absolute"])
def test_a_pointer_naming_a_checkpoint_outside_its_directory_is_refused(
    tmp_path: Path, where: str
) -> None:
    run, victim = run_with_victim(tmp_path)
    doc = json.loads((run / "latest").read_bytes())
    if where == "latest":
        doc["latest"], doc["all"] = "../victim", ["../victim"]
    elif where == "all":
        doc["all"] = ["../victim", doc["latest"]]
    else:
        doc["latest"], doc["all"] = str(victim), [str(victim)]
    (run / "latest").write_bytes(reseal(json.dumps(doc).encode()))
    before = sorted(p.name for p in victim.rglob("*"))
    w = torch.zeros(4)
    with pytest.raises(CorruptCheckpointError, match="latest"):
        distckpt.CheckpointManager(distckpt.Checkpoint(w=w), run, max_to_keep=1)
    with pytest.raises(CorruptCheckpointError):
        distckpt.latest_checkpoint(run)
    assert torch.equal(w, torch.zeros(4))  # the victim was not restored
    assert sorted(p.name for p in victim.rglob("*")) == before
    ls = cli("ls", run)
    assert ls.returncode in (0, 2) and len(ls.stderr.strip().splitlines()) <= 1, ls.stderr


def test_retention_and_gc_never_act_through_a_link(tmp_path: Path) -> None:
    """A run directory entry that is a link (named as a checkpoint, or as a leftover of a
    save) is not the run's: never restored, marked, renamed or deleted through."""
    run, victim = run_with_victim(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(victim, elsewhere)
    (run / "ckpt-0").symlink_to(victim)
    (run / ".ckpt-7.staging-0123abcd").symlink_to(elsewhere)
    stale = os.path.getmtime(elsewhere) - 3600
    os.utime(run / ".ckpt-7.staging-0123abcd", (stale, stale), follow_symlinks=False)
    before = {p: p.read_bytes() for p in [*victim.rglob("*"), *elsewhere.rglob("*")] if p.is_file()}
    ckpt = distckpt.Checkpoint(w=torch.zeros(4))
    with distckpt.CheckpointManager(ckpt, run, max_to_keep=1) as manager:
        assert manager.restore_or_initialize() == str(run / "ckpt-1")
        assert torch.equal(ckpt.w, torch.ones(4))
        for _ in range(3):
            manager.save()
        assert manager.checkpoints == [str(run / "ckpt-4")]
    assert cli("gc", run).returncode == 0
    after = {p: p.read_bytes() for p in [*victim.rglob("*"), *elsewhere.rglob("*")] if p.is_file()}
    assert after == before  # no owner file written in, nothing deleted
    assert (run / "ckpt-0").is_symlink()


# ---------------------------------------------------------------- 3. damaged metadata


def deep_value(ck: Path) -> None:
    text = (ck / "zarr.json").read_text()
    doc = json.loads(text)
    doc["attributes"]["distckpt"]["variables"]["cfg"] = {"kind": "value", "value": "@DEEP@"}
    text = json.dumps(doc).replace('"@DEEP@"', "[" * 100_000 + "]" * 100_000)
    (ck / "zarr.json").write_bytes(reseal(text.encode()))


def shallow_but_too_deep(ck: Path) -> None:  # parses, but nests past the values' limit
    edit_index(
        ck, lambda v: v.update(cfg={"kind": "value", "value": json.loads("[" * 150 + "]" * 150)})
    )


def huge_shape(ck: Path) -> None:
    def edit(v: dict[str, Any]) -> None:
        piece = v["b"]["pieces"][0]
        v["b"]["shape"] = [10**15]
        piece["box"], piece["block"] = [[0], [10**15]], [10**15]

    edit_index(ck, edit)


def edit_attributes(ck: Path, **fields: Any) -> None:
    doc = index_of(ck)
    doc["attributes"]["distckpt"].update(fields)
    (ck / "zarr.json").write_bytes(reseal(json.dumps(doc).encode()))


DAMAGE: dict[str, Callable[[Path], None]] = {
    "deep": deep_value,
    "too-deep": shallow_but_too_deep,
    "huge-shape": huge_shape,
    "entry-string": lambda ck: edit_index(ck, lambda v: v.update(w="hello")),
    "dtype-dict": lambda ck: edit_index(ck, lambda v: v["w"].update(dtype={"a": 1})),
    "inner-zero": lambda ck: edit_index(ck, lambda v: v["w"].update(inner=[0, 0])),
    "world-zero": lambda ck: edit_attributes(ck, world_size=0),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_metadata_is_one_clear_error_everywhere(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    ckpt = distckpt.Checkpoint(
        w=torch.arange(120_000.0).reshape(300, 400), b=torch.ones(5), cfg={"a": 1}
    )
    with distckpt.CheckpointManager(ckpt, run, max_to_keep=3) as manager:
        manager.save()
        ckpt.w.add_(1)
        manager.save()
    ck = run / "ckpt-2"
    DAMAGE[damage](ck)
    state = {"w": torch.zeros(300, 400), "b": torch.zeros(5), "cfg": None, "save_counter": None}
    with bounded(BOUND), pytest.raises(CheckpointError):
        distckpt.load(state, ck)
    with bounded(BOUND), pytest.raises(CheckpointError):
        distckpt.list_variables(ck)
    # The manager resumes from the newest readable checkpoint, and says why.
    fresh = distckpt.Checkpoint(w=torch.zeros(300, 400), b=torch.zeros(5), cfg={"a": 0})
    with (
        bounded(BOUND),
        caplog.at_level("WARNING", "distckpt"),
        distckpt.CheckpointManager(fresh, run, max_to_keep=3) as manager,
    ):
        assert manager.restore_or_initialize() == str(run / "ckpt-1")
    assert torch.equal(fresh.w, torch.arange(120_000.0).reshape(300, 400))
    assert f"{ck} is unreadable" in caplog.text
    for cmd in (["inspect", ck], ["verify", ck], ["export", ck, tmp_path / "out.safetensors"]):
        one_error_line(cli(*cmd), str(ck))
    ls = cli("ls", run)  # the damaged one is marked, the rest listed
    assert ls.returncode == 0, ls.stderr
    (damaged,) = [line for line in ls.stdout.splitlines() if "ckpt-2" in line]
    (intact,) = [line for line in ls.stdout.splitlines() if "ckpt-1" in line]
    assert "unreadable" in damaged and "committed" in intact, ls.stdout


def test_a_save_counter_that_is_not_a_count_is_refused(tmp_path: Path) -> None:
    ckpt = distckpt.Checkpoint(w=torch.ones(2))
    with distckpt.CheckpointManager(ckpt, tmp_path / "run") as manager:
        manager.save()
    edit_index(tmp_path / "run" / "ckpt-1", lambda v: v["save_counter"].update(value="../x"))
    fresh = distckpt.Checkpoint(w=torch.zeros(2))
    with pytest.raises(CorruptCheckpointError, match="save_counter"):
        fresh.restore(tmp_path / "run" / "ckpt-1")


def test_values_nested_too_deep_are_refused_when_saved(tmp_path: Path) -> None:
    deep: Any = 1
    for _ in range(150):
        deep = [deep]
    with pytest.raises(distckpt.UnsupportedValueError, match="nested"):
        distckpt.save({"v": deep}, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


# ---------------------------------------------------------------- 4. only regular files


@pytest.mark.parametrize("what", ["piece", "index"])
def test_a_fifo_is_never_opened(two: tuple[Path, Path], what: str) -> None:
    ck, _ = two
    victim = ck / "b" / "c.0" if what == "piece" else ck / "zarr.json"
    victim.unlink()
    os.mkfifo(victim)
    with bounded(BOUND), pytest.raises(UnsafePathError, match="FIFO"):
        distckpt.load({"b": torch.zeros(4)}, ck)
    commands = [["verify", ck], ["export", ck, ck.parent / "x.safetensors"]]
    for cmd in commands + ([["inspect", ck]] if what == "index" else []):
        run = cli(*cmd)
        assert run.returncode in (1, 2) and "FIFO" in run.stderr + run.stdout, run


def test_a_local_step_with_a_fifo_or_link_falls_back_to_the_shared_directory(
    tmp_path: Path,
) -> None:
    def manager(ckpt: distckpt.Checkpoint) -> distckpt.CheckpointManager:
        return local_manager(tmp_path, ckpt)

    ckpt = distckpt.Checkpoint(step=torch.tensor(0), w=torch.zeros(8))
    with manager(ckpt) as m:
        for step in (1, 2):
            ckpt.step.fill_(step)
            ckpt.w.fill_(step)
            m.save()
    (data,) = (tmp_path / "local" / "step-2").glob("*.data")
    outside = tmp_path / "outside.data"
    shutil.copy(data, outside)  # the very bytes, outside the tier: still never read
    data.unlink()
    data.symlink_to(outside)
    fresh = distckpt.Checkpoint(step=torch.tensor(0), w=torch.zeros(8))
    with bounded(BOUND), manager(fresh) as m:
        m.restore_or_initialize()
        assert m.restored is not None and m.restored.tier == "persistent", m.restored
        assert "symbolic link" in m.restored.reason
    assert int(fresh.step) == 1 and torch.equal(fresh.w, torch.ones(8))


# ---------------------------------------------------------------- Hugging Face weights


def test_hf_weights_read_only_inside_their_directory(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    weights, outside = tmp_path / "weights", tmp_path / "outside"
    weights.mkdir()
    outside.mkdir()
    save_file({"w": torch.ones(3)}, str(outside / "model.safetensors"))
    (weights / "model.safetensors").symlink_to(outside / "model.safetensors")
    with pytest.raises(UnsafePathError, match="outside the weights directory"):
        distckpt.load_hf({"w": torch.zeros(3)}, weights)
    # An index naming a file elsewhere, and a FIFO in place of a file.
    (weights / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {"w": "../outside/model.safetensors"}}
    (weights / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError):
        distckpt.load_hf({"w": torch.zeros(3)}, weights)
    index["weight_map"]["w"] = "model.safetensors"
    (weights / "model.safetensors.index.json").write_text(json.dumps(index))
    os.mkfifo(weights / "model.safetensors")
    with bounded(BOUND), pytest.raises(UnsafePathError, match="FIFO"):
        distckpt.load_hf({"w": torch.zeros(3)}, weights)


def test_hf_hub_cache_snapshots_are_read_through_their_links(tmp_path: Path) -> None:
    """The hub's cache keeps each file once, in ``blobs/``, and links a snapshot's names
    to them: those links lead inside the repository's folder, and are followed."""
    from safetensors.torch import save_file

    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    save_file({"w": torch.arange(3.0)}, str(repo / "blobs" / "f00d"))
    (snapshot / "model.safetensors").symlink_to(Path("..", "..", "blobs", "f00d"))
    w = torch.zeros(3)
    distckpt.load_hf({"w": w}, snapshot)
    assert torch.equal(w, torch.arange(3.0))
