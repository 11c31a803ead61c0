"""Small Python values stored in the checkpoint index as typed JSON.

Plain JSON loses types (tuples become lists, dict keys become strings, NaN is not JSON).
Values are therefore encoded with a tag where JSON alone would lose something::

    >>> encode((1, float("nan"), {2: None}))
    {'tuple': [1, {'float': 'nan'}, {'dict': [[2, None]]}]}
    >>> decode(encode((1, 2.5)))
    (1, 2.5)

Only ``None``, ``bool``, ``int``, ``float``, ``str`` and lists, tuples and dicts of them
are accepted; anything else raises :class:`~distckpt.errors.UnsupportedValueError`.
Nothing is ever unpickled.
"""

from __future__ import annotations

import math
from typing import Any

from distckpt.errors import UnsupportedValueError

JSON = Any

SCALARS = (type(None), bool, int, float, str)


def is_value(obj: object) -> bool:
    """Whether ``obj`` is a value distckpt stores in the index (checked shallowly)."""
    return isinstance(obj, (*SCALARS, list, tuple, dict))


def encode(value: object, name: str = "") -> JSON:
    """Typed JSON for ``value``; ``name`` only serves the error message."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, list):
        return [encode(v, name) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [encode(v, name) for v in value]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {"map": {k: encode(v, name) for k, v in value.items()}}
        for k in value:
            if not isinstance(k, (*SCALARS, tuple)):
                raise UnsupportedValueError(
                    f"variable {name or 'value'!r}: dict key {k!r} of type {type(k).__name__} "
                    "cannot be stored"
                )
        return {"dict": [[encode(k, name), encode(v, name)] for k, v in value.items()]}
    where = f"variable {name!r}: " if name else ""
    raise UnsupportedValueError(
        f"{where}cannot store a {type(value).__module__}.{type(value).__qualname__}; distckpt "
        "stores tensors, Shard, PerRank, and None/bool/int/float/str with lists, tuples and dicts "
        "of them"
    )


def decode(data: JSON) -> Any:
    """The Python value that :func:`encode` turned into ``data``."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode(v) for v in data]
    if isinstance(data, dict) and len(data) == 1:
        ((tag, body),) = data.items()
        if tag == "float":
            return float(body)
        if tag == "tuple":
            return tuple(decode(v) for v in body)
        if tag == "map":
            return {k: decode(v) for k, v in body.items()}
        if tag == "dict":
            return {decode(k): decode(v) for k, v in body}
    raise ValueError(f"malformed stored value {data!r}")
