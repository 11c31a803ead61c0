"""The index's published JSON Schema (distckpt/format/index.schema.json): a valid draft
2020-12 schema, followed by every index distckpt writes, and read by distckpt's own
validator exactly as the reference implementation (jsonschema) reads it."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import distckpt
from distckpt.errors import CorruptCheckpointError
from distckpt.format import index, schema, stored
from distckpt.storage.posix import PosixStore

REFERENCE = jsonschema.Draft202012Validator(schema.index_schema())


def reference_ok(doc: Any) -> bool:
    return REFERENCE.is_valid(doc)


def test_the_schema_is_a_draft_2020_12_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(schema.index_schema())


def written(tmp_path: Path) -> list[dict[str, Any]]:
    """Root documents of checkpoints holding every kind of entry distckpt writes."""
    torch.manual_seed(0)
    state = {
        "net": {"w": torch.randn(400, 200), "b": torch.randn(8), "h": torch.randn(4).half()},
        "bf": torch.randn(6).bfloat16(),
        "flags": torch.tensor([True, False]),
        "step": 7,
        "values": {"t": (1, 2.5, None), 3: "x", "nan": float("nan"), "l": [True, "s"]},
        "blob": b"\x00\xff",
        "stream": io.BytesIO(b"abc"),
        "rng": distckpt.PerRank(torch.get_rng_state()),
        "seed": distckpt.PerRank(5),
    }
    distckpt.save(state, tmp_path / "a")
    distckpt.save(state, tmp_path / "z", compression="zstd")
    state["net"]["b"] += 1
    distckpt.save(state, tmp_path / "inc", base=tmp_path / "a")
    docs = [json.loads((tmp_path / n / "zarr.json").read_text()) for n in ("a", "z", "inc")]
    # A regular entry of many shards stores its columns as base64 (past 64 shards).
    wide = copy.deepcopy(docs[0])
    entry = wide["attributes"]["distckpt"]["variables"]["net/w"]
    entry["chunks"] = [3, 200]
    entry["crc"] = stored.column(np.arange(100, dtype=np.uint32))
    entry["size"] = stored.column(np.full(100, 4096, dtype=np.uint64))
    docs.append(wide)
    return docs


def test_every_index_written_follows_the_schema(tmp_path: Path) -> None:
    docs = written(tmp_path)
    kinds = {e["kind"] for d in docs for e in d["attributes"]["distckpt"]["variables"].values()}
    assert kinds == {"tensor", "value", "per_rank"}
    assert any("reused" in json.dumps(d) for d in docs)  # the incremental save's
    assert any('"codec"' in json.dumps(d) for d in docs)
    for doc in docs:
        assert reference_ok(doc), next(REFERENCE.iter_errors(doc)).message
        assert schema.problem(doc) is None


#: Damage the schema states, each with where distckpt's validator names it.
DAMAGED = [
    (lambda d: d.update(zarr_format=2), "/zarr_format"),
    (lambda d: d["attributes"]["distckpt"].update(format_version=0), "/format_version"),
    (lambda d: d["attributes"]["distckpt"].update(checksum="crc32c:XYZ"), "/checksum"),
    (lambda d: d["attributes"]["distckpt"].pop("variables"), "'variables' is missing"),
    (lambda d: var(d, "net/b").update(kind="tensors"), "/variables/net~1b/kind"),
    (lambda d: var(d, "net/b").update(dtype="float128"), "/variables/net~1b/dtype"),
    (lambda d: var(d, "net/b").update(shape=[8, -1]), "/variables/net~1b/shape/1"),
    (lambda d: var(d, "net/b").update(shape=[1] * 65), "/variables/net~1b/shape"),
    (lambda d: var(d, "net/b")["pieces"][0].update(file="../../etc/passwd"), "/pieces/0/file"),
    (lambda d: var(d, "net/b")["pieces"][0].update(file="/abs"), "/pieces/0/file"),
    (lambda d: var(d, "net/b")["pieces"][0].update(crc=2**32), "/pieces/0/crc"),
    (lambda d: var(d, "net/b")["pieces"][0].update(box=[[0]]), "/pieces/0/box"),
    (lambda d: var(d, "net/b")["pieces"][0].update(digest="xyz"), "/pieces/0/digest"),
    (lambda d: var(d, "net/b").pop("pieces"), "'pieces' is missing"),
    (lambda d: var(d, "net/w").pop("crc"), "'crc' is missing"),
    (lambda d: var(d, "net/w").update(crc="not base64!"), "/variables/net~1w/crc"),
    (lambda d: var(d, "step").update(value={"float": "NaN"}), "/variables/step/value"),
    (lambda d: var(d, "step").update(value={"tuple": [], "map": {}}), "/variables/step/value"),
    (lambda d: var(d, "step").update(value={"set": [1]}), "/variables/step/value"),
    (lambda d: var(d, "seed")["ranks"].update({"01": {"kind": "value", "value": 1}}), "ranks"),
    (lambda d: var(d, "seed")["ranks"].update({"1": {"kind": "per_rank"}}), "/ranks/1/kind"),
]


def var(doc: dict[str, Any], name: str) -> dict[str, Any]:
    entry: dict[str, Any] = doc["attributes"]["distckpt"]["variables"][name]
    return entry


@pytest.mark.parametrize("damage,where", DAMAGED, ids=[w for _, w in DAMAGED])
def test_damage_is_named_and_refused(tmp_path: Path, damage: Any, where: str) -> None:
    doc = written(tmp_path)[0]
    damage(doc)
    assert not reference_ok(doc)
    found = schema.problem(doc)
    assert found is not None and where in found, found
    # A reader refuses it (the seal is skipped: an attacker recomputes it).
    if doc["attributes"]["distckpt"].get("checksum") != "crc32c:XYZ":
        doc["attributes"]["distckpt"].pop("checksum", None)
    with pytest.raises(CorruptCheckpointError):
        index.parse_index(json.dumps(doc).encode(), PosixStore(tmp_path / "a"))


def test_a_deep_value_is_refused_not_a_crash() -> None:
    value: Any = 1
    for _ in range(3000):
        value = [value]
    doc = {
        "zarr_format": 3,
        "node_type": "group",
        "attributes": {
            "distckpt": {
                "format": "distckpt",
                "format_version": 1,
                "variables": {"v": {"kind": "value"}},
            }
        },
    }
    doc["attributes"]["distckpt"]["variables"]["v"]["value"] = value
    assert "deeper" in (schema.problem(doc) or "")


def test_a_keyword_the_validator_does_not_read_is_an_error() -> None:
    with pytest.raises(ValueError, match="uniqueItems"):
        schema.Compiler({}).compile({"type": "array", "uniqueItems": True})


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.sampled_from(["tensor", "value", "per_rank", "float32", "nan"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "kind",
                    "value",
                    "ranks",
                    "0",
                    "1",
                    "dtype",
                    "shape",
                    "pieces",
                    "chunks",
                    "float",
                    "tuple",
                    "map",
                    "dict",
                    "bytes",
                    "x",
                ]
            ),
            inner,
            max_size=3,
        )
    ),
    max_leaves=12,
)


def paths(node: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [at]
    if isinstance(node, dict):
        for k, v in node.items():
            found += paths(v, (*at, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += paths(v, (*at, i))
    return found


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return written(tmp_path_factory.mktemp("schema"))[0]


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_the_validator_agrees_with_the_reference(
    sample: dict[str, Any], data: st.DataObject
) -> None:
    """Any node of a written index replaced by any JSON: distckpt's validator and
    jsonschema agree on whether the document follows the schema."""
    doc = copy.deepcopy(sample)
    at = data.draw(st.sampled_from(paths(doc)[1:]))
    parent = doc
    for key in at[:-1]:
        parent = parent[key]
    parent[at[-1]] = data.draw(JSON)
    assert (schema.problem(doc) is None) == reference_ok(doc)
