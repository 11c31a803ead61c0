"""zarr v3 metadata documents (``zarr.json``) for the arrays and groups distckpt writes.

distckpt writes these documents and the chunk files itself, which is faster than going
through zarr-python's per-array API and keeps every rank's writes to its own files; the
result is an ordinary zarr v3 hierarchy that zarr-python and tensorstore open.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from distckpt import dtypes

ZARR_JSON = "zarr.json"
SEPARATOR = "."

_BYTES = {"name": "bytes", "configuration": {"endian": "little"}}
_CRC = {"name": "crc32c"}


def chunk_key(coord: Sequence[int]) -> str:
    """The chunk (or shard) file name for a grid coordinate: ``c.1.0`` (``c`` for 0-d)."""
    return SEPARATOR.join(["c", *(str(c) for c in coord)])


def array_meta(
    shape: Sequence[int],
    dtype: str,
    chunk_shape: Sequence[int],
    inner: Sequence[int] | None,
    attributes: dict[str, Any] | None = None,
    compressor: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """An array's metadata: ``inner`` None for plain chunks, else the sharding codec's
    inner chunk shape (``chunk_shape`` is then the shard shape). ``compressor``, the JSON
    of a :mod:`distckpt.format.codecs` codec, compresses each inner chunk before its
    crc32c: inner codecs ``[bytes, compressor, crc32c]``."""
    if inner is None:
        if compressor is not None:
            raise ValueError("plain chunks are stored uncompressed")
        codecs: list[dict[str, Any]] = [_BYTES, _CRC]
    else:
        inner_codecs = [_BYTES, _CRC] if compressor is None else [_BYTES, compressor, _CRC]
        codecs = [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": list(inner),
                    "codecs": inner_codecs,
                    "index_codecs": [_BYTES, _CRC],
                    "index_location": "end",
                },
            }
        ]
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": SEPARATOR}},
        "fill_value": dtypes.fill_value(dtype),
        "codecs": codecs,
        "attributes": attributes or {},
    }


def group_meta(attributes: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}


def dumps(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
