"""Exports of checkpoints that declare more than they store: memory follows a slab, never
a declared size, and every byte written is a stored, verified byte.

A compressed piece may declare up to 65,536 times its stored bytes (zstd's densest
encoding, runs of one byte, stays under that): a 220 KB checkpoint holds a 320 MiB
tensor. The checkpoints here are crafted as an attacker would, zstd frames written by hand
and every checksum recomputed; each export runs in a process of its own, whose peak
resident memory is measured (VmHWM: ru_maxrss would start at the parent's).
"""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import pytest
import safetensors.torch
import torch

import distckpt
from distckpt import CorruptCheckpointError
from distckpt.hf.safetensors import TensorHeader, header
from distckpt.testing.hostile import reseal
from distckpt.tools import torch_file
from distckpt.tools.diff import diff
from distckpt.tools.export import export
from tests.support.hostile_util import cli

pytestmark = pytest.mark.timeout(600)

GROWTH = 200  # MiB of peak memory an export may add (a slab is 64 MiB)
MiB = 1 << 20

CHILD = """
import json, sys, time
import torch  # in the baseline: the commands need it (import distckpt alone does not)
from distckpt.cli import main

def peak():  # MiB
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 1024

base = peak()
for argv in json.loads(sys.argv[1]):
    began = time.monotonic()
    print("command:", file=sys.stderr, flush=True)
    code = main(argv)
    out = {"code": code, "seconds": time.monotonic() - began, "growth": peak() - base}
    print("result:", json.dumps(out), flush=True)
"""


def in_a_child(*commands: list[str | Path]) -> list[dict[str, Any]]:
    """Each ``distckpt`` command in turn in one process: its exit code, seconds, and the
    growth of the process's peak memory so far; ``stderr``: what it printed."""
    argv = json.dumps([[str(a) for a in command] for command in commands])
    run = subprocess.run(
        [sys.executable, "-c", CHILD, argv], capture_output=True, text=True, timeout=500
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = [
        json.loads(line.removeprefix("result:"))
        for line in run.stdout.splitlines()
        if line.startswith("result:")
    ]
    for result, err in zip(results, run.stderr.split("command:\n")[1:], strict=True):
        result["stderr"] = err
    return results


def zstd_zeros(nbytes: int) -> bytes:
    """A zstd frame of ``nbytes`` zero bytes: a header declaring them, then RLE blocks
    of 128 KiB, four bytes each."""
    frame = bytearray(struct.pack("<I", 0xFD2FB528)) + bytes([0b11100000])
    frame += struct.pack("<Q", nbytes)  # single segment, 8-byte content size
    left = nbytes
    while left:
        n = min(128 * 1024, left)
        left -= n
        frame += ((1 if left == 0 else 0) | (1 << 1) | (n << 3)).to_bytes(3, "little") + b"\0"
    return bytes(frame)


def declaring_zeros(ck: Path, elements: int, inner: int) -> Path:
    """A checkpoint whose float32 ``b`` declares ``elements`` zeros, stored as zstd inner
    chunks of ``inner`` elements: one shard of RLE frames, every checksum recomputed."""
    distckpt.save({"b": torch.zeros(1024)}, ck, compression="zstd", inner_bytes=4096, small_bytes=0)
    doc = json.loads((ck / "zarr.json").read_bytes())
    entry = doc["attributes"]["distckpt"]["variables"]["b"]
    assert entry["layout"] == "regular" and len(entry["crc"]) == 1, entry
    frame = zstd_zeros(inner * 4)
    chunk = frame + crc32c.crc32c(frame).to_bytes(4, "little")
    count = elements // inner
    table = crc32c.crc32c(frame).to_bytes(4, "little") * count
    index = b"".join(
        struct.pack("<QQ", len(table) + k * len(chunk), len(chunk)) for k in range(count)
    )
    index += crc32c.crc32c(index).to_bytes(4, "little")
    shard = table + chunk * count + index
    (ck / "b" / "c.0").write_bytes(shard)
    entry.update(shape=[elements], chunks=[elements], inner=[inner])
    entry.update(crc=[crc32c.crc32c(table)], size=[len(shard)])
    entry.pop("digest", None)
    (ck / "zarr.json").write_bytes(reseal(json.dumps(doc).encode()))
    return ck


def test_a_declared_inner_chunk_larger_than_a_slab_is_refused_within_bounds(
    tmp_path: Path,
) -> None:
    """512 MiB in one compressed inner chunk, stored in 16 KB: reading any slab of it
    decompressed it whole (and a .pt export built the tensor whole besides)."""
    ck = declaring_zeros(tmp_path / "ck", 128 * MiB, 128 * MiB)
    assert sum(f.stat().st_size for f in ck.rglob("*") if f.is_file()) < 64 * 1024
    results = in_a_child(
        ["export", ck, tmp_path / "o.safetensors"],
        ["export", ck, tmp_path / "o.pt"],
        ["export", ck, tmp_path / "hf", "--hf"],
        ["diff", ck, ck],
    )
    for result in results:
        assert result["code"] == 2, result
        assert "compressed inner chunks [134217728] of 536870912 bytes" in result["stderr"]
        assert result["growth"] < GROWTH, result
    assert not list(tmp_path.glob("*o.*")) and not list((tmp_path / "hf").glob("*"))
    with pytest.raises(CorruptCheckpointError, match="at most 67108864 are ever written"):
        export(ck, tmp_path / "o.safetensors")


def test_a_declared_tensor_exports_a_slab_at_a_time(tmp_path: Path) -> None:
    """320 MiB of zeros in 256 KiB chunks, stored in about 100 KB: both formats stream it
    (a .pt export held it whole)."""
    elements = 80 * MiB
    ck = declaring_zeros(tmp_path / "ck", elements, 64 * 1024)
    assert sum(f.stat().st_size for f in ck.rglob("*") if f.is_file()) < 256 * 1024
    pt, st = tmp_path / "o.pt", tmp_path / "o.safetensors"
    results = in_a_child(["export", ck, pt], ["export", ck, st])
    for result in results:
        assert result["code"] == 0 and result["growth"] < GROWTH, result
    with zipfile.ZipFile(pt) as archive:  # read back through its crc32, a slab at a time
        (name,) = [n for n in archive.namelist() if n.endswith("/data/0")]
        with archive.open(name) as record:
            for block in iter(lambda: record.read(16 * MiB), b""):
                assert not any(block), "a byte that is not zero"
        assert archive.getinfo(name).file_size == 4 * elements
    with open(st, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        assert json.loads(f.read(length))["b"]["shape"] == [elements]
        for block in iter(lambda: f.read(16 * MiB), b""):
            assert not any(block), "a byte that is not zero"


def test_pieces_that_overlap_and_leave_a_gap_are_never_exported(tmp_path: Path) -> None:
    """[0:5] and [2:5] of [8] add up to 8 elements: the export wrote [5:8] from
    uninitialised memory."""
    ck = tmp_path / "ck"
    distckpt.save({"b": torch.arange(8.0)}, ck)
    doc = json.loads((ck / "zarr.json").read_bytes())
    entry = doc["attributes"]["distckpt"]["variables"]["b"]
    piece = entry["pieces"][0]
    entry["pieces"] = [{**piece, "box": [[0], [5]]}, {**piece, "box": [[2], [3]]}]
    (ck / "zarr.json").write_bytes(reseal(json.dumps(doc).encode()))
    for out in ("o.safetensors", "o.pt"):
        with pytest.raises(CorruptCheckpointError, match=r"'b'.*\[0:5\] and \[2:5\] share"):
            export(ck, tmp_path / out)
        assert not (tmp_path / out).exists()
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        diff(ck, ck)


# --------------------------------------------------- legitimate exports, byte for byte


def model_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "net": {"w": torch.randn(300, 7, generator=g), "e": torch.zeros(0, 3)},
        "h": torch.randn(33, generator=g).to(torch.bfloat16),
        "i": torch.arange(-5, 5, dtype=torch.int16),
        "c": torch.randn(4, dtype=torch.complex64, generator=g),
        "f8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
        "m": torch.tensor([True, False, True]),
        "step": 12,
        "cfg": {"lr": 0.1, "name": "x"},
    }


def flat(state: dict[str, Any]) -> dict[str, Any]:
    """The export's names: nested keys joined by ``/``, sorted."""
    out = {f"net/{k}": v for k, v in state["net"].items()}
    out.update({k: v for k, v in state.items() if k != "net"})
    return dict(sorted(out.items()))


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_pt_export_is_the_file_torch_save_writes(tmp_path: Path, compression: Any) -> None:
    if not torch_file.supported():
        pytest.skip("torch older than 2.6: .pt exports are built in memory")
    state = model_state()
    ck = tmp_path / "ck"
    distckpt.save(state, ck, compression=compression, inner_bytes=256)
    report = export(ck, tmp_path / "o.pt", max_slab_bytes=100)
    made = (tmp_path / "o.pt").read_bytes()
    buffer = io.BytesIO()
    torch.save(flat(state), buffer)
    want = buffer.getvalue()
    assert len(made) == len(want)
    with zipfile.ZipFile(io.BytesIO(made)) as a, zipfile.ZipFile(io.BytesIO(want)) as b:
        assert a.testzip() is None  # every record's crc32, data descriptor and directory
        assert [i.filename for i in a.infolist()] == [i.filename for i in b.infolist()]
        for x, y in zip(a.infolist(), b.infolist(), strict=True):
            if not x.filename.endswith("serialization_id"):  # drawn anew by each save
                assert (x.header_offset, x.CRC) == (y.header_offset, y.CRC), x.filename
                assert a.read(x) == b.read(y), x.filename
    assert_pt_holds(tmp_path / "o.pt", state)
    assert report.largest_buffer <= 100 and report.tensors == 7 and report.values == 2


def assert_pt_holds(path: Path, state: dict[str, Any]) -> None:
    """The ``.pt`` file at ``path`` loads (weights only) as ``state`` flattened, bit for bit."""
    loaded = torch.load(path, weights_only=True)
    for name, value in flat(state).items():
        if isinstance(value, torch.Tensor):
            assert loaded[name].view(torch.uint8).equal(value.view(torch.uint8)), name
        else:
            assert loaded[name] == value, name


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_safetensors_export_is_its_header_then_its_bytes(
    tmp_path: Path, compression: Any
) -> None:
    state = model_state()
    del state["c"]  # (complex64 is kept; complex128 has no safetensors dtype)
    ck = tmp_path / "ck"
    distckpt.save(state, ck, compression=compression, inner_bytes=256)
    export(ck, tmp_path / "o.safetensors", max_slab_bytes=100)
    tensors = {k: v for k, v in flat(state).items() if isinstance(v, torch.Tensor)}
    values = {"cfg": json.dumps({"map": {"lr": 0.1, "name": "x"}}), "step": "12"}
    heads = [
        TensorHeader(k, str(v.dtype).removeprefix("torch."), tuple(v.shape), v.nbytes)
        for k, v in tensors.items()
    ]
    want = header(heads, values) + b"".join(
        v.contiguous().view(torch.uint8).numpy().tobytes() for v in tensors.values()
    )
    assert (tmp_path / "o.safetensors").read_bytes() == want
    loaded = safetensors.torch.load_file(tmp_path / "o.safetensors")
    assert all(
        np.array_equal(loaded[k].view(torch.uint8), v.view(torch.uint8)) for k, v in tensors.items()
    )


def test_a_pt_export_without_skip_data_is_built_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch older than 2.6 cannot leave room for storages: the tensors are read whole."""
    state = model_state()
    distckpt.save(state, tmp_path / "ck")
    monkeypatch.setattr(torch_file, "supported", lambda: False)
    report = export(tmp_path / "ck", tmp_path / "o.pt")
    assert report.tensors == 7 and report.largest_buffer == 300 * 7 * 4
    assert_pt_holds(tmp_path / "o.pt", state)


class Holder:
    """A pickled value that holds a tensor of its own."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def test_a_pt_export_of_a_pickled_value_holding_a_tensor(tmp_path: Path) -> None:
    """Its storage is numbered among the tensors': the export is built in memory."""
    state = {"w": torch.arange(4.0), "obj": Holder(torch.ones(3)), "z": torch.zeros(2)}
    distckpt.save(state, tmp_path / "ck", allow_pickle=True)
    export(tmp_path / "ck", tmp_path / "o.pt", allow_pickle=True)
    loaded = torch.load(tmp_path / "o.pt", weights_only=False)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["z"], state["z"])
    assert torch.equal(loaded["obj"].tensor, torch.ones(3))


# --------------------------------------------------- names and values an index crafts


def crafted(ck: Path, old: str, new: str) -> Path:
    """A checkpoint of w, v = "x" and per-rank x whose index text has ``old`` replaced by
    ``new`` (JSON escapes: ``\\ud800`` reads as a lone surrogate), resealed."""
    distckpt.save({"w": torch.arange(4.0), "v": "x", "x": distckpt.PerRank(torch.zeros(3))}, ck)
    text = (ck / "zarr.json").read_text()
    assert old in text, text
    (ck / "zarr.json").write_bytes(reseal(text.replace(old, new, 1).encode()))
    return ck


#: attack -> (the craft, the one error line's words, None: the commands succeed)
INDEXES: dict[str, tuple[Any, str | None]] = {
    "name-lone-surrogate": (lambda ck: crafted(ck, '"w":', '"w\\ud800":'), "lone surrogate"),
    "file-lone-surrogate": (lambda ck: crafted(ck, '"file":"w/', '"file":"w\\ud800/'), "surrogate"),
    # x (per-rank: rank 0 shown as x/rank0) and a value x/rank0: one hid the other from
    # export, diff and verify (which then never read the per-rank x's piece)
    "name-twice": (lambda ck: crafted(ck, '"v":', '"x/rank0":'), "names it twice"),
    "value-lone-surrogate": (lambda ck: crafted(ck, '"value":"x"', '"value":"\\udcff"'), None),
}


@pytest.mark.parametrize("attack", sorted(INDEXES))
def test_crafted_names_are_one_line_and_values_export_as_stored(
    tmp_path: Path, attack: str
) -> None:
    """A lone surrogate in a name or a value made the safetensors export a traceback."""
    craft, words = INDEXES[attack]
    ck = craft(tmp_path / "ck")
    other = tmp_path / "other"
    distckpt.save({"w": torch.arange(4.0)}, other)
    commands = [
        ["export", ck, tmp_path / "o.safetensors"],
        ["export", ck, tmp_path / "o.pt"],
        ["export", ck, tmp_path / "hf", "--hf"],
        ["diff", ck, other],
        ["verify", ck],
    ]
    for command in commands:
        run = cli(*command)
        lines = run.stderr.strip().splitlines()
        if words is None:
            assert run.returncode in (0, 1) and not lines, (command, run.stderr)
            continue
        assert run.returncode == 2, (command, run.returncode, run.stdout, run.stderr)
        assert len(lines) == 1 and words in lines[0], (command, lines)
    if words is None:  # the stored value, escaped where UTF-8 cannot hold it
        metadata = safetensors.safe_open(tmp_path / "o.safetensors", "pt").metadata()
        assert json.loads(metadata["v"]) == "\udcff"


def test_a_differing_value_of_any_size_is_one_short_line(tmp_path: Path) -> None:
    """Two values of 10 MB each that differ: the report printed both whole (20 MB)."""
    a, b = tmp_path / "a", tmp_path / "b"
    distckpt.save({"v": "x" * 10_000_000}, a)
    distckpt.save({"v": "y" * 10_000_000}, b)
    (found,) = diff(a, b)
    assert found.what == "value" and len(str(found)) < 500, str(found)[:1000]


def test_targets_that_are_links_are_replaced_never_written_through(tmp_path: Path) -> None:
    """Held: an export is written beside its target and renamed onto it, so a link there
    is replaced (with --overwrite), a dangling one too, and what they lead to is left
    alone; an import refuses a target that is a link (to a directory or to nothing)."""
    ck, outside = tmp_path / "ck", tmp_path / "outside"
    distckpt.save({"w": torch.arange(4.0), "v": 1}, ck)
    outside.mkdir()
    for name in ("victim.safetensors", "victim.pt", "model.safetensors"):
        (outside / name).write_bytes(b"precious")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").symlink_to(outside / "model.safetensors")
    links = {
        "st": (tmp_path / "o.safetensors", outside / "victim.safetensors"),
        "pt": (tmp_path / "o.pt", outside / "victim.pt"),
        "dangling": (tmp_path / "d.safetensors", outside / "nothing.safetensors"),
        "dir": (tmp_path / "into", outside),
        "none": (tmp_path / "nowhere", outside / "nothing"),
    }
    for link, to in links.values():
        link.symlink_to(to)
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    for key in ("st", "pt", "dangling"):
        run = cli("export", ck, links[key][0], "--overwrite")
        assert run.returncode == 0, run.stderr
        assert not links[key][0].is_symlink()  # the link replaced by the export
    assert cli("export", ck, hf, "--hf", "--overwrite").returncode == 0
    for key in ("dir", "none"):
        run = cli("import", tmp_path / "o.safetensors", links[key][0], "--overwrite")
        assert run.returncode == 2 and "not a distckpt checkpoint" in run.stderr, run.stderr
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before
