"""The ``distckpt`` command: ls, inspect, verify, export, import, diff, gc.

One process. Checkpoints are made in-process with ``distckpt.save`` (tiny inner chunks, so
even small tensors are shards of several checksummed chunks) or copied from the golden
multi-rank checkpoints in tests/golden/ (copied before anything is damaged). The command
runs in-process through ``distckpt.cli.main``; one test runs ``python -m distckpt``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp

import distckpt
from distckpt.cli import main
from distckpt.comm import SingleComm
from distckpt.commit.staging import OWNER_FILE
from distckpt.slices import Box
from distckpt.testing.hostile import reseal
from distckpt.tools import export as export_mod
from distckpt.tools.export import export
from distckpt.tools.runs import list_run
from distckpt.tools.slabs import slabs
from distckpt.tools.verify import coverage_problems
from tests.support.make_golden import DTYPES, TWO_RANKS, assert_same_bits, emb, flat, weight

pytestmark = pytest.mark.timeout(120)

COMM = SingleComm()
SAFETENSORS_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str, command: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"distckpt {command}: error: "), err
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0], (word, err)


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        return torch.randint(0, 100, shape, generator=g, dtype=torch.int64).to(dtype)
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    return torch.randn(shape, generator=g).to(dtype)


def model_state() -> dict[str, Any]:
    """Tensors of every safetensors dtype (some of several inner chunks), a 0-d and an
    empty tensor, nested names, and values."""
    tensors = {
        str(dtype).removeprefix("torch."): make_tensor(dtype, (7, 5), i)
        for i, dtype in enumerate(SAFETENSORS_DTYPES)
    }
    return {
        "model": {
            "l1.weight": make_tensor(torch.float32, (33, 17), 100),
            "emb": make_tensor(torch.bfloat16, (20, 9), 101),
            "scalar": torch.tensor(3.25),
            "empty": torch.zeros(0, 4),
        },
        "dtypes": tensors,
        "step": 12,
        "cfg": {"lr": 0.5, "betas": (0.9, 0.99), "name": "run"},
    }


def save_small(state: dict[str, Any], path: Path) -> Path:
    distckpt.save(state, path, COMM, small_bytes=64, inner_bytes=64)
    return path


def flat_tensors(state: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[prefix + key] = value
        elif isinstance(value, dict):
            out.update(flat_tensors(value, f"{prefix}{key}/"))
    return out


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return save_small(model_state(), tmp_path / "ckpt-1")


@pytest.fixture
def golden(tmp_path: Path) -> Path:
    dst = tmp_path / "golden"
    shutil.copytree(TWO_RANKS, dst)
    return dst


# --------------------------------------------------------------------------- pure parts


def test_slabs_cover_in_c_order_within_the_limit() -> None:
    for shape, itemsize, limit in [
        ((10, 6), 4, 50),  # whole rows: 2 per slab
        ((3, 1000), 2, 64),  # a row is too big: runs along the last dimension
        ((4, 3, 5), 8, 100),  # runs along the middle dimension
        ((2, 2), 16, 8),  # an element larger than the limit: one at a time
        ((), 4, 1),
    ]:
        boxes = list(slabs(shape, itemsize, limit))
        numbered = np.arange(int(np.prod(shape))).reshape(shape)
        pieces = [numbered[b.slices()].reshape(-1) for b in boxes]
        assert np.array_equal(np.concatenate(pieces), numbered.reshape(-1)), shape
        assert all(b.numel * itemsize <= max(limit, itemsize) for b in boxes), shape
    assert list(slabs((0, 5), 4, 64)) == []


def test_coverage_problems() -> None:
    full = [Box((0, 0), (2, 4)), Box((2, 0), (2, 4))]
    assert coverage_problems("w", (4, 4), full) == []
    gap = coverage_problems("w", (4, 4), full[:1])
    assert gap and "'w'" in gap[0] and "cover 8 of its 16" in gap[0]
    overlap = coverage_problems("w", (4, 4), [*full, Box((1, 0), (2, 4))])
    assert overlap and "overlap" in overlap[0]
    outside = coverage_problems("w", (4, 4), [Box((3, 0), (2, 4))])
    assert outside and "outside" in outside[0]
    # Thousands of pieces whose boxes all span dimension 0: proven in milliseconds.
    bands = [Box((0, 3 * k), (4, 3)) for k in range(8192)]
    t0 = time.perf_counter()
    assert coverage_problems("w", (4, 3 * 8192), bands) == []
    assert time.perf_counter() - t0 < 2
    hidden = coverage_problems("w", (4, 3 * 8192), [*bands[:-1], Box((0, 3), (4, 3))])
    assert hidden and "[0:4, 3:6] is listed twice" in hidden[0], hidden


# --------------------------------------------------------------------------- ls, inspect, gc


def test_ls_marks_latest_and_leftovers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    ckpt = distckpt.Checkpoint(w=torch.arange(6.0), step=torch.tensor(0))
    with distckpt.CheckpointManager(ckpt, run_dir, max_to_keep=5, comm=COMM) as manager:
        for _ in range(3):
            manager.save()
    leftover = run_dir / ".ckpt-4.staging-0a1b2c"
    leftover.mkdir()
    (leftover / OWNER_FILE).write_text(json.dumps({"host": "elsewhere", "started": 1.0}))
    (leftover / "partial").write_bytes(b"x" * 10)
    (run_dir / "notes").mkdir()  # not a checkpoint: not listed

    code, out, err = run(capsys, "ls", run_dir)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["NUMBER", "CREATED", "BYTES", "WORLD", "STATE", "NAME"]
    rows = [line.split() for line in lines[1:]]
    # number, created (date and time), bytes, world size, state, name
    assert [r[6] for r in rows] == ["ckpt-1", "ckpt-2", "ckpt-3", ".ckpt-4.staging-0a1b2c"]
    assert [r[0] for r in rows] == ["1", "2", "3", "4"]
    assert "<- latest" in lines[3] and "latest" not in lines[1] + lines[2]
    assert [r[5] for r in rows] == ["committed"] * 3 + ["uncommitted"]
    assert rows[0][4] == "1" and rows[3][4] == "-"

    code, out, _ = run(capsys, "ls", run_dir, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["latest"] == "ckpt-3"
    by_name = {e["name"]: e for e in doc["checkpoints"]}
    assert by_name["ckpt-3"]["latest"] and not by_name["ckpt-2"]["latest"]
    assert by_name["ckpt-2"]["world_size"] == 1 and by_name["ckpt-2"]["number"] == 2
    assert by_name["ckpt-2"]["step"] == 2  # the number's old name, kept for a release
    entry = next(e for e in list_run(run_dir).entries if e.name == "ckpt-2")
    with pytest.warns(DeprecationWarning, match="Entry.number"):
        assert entry.step == entry.number == 2
    assert by_name["ckpt-2"]["created"] > 1e9
    on_disk = sum(p.stat().st_size for p in (run_dir / "ckpt-2").rglob("*") if p.is_file())
    assert by_name["ckpt-2"]["bytes"] == on_disk > 0
    staging = by_name[".ckpt-4.staging-0a1b2c"]
    assert staging["state"] == "uncommitted" and staging["bytes"] > 10
    assert staging["created"] == 1.0 and staging["world_size"] is None


def test_ls_bad_input(tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "ls", tmp_path / "nope")
    assert code == 2
    assert_one_line_error(err, "ls", "not a directory")
    code, _, err = run(capsys, "ls", ckpt)
    assert code == 2
    assert_one_line_error(err, "ls", "is a checkpoint")
    code, out, _ = run(capsys, "ls", tmp_path / "ckpt-1" / "model")
    assert code == 0 and "no checkpoints" in out


def test_inspect_shows_total_bytes(golden: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "inspect", golden)
    assert code == 0 and "saved on 2 ranks" in out
    assert "model/l1.weight  float32[5, 8]  regular, 2 slice(s), 160 bytes" in out
    code, out, _ = run(capsys, "inspect", golden, "--json")
    doc = json.loads(out)
    assert doc["world_size"] == 2
    assert doc["bytes"] == sum(v.get("bytes", 0) for v in doc["variables"]) > 0


def test_gc_removes_only_abandoned(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / ".ckpt-9.staging-abc"
    stale.mkdir()
    os.utime(stale, (1, 1))
    code, out, _ = run(capsys, "gc", tmp_path)
    assert code == 0 and "removed" in out and not stale.exists()
    code, out, _ = run(capsys, "gc", tmp_path)
    assert code == 0 and "nothing to remove" in out


# --------------------------------------------------------------------------- verify


def test_verify_accepts_good_checkpoints(
    ckpt: Path, golden: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for path in (ckpt, golden, DTYPES):
        code, out, err = run(capsys, "verify", path)
        assert code == 0 and err == "", err
        assert ": ok," in out


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "file, variable",
    [
        ("model/l1.weight/c.1.0", "model/l1.weight"),  # sharded: an inner chunk's data
        ("bias/c.0", "bias"),  # a plain chunk
        ("opt/flat/p1/c.0.0", "opt/flat"),  # one box of an irregular partition
        ("rng/r1/c.0", "rng/rank1"),  # a per-rank tensor
    ],
)
def test_verify_names_the_damaged_variable_and_file(
    golden: Path, file: str, variable: str, capsys: pytest.CaptureFixture[str]
) -> None:
    target = golden / file
    # past a shard's checksum table (4 bytes per inner chunk), inside the data
    offset = 24 if "c.1.0" in file or "p1" in file else 2
    _flip(target, offset)
    code, out, err = run(capsys, "verify", golden)
    assert code == 1, out + err
    assert f"variable {variable!r}" in err and str(target) in err
    assert "1 problem(s)" in out


def test_verify_reports_every_problem(golden: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (golden / "model/emb/c.0.1").unlink()
    with open(golden / "model/l1.weight/c.0.0", "ab") as f:
        f.write(b"\0")  # longer than the index says
    index = json.loads((golden / "zarr.json").read_bytes())
    pieces = index["attributes"]["distckpt"]["variables"]["opt/flat"]["pieces"]
    pieces[1]["box"] = [[0, 0], [5, 4]]  # overlaps p0 and leaves row 5 uncovered
    (golden / "zarr.json").write_bytes(reseal(json.dumps(index).encode()))
    code, out, err = run(capsys, "verify", golden)
    assert code == 1
    problems = err.strip().splitlines()
    assert len(problems) == 3, err
    assert "'model/emb'" in problems[0] and "missing" in problems[0]
    assert "c.0.1" in problems[0]
    assert "'model/l1.weight'" in problems[1] and "the index says" in problems[1]
    assert "'opt/flat'" in problems[2] and "overlap" in problems[2]


def test_verify_reports_progress_bytes(ckpt: Path) -> None:
    from distckpt.tools.verify import verify

    seen: list[int] = []
    report = verify(ckpt, on_bytes=seen.append)
    assert report.ok and sum(seen) > 0 and len(seen) > 10


@pytest.mark.parametrize("command", ["inspect", "verify", "export", "diff"])
def test_truncated_index_is_one_line_error(
    command: str, ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    index = ckpt / "zarr.json"
    index.write_bytes(index.read_bytes()[:100])
    extra = {"export": [tmp_path / "out.safetensors"], "diff": [ckpt]}.get(command, [])
    code, _, err = run(capsys, command, ckpt, *extra)
    assert code == 2
    assert_one_line_error(err, command, "index is not readable JSON")
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("command", ["inspect", "verify", "export", "diff"])
def test_not_a_checkpoint_is_one_line_error(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = {"export": [tmp_path / "out.pt"], "diff": [tmp_path]}.get(command, [])
    code, _, err = run(capsys, command, tmp_path, *extra)
    assert code == 2
    assert_one_line_error(err, command, "not a distckpt checkpoint")
    code, _, err = run(capsys, command, tmp_path / "missing", *extra)
    assert code == 2
    assert_one_line_error(err, command, "no checkpoint at")


def test_missing_chunk_fails_export_and_diff(
    golden: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (golden / "model/l1.weight/c.0.0").unlink()
    out_file = tmp_path / "out.safetensors"
    code, _, err = run(capsys, "export", golden, out_file)
    assert code == 2
    assert_one_line_error(err, "export", "'model/l1.weight'", "missing", "c.0.0")
    assert not out_file.exists() and not list(tmp_path.glob(".out.safetensors.tmp-*"))
    code, _, err = run(capsys, "diff", golden, TWO_RANKS)
    assert code == 2
    assert_one_line_error(err, "diff", "'model/l1.weight'")


# --------------------------------------------------------------------------- export


def test_export_safetensors_is_bit_exact(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "model.safetensors"
    code, out, err = run(capsys, "export", ckpt, out_file, "--slab-mib", "1")
    assert code == 0 and err == "", err
    loaded = safetensors.torch.load_file(out_file)
    want = flat_tensors(model_state())
    assert sorted(loaded) == sorted(want)
    for name, tensor in want.items():
        assert_same_bits(loaded[name], tensor, name)
    with open(out_file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(n))["__metadata__"]
    assert json.loads(meta["step"]) == 12
    assert json.loads(meta["cfg"])["map"]["betas"] == {"tuple": [0.9, 0.99]}
    code, _, err = run(capsys, "export", ckpt, out_file)
    assert code == 2
    assert_one_line_error(err, "export", "exists", "--overwrite")
    assert run(capsys, "export", ckpt, out_file, "--overwrite")[0] == 0


def test_export_golden_multi_rank(golden: Path, tmp_path: Path) -> None:
    out_file = tmp_path / "g.safetensors"
    report = export(golden, out_file, max_slab_bytes=16)
    loaded = safetensors.torch.load_file(out_file)
    assert_same_bits(loaded["model/l1.weight"], weight(), "weight")
    assert_same_bits(loaded["model/emb"], emb(), "emb")
    assert_same_bits(loaded["opt/flat"], flat(), "flat")
    assert {"rng/rank0", "rng/rank1"} <= set(loaded)  # per-rank tensors: one per rank
    assert report.largest_buffer <= 16


def test_export_safetensors_memory_is_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {
        "rows": make_tensor(torch.float32, (256, 64), 1),  # 64 KiB: rows at a time
        "long": make_tensor(torch.bfloat16, (40000,), 2),  # one huge row: runs of it
        "wide": make_tensor(torch.int16, (3, 9000), 3),
    }
    path = save_small(state, tmp_path / "ckpt")
    limit = 4096
    sizes: list[int] = []
    real = export_mod.read_region

    def counting(root: Any, name: str, entry: Any, box: Box, out: np.ndarray, **kw: Any) -> int:
        sizes.append(out.nbytes)
        return real(root, name, entry, box, out, **kw)

    monkeypatch.setattr(export_mod, "read_region", counting)
    written: list[int] = []
    report = export(path, tmp_path / "m.safetensors", max_slab_bytes=limit, on_bytes=written.append)
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert max(sizes) <= limit and sum(sizes) == total and len(sizes) > total // limit
    assert report.largest_buffer <= limit and sum(written) == report.bytes_written == total
    loaded = safetensors.torch.load_file(tmp_path / "m.safetensors")
    for name, tensor in state.items():
        assert_same_bits(loaded[name], tensor, name)


def test_export_pt(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "model.pt"
    code, _, err = run(capsys, "export", ckpt, out_file)
    assert code == 0 and err == ""
    loaded = torch.load(out_file, weights_only=True)
    for name, tensor in flat_tensors(model_state()).items():
        assert_same_bits(loaded[name], tensor, name)
    assert loaded["step"] == 12 and loaded["cfg"]["betas"] == (0.9, 0.99)


def test_export_refusals(tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "export", ckpt, tmp_path / "model.npz")
    assert code == 2
    assert_one_line_error(err, "export", "'model.npz'", ".safetensors")
    cplx = save_small({"z": torch.zeros(2, dtype=torch.complex128)}, tmp_path / "c")
    code, _, err = run(capsys, "export", cplx, tmp_path / "c.safetensors")
    assert code == 2
    assert_one_line_error(err, "export", "'z'", "complex128", ".pt")
    assert run(capsys, "export", cplx, tmp_path / "c.pt")[0] == 0
    code, _, err = run(capsys, "export", ckpt, tmp_path / "no" / "x.safetensors")
    assert code == 2
    assert_one_line_error(err, "export", "no directory")


# --------------------------------------------------------------------------- import


def test_import_safetensors_and_round_trip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tensors = {
        "model.embed.weight": make_tensor(torch.bfloat16, (30, 8), 1),
        "layers/0/w": make_tensor(torch.float8_e5m2, (4, 4), 2),
        "layers/1/w": make_tensor(torch.float32, (9, 3), 3),
        "mask": make_tensor(torch.bool, (5,), 4),
    }
    src = tmp_path / "src.safetensors"
    safetensors.torch.save_file(tensors, src, metadata={"format": "pt", "step": "7"})
    code, out, err = run(capsys, "import", src, tmp_path / "ckpt")
    assert code == 0 and err == "" and "saved" in out
    names = {v.name: v for v in distckpt.list_variables(tmp_path / "ckpt")}
    assert set(names) == {*tensors, "format", "step"}
    state: dict[str, Any] = {"format": None, "step": None}
    for name, tensor in tensors.items():
        node = state
        *parents, leaf = name.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = torch.empty_like(tensor)
    distckpt.load(state, tmp_path / "ckpt", COMM)
    assert state["format"] == "pt" and state["step"] == 7
    assert_same_bits(state["layers"]["0"]["w"], tensors["layers/0/w"])

    back = tmp_path / "back.safetensors"
    assert run(capsys, "export", tmp_path / "ckpt", back)[0] == 0
    again = safetensors.torch.load_file(back)
    assert sorted(again) == sorted(tensors)
    for name, tensor in tensors.items():
        assert_same_bits(again[name], tensor, name)


def test_import_torch_save(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = {"l1.weight": make_tensor(torch.bfloat16, (6, 4), 1), "opt": {"step": 3}}
    torch.save(plain, tmp_path / "plain.pt")
    code, _, err = run(capsys, "import", tmp_path / "plain.pt", tmp_path / "a")
    assert code == 0, err  # weights_only=True suffices for tensors and plain values
    state = {"l1.weight": torch.empty(6, 4, dtype=torch.bfloat16), "opt": None}
    distckpt.load(state, tmp_path / "a", COMM)
    assert_same_bits(state["l1.weight"], plain["l1.weight"])
    assert state["opt"] == {"step": 3}

    fancy = {"w": torch.ones(3), "ratio": Fraction(1, 3)}
    torch.save(fancy, tmp_path / "fancy.pth")
    code, _, err = run(capsys, "import", tmp_path / "fancy.pth", tmp_path / "b")
    assert code == 2
    assert_one_line_error(err, "import", "weights_only=True", "--allow-pickle")
    assert not (tmp_path / "b").exists()
    code, _, err = run(capsys, "import", tmp_path / "fancy.pth", tmp_path / "b", "--allow-pickle")
    assert code == 0, err
    state = {"w": torch.empty(3), "ratio": None}
    distckpt.load(state, tmp_path / "b", COMM, allow_pickle=True)
    assert state["ratio"] == Fraction(1, 3)

    torch.save(torch.ones(2), tmp_path / "bare.bin")
    code, _, err = run(capsys, "import", tmp_path / "bare.bin", tmp_path / "c")
    assert code == 2
    assert_one_line_error(err, "import", "single tensor")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    code, _, err = run(capsys, "import", tmp_path / "junk.pt", tmp_path / "c")
    assert code == 2 and "Traceback" not in err


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_import_dcp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = {
        "model": {
            "w": make_tensor(torch.float32, (5, 3), 1),
            "b": make_tensor(torch.int64, (5,), 2),
        },
        "emb": make_tensor(torch.bfloat16, (4, 2), 3),
        "step": 9,
    }
    dcp.save(state, checkpoint_id=tmp_path / "dcp")  # one process, no process group
    code, _, err = run(capsys, "import", tmp_path / "dcp", tmp_path / "ckpt")
    assert code == 2
    assert_one_line_error(err, "import", ".metadata", "pickle", "--allow-pickle")
    code, _, err = run(capsys, "import", tmp_path / "dcp", tmp_path / "ckpt", "--allow-pickle")
    assert code == 0, err
    assert {v.name for v in distckpt.list_variables(tmp_path / "ckpt")} == {
        "model/w",
        "model/b",
        "emb",
        "step",
    }
    target = {
        "model": {"w": torch.empty(5, 3), "b": torch.empty(5, dtype=torch.int64)},
        "emb": torch.empty(4, 2, dtype=torch.bfloat16),
        "step": None,
    }
    distckpt.load(target, tmp_path / "ckpt", COMM)
    assert target["step"] == 9
    for name, tensor in flat_tensors(state).items():
        got = flat_tensors(target)[name]
        assert_same_bits(got, tensor, name)
    code, _, err = run(capsys, "import", tmp_path, tmp_path / "x")
    assert code == 2
    assert_one_line_error(err, "import", "not a torch.distributed.checkpoint")


# --------------------------------------------------------------------------- diff


def test_diff(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    same = save_small(model_state(), tmp_path / "same")
    code, out, _ = run(capsys, "diff", ckpt, same)
    assert code == 0 and out.strip() == "identical"

    changed = model_state()
    changed["model"]["l1.weight"][3, 4] += 0.5
    changed["model"]["emb"][0, 0] = float("nan")
    changed["dtypes"]["int32"] = changed["dtypes"]["int32"].to(torch.int64)
    changed["dtypes"]["bool"] = torch.zeros(3, dtype=torch.bool)
    del changed["dtypes"]["uint8"]
    changed["extra"] = torch.ones(1)
    changed["step"] = 13
    other = save_small(changed, tmp_path / "other")
    code, out, _ = run(capsys, "diff", ckpt, other, "--slab-mib", "1")
    assert code == 1
    lines = out.strip().splitlines()
    assert lines[-1] == "7 variable(s) differ"
    assert "dtypes/bool: shape [7, 5] vs [3]" in lines
    assert "dtypes/int32: dtype int32 vs int64" in lines
    assert "only in A: dtypes/uint8" in lines
    assert "only in B: extra" in lines
    assert "step: value 12 vs 13" in lines
    assert "model/l1.weight: value 1 of 561 elements differ, max abs difference 0.5" in lines
    assert "model/emb: value 1 of 180 elements differ (1 with NaN or infinity)" in lines


def test_diff_golden_with_itself(golden: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "diff", golden, TWO_RANKS)[0] == 0
    _flip(golden / "model/l1.weight/c.1.0", 24)
    code, _, err = run(capsys, "diff", golden, TWO_RANKS)
    assert code == 2  # damaged data is an error, not a difference
    assert_one_line_error(err, "diff", "'model/l1.weight'", "crc32c")


# --------------------------------------------------------------------------- the real command


def test_python_m_distckpt(golden: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    ok = subprocess.run(
        [sys.executable, "-m", "distckpt", "verify", str(golden)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert ok.returncode == 0 and ": ok," in ok.stdout, ok.stderr
    (golden / "bias/c.0").unlink()
    bad = subprocess.run(
        [sys.executable, "-m", "distckpt", "export", str(golden), str(golden / "x.pt")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("distckpt export: error: variable 'bias'")


#: Run the command with torch unimportable: what it imports of torch fails loudly.
WITHOUT_TORCH = """
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ImportError("torch imported by " + name)

sys.meta_path.insert(0, NoTorch())
from distckpt.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_reading_commands_start_without_torch(golden: Path, tmp_path: Path) -> None:
    """``ls``, ``inspect``, ``verify``, ``keygen``, ``sign`` and ``gc`` read (and sign)
    metadata and bytes only: they import neither torch nor the save and load (``import
    distckpt`` imports a name when it is first used), so they start in a fraction of
    torch's import time."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copytree(golden, run_dir / "ckpt-3")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for argv, said in (
        (["ls", str(run_dir)], "ckpt-3"),
        (["inspect", str(run_dir / "ckpt-3")], "variables"),
        (["verify", str(run_dir / "ckpt-3")], ": ok,"),
        (["keygen", str(tmp_path / "k.key")], "k.key.pub"),
        (["sign", str(run_dir / "ckpt-3"), "--key", str(tmp_path / "k.key")], "signed by"),
        (["verify", str(run_dir / "ckpt-3"), "--key", str(tmp_path / "k.key.pub")], "trusted"),
        (["gc", str(run_dir)], "nothing to remove"),
    ):
        done = subprocess.run(
            [sys.executable, "-c", WITHOUT_TORCH, *argv],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert done.returncode == 0 and said in done.stdout, (argv, done.stdout, done.stderr)


def test_ls_tells_a_running_save_from_an_abandoned_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import os
    import socket

    run_dir = tmp_path / "run"
    live = run_dir / ".ckpt-2.staging-aa"
    dead = run_dir / ".ckpt-1.staging-bb"
    for path, pid in ((live, os.getpid()), (dead, 2**22 + 12345)):
        path.mkdir(parents=True)
        owner = {"host": socket.gethostname(), "pid": pid, "started": 5.0}
        (path / OWNER_FILE).write_text(json.dumps(owner))
    code, out, _ = run(capsys, "ls", run_dir, "--json")
    notes = {e["name"]: e["note"] for e in json.loads(out)["checkpoints"]}
    assert code == 0
    assert notes[live.name] == "a save of ckpt-2 in progress"
    assert notes[dead.name].startswith("leftover of a save of ckpt-1"), notes


def test_a_reader_that_goes_away_ends_it_quietly(tmp_path: Path) -> None:
    """``distckpt inspect CKPT | head -1``: once the reader has gone, the command stops
    with status 141 (128 + SIGPIPE), as the shell's own tools do, printing nothing more."""
    ckpt = tmp_path / "many"
    distckpt.save({f"variable_{i:05d}": torch.zeros(1) for i in range(3000)}, ckpt)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "distckpt", "inspect", str(ckpt)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(str(ckpt).encode())
    proc.stdout.close()  # the pipe holds less than the listing: the writer meets EPIPE
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert err == b""
