"""zarr-python <-> tensorstore interoperability of the bfloat16 / float8 zarr v3 data types.

Covers :mod:`distckpt.format.zarr_dtypes`: arrays written by zarr-python (after ``register()``)
read back bit-exactly by zarr-python and tensorstore, arrays laid out the way distckpt writes
them (hand-written metadata and shards, or written by tensorstore) read by zarr-python, fill
value JSON forms, and that ordinary NumPy dtypes still resolve as before.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import google_crc32c
import ml_dtypes
import numpy as np
import pytest
import zarr
from zarr.core.dtype import (
    Bool,
    Float32,
    Int8,
    RawBytes,
    data_type_registry,
    get_data_type_from_native_dtype,
    parse_dtype,
)

from distckpt import dtypes as dd
from distckpt.format import zarr_dtypes
from distckpt.format.zarr_dtypes import BFloat16, Float8E4M3FN, Float8E5M2, register

ts = pytest.importorskip("tensorstore")

pytestmark = [
    # zarr-python's empty-chunk check compares chunks with NaNs to the fill value.
    pytest.mark.filterwarnings("ignore:invalid value encountered in equal:RuntimeWarning"),
    # np.dtype("V2") has no zarr v3 spec; we only check it still resolves as before.
    pytest.mark.filterwarnings("ignore::zarr.errors.UnstableSpecificationWarning"),
]

NAMES = ["bfloat16", "float8_e4m3fn", "float8_e5m2"]
ML_TYPES: dict[str, Any] = {
    "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
}
CLASSES: dict[str, type] = {
    "bfloat16": BFloat16,
    "float8_e4m3fn": Float8E4M3FN,
    "float8_e5m2": Float8E5M2,
}
EMPTY = 2**64 - 1


@pytest.fixture(autouse=True)
def _registered() -> None:
    register()


def _uint(name: str) -> np.dtype[Any]:
    return np.dtype(np.uint16 if np.dtype(ML_TYPES[name]).itemsize == 2 else np.uint8)


def bits(a: np.ndarray) -> np.ndarray:
    """Bit patterns of an ml_dtypes array (little or big endian) as native unsigned ints."""
    a = np.ascontiguousarray(a)
    native = a.astype(a.dtype.newbyteorder("="))
    return native.view(np.uint16 if a.dtype.itemsize == 2 else np.uint8)


def every_value(name: str) -> np.ndarray:
    """Every bit pattern of the type (all NaNs, infinities, subnormals, -0.0), as a 2-D array."""
    u = _uint(name)
    n = 1 << (8 * u.itemsize)
    return np.arange(n, dtype=u).view(ML_TYPES[name]).reshape(-1, 64 if n > 256 else 16)


def ts_open(path: Path | str, **extra: Any) -> Any:
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}, **extra}
    return ts.open(spec).result()


def ts_read(path: Path | str) -> np.ndarray:
    return ts_open(path).read().result()


# -- (a) written by zarr-python ---------------------------------------------------------------


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "sharded"])
@pytest.mark.parametrize("name", NAMES)
def test_zarr_python_write_bit_exact(tmp_path: Path, name: str, sharded: bool) -> None:
    values = every_value(name)
    # Special values by name too, so a failure says which one went wrong.
    fi = ml_dtypes.finfo(ML_TYPES[name])
    specials = [0.0, -0.0, 1.0, -1.5, float(fi.max), -float(fi.max)]
    specials += [float(fi.smallest_subnormal), -float(fi.smallest_subnormal), float("nan")]
    if name != "float8_e4m3fn":
        specials += [float("inf"), float("-inf")]
    for v in specials:
        assert (bits(values) == bits(np.array([v], dtype=ML_TYPES[name]))[0]).sum() == 1, v

    kwargs: dict[str, Any] = {"chunks": (4, 8)}
    if sharded:
        kwargs = {"chunks": (4, 8), "shards": (8, 16)}
    path = tmp_path / name
    arr = zarr.create_array(
        str(path),
        shape=values.shape,
        dtype=ML_TYPES[name],
        fill_value=0.0,
        config={"write_empty_chunks": True},
        **kwargs,
    )
    arr[...] = values

    meta = json.loads((path / "zarr.json").read_text())
    assert meta["data_type"] == name
    assert meta["fill_value"] == 0.0

    back = zarr.open_array(str(path))[...]
    assert back.dtype == np.dtype(ML_TYPES[name])
    np.testing.assert_array_equal(bits(back), bits(values))

    got = ts_read(path)
    assert got.dtype == np.dtype(ML_TYPES[name])
    np.testing.assert_array_equal(bits(got), bits(values))


@pytest.mark.parametrize("name", NAMES)
def test_negative_zero_chunks_survive_with_write_empty_chunks(tmp_path: Path, name: str) -> None:
    # A chunk of only -0.0 compares equal to a 0.0 fill value; zarr-python's default
    # (write_empty_chunks=False) then skips it for the "V"-kind ml_dtypes, losing the sign.
    values = np.full((8,), -0.0, dtype=ML_TYPES[name])
    path = tmp_path / name
    arr = zarr.create_array(
        str(path),
        shape=values.shape,
        dtype=ML_TYPES[name],
        chunks=(4,),
        fill_value=0.0,
        config={"write_empty_chunks": True},
    )
    arr[...] = values
    np.testing.assert_array_equal(bits(zarr.open_array(str(path))[...]), bits(values))
    np.testing.assert_array_equal(bits(ts_read(path)), bits(values))


def test_big_endian_bfloat16(tmp_path: Path) -> None:
    values = every_value("bfloat16")
    big = np.dtype(ml_dtypes.bfloat16).newbyteorder(">")
    assert get_data_type_from_native_dtype(big) == BFloat16(endianness="big")
    path = tmp_path / "be"
    arr = zarr.create_array(str(path), shape=values.shape, dtype=big, chunks=(64, 64))
    arr[...] = values.astype(big)
    np.testing.assert_array_equal(bits(zarr.open_array(str(path))[...]), bits(values))
    np.testing.assert_array_equal(bits(ts_read(path)), bits(values))


@pytest.mark.parametrize(
    ("name", "fill_bits"),
    [
        ("bfloat16", 0x7FC0),  # canonical NaN
        ("bfloat16", 0x7FC1),  # NaN with a payload: needs the hex form
        ("bfloat16", 0xFF80),  # -inf
        ("bfloat16", 0x8000),  # -0.0
        ("bfloat16", 0x0001),  # smallest subnormal
        ("float8_e4m3fn", 0x7F),
        ("float8_e4m3fn", 0xFF),  # negative NaN
        ("float8_e4m3fn", 0x01),
        ("float8_e5m2", 0x7E),
        ("float8_e5m2", 0x7D),  # signalling NaN
        ("float8_e5m2", 0x7C),  # inf
        ("float8_e5m2", 0x80),
    ],
)
def test_fill_value_bits_round_trip(tmp_path: Path, name: str, fill_bits: int) -> None:
    fill = np.array(fill_bits, dtype=_uint(name)).reshape(1).view(ML_TYPES[name])[0]
    path = tmp_path / name
    zarr.create_array(str(path), shape=(6,), dtype=ML_TYPES[name], chunks=(3,), fill_value=fill)
    meta = json.loads((path / "zarr.json").read_text())
    back = zarr.open_array(str(path))
    assert (bits(back[...]) == fill_bits).all(), meta["fill_value"]
    got = ts_open(path)
    assert (bits(got.read().result()) == fill_bits).all(), meta["fill_value"]
    assert int(bits(np.asarray(got.fill_value).reshape(1))[0]) == fill_bits


# -- fill value JSON --------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_fill_value_json_forms(name: str) -> None:
    z = CLASSES[name]()
    t = ML_TYPES[name]

    def parse(data: Any) -> int:
        v = z.from_json_scalar(data, zarr_format=3)
        assert type(v) is t
        return int(bits(np.asarray(v).reshape(1))[0])

    zero = int(bits(np.zeros(1, t))[0])
    neg_zero = int(bits(np.array([-0.0], t))[0])
    assert parse(0.0) == parse(0) == parse("0.0") == zero
    assert parse(dd.fill_value(name)) == zero
    assert parse(-0.0) == neg_zero
    assert parse(1.5) == int(bits(np.array([1.5], t))[0])
    assert parse("NaN") == int(bits(np.array([np.nan], t))[0])
    assert parse("Infinity") == int(bits(np.array([np.inf], t))[0])
    assert parse("-Infinity") == int(bits(np.array([-np.inf], t))[0])
    width = 2 * np.dtype(t).itemsize
    assert parse("0x" + "7f".ljust(width, "0")) == 0x7F << (8 * (np.dtype(t).itemsize - 1))
    assert parse("0x" + "1".rjust(width, "0")) == 1
    assert parse("0X" + "AB".rjust(width, "0")) == 0xAB
    for bad in ["0x" + "0" * (width + 2), "0x7fc00000", "0x", "0xzz", "nope", True, None, [0.0]]:
        with pytest.raises((TypeError, ValueError)):
            z.from_json_scalar(bad, zarr_format=3)

    assert z.to_json_scalar(0.0, zarr_format=3) == 0.0
    assert z.to_json_scalar(float("nan"), zarr_format=3) == "NaN"
    assert z.to_json_scalar(1.5, zarr_format=3) == 1.5
    neg = z.to_json_scalar(-0.0, zarr_format=3)
    assert neg == 0.0 and str(neg) == "-0.0"


@pytest.mark.parametrize("name", NAMES)
def test_fill_value_json_round_trips_every_bit_pattern(name: str) -> None:
    z = CLASSES[name]()
    values = every_value(name).reshape(-1)
    if values.size > 256:  # bfloat16: every NaN / inf / subnormal pattern plus a sample of normals
        u = bits(values)
        exponent_all_ones_or_zero = ((u & 0x7F80) == 0x7F80) | ((u & 0x7F80) == 0)
        values = values[exponent_all_ones_or_zero | (np.arange(u.size) % 97 == 0)]
    for v in values:
        encoded = z.to_json_scalar(v, zarr_format=3)
        json.dumps(encoded, allow_nan=False)  # strict JSON: no bare NaN / Infinity
        decoded = z.from_json_scalar(json.loads(json.dumps(encoded)), zarr_format=3)
        assert bits(np.asarray(decoded).reshape(1))[0] == bits(np.asarray(v).reshape(1))[0], encoded


@pytest.mark.parametrize(
    ("name", "fill"),
    [
        ("bfloat16", 0.0),
        ("bfloat16", -0.0),
        ("bfloat16", 0.1),
        ("bfloat16", 1e39),
        ("bfloat16", "NaN"),
        ("bfloat16", "Infinity"),
        ("bfloat16", "-Infinity"),
        ("bfloat16", "0x7fc1"),
        ("bfloat16", "0xffc0"),
        ("float8_e4m3fn", 460.0),
        ("float8_e4m3fn", 1000.0),
        ("float8_e4m3fn", "Infinity"),  # no infinities: both libraries make it NaN
        ("float8_e4m3fn", "-Infinity"),
        ("float8_e4m3fn", "0xff"),
        ("float8_e5m2", 3.3),
        ("float8_e5m2", "0x7d"),
        ("float8_e5m2", "-Infinity"),
    ],
)
def test_fill_value_parsing_agrees_with_tensorstore(tmp_path: Path, name: str, fill: Any) -> None:
    path = tmp_path / "a"
    arr = ts_open(path, metadata=_metadata(name, [4], [4], [4], fill), create=True)
    ts_bits = int(bits(np.asarray(arr.fill_value).reshape(1))[0])
    ours = CLASSES[name]().from_json_scalar(fill, zarr_format=3)
    assert int(bits(np.asarray(ours).reshape(1))[0]) == ts_bits
    # ... and what tensorstore wrote back into zarr.json reads the same in zarr-python.
    assert (bits(zarr.open_array(str(path))[...]) == ts_bits).all()


# -- (b) arrays laid out the way distckpt writes them -----------------------------------------


def _metadata(
    name: str, shape: list[int], shard: list[int], inner: list[int], fill: Any
) -> dict[str, Any]:
    crc_codecs = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": shape,
        "data_type": name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": shard}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
        "fill_value": fill,
        "codecs": [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": inner,
                    "codecs": crc_codecs,
                    "index_codecs": crc_codecs,
                    "index_location": "end",
                },
            }
        ],
        "attributes": {},
    }


def _crc(data: bytes) -> bytes:
    return data + struct.pack("<I", google_crc32c.value(data))


def write_by_hand(
    path: Path, name: str, data: np.ndarray, shard: tuple[int, ...], inner: tuple[int, ...]
) -> None:
    """Write metadata and shard files directly; inner chunks wholly outside the array are
    marked empty (offset and nbytes 2**64-1) in the shard index, partial ones zero-padded."""
    dtype = dd.numpy_dtype(name)
    path.mkdir(parents=True)
    meta = _metadata(name, list(data.shape), list(shard), list(inner), dd.fill_value(name))
    (path / "zarr.json").write_text(json.dumps(meta))
    n_shards = [-(-s // c) for s, c in zip(data.shape, shard, strict=True)]
    per_shard = [s // c for s, c in zip(shard, inner, strict=True)]
    for shard_idx in np.ndindex(*n_shards):
        body, index = b"", []
        for inner_idx in np.ndindex(*per_shard):
            start = [
                i * s + j * c for i, s, j, c in zip(shard_idx, shard, inner_idx, inner, strict=True)
            ]
            if any(st >= n for st, n in zip(start, data.shape, strict=True)):
                index += [EMPTY, EMPTY]
                continue
            part = data[tuple(slice(st, st + c) for st, c in zip(start, inner, strict=True))]
            block = np.zeros(inner, dtype=dtype)
            block[tuple(slice(0, n) for n in part.shape)] = part
            raw = _crc(block.astype(dtype.newbyteorder("<")).tobytes())
            index += [len(body), len(raw)]
            body += raw
        key = "c." + ".".join(map(str, shard_idx))
        (path / key).write_bytes(body + _crc(struct.pack(f"<{len(index)}Q", *index)))


def _awkward_values(name: str, shape: tuple[int, int]) -> np.ndarray:
    """Random values plus every bit pattern of the type, in a non-chunk-aligned shape."""
    n = int(np.prod(shape))
    rng = np.random.default_rng(0)
    if name in ML_TYPES:
        pool = bits(every_value(name).reshape(-1))
        u = rng.choice(pool, size=n)
        u[: min(n, pool.size)] = pool[: min(n, pool.size)]
        return u.view(ML_TYPES[name]).reshape(shape)
    return (rng.standard_normal(n) * 100).astype(dd.numpy_dtype(name)).reshape(shape)


@pytest.mark.parametrize("name", NAMES + ["float32", "int8", "bool", "complex64", "complex128"])
def test_hand_written_distckpt_layout(tmp_path: Path, name: str) -> None:
    shape = (37, 21)  # edge shards hold inner chunks wholly outside the array
    data = _awkward_values(name, shape)
    if name.startswith("complex"):
        data = data + 1j * data[::-1]
    data = data.astype(dd.numpy_dtype(name))
    path = tmp_path / name
    write_by_hand(path, name, data, shard=(16, 16), inner=(4, 8))
    # The edge shard really does hold index entries marked empty.
    index = struct.unpack("<16Q", (path / "c.2.1").read_bytes()[-(16 * 8 + 4) : -4])
    assert index.count(EMPTY) == 2 * 6  # 8 inner chunks, 2 of them overlap the array

    back = zarr.open_array(str(path))[...]
    assert back.dtype == dd.numpy_dtype(name)
    assert back.tobytes() == data.tobytes()
    got = ts_read(path)
    assert got.dtype == dd.numpy_dtype(name)
    assert got.tobytes() == data.tobytes()


@pytest.mark.parametrize("name", NAMES + ["bool", "complex64", "complex128"])
def test_tensorstore_written_distckpt_layout(tmp_path: Path, name: str) -> None:
    shape = (37, 21)
    data = _awkward_values(name, shape)
    if name.startswith("complex"):
        data = data + 1j * data[::-1]
    data = data.astype(dd.numpy_dtype(name))
    path = tmp_path / name
    meta = _metadata(name, list(shape), [16, 16], [4, 8], dd.fill_value(name))
    arr = ts_open(path, metadata=meta, create=True)
    arr.write(data).result()
    written = json.loads((path / "zarr.json").read_text())
    assert written["data_type"] == name
    assert written["fill_value"] == dd.fill_value(name)

    back = zarr.open_array(str(path))[...]
    assert back.dtype == dd.numpy_dtype(name)
    assert back.tobytes() == data.tobytes()


# -- registry behaviour -----------------------------------------------------------------------


def test_register_is_idempotent() -> None:
    register()
    before = dict(data_type_registry.contents)
    for _ in range(3):
        register()
    assert data_type_registry.contents == before
    for name, cls in CLASSES.items():
        assert data_type_registry.get(name) is cls
        assert parse_dtype(name, zarr_format=3) == cls()
        assert get_data_type_from_native_dtype(np.dtype(ML_TYPES[name])) == cls()
    assert set(zarr_dtypes.__all__) >= {"register"}


@pytest.mark.parametrize(
    ("native", "expected"),
    [
        (np.dtype("float32"), Float32()),
        (np.dtype("int8"), Int8()),
        (np.dtype("bool"), Bool()),
        (np.dtype("V2"), RawBytes(length=2)),
        (np.dtype("V1"), RawBytes(length=1)),
    ],
)
def test_ordinary_dtypes_unaffected(tmp_path: Path, native: np.dtype[Any], expected: Any) -> None:
    assert get_data_type_from_native_dtype(native) == expected
    assert parse_dtype(expected.to_json(zarr_format=3), zarr_format=3) == expected
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, size=10 * native.itemsize, dtype=np.uint8).view(native)
    if native.kind == "b":
        data = data.view(np.uint8) % 2 == 1
    path = tmp_path / "a"
    arr = zarr.create_array(str(path), shape=data.shape, dtype=native, chunks=(4,))
    arr[...] = data
    back = zarr.open_array(str(path))
    assert back.metadata.data_type == expected
    assert back[...].dtype == native
    assert back[...].tobytes() == data.tobytes()


def test_zarr_format_2_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="zarr format 3"):
        zarr.create_array(str(tmp_path / "a"), shape=(3,), dtype=ml_dtypes.bfloat16, zarr_format=2)


# -- (c) compressed arrays, as distckpt writes them -------------------------------------------


def write_compressed(
    path: Path,
    name: str,
    data: np.ndarray,
    shard: tuple[int, ...],
    inner: tuple[int, ...],
    choice: str,
) -> None:
    """An array written through distckpt's own shard writer, one file per shard, each
    inner chunk compressed (edge shards: absent and zero-padded inner chunks)."""
    from distckpt.format import codecs, shard_io, zarr_meta
    from distckpt.storage.posix import PosixStore

    codec = codecs.make(choice, data.dtype.itemsize)
    assert codec is not None
    path.mkdir(parents=True)
    meta = zarr_meta.array_meta(data.shape, name, shard, inner, compressor=codec.to_json())
    (path / "zarr.json").write_bytes(zarr_meta.dumps(meta))
    store = PosixStore(path)
    n_shards = [-(-s // c) for s, c in zip(data.shape, shard, strict=True)]
    for idx in np.ndindex(*n_shards):
        box = tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, shard, strict=True))
        part = np.ascontiguousarray(data[box])
        key = zarr_meta.chunk_key(idx)
        store.prepare([key])
        shard_io.write_sharded(store, key, part, shard, inner, codec=codec, fsync=False)


@pytest.mark.parametrize("choice", ["zstd", "blosc-zstd", "blosc-lz4"])
@pytest.mark.parametrize("name", NAMES + ["float32", "int8", "bool", "complex128"])
def test_compressed_distckpt_layout_reads_in_both(tmp_path: Path, name: str, choice: str) -> None:
    shape = (37, 21)
    data = _awkward_values(name, shape)
    if name.startswith("complex"):
        data = data + 1j * data[::-1]
    data = data.astype(dd.numpy_dtype(name))
    data[:8] = data[0]  # some runs, so compression has something to do
    path = tmp_path / name
    write_compressed(path, name, data, shard=(16, 16), inner=(4, 8), choice=choice)
    codecs = json.loads((path / "zarr.json").read_text())["codecs"][0]["configuration"]["codecs"]
    assert [c["name"] for c in codecs] == [
        "bytes",
        "zstd" if choice == "zstd" else "blosc",
        "crc32c",
    ]

    back = zarr.open_array(str(path))[...]
    assert back.dtype == dd.numpy_dtype(name)
    assert back.tobytes() == data.tobytes()
    got = ts_read(path)
    assert got.dtype == dd.numpy_dtype(name)
    assert got.tobytes() == data.tobytes()
    # a region across shard and inner chunk borders
    region = (slice(3, 30), slice(5, 19))
    assert zarr.open_array(str(path))[region].tobytes() == data[region].tobytes()
    assert ts_open(path)[region].read().result().tobytes() == data[region].tobytes()


@pytest.mark.parametrize("choice", ["zstd", "blosc-zstd", "blosc-lz4"])
def test_compressed_checkpoint_array_reads_in_both(tmp_path: Path, choice: str) -> None:
    import torch

    import distckpt
    from distckpt.comm import SingleComm

    weight = torch.arange(300 * 70, dtype=torch.float32).reshape(300, 70) % 13
    emb = (torch.arange(200 * 40) % 5).to(torch.bfloat16).reshape(200, 40)
    state = {"net": {"weight": weight, "emb": emb}}
    ckpt = tmp_path / "ck"
    distckpt.save(state, ckpt, SingleComm(), small_bytes=0, inner_bytes=4096, compression=choice)
    want = {
        "net/weight": weight.numpy(),
        "net/emb": emb.view(torch.int16).numpy().view(ml_dtypes.bfloat16),
    }
    for name, values in want.items():
        for got in (zarr.open_array(str(ckpt / name))[...], ts_read(ckpt / name)):
            assert got.dtype == values.dtype
            assert got.tobytes() == values.tobytes(), name
