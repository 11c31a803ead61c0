"""Metadata documents carry their own checksum (:mod:`distckpt.format.seal`): a flipped
byte that leaves the JSON well-formed (another offset, shape, crc, value, or a pointer's
step) is refused as damage, naming the file, by every reader; documents written before
(tests/golden/v1-*) still load, and say that they carry none."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

import distckpt
from distckpt import CorruptCheckpointError, UnsupportedFormatError
from distckpt.cli import main
from distckpt.format import seal
from distckpt.testing.hostile import reseal
from tests.support.hostile_util import local_manager
from tests.support.launch_util import bounded
from tests.support.make_golden import SEALED, TWO_RANKS, sealed_state

BOUND = 60
CHECKSUM = "metadata checksum does not match"


def cli(*args: str | Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with bounded(BOUND), redirect_stdout(out), redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def flip(path: Path, old: bytes, new: bytes) -> None:
    """Replace the one occurrence of ``old`` in ``path`` by ``new`` (as a damaged disk,
    not an attacker: no checksum recomputed)."""
    raw = path.read_bytes()
    assert raw.count(old) == 1, (old, raw[:300])
    path.write_bytes(raw.replace(old, new))


def spec_checksum(raw: bytes) -> str:
    """The checksum of a sealed document as the specification computes it, written
    independently of distckpt.format.seal."""
    mark = b'"checksum": "crc32c:'
    at = raw.index(mark) + len(mark)
    return f"{crc32c.crc32c(raw[:at] + b'00000000' + raw[at + 8 :]):08x}"


# ---------------------------------------------------------------- the primitives


@pytest.mark.parametrize("indent", [None, 1])
def test_a_sealed_document_follows_the_specification(indent: int | None) -> None:
    doc = {"format": "x", "n": [1, 2.5, None], "s": 'a "checksum": "crc32c:ffffffff" b'}
    raw = seal.dumps(seal.sealed(doc), indent=indent)
    parsed = json.loads(raw)
    assert list(parsed) == ["checksum", "format", "n", "s"]  # the member comes first
    assert raw.startswith(b'{"checksum": "crc32c:' if indent is None else b'{\n "checksum"')
    assert parsed["checksum"] == f"crc32c:{spec_checksum(raw)}"
    assert seal.check(raw, "doc", parsed) is True
    assert seal.check(raw, "doc") is True  # parsed there
    assert seal.strip(parsed) == doc


def test_a_nested_sealed_object_covers_its_whole_file() -> None:
    raw = seal.dumps({"zarr_format": 3, "attributes": {"distckpt": seal.sealed({"a": 1})}})
    assert raw.startswith(b'{"zarr_format":3,"attributes":{"distckpt":{"checksum": "crc32c:')
    inner = json.loads(raw)["attributes"]["distckpt"]
    assert seal.check(raw, "zarr.json", inner)
    damaged = raw.replace(b'"zarr_format":3', b'"zarr_format":4')  # in the wrapper
    with pytest.raises(CorruptCheckpointError, match=CHECKSUM):
        seal.check(damaged, "zarr.json", json.loads(damaged)["attributes"]["distckpt"])


def test_every_flipped_bit_is_refused_or_leaves_the_document_as_written() -> None:
    """Each single-bit flip of a sealed document, wherever it falls: refused, or (a flip
    in the member's own name, which leaves a document without a checksum) the other
    members exactly as written. Never another document read as valid."""
    doc = {"format": "distckpt-pointer", "latest": "ckpt-12", "all": ["ckpt-11", "ckpt-12"]}
    raw = seal.dumps(seal.sealed(doc), indent=1)
    unsealed = 0
    for at in range(len(raw)):
        for bit in range(8):
            damaged = bytearray(raw)
            damaged[at] ^= 1 << bit
            try:
                parsed = json.loads(bytes(damaged))
            except (ValueError, UnicodeDecodeError):
                continue  # not JSON any more: every reader refuses it already
            try:
                valid = seal.check(bytes(damaged), "latest", parsed)
            except (CorruptCheckpointError, UnsupportedFormatError):
                continue
            assert not valid, (at, bit)  # never a sealed document that passes
            unsealed += 1
            # The member renamed: one more member, the others as written.
            assert {k: v for k, v in parsed.items() if k in doc} == doc, (at, bit)
            assert len(parsed) == len(doc) + 1, (at, bit)
    assert unsealed > 0


@pytest.mark.parametrize(
    "value, error, words",
    [
        (7, CorruptCheckpointError, "malformed"),
        ("crc32c", CorruptCheckpointError, "malformed"),
        ("crc32c:0123", CorruptCheckpointError, "malformed"),
        ("crc32c:0123ABCD", CorruptCheckpointError, "lowercase"),
        ("crc32c:0123abcg", CorruptCheckpointError, "malformed"),
        ("sha256:0123abcd", UnsupportedFormatError, "algorithm 'sha256'"),
    ],
)
def test_a_malformed_checksum_is_refused(value: Any, error: type[Exception], words: str) -> None:
    raw = json.dumps({"checksum": value, "a": 1}).encode()
    with pytest.raises(error, match=words) as ei:
        seal.check(raw, "/run/latest")
    assert "/run/latest" in str(ei.value)


def test_the_digits_must_be_those_of_the_first_mark() -> None:
    raw = seal.dumps(seal.sealed({"a": 1}))
    compact = raw.replace(b'"checksum": "', b'"checksum":"')  # another byte form
    with pytest.raises(CorruptCheckpointError, match="malformed"):
        seal.check(compact, "doc")
    # Another object's member before it: its digits are the ones the reader compares.
    twice = raw[:1] + b'"c": {"checksum": "crc32c:12345678"}, ' + raw[1:]
    with pytest.raises(CorruptCheckpointError, match="malformed"):
        seal.check(twice, "doc")


def test_an_unsealed_document_is_read_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    raw = json.dumps({"format": "x"}).encode()
    with caplog.at_level(logging.INFO, "distckpt"):
        for _ in range(3):
            assert seal.check(raw, "/somewhere/unique-for-this-test") is False
    records = [r for r in caplog.records if "unique-for-this-test" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert seal.UNSEALED in records[0].getMessage()


def test_reseal_recomputes_an_edited_document_and_leaves_an_unsealed_one() -> None:
    raw = seal.dumps(seal.sealed({"latest": "ckpt-3"}), indent=1)
    edited = raw.replace(b"ckpt-3", b"ckpt-2")
    with pytest.raises(CorruptCheckpointError, match=CHECKSUM):
        seal.check(edited, "latest")
    assert seal.check(reseal(edited), "latest") is True
    assert reseal(raw) == raw
    plain = b'{"latest": "ckpt-2"}'
    assert reseal(plain) == plain


# ---------------------------------------------------------------- the index


@pytest.fixture
def ck(tmp_path: Path) -> Path:
    """A checkpoint with a regular tensor (4 shards), a small one and a value."""
    path = tmp_path / "ck"
    state = {"w": torch.arange(4096.0), "b": torch.arange(6.0), "step": 1234}
    distckpt.save(state, path, small_bytes=64, inner_bytes=1024)
    return path


def fresh() -> dict[str, Any]:
    return {"w": torch.zeros(4096), "b": torch.zeros(6), "step": None}


# Flips that keep the JSON well-formed: (what, old bytes, new bytes).
INDEX_FLIPS = [
    ("value", b'"value":1234', b'"value":1235'),  # read as written before: a wrong value
    ("shape", b'"shape":[6]', b'"shape":[5]'),
    ("offset", b'"box":[[0],[6]]', b'"box":[[1],[6]]'),
    ("crc", b'"crc":[', b'"crc":[1'),
    ("wrapper", b'"zarr_format":3', b'"zarr_format":2'),
]


@pytest.mark.parametrize("what, old, new", INDEX_FLIPS, ids=[f[0] for f in INDEX_FLIPS])
def test_a_flipped_index_byte_is_refused_by_every_reader(
    ck: Path, tmp_path: Path, what: str, old: bytes, new: bytes
) -> None:
    index = ck / "zarr.json"
    flip(index, old, new)
    state = fresh()
    with bounded(BOUND), pytest.raises(CorruptCheckpointError, match=CHECKSUM) as ei:
        distckpt.load(state, ck)
    assert str(index) in str(ei.value)
    assert state["step"] is None and not state["b"].any()  # nothing read
    with pytest.raises(CorruptCheckpointError, match=CHECKSUM):
        distckpt.list_variables(ck)
    ckpt = distckpt.Checkpoint(w=torch.zeros(4096))
    with pytest.raises(CorruptCheckpointError, match=CHECKSUM):
        ckpt.restore(ck)
    for argv in (
        ["inspect", ck],
        ["verify", ck],
        ["export", ck, tmp_path / "out.safetensors"],
        ["diff", ck, ck],
    ):
        rc, _, err = cli(*argv)
        assert rc == 2 and CHECKSUM in err and str(index) in err, (argv, err)
        assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out.safetensors").exists()


def test_the_dcp_reader_refuses_a_flipped_index(ck: Path) -> None:
    from distckpt.integrations.dcp import DistckptReader

    flip(ck / "zarr.json", b'"value":1234', b'"value":1235')
    with pytest.raises(CorruptCheckpointError, match=CHECKSUM):
        DistckptReader(ck).read_metadata()


def test_an_edit_with_its_checksum_recomputed_reaches_the_checks_behind_it(ck: Path) -> None:
    """What an attacker does: the seal is no defence, the value is what was written."""
    index = ck / "zarr.json"
    index.write_bytes(reseal(index.read_bytes().replace(b'"value":1234', b'"value":1235')))
    state = fresh()
    distckpt.load(state, ck)
    assert state["step"] == 1235 and torch.equal(state["b"], torch.arange(6.0))


def test_an_index_is_sealed_on_an_object_store(s3: Any) -> None:
    from distckpt.storage.registry import open_store

    url = f"{s3.url}/ck"
    distckpt.save({"b": torch.arange(6.0), "step": 1234}, url)
    store = open_store(url)
    raw = store.read("zarr.json")
    doc = json.loads(raw)["attributes"]["distckpt"]
    assert doc["checksum"] == f"crc32c:{spec_checksum(raw)}"
    store.write("zarr.json", raw.replace(b'"value":1234', b'"value":1235'))
    with pytest.raises(CorruptCheckpointError, match=CHECKSUM):
        distckpt.load({"b": torch.zeros(6), "step": None}, url)


def test_the_manager_falls_back_when_the_newest_index_fails_its_checksum(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    ckpt = distckpt.Checkpoint(w=torch.arange(8.0), cfg={"lr": 1})
    with distckpt.CheckpointManager(ckpt, run, max_to_keep=3) as manager:
        manager.save()
        ckpt.w.add_(1)
        ckpt.cfg = {"lr": 2}
        manager.save()
    flip(run / "ckpt-2" / "zarr.json", b'{"lr":2}', b'{"lr":3}')
    again = distckpt.Checkpoint(w=torch.zeros(8), cfg={"lr": 0})
    with (
        caplog.at_level(logging.WARNING, "distckpt"),
        distckpt.CheckpointManager(again, run, max_to_keep=3) as manager,
    ):
        assert manager.restore_or_initialize() == str(run / "ckpt-1")
    assert torch.equal(again.w, torch.arange(8.0)) and again.cfg == {"lr": 1}
    assert f"{run / 'ckpt-2'} is unreadable" in caplog.text and CHECKSUM in caplog.text
    rc, out, _ = cli("ls", run)
    (damaged,) = [line for line in out.splitlines() if "ckpt-2" in line]
    assert rc == 0 and "unreadable" in damaged and CHECKSUM in damaged


# ---------------------------------------------------------------- the pointer


def test_a_flipped_pointer_step_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ckpt = distckpt.Checkpoint(w=torch.zeros(2))
    with distckpt.CheckpointManager(ckpt, run, max_to_keep=3) as manager:
        for _ in range(3):
            manager.save()
    pointer = run / "latest"
    flip(pointer, b'"latest": "ckpt-3"', b'"latest": "ckpt-2"')  # an older one, silently
    with pytest.raises(CorruptCheckpointError, match=CHECKSUM) as ei:
        distckpt.latest_checkpoint(run)
    assert str(pointer) in str(ei.value)
    with pytest.raises(CorruptCheckpointError, match=CHECKSUM):
        distckpt.CheckpointManager(distckpt.Checkpoint(w=torch.zeros(2)), run)
    rc, out, err = cli("ls", run)
    assert rc == 0 and "ignoring the pointer" in err and CHECKSUM in err
    assert "<- latest" not in out


# ---------------------------------------------------------------- the node-local tier


def _two_steps(tmp_path: Path) -> None:
    """Step 1 in the shared directory, step 2 in the local tier only."""
    ckpt = distckpt.Checkpoint(step=torch.tensor(0), w=torch.zeros(8))
    with local_manager(tmp_path, ckpt) as m:
        for step in (1, 2):
            ckpt.step.fill_(step)
            ckpt.w.fill_(step)
            m.save()


def test_a_flipped_local_manifest_falls_back_to_the_shared_directory(tmp_path: Path) -> None:
    _two_steps(tmp_path)
    (manifest,) = (tmp_path / "local" / "step-2").glob("o0.*.json")
    flip(manifest, b'"save_counter":2', b'"save_counter":7')  # read as written before
    again = distckpt.Checkpoint(step=torch.tensor(0), w=torch.zeros(8))
    with bounded(BOUND), local_manager(tmp_path, again) as m:
        m.restore_or_initialize()
        assert m.restored is not None and m.restored.tier == "persistent", m.restored
        assert CHECKSUM in m.restored.reason and manifest.name in m.restored.reason
    assert int(again.step) == 1 and torch.equal(again.w, torch.ones(8))
    assert int(again.save_counter) == 1


def test_a_flipped_local_mark_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _two_steps(tmp_path)
    (mark,) = (tmp_path / "local" / "step-2").glob("done.*")
    flip(mark, b'"world":1', b'"world":2')
    again = distckpt.Checkpoint(step=torch.tensor(0), w=torch.zeros(8))
    with (
        bounded(BOUND),
        caplog.at_level(logging.WARNING, "distckpt"),
        local_manager(tmp_path, again) as m,
    ):
        m.restore_or_initialize()
        assert m.restored is not None and m.restored.tier == "persistent", m.restored
    assert int(again.step) == 1
    assert f"ignoring {mark}" in caplog.text and CHECKSUM in caplog.text


# ---------------------------------------------------------------- owner files and leases


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], **_OUT)
    return int(proc.stdout)


_OUT: dict[str, Any] = {"capture_output": True, "text": True, "timeout": BOUND, "check": True}


def _swap_pid(path: Path) -> None:
    raw = path.read_bytes()
    mine = str(os.getpid()).encode()
    assert raw.count(b'"pid":' + mine) == 1, raw
    path.write_bytes(raw.replace(b'"pid":' + mine, b'"pid":%d' % _dead_pid()))


def test_a_damaged_owner_file_never_gets_a_live_save_removed(tmp_path: Path) -> None:
    """A flipped pid naming a process gone on this host would make gc take the save for
    abandoned; failing its checksum, the owner is unknown and the heartbeat decides."""
    from distckpt.commit.staging import OWNER_FILE, Staging, collect
    from distckpt.storage.registry import open_store

    staging = Staging(open_store(tmp_path / "ckpt-1"), "abc123", 1)
    try:
        _swap_pid(Path(staging.path, OWNER_FILE))
        assert collect(open_store(tmp_path)) == []
        assert Path(staging.path, OWNER_FILE).exists()
        rc, out, _ = cli("ls", tmp_path)
        assert rc == 0 and "in progress" in out, out
    finally:
        staging.abort()


def test_a_damaged_lease_never_hands_a_held_lock_over(tmp_path: Path) -> None:
    from distckpt.training.lock import LOCK_FILE, DirectoryLock, DirectoryLockedError

    held = DirectoryLock(tmp_path)
    held.acquire()
    try:
        _swap_pid(tmp_path / LOCK_FILE)
        other = DirectoryLock(tmp_path)
        with pytest.raises(DirectoryLockedError, match="host \\?, pid \\?"):
            other.acquire()
    finally:
        held.release()


# ---------------------------------------------------------------- older checkpoints


def test_golden_checkpoints_load_and_say_they_are_unsealed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    golden = tmp_path / "golden"
    shutil.copytree(TWO_RANKS, golden)
    with caplog.at_level(logging.INFO, "distckpt"):
        for _ in range(2):
            assert len(distckpt.list_variables(golden)) == 10
    assert caplog.text.count(seal.UNSEALED) == 1  # once per document
    rc, out, err = cli("verify", golden)
    assert rc == 0 and "ok," in out and seal.UNSEALED in out, out + err
    rc, out, _ = cli("inspect", golden)
    assert rc == 0 and seal.UNSEALED in out
    rc, out, _ = cli("inspect", golden, "--json")
    assert rc == 0 and json.loads(out)["metadata_checksum"] is False


def test_an_unsealed_pointer_and_manifest_still_load(tmp_path: Path) -> None:
    """Documents as a distckpt that did not seal wrote them: the member removed."""
    _two_steps(tmp_path)

    def unseal(path: Path) -> None:
        doc = json.loads(path.read_bytes())
        del doc["checksum"]
        path.write_text(json.dumps(doc))

    (manifest,) = (tmp_path / "local" / "step-2").glob("o0.*.json")
    (mark,) = (tmp_path / "local" / "step-2").glob("done.*")
    for path in (tmp_path / "run" / "latest", manifest, mark):
        unseal(path)
    again = distckpt.Checkpoint(step=torch.tensor(0), w=torch.zeros(8))
    with bounded(BOUND), local_manager(tmp_path, again) as m:
        m.restore_or_initialize()
        assert m.restored is not None and m.restored.tier == "local", m.restored
    assert int(again.step) == 2 and torch.equal(again.w, torch.full((8,), 2.0))


def test_the_sealed_golden_checkpoint_loads_and_verifies() -> None:
    raw = (SEALED / "zarr.json").read_bytes()
    index = json.loads(raw)["attributes"]["distckpt"]
    assert index["checksum"] == f"crc32c:{spec_checksum(raw)}"
    assert index["format_version"] == 3  # the member changed no version
    want = sealed_state()
    got = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in want.items()}
    distckpt.load(got, SEALED)
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[name].view(torch.uint8), value.view(torch.uint8)), name
        else:
            assert got[name] == value, name
    rc, out, _ = cli("verify", SEALED)
    assert rc == 0 and seal.UNSEALED not in out


# ---------------------------------------------------------------- the damage of test_hostile


def test_hand_edits_without_a_recomputed_checksum_are_refused_as_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tests/hostile/test_hostile.py's damaged indexes, written without recomputing the checksum
    (a damaged disk, not an attacker): each is refused by its checksum."""
    from tests.hostile import test_hostile

    monkeypatch.setattr(test_hostile, "reseal", lambda raw: raw)
    damage: dict[str, Callable[[Path], None]] = test_hostile.DAMAGE
    state = {"w": torch.arange(120_000.0).reshape(300, 400), "b": torch.ones(5), "cfg": {"a": 1}}
    for name, apply in sorted(damage.items()):
        ck = tmp_path / name
        distckpt.save(state, ck)
        apply(ck)
        # Too deep to parse at all: refused before the checksum can be looked at.
        words = "not readable JSON" if name == "deep" else CHECKSUM
        with bounded(BOUND), pytest.raises(CorruptCheckpointError, match=words):
            distckpt.load({"w": torch.zeros(300, 400), "b": torch.zeros(5), "cfg": None}, ck)
