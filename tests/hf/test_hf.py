"""Hugging Face weights in and out: ``load_hf``, ``save_hf``, ``export_hf``, ``import
--prefix``, and safetensors headers and indexes as untrusted input.

One process. The safetensors library writes the inputs and reads the outputs, so each
direction is checked against an independent implementation; corrupt files are written
byte by byte. Values are compared bit for bit. Tiny staging slabs make non-contiguous
targets and sources cross many bands.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch

import distckpt
from distckpt.errors import CorruptCheckpointError, ValidationError
from distckpt.hf import directory, load
from distckpt.hf.directory import INDEX, parse_size
from distckpt.slices import Box, byte_runs
from distckpt.transfer import ranges
from distckpt.transfer.slabs import SlabPool
from tests.support.make_golden import assert_same_bits
from tests.tools.test_cli import COMM, assert_one_line_error, make_tensor, run, save_small

pytestmark = pytest.mark.timeout(120)

SLAB = 64  # bytes: every staged tensor here spans several slabs


def weights() -> dict[str, torch.Tensor]:
    """A model's weights: the safetensors dtypes distckpt maps, a 0-d and an empty tensor."""
    return {
        "embed.weight": make_tensor(torch.bfloat16, (6, 5, 4), 1),
        "layers.0.w": make_tensor(torch.float32, (16, 12), 2),
        "layers.0.b": make_tensor(torch.float16, (7,), 3),
        "layers.0.idx": make_tensor(torch.int64, (3, 5), 4),
        "mask": make_tensor(torch.bool, (4, 4), 5),
        "bytes": make_tensor(torch.uint8, (10,), 6),
        "fp8": make_tensor(torch.float8_e4m3fn, (6, 4), 7),
        "wide": make_tensor(torch.float64, (3, 4), 8),
        "scale": make_tensor(torch.float32, (), 9),
        "empty": make_tensor(torch.float32, (0, 3), 10),
    }


def write_hf_dir(root: Path, tensors: dict[str, torch.Tensor], files: int = 3) -> Path:
    """``tensors`` spread over ``files`` files with an index, as ``save_pretrained`` lays
    them out (the index written by hand, in Hugging Face's format)."""
    root.mkdir(parents=True)
    names = list(tensors)
    weight_map: dict[str, str] = {}
    for k in range(files):
        file = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::files]}
        safetensors.torch.save_file(part, root / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / INDEX).write_text(json.dumps(doc))
    return root


def zeros(shape: tuple[int, ...], dtype: torch.dtype, staged: bool = False) -> torch.Tensor:
    """Zeros of ``shape``; with ``staged``, a permuted view (not readable in place)."""
    if not staged:
        return torch.zeros(shape, dtype=dtype)
    return torch.zeros(shape[::-1], dtype=dtype).permute(tuple(reversed(range(len(shape)))))


def frame(doc: dict[str, Any] | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    """A safetensors file by hand: 8-byte little-endian header length, header, data."""
    text = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def weight_files(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file under ``root``, read by safetensors."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(root.glob("*.safetensors")):
        found = safetensors.torch.load_file(file)
        assert not set(found) & set(out), file
        out.update(found)
    return out


def leftovers(root: Path) -> list[str]:
    return [p.name for p in root.iterdir() if ".tmp-" in p.name] if root.exists() else []


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    return write_hf_dir(tmp_path / "hf", weights())


@pytest.fixture
def bands(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Slabs of ``SLAB`` bytes (2 of them); yields the size of every region taken."""
    taken: list[int] = []
    take = SlabPool.take

    def counting(self: SlabPool, nbytes: int) -> Any:
        taken.append(nbytes)
        return take(self, nbytes)

    monkeypatch.setattr(SlabPool, "take", counting)
    distckpt.set_staging(slab_bytes=SLAB, slabs=2)
    yield taken
    distckpt.set_staging()  # back to $DISTCKPT_SLAB_MIB / the default


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every (offset, length) the loads read from a file."""
    seen: list[tuple[int, int]] = []
    read_runs = ranges.read_runs

    def spy(path: str, runs: list[ranges.Run], out: np.ndarray, what: str) -> int:
        seen.extend((offset, length) for offset, length, _ in runs)
        return read_runs(path, runs, out, what)

    monkeypatch.setattr(ranges, "read_runs", spy)
    return seen


# --------------------------------------------------------------------------- byte runs


def _random_box(rng: random.Random) -> tuple[tuple[int, ...], Box]:
    ndim = rng.randint(0, 4)
    shape = tuple(
        rng.choice([0, 1, 2, 3, 5, 7]) if rng.random() < 0.15 else rng.randint(1, 6)
        for _ in range(ndim)
    )
    offsets, lengths = [], []
    for n in shape:
        start = rng.randint(0, n)
        whole = rng.random() < 0.4
        offsets.append(0 if whole else start)
        lengths.append(n if whole else rng.randint(0, n - start))
    return shape, Box(tuple(offsets), tuple(lengths))


@pytest.mark.parametrize("seed", range(200))
def test_byte_runs_are_the_boxs_c_order_bytes(seed: int) -> None:
    rng = random.Random(seed)
    shape, box = _random_box(rng)
    itemsize = rng.choice([1, 2, 4, 8])
    raw = (np.arange(math.prod(shape) * itemsize) % 251).astype(np.uint8)
    data = raw.tobytes()
    runs = list(byte_runs(shape, box, itemsize))
    want = np.ascontiguousarray(raw.reshape(*shape, itemsize)[box.slices()]).tobytes()
    assert b"".join(data[o : o + n] for o, n in runs) == want, (shape, box, runs)
    assert all(n > 0 for _, n in runs)
    # In order, and maximal: two runs that touch would have been one.
    for (a, n), (b, _) in zip(runs, runs[1:]):
        assert a + n < b, (shape, box, runs)


def test_byte_runs_merge_trailing_whole_dimensions() -> None:
    assert list(byte_runs((4, 6), Box((1, 0), (2, 6)), 1)) == [(6, 12)]
    assert list(byte_runs((4, 6), Box((1, 2), (2, 3)), 1)) == [(8, 3), (14, 3)]
    assert list(byte_runs((2, 3, 4), Box((1, 0, 0), (1, 3, 4)), 2)) == [(24, 24)]
    assert list(byte_runs((2, 3, 4), Box((0, 1, 0), (2, 2, 4)), 2)) == [(8, 16), (32, 16)]
    assert list(byte_runs((5, 1, 3), Box((0, 0, 0), (5, 1, 3)), 4)) == [(0, 60)]
    assert list(byte_runs((), Box((), ()), 8)) == [(0, 8)]
    assert list(byte_runs((3, 0), Box((0, 0), (3, 0)), 4)) == []


@pytest.mark.parametrize("seed", range(30))
def test_split_cuts_at_the_limit_and_keeps_every_byte_in_place(seed: int) -> None:
    rng = random.Random(seed)
    runs = [(rng.randint(0, 500), rng.randint(0, 40)) for _ in range(rng.randint(0, 8))]
    base, limit = rng.randint(0, 100), rng.randint(1, 50)
    tasks = ranges.split(runs, base, limit)
    total = sum(n for _, n in runs)
    sizes = [sum(n for _, n, _ in task) for task in tasks]
    assert sum(sizes) == total
    assert all(size == limit for size in sizes[:-1]) and all(0 < s <= limit for s in sizes)
    # Byte by byte: position in the buffer -> offset in the file, as the runs say.
    want = [base + o + i for o, n in runs for i in range(n)]
    got: dict[int, int] = {}
    for task in tasks:
        for offset, n, pos in task:
            assert n > 0
            got.update((pos + i, offset + i) for i in range(n))
    assert [got[p] for p in range(total)] == want and len(got) == total


# --------------------------------------------------------------------------- load_hf


@pytest.mark.parametrize("staged", [False, True])
def test_load_hf_into_tensors_and_views(
    hf_dir: Path, bands: list[int], reads: list[tuple[int, int]], staged: bool
) -> None:
    want = weights()
    state = {n: zeros(tuple(t.shape), t.dtype, staged) for n, t in want.items()}
    result = distckpt.load_hf(state, hf_dir, COMM)
    for name, tensor in want.items():
        assert_same_bits(state[name], tensor, name)
    assert sorted(result.loaded) == sorted(want) and not result.missing
    nbytes = sum(t.numel() * t.element_size() for t in want.values())
    assert result.bytes_read == nbytes == sum(n for _, n in reads)
    views = [t for t in state.values() if not t.is_contiguous()]
    assert sum(bands) == sum(t.numel() * t.element_size() for t in views)  # a slab at a time
    assert len(views) == (6 if staged else 0) and len(bands) >= (20 if staged else 0)


@pytest.mark.parametrize("layout", ["file", "dir"])
def test_load_hf_from_one_file(tmp_path: Path, layout: str) -> None:
    want = weights()
    (tmp_path / "w").mkdir()
    file = tmp_path / "w" / "model.safetensors"
    safetensors.torch.save_file(want, file)
    state: dict[str, Any] = {n: torch.zeros_like(t) for n, t in want.items()}
    distckpt.load_hf(state, file if layout == "file" else file.parent, COMM)
    for name, tensor in want.items():
        assert_same_bits(state[name], tensor, name)


BOXES = [  # name, offsets, lengths
    ("layers.0.w", (4, 0), (5, 12)),  # rows: one run
    ("layers.0.w", (0, 3), (16, 6)),  # columns: a run per row
    ("embed.weight", (0, 1, 0), (6, 3, 4)),  # the middle dimension
    ("embed.weight", (2, 1, 1), (3, 4, 3)),
    ("fp8", (1, 1), (4, 2)),
    ("mask", (0, 1), (4, 3)),
]


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("case", range(len(BOXES)))
def test_load_hf_reads_only_the_shards_box(
    hf_dir: Path, bands: list[int], reads: list[tuple[int, int]], case: int, staged: bool
) -> None:
    name, offsets, lengths = BOXES[case]
    full = weights()[name]
    box = Box(offsets, lengths)
    target = zeros(lengths, full.dtype, staged)
    assert target.is_contiguous() != staged
    state = {name: distckpt.Shard(target, tuple(full.shape), offsets)}
    result = distckpt.load_hf(state, hf_dir, COMM, strict=False)
    assert_same_bits(target, full[box.slices()].contiguous(), name)
    nbytes = box.numel * full.element_size()
    assert result.bytes_read == nbytes == sum(n for _, n in reads)
    assert result.loaded == [name] and name not in result.unexpected
    assert sum(bands) == (nbytes if staged else 0)  # views: a slab at a time


def test_load_hf_gives_a_none_placeholder_a_new_tensor(hf_dir: Path) -> None:
    want = weights()
    state: dict[str, Any] = {"layers.0.w": None, "scale": None, "empty": None}
    distckpt.load_hf(state, hf_dir, COMM, strict=False)
    for name in state:
        assert_same_bits(state[name], want[name], name)


# --------------------------------------------------------------------------- names


def test_load_hf_prefix_and_rename(hf_dir: Path) -> None:
    want = weights()
    state: dict[str, Any] = {"net": {n: torch.zeros_like(t) for n, t in want.items()}}
    distckpt.load_hf(state, hf_dir, COMM, prefix="net/")
    for name, tensor in want.items():
        assert_same_bits(state["net"][name], tensor, name)

    def rename(name: str) -> str | None:
        return None if name.startswith("layers.") else "m/" + name.upper()

    kept = {n: t for n, t in want.items() if not n.startswith("layers.")}
    state = {"m": {n.upper(): torch.zeros_like(t) for n, t in kept.items()}}
    result = distckpt.load_hf(state, hf_dir, COMM, rename=rename)  # strict: skipped is fine
    for name, tensor in kept.items():
        assert_same_bits(state["m"][name.upper()], tensor, name)
    assert not result.unexpected and not result.missing
    with pytest.raises(ValueError, match="prefix= or rename="):
        distckpt.load_hf(state, hf_dir, COMM, prefix="m/", rename=rename)


def test_load_hf_with_a_prefix_leaves_the_rest_of_the_state_alone(hf_dir: Path) -> None:
    want = weights()
    rng = distckpt.PerRank(torch.arange(3))
    state: dict[str, Any] = {
        "net": {n: torch.zeros_like(t) for n, t in want.items()},
        "step": 3,
        "rng": rng,
        "opt": {"m": torch.ones(2)},
    }
    result = distckpt.load_hf(state, hf_dir, COMM, prefix="net/")  # strict
    assert not result.missing and not result.unexpected
    assert (
        state["step"] == 3 and state["rng"] is rng and torch.equal(state["opt"]["m"], torch.ones(2))
    )
    for name, tensor in want.items():
        assert_same_bits(state["net"][name], tensor, name)


def test_save_hf_with_nothing_to_write_is_an_error(tmp_path: Path) -> None:
    state = {"net": {"w": torch.ones(3)}}
    with pytest.raises(ValidationError, match="no tensor to write"):
        distckpt.save_hf(state, tmp_path / "out", COMM, prefix="nte/")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    distckpt.save({"net": state["net"]}, tmp_path / "ckpt", COMM)
    with pytest.raises(ValidationError, match="no tensor to write"):
        distckpt.export_hf(tmp_path / "ckpt", tmp_path / "out", COMM, prefix="nte/")


def test_load_hf_refuses_two_weights_for_one_name(hf_dir: Path) -> None:
    state = {"x": torch.zeros(7, dtype=torch.float16)}
    with pytest.raises(distckpt.ValidationError, match="map to 'x'"):
        distckpt.load_hf(state, hf_dir, COMM, rename=lambda n: "x" if "." in n else None)


def test_load_hf_strict_and_partial(hf_dir: Path) -> None:
    want = weights()
    state: dict[str, Any] = {n: torch.zeros_like(t) for n, t in want.items() if n != "mask"}
    state["extra"] = torch.zeros(3)
    with pytest.raises(distckpt.MissingVariablesError) as info:
        distckpt.load_hf(state, hf_dir, COMM)
    assert info.value.missing == ["extra"] and info.value.unexpected == ["mask"]
    assert "extra" in str(info.value) and "mask" in str(info.value)
    assert not state["layers.0.w"].any()  # checked before anything is read

    result = distckpt.load_hf(state, hf_dir, COMM, strict=False)
    assert result.missing == ["extra"] and result.unexpected == ["mask"]
    assert_same_bits(state["layers.0.w"], want["layers.0.w"])
    assert_same_bits(state["extra"], torch.zeros(3))


@pytest.mark.parametrize(
    ("target", "words"),
    [
        (torch.zeros(12, 16), ["[12, 16]", "[16, 12]"]),
        (torch.zeros(16, 12, dtype=torch.bfloat16), ["bfloat16", "float32"]),
        (distckpt.Shard(torch.zeros(4, 12), (17, 12), (0, 0)), ["[17, 12]", "[16, 12]"]),
    ],
)
def test_load_hf_names_shape_and_dtype_mismatches(
    hf_dir: Path, target: Any, words: list[str]
) -> None:
    with pytest.raises(distckpt.ShapeMismatchError, match="'layers.0.w'") as info:
        distckpt.load_hf({"layers.0.w": target}, hf_dir, COMM, strict=False)
    for word in words:
        assert word in str(info.value)


def test_load_hf_fills_tied_weights(tmp_path: Path) -> None:
    embed = make_tensor(torch.float32, (10, 4), 1)
    safetensors.torch.save_file({"embed.weight": embed}, tmp_path / "model.safetensors")
    shared = torch.zeros(10, 4)
    state = {"embed.weight": shared, "lm_head.weight": shared}
    result = distckpt.load_hf(state, tmp_path, COMM)
    assert_same_bits(state["lm_head.weight"], embed)
    assert not result.missing and "lm_head.weight" in result.loaded
    with pytest.raises(distckpt.MissingVariablesError, match="lm_head.weight"):
        distckpt.load_hf(
            {"embed.weight": shared, "lm_head.weight": torch.zeros(10, 4)}, tmp_path, COMM
        )


# --------------------------------------------------------------------------- untrusted input

F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
CORRUPT = {
    "shorter than 8 bytes": (b"\x01\x02\x03", "shorter than 8 bytes"),
    "header past the end": (frame(b"{}", length=1000), "header length 1000"),
    "header not JSON": (frame(b"{not json"), "not JSON"),
    "header not an object": (frame(b"[1, 2]"), "not a JSON object"),
    "a name twice": (
        frame(b'{"w": %s, "w": %s}' % ((json.dumps(F32).encode(),) * 2), bytes(8)),
        "'w' appears twice",
    ),
    "unknown dtype": (frame({"w": {**F32, "dtype": "F4"}}, bytes(8)), "dtype 'F4'"),
    "dtype not a name": (frame({"w": {**F32, "dtype": ["F32"]}}, bytes(8)), 'dtype ["F32"]'),
    "bad shape": (frame({"w": {**F32, "shape": [-2]}}, bytes(8)), "bad shape"),
    "offsets not shape": (frame({"w": {**F32, "data_offsets": [0, 4]}}, bytes(8)), "offsets"),
    "offsets past the end": (frame({"w": {**F32, "data_offsets": [8, 16]}}, bytes(8)), "offsets"),
    "overlap": (
        frame({"a": F32, "b": {**F32, "data_offsets": [4, 12]}}, bytes(12)),
        "'a' and 'b' overlap",
    ),
    "truncated data": (frame({"w": F32}, bytes(5)), "tensor 'w'"),
    "bad metadata": (frame({"__metadata__": {"a": 1}}), "__metadata__"),
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_corrupt_safetensors_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    data, words = CORRUPT[case]
    file = tmp_path / "model.safetensors"
    file.write_bytes(data)
    with pytest.raises(CorruptCheckpointError, match=re.escape(words)) as info:
        distckpt.load_hf({}, file, COMM, strict=False)
    assert str(file) in str(info.value)
    code, _, err = run(capsys, "import", file, tmp_path / "ckpt")
    assert code == 2
    assert_one_line_error(err, "import", str(file), words)
    assert not (tmp_path / "ckpt").exists()


def test_a_file_cut_while_loading_names_the_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = tmp_path / "model.safetensors"
    safetensors.torch.save_file({"w": torch.ones(64)}, file)
    opened = load.open_weights

    def then_cut(path: Any) -> Any:
        found = opened(path)
        os.truncate(file, file.stat().st_size - 10)
        return found

    monkeypatch.setattr(load, "open_weights", then_cut)
    with pytest.raises(CorruptCheckpointError, match="ends at byte .* inside 'w'") as info:
        distckpt.load_hf({"w": torch.zeros(64)}, file, COMM)
    assert str(file) in str(info.value)


@pytest.mark.parametrize("evil", ["../evil.safetensors", "ABS", "sub/evil.safetensors", ".."])
def test_an_index_naming_a_file_elsewhere_is_refused_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, evil: str
) -> None:
    for outside in (tmp_path / "evil.safetensors", tmp_path / "hf" / "sub" / "evil.safetensors"):
        outside.parent.mkdir(exist_ok=True, parents=True)
        safetensors.torch.save_file({"w": torch.ones(2)}, outside)
    root = tmp_path / "hf"
    safetensors.torch.save_file({"v": torch.ones(2)}, root / "a.safetensors")
    evil = str(tmp_path / "evil.safetensors") if evil == "ABS" else evil
    (root / INDEX).write_text(json.dumps({"weight_map": {"v": "a.safetensors", "w": evil}}))
    opened: list[str] = []
    monkeypatch.setattr(directory, "read_header", lambda p: opened.append(str(p)))
    with pytest.raises(CorruptCheckpointError, match="'w' names the file") as info:
        distckpt.load_hf({}, root, COMM, strict=False)
    assert str(root / INDEX) in str(info.value) and opened == []


@pytest.mark.parametrize(
    ("weight_map", "words"),
    [
        ({"v": "a.safetensors", "w": "gone.safetensors"}, "gone.safetensors, which is missing"),
        (
            {"v": "a.safetensors", "w": "a.safetensors"},
            "1 tensors are not in the files it names: w",
        ),
        ("not a map", "weight_map is not a map"),
    ],
)
def test_an_index_that_does_not_match_its_files(
    tmp_path: Path, weight_map: Any, words: str
) -> None:
    safetensors.torch.save_file({"v": torch.ones(2)}, tmp_path / "a.safetensors")
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CorruptCheckpointError, match=words) as info:
        distckpt.load_hf({}, tmp_path, COMM, strict=False)
    assert str(tmp_path) in str(info.value)


def test_no_weights_is_not_found(tmp_path: Path) -> None:
    for path in (tmp_path, tmp_path / "nothing"):
        with pytest.raises(distckpt.CheckpointNotFoundError, match=re.escape(str(path))):
            distckpt.load_hf({}, path, COMM, strict=False)


# --------------------------------------------------------------------------- save_hf


def save_state() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A state for ``save_hf`` and the weights it should become (state order)."""
    shard = make_tensor(torch.float64, (20, 10), 20)
    view = make_tensor(torch.float32, (48, 32), 21)
    state: dict[str, Any] = {
        "empty": torch.zeros(0, 3),  # zero bytes, first
        "embed.weight": make_tensor(torch.bfloat16, (50, 40), 22),
        "layers": {
            "0.w": make_tensor(torch.float32, (64, 40), 23),  # larger than a file
            "0.wt": view.t(),  # not contiguous: staged
            "0.b": make_tensor(torch.float16, (40,), 24),
        },
        "idx": make_tensor(torch.int64, (30, 5), 25),
        "mask": make_tensor(torch.bool, (9, 7), 26),
        "fp8": make_tensor(torch.float8_e4m3fn, (32, 16), 27),
        "bytes": make_tensor(torch.uint8, (100,), 28),
        "scale": make_tensor(torch.float32, (), 29),
        "sharded": distckpt.Shard(shard, (20, 10), (0, 0)),
        "sharded_view": distckpt.Shard(shard.t(), (10, 20), (0, 0)),
        "step": 3,
        "cfg": {"lr": 0.1},
        "rng": distckpt.PerRank(7),
    }
    want = {
        "empty": state["empty"],
        "embed.weight": state["embed.weight"],
        "layers/0.w": state["layers"]["0.w"],
        "layers/0.wt": view.t().contiguous(),
        "layers/0.b": state["layers"]["0.b"],
        "idx": state["idx"],
        "mask": state["mask"],
        "fp8": state["fp8"],
        "bytes": state["bytes"],
        "scale": state["scale"],
        "sharded": shard,
        "sharded_view": shard.t().contiguous(),
    }
    return state, want


def test_save_hf_writes_several_files_and_an_index(tmp_path: Path, bands: list[int]) -> None:
    state, want = save_state()
    limit = 8192
    result = distckpt.save_hf(state, tmp_path / "out", COMM, max_shard_size=limit)
    out = tmp_path / "out"
    index = json.loads((out / INDEX).read_text())
    n = result.files_written
    files = [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert n >= 3 and sorted(p.name for p in out.iterdir()) == sorted([*files, INDEX])
    assert list(index["weight_map"]) == list(want)  # values, PerRank left out
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in want.values()
    )
    assert [index["weight_map"][name] for name in want] == sorted(index["weight_map"].values())
    got = weight_files(out)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert_same_bits(got[name], tensor, name)
    for file in files:
        found = safetensors.torch.load_file(out / file)
        assert all(index["weight_map"][name] == file for name in found)
        size = sum(t.numel() * t.element_size() for t in found.values())
        assert size <= limit or len(found) == 1, (file, size)
        with safetensors.safe_open(out / file, "pt") as f:
            assert f.metadata() == {"format": "pt"}  # what from_pretrained asks for
    assert len(bands) > 2  # the views went a slab at a time
    assert result.bytes_written == index["metadata"]["total_size"]


def test_save_hf_one_file_has_no_index(tmp_path: Path) -> None:
    state, want = save_state()
    distckpt.save_hf(state, tmp_path, COMM)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    got = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert_same_bits(got[name], tensor, name)
    back: dict[str, Any] = {"layers": {}}
    for name, tensor in want.items():  # "layers/0.w" is the state's {"layers": {"0.w": ...}}
        *parent, key = name.split("/")
        (back[parent[0]] if parent else back)[key] = torch.zeros_like(tensor)
    distckpt.load_hf(back, tmp_path, COMM)
    for name, tensor in want.items():
        *parent, key = name.split("/")
        assert_same_bits((back[parent[0]] if parent else back)[key], tensor, name)


def test_save_hf_prefix_and_rename(tmp_path: Path) -> None:
    net = {"a.weight": make_tensor(torch.float32, (4, 3), 1), "b": make_tensor(torch.int8, (5,), 2)}
    state = {"net": net, "opt": {"m": torch.ones(2)}}
    distckpt.save_hf(state, tmp_path / "p", COMM, prefix="net/")
    got = safetensors.torch.load_file(tmp_path / "p" / "model.safetensors")
    assert sorted(got) == sorted(net)
    assert_same_bits(got["a.weight"], net["a.weight"])
    distckpt.save_hf(state, tmp_path / "r", COMM, rename=lambda n: n.upper() if "m" in n else None)
    got = safetensors.torch.load_file(tmp_path / "r" / "model.safetensors")
    assert sorted(got) == ["OPT/M"]


def test_save_hf_refuses_two_tensors_for_one_name(tmp_path: Path) -> None:
    state = {"a": torch.ones(3), "b": torch.zeros(3)}
    with pytest.raises(distckpt.ValidationError, match="'a' and 'b'"):
        distckpt.save_hf(state, tmp_path, COMM, rename=lambda n: "x")
    assert list(tmp_path.iterdir()) == []


def test_save_hf_refuses_then_overwrites(tmp_path: Path) -> None:
    state, _ = save_state()
    distckpt.save_hf(state, tmp_path, COMM, max_shard_size=8192)
    (tmp_path / "config.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert INDEX in before and len(before) > 3
    with pytest.raises(distckpt.CheckpointExists, match="overwrite=True"):
        distckpt.save_hf({"w": torch.ones(2)}, tmp_path, COMM)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before

    distckpt.save_hf({"w": torch.ones(2)}, tmp_path, COMM, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert_same_bits(
        safetensors.torch.load_file(tmp_path / "model.safetensors")["w"], torch.ones(2)
    )

    distckpt.save_hf(state, tmp_path, COMM, max_shard_size=8192, overwrite=True)
    assert {p.name for p in tmp_path.iterdir()} == set(before)


def test_save_hf_failures_leave_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text("{}")
    half = distckpt.Shard(torch.ones(2, 3), (4, 3), (0, 0))
    with pytest.raises(distckpt.ValidationError, match="cover 6 of the 12"):
        distckpt.save_hf({"w": half}, tmp_path, COMM)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]

    def full_disk(*args: Any) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ranges, "write_runs", full_disk)
    state, _ = save_state()
    with pytest.raises(OSError, match="No space left"):
        distckpt.save_hf(state, tmp_path, COMM, max_shard_size=8192)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


@pytest.mark.parametrize(
    ("size", "nbytes"),
    [("100KB", 100_000), ("1MiB", 1 << 20), ("2.5GB", 25 * 10**8), (" 3 kib ", 3072), (512, 512)],
)
def test_max_shard_size(size: Any, nbytes: int) -> None:
    assert parse_size(size) == nbytes


@pytest.mark.parametrize("size", ["", "abc", "5XB", "1.5.5GB", "0", 0, -1, "-1KB", True])
def test_bad_max_shard_size(tmp_path: Path, size: Any) -> None:
    with pytest.raises(ValueError):
        distckpt.save_hf({"w": torch.ones(2)}, tmp_path / "out", COMM, max_shard_size=size)
    assert not (tmp_path / "out").exists()


def test_save_hf_leaves_no_temporary_files(tmp_path: Path) -> None:
    state, _ = save_state()
    distckpt.save_hf(state, tmp_path, COMM, max_shard_size=4096)
    assert leftovers(tmp_path) == [] and (tmp_path / INDEX).exists()


# --------------------------------------------------------------------------- export_hf


def net_state() -> dict[str, torch.Tensor]:
    return {
        "embed.weight": make_tensor(torch.bfloat16, (256, 128), 1),  # 64 KiB
        "layers.0.w": make_tensor(torch.float32, (40, 30), 2),
        "layers.0.b": make_tensor(torch.float16, (30,), 3),
        "mask": make_tensor(torch.bool, (5, 5), 4),
        "fp8": make_tensor(torch.float8_e4m3fn, (16, 8), 5),
        "scale": make_tensor(torch.float32, (), 6),
    }


def test_export_hf(tmp_path: Path) -> None:
    net = net_state()
    ckpt = save_small({"net": net, "step": 3, "other": torch.ones(2)}, tmp_path / "ckpt")
    result = distckpt.export_hf(ckpt, tmp_path / "hf", COMM, prefix="net/", max_shard_size=6000)
    index = json.loads((tmp_path / "hf" / INDEX).read_text())
    assert result.files_written == len(set(index["weight_map"].values())) >= 2
    assert sorted(index["weight_map"]) == sorted(net)
    got = weight_files(tmp_path / "hf")
    assert sorted(got) == sorted(net)
    for name, tensor in net.items():
        assert_same_bits(got[name], tensor, name)
    fresh = {"net": {n: torch.zeros_like(t) for n, t in net.items()}}
    distckpt.load_hf(fresh, tmp_path / "hf", COMM, prefix="net/")
    for name, tensor in net.items():
        assert_same_bits(fresh["net"][name], tensor, name)
    assert leftovers(tmp_path / "hf") == []


def test_export_hf_refuses_two_variables_for_one_name(tmp_path: Path) -> None:
    ckpt = save_small({"a": torch.ones(3), "b": torch.zeros(3)}, tmp_path / "ckpt")
    with pytest.raises(distckpt.ValidationError, match="'a' and 'b'"):
        distckpt.export_hf(ckpt, tmp_path / "hf", COMM, rename=lambda n: "x")
    assert not (tmp_path / "hf").exists() or list((tmp_path / "hf").iterdir()) == []


def test_export_hf_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    net = net_state()
    ckpt = save_small({"net": net, "step": 3}, tmp_path / "ckpt")
    out = tmp_path / "hf"
    code, stdout, err = run(
        capsys, "export", ckpt, out, "--hf", "--prefix", "net/", "--max-shard-size", "50KB"
    )
    assert code == 0 and err == "" and "file(s)" in stdout, err
    assert (out / INDEX).exists() and (out / "model-00002-of-00002.safetensors").exists()
    got = weight_files(out)
    for name, tensor in net.items():
        assert_same_bits(got[name], tensor, name)

    code, _, err = run(capsys, "export", ckpt, tmp_path / "x.safetensors", "--prefix", "net/")
    assert code == 2
    assert_one_line_error(err, "export", "--hf")
    code, _, err = run(capsys, "export", ckpt, tmp_path / "y", "--hf", "--max-shard-size", "5XB")
    assert code == 2
    assert_one_line_error(err, "export", "'5XB'")


# --------------------------------------------------------------------------- import


def test_import_hf_dir_with_prefix(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    want = weights()
    code, _, err = run(capsys, "import", hf_dir, tmp_path / "ckpt", "--prefix", "net/")
    assert code == 0 and err == ""
    names = {v.name for v in distckpt.list_variables(tmp_path / "ckpt")}
    assert names == {"net/" + n for n in want}  # a directory's metadata is not imported
    state = {"net": {n: torch.zeros_like(t) for n, t in want.items()}}
    distckpt.load(state, tmp_path / "ckpt", COMM)
    for name, tensor in want.items():
        assert_same_bits(state["net"][name], tensor, name)


_IMPORT_MEMORY = """
import resource, sys
import numpy as np, safetensors.torch, torch, distckpt
from distckpt.comm import SingleComm
from distckpt.hf.safetensors import TensorHeader, header
from distckpt.tools.importer import import_checkpoint

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10

root, N, STEP = sys.argv[1], 16 << 20, 1 << 18     # 3 tensors of 64 MiB
names = [f"layers.{k}.weight" for k in range(3)]
with open(root + "/big.safetensors", "wb") as f:   # written 1 MiB at a time
    f.write(header([TensorHeader(n, "int32", (4096, 4096), 4 * N) for n in names], {}))
    for k in range(3):
        for s in range(k * N, (k + 1) * N, STEP):
            f.write(np.arange(s, s + STEP, dtype=np.int32).tobytes())
distckpt.set_staging(slab_bytes=4 << 20, slabs=2)
safetensors.torch.save_file({"w": torch.ones(4, 4)}, root + "/warm.safetensors")
import_checkpoint(root + "/warm.safetensors", root + "/warm")
before = peak()
import_checkpoint(root + "/big.safetensors", root + "/ckpt", prefix="net/")
grown = peak() - before
state = {"net": {n: torch.empty(4096, 4096, dtype=torch.int32) for n in names}}
distckpt.load(state, root + "/ckpt", SingleComm())
for k, n in enumerate(names):
    want = torch.arange(k * N, (k + 1) * N, dtype=torch.int32)
    assert torch.equal(state["net"][n].reshape(-1), want), n
print(grown >> 20)
"""


def test_import_streams_through_the_slabs(tmp_path: Path) -> None:
    """Importing a 192 MiB safetensors file adds about the slabs (2 x 4 MiB) and a task
    buffer to the peak memory, not the file's size."""
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_MEMORY, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "OMP_NUM_THREADS": "1", "DISTCKPT_IO_WORKERS": "1"},
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) < 64, out.stdout
