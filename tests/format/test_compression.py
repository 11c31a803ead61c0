"""Compressed checkpoints: zstd, blosc-zstd and blosc-lz4 inner chunks, chosen per name pattern.

Round trips of every dtype (bit-exact), the index and zarr metadata a compressed save
writes, resharded reads into ``distckpt.Shard`` targets, damage inside a compressed chunk,
an unknown codec, and the command line's verify and export. (zarr-python and tensorstore
reading compressed arrays: tests/format/test_zarr_dtypes.py.)
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import distckpt
from distckpt import cli
from distckpt.errors import CorruptCheckpointError, UnsupportedFormatError
from distckpt.format import codecs
from distckpt.testing.hostile import reseal
from distckpt.tools.verify import verify
from tests.engine.test_single_process import (
    ALL_DTYPES,
    flip_byte,
    index_of,
    inner_chunk_offsets,
    load1,
    random_tensor,
    save1,
)
from tests.support.make_golden import assert_same_bits

pytestmark = pytest.mark.timeout(120)

CHOICES = ["zstd", "blosc-zstd", "blosc-lz4"]
STORED = {"zstd": "zstd", "blosc-zstd": "blosc", "blosc-lz4": "blosc"}


def smooth(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Compressible values (few distinct ones, in runs)."""
    n = math.prod(shape)
    return (torch.arange(n) // 64 % 7).to(dtype).reshape(shape)


def inner_codecs(ckpt: Path, array: str) -> list[str]:
    meta = json.loads((ckpt / array / "zarr.json").read_bytes())
    return [c["name"] for c in meta["codecs"][0]["configuration"]["codecs"]]


@pytest.mark.parametrize("choice", CHOICES)
def test_every_dtype_round_trips_bit_exactly(tmp_path: Path, choice: str) -> None:
    shape = (37, 5)
    state = {
        str(d).removeprefix("torch."): random_tensor(d, shape, i) for i, d in enumerate(ALL_DTYPES)
    }
    state["smooth"] = smooth((64, 32))
    save1(state, tmp_path / "ck", small_bytes=0, inner_bytes=96, compression=choice)
    index = index_of(tmp_path / "ck")
    assert index["format_version"] == 3  # regular entries
    for name, var in index["variables"].items():
        for p in var["pieces"]:
            assert p["inner"] != p["block"], name  # several inner chunks per shard
            assert p["codec"]["name"] == STORED[choice], name
        assert inner_codecs(tmp_path / "ck", name) == ["bytes", STORED[choice], "crc32c"]
    blosc = index["variables"]["complex128"]["pieces"][0]["codec"]
    if choice.startswith("blosc"):  # configured as zarr-python configures it for the dtype
        assert blosc["configuration"] == {
            "typesize": 16,
            "cname": choice.removeprefix("blosc-"),
            "clevel": 5 if choice == "blosc-lz4" else 3,
            "shuffle": "shuffle",
            "blocksize": 0,
        }
        assert index["variables"]["uint8"]["pieces"][0]["codec"]["configuration"]["shuffle"] == (
            "bitshuffle"
        )
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    result = load1(target, tmp_path / "ck")
    assert sorted(result.loaded) == sorted(state)
    for k in state:
        assert_same_bits(target[k], state[k], k)
    # non-contiguous targets (a staged copy)
    target_t = {k: torch.zeros(v.shape[::-1], dtype=v.dtype).t() for k, v in state.items()}
    load1(target_t, tmp_path / "ck")
    for k in state:
        assert_same_bits(target_t[k].contiguous(), state[k], k)


def test_pattern_selection_first_match_wins(tmp_path: Path) -> None:
    state = {
        "model": {"w": smooth((256, 64)), "b": smooth((4,))},
        "optimizer": {"m": smooth((256, 64)), "v": smooth((256, 64))},
        "other": smooth((256, 64)),
    }
    compression = {"optimizer/v": None, "optimizer/*": "zstd", "model/*": "blosc-lz4"}
    result = save1(state, tmp_path / "ck", small_bytes=1024, compression=compression)
    variables = index_of(tmp_path / "ck")["variables"]
    got = {n: {p.get("codec", {}).get("name") for p in v["pieces"]} for n, v in variables.items()}
    assert got == {
        "model/w": {"blosc"},
        "model/b": {None},  # a plain chunk: never compressed
        "optimizer/m": {"zstd"},
        "optimizer/v": {None},  # the first matching pattern wins
        "other": {None},  # no pattern matches
    }
    assert inner_codecs(tmp_path / "ck", "optimizer/v") == ["bytes", "crc32c"]
    size = {n: sum(p["size"] for p in v["pieces"]) for n, v in variables.items()}
    assert size["optimizer/m"] < size["other"] // 10  # compressible values, compressed
    assert size["model/w"] < size["other"] // 10
    assert result.bytes_written == sum(p["size"] for v in variables.values() for p in v["pieces"])
    target = {
        "model": {"w": torch.zeros(256, 64), "b": torch.zeros(4)},
        "optimizer": {"m": torch.zeros(256, 64), "v": torch.zeros(256, 64)},
        "other": torch.zeros(256, 64),
    }
    load1(target, tmp_path / "ck")
    assert_same_bits(target["optimizer"]["m"], state["optimizer"]["m"])
    assert_same_bits(target["model"]["w"], state["model"]["w"])


def test_choose_and_check() -> None:
    patterns = {"opt/*": "zstd", "*": None}
    assert codecs.choose(patterns, "opt/state/net/w/exp_avg") == "zstd"  # * matches "/"
    assert codecs.choose(patterns, "net/w") is None
    assert codecs.choose({"a*": "zstd"}, "b") is None
    assert codecs.choose("blosc-lz4", "anything") == "blosc-lz4"
    for good in (None, "zstd", "blosc-zstd", "blosc-lz4", {"*": "zstd", "x": None}):
        codecs.check(good)
    for bad in ("gzip", {"*": "lz4"}, {1: "zstd"}):
        with pytest.raises(ValueError):
            codecs.check(bad)  # type: ignore[arg-type]


def test_unknown_compression_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown compression 'gzip'"):
        save1({"w": torch.zeros(300, 300)}, tmp_path / "ck", compression="gzip")
    assert not (tmp_path / "ck").exists()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_checkpoints_record_the_lowest_format_version_that_reads_them(tmp_path: Path) -> None:
    """1: pieces listed, uncompressed; 2: compressed pieces listed; 3: regular entries."""
    save1({"w": torch.zeros(300, 300)}, tmp_path / "regular")
    index = index_of(tmp_path / "regular")
    assert index["format_version"] == 3
    assert "codec" not in index["variables"]["w"]["pieces"][0]
    save1({"s": torch.zeros(8, 8)}, tmp_path / "small")
    assert index_of(tmp_path / "small")["format_version"] == 1
    state = {"r": distckpt.PerRank(torch.zeros(300, 300))}
    save1(state, tmp_path / "per_rank", compression="zstd")
    assert index_of(tmp_path / "per_rank")["format_version"] == 2


@pytest.mark.parametrize("choice", CHOICES)
def test_resharded_load_into_shards(tmp_path: Path, choice: str) -> None:
    full = random_tensor(torch.float32, (96, 80), 7)
    full[::3] = 1.5  # some compressible rows
    save1({"w": full}, tmp_path / "ck", small_bytes=0, inner_bytes=2048, compression=choice)
    p = index_of(tmp_path / "ck")["variables"]["w"]["pieces"][0]
    assert p["inner"] == [6, 80]  # 16 inner chunks of 6 rows
    # boxes across inner chunk borders, whole chunks, single rows, columns, 2-D boxes
    boxes = [((0, 0), (96, 80)), ((5, 0), (8, 80)), ((12, 0), (12, 80)), ((7, 0), (1, 80))]
    boxes += [((0, 3), (96, 5)), ((31, 17), (40, 50)), ((90, 79), (6, 1))]
    for offsets, lengths in boxes:
        t = torch.full(lengths, -1.0)
        result = load1({"w": distckpt.Shard(t, (96, 80), offsets)}, tmp_path / "ck")
        region = tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))
        assert_same_bits(t, full[region], str(offsets))
        assert result.bytes_read > 0
    # several targets of one process restore the whole tensor between them
    parts = [torch.empty(32, 80) for _ in range(3)]
    for k, part in enumerate(parts):
        load1({"w": distckpt.Shard(part, (96, 80), (32 * k, 0))}, tmp_path / "ck")
    assert_same_bits(torch.cat(parts), full)


@pytest.fixture
def compressed(tmp_path: Path) -> Path:
    ck = tmp_path / "ck"
    state = {"w": random_tensor(torch.float32, (16, 64), 3), "s": smooth((8, 8))}
    save1(state, ck, small_bytes=1024, inner_bytes=1024, compression="zstd")
    return ck


def test_flipped_byte_in_a_compressed_chunk_is_detected_and_named(compressed: Path) -> None:
    p = index_of(compressed)["variables"]["w"]["pieces"][0]
    shard = compressed / "w" / "c.0.0"
    chunks = inner_chunk_offsets(shard, p["block"], p["inner"])
    assert p["inner"] == [4, 64] and len({length for _, length in chunks}) >= 1
    flip_byte(shard, chunks[2][0] + chunks[2][1] // 2)  # inside chunk 2's compressed bytes
    with pytest.raises(CorruptCheckpointError) as ei:
        load1({"w": torch.zeros(16, 64), "s": torch.zeros(8, 8)}, compressed)
    msg = str(ei.value)
    assert "variable 'w'" in msg and "inner chunk (2, 0) fails its crc32c checksum" in msg
    assert str(shard) in msg
    # rows in other inner chunks still read
    full = random_tensor(torch.float32, (16, 64), 3)
    t = torch.zeros(8, 64)
    load1({"w": distckpt.Shard(t, (16, 64), (0, 0))}, compressed, strict=False)
    assert_same_bits(t, full[:8])
    report = verify(compressed)
    assert len(report.problems) == 1 and "inner chunk (2, 0)" in report.problems[0]


def test_chunk_that_does_not_decompress_is_named(compressed: Path) -> None:
    """A chunk whose crc32c was recomputed over garbage still fails: on decompression."""
    import struct

    from distckpt.format.shard_io import crc32c

    p = index_of(compressed)["variables"]["w"]["pieces"][0]
    shard = compressed / "w" / "c.0.0"
    offset, length = inner_chunk_offsets(shard, p["block"], p["inner"])[1]
    raw = bytearray(shard.read_bytes())
    raw[offset : offset + length - 4] = b"\x00" * (length - 4)
    crc = crc32c(bytes(raw[offset : offset + length - 4]))
    raw[offset + length - 4 : offset + length] = struct.pack("<I", crc)
    table = np.frombuffer(bytes(raw[: 4 * 4]), dtype="<u4").copy()
    table[1] = crc
    raw[: 4 * 4] = table.tobytes()
    shard.write_bytes(bytes(raw))
    doc = json.loads((compressed / "zarr.json").read_bytes())
    doc["attributes"]["distckpt"]["variables"]["w"]["crc"][0] = crc32c(table.tobytes())
    (compressed / "zarr.json").write_bytes(reseal(json.dumps(doc).encode()))
    with pytest.raises(CorruptCheckpointError, match=r"'w': inner chunk \(1, 0\) does not decom"):
        load1({"w": torch.zeros(16, 64), "s": torch.zeros(8, 8)}, compressed)


def test_unknown_codec_is_refused_naming_the_variable(compressed: Path, capsys: Any) -> None:
    doc = json.loads((compressed / "zarr.json").read_bytes())
    entry = doc["attributes"]["distckpt"]["variables"]["w"]
    entry["codec"] = {"name": "brotli", "configuration": {}}
    (compressed / "zarr.json").write_bytes(reseal(json.dumps(doc).encode()))
    before = torch.full((8, 8), -1.0)
    with pytest.raises(UnsupportedFormatError, match="variable 'w' is stored with codec") as ei:
        load1({"s": before, "w": torch.zeros(16, 64)}, compressed)
    assert "brotli" in str(ei.value)
    assert (before == -1).all()  # refused before anything was read
    assert cli.main(["verify", str(compressed)]) == cli.ERROR
    assert "variable 'w' is stored with codec" in capsys.readouterr().err


def test_cli_verify_and_export_of_a_compressed_checkpoint(
    compressed: Path, tmp_path: Path, capsys: Any
) -> None:
    assert cli.main(["verify", str(compressed)]) == cli.OK
    out = capsys.readouterr().out
    assert "ok, 2 variables, 2 pieces" in out
    w_size = (compressed / "w" / "c.0.0").stat().st_size
    assert cli.main(["inspect", str(compressed)]) == cli.OK
    out = capsys.readouterr().out
    assert f"w  float32[16, 64]  regular, 1 slice(s), 4096 bytes (zstd: {w_size} stored)" in out
    assert "s  float32[8, 8]  small, 1 slice(s), 256 bytes\n" in out
    report = verify(compressed)
    files = [compressed / "w" / "c.0.0", compressed / "s" / "c.0.0"]
    assert report.bytes_read == sum(f.stat().st_size for f in files)
    target = tmp_path / "out.safetensors"
    assert cli.main(["export", str(compressed), str(target)]) == cli.OK
    from safetensors.torch import load_file

    exported = load_file(str(target))
    assert_same_bits(exported["w"], random_tensor(torch.float32, (16, 64), 3))
    assert_same_bits(exported["s"], smooth((8, 8)))
    copy = tmp_path / "copy"
    shutil.copytree(compressed, copy)
    assert cli.main(["diff", str(compressed), str(copy)]) == cli.OK


def test_training_layer_compresses(tmp_path: Path) -> None:
    net = torch.nn.Linear(256, 512)
    opt = torch.optim.Adam(net.parameters())
    net(torch.ones(2, 256)).sum().backward()
    opt.step()
    ckpt = distckpt.Checkpoint(net=net, optimizer=opt)
    with distckpt.CheckpointManager(
        ckpt, tmp_path / "run", compression={"optimizer/*": "zstd"}
    ) as manager:
        path = manager.save()
    variables = index_of(Path(path))["variables"]
    codec_of = {
        n: v["pieces"][0].get("codec", {}).get("name")
        for n, v in variables.items()
        if v["kind"] == "tensor"
    }
    assert codec_of["net/weight"] is None
    assert {c for n, c in codec_of.items() if n.startswith("optimizer/") and "exp_avg" in n} == {
        "zstd",
        None,  # the bias's slots are small: plain chunks
    }
    written = ckpt.write(tmp_path / "one", compression="blosc-lz4")
    assert index_of(Path(written))["variables"]["net/weight"]["pieces"][0]["codec"]["name"] == (
        "blosc"
    )
    fresh = torch.nn.Linear(256, 512)
    distckpt.Checkpoint(net=fresh).restore(path).expect_partial()
    assert_same_bits(fresh.weight.detach(), net.weight.detach())


def test_a_plan_is_reused_only_with_the_same_compression_choices(tmp_path: Path) -> None:
    from distckpt.engine.agree import forget_plans

    forget_plans()
    state = {"w": random_tensor(torch.float32, (256, 256), 3)}
    choices: dict[str, str | None] = {"w*": None}
    runs = []
    for name, compression in [
        ("a", choices),
        ("b", choices),  # after the edit below: zstd
        ("c", {"*": None, "w*": "zstd"}),  # the first matching pattern wins: raw
        ("d", {"*": None, "w*": "zstd"}),
    ]:
        if name == "b":
            choices["w*"] = "zstd"  # the same dict, edited in place
        result = save1(state, tmp_path / name, small_bytes=1024, compression=compression)
        entry = index_of(tmp_path / name)["variables"]["w"]
        runs.append((result.plan_reused, entry.get("codec", {}).get("name")))
    assert runs == [(False, None), (False, "zstd"), (False, None), (True, None)]
