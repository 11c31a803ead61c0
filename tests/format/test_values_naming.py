"""Typed JSON values and the name-to-zarr-path escaping rule."""

from __future__ import annotations

import io
import json
import math

import pytest

from distckpt.errors import CorruptCheckpointError, UnsupportedValueError
from distckpt.naming import escape_key, join_keys, unescape_key, zarr_path
from distckpt.values import MAX_DEPTH, decode, encode


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -(2**70),
        1.5,
        "s",
        [],
        (),
        {},
        [1, (2, 3)],
        {"a": {"b": [None]}},
        {1: "x", (1, 2): [3.0]},
        (float("inf"), -float("inf")),
        {"k": (1,)},
        b"\x00\xffbytes",
        {"blob": b""},
    ],
)
def test_values_round_trip_with_types(value):
    encoded = json.loads(json.dumps(encode(value), allow_nan=False))
    back = decode(encoded)
    assert back == value and type(back) is type(value)


def test_nan_round_trips():
    back = decode(json.loads(json.dumps(encode([float("nan")]), allow_nan=False)))
    assert math.isnan(back[0])


def test_bytesio_round_trips_its_contents():
    back = decode(json.loads(json.dumps(encode({"loader": io.BytesIO(b"pos=17")}))))
    assert isinstance(back["loader"], io.BytesIO) and back["loader"].getvalue() == b"pos=17"


@pytest.mark.parametrize("value", [{1, 2}, object(), bytearray(b"x"), {frozenset(): 1}])
def test_unsupported_values_are_refused_by_name(value):
    with pytest.raises(UnsupportedValueError, match="opt/x"):
        encode(value, "opt/x")


def test_decode_rejects_malformed():
    malformed = (
        {"unknown-tag": 1},
        {"float": "7"},
        {"dict": [[[1], 2]]},
        {"tuple": 5},
        {"bytes": "not base64!"},
        {"bytesio": 5},
    )
    for stored in malformed:
        with pytest.raises(CorruptCheckpointError, match="malformed stored value"):
            decode(stored, name="v")


def test_values_nest_at_most_max_depth():
    deep: object = 1
    for _ in range(MAX_DEPTH):
        deep = [deep]
    assert decode(encode(deep)) == deep
    with pytest.raises(UnsupportedValueError, match="nested"):
        encode([deep])
    with pytest.raises(CorruptCheckpointError, match="nested"):
        decode([encode(deep)])


def test_names_and_paths():
    assert join_keys(["net", "l1.weight"]) == "net/l1.weight"
    assert join_keys(["a/b", "50%"]) == "a%2Fb/50%25"
    assert zarr_path("net/l1.weight") == "net/l1.weight"
    assert zarr_path("zarr.json/x") == "%7Aarr.json/x"
    assert zarr_path("__init__/.hidden/..") == "%5F_init__/%2Ehidden/%2E."
    assert zarr_path("a//b") == "a/%00/b"


@pytest.mark.parametrize("key", ["plain", "a/b", "100%", "%2F", "a%/b/%25", ""])
def test_an_escaped_key_unescapes_to_itself(key):
    assert "/" not in escape_key(key)
    assert unescape_key(escape_key(key)) == key


def test_a_binary_value_makes_format_version_4(tmp_path):
    """A checkpoint holding bytes is format version 4, which a distckpt reading versions
    up to 3 refuses by name instead of calling the value malformed; one without keeps its
    version."""
    import torch

    import distckpt
    from distckpt.format import index

    distckpt.save({"w": torch.ones(2), "r": distckpt.PerRank(b"\x00")}, tmp_path / "b")
    distckpt.save({"w": torch.ones(2), "n": 1}, tmp_path / "plain")
    assert index.read_index(tmp_path / "b")["format_version"] == 4
    assert index.read_index(tmp_path / "plain")["format_version"] == 1
