"""Small Python values stored in the checkpoint index as typed JSON.

Plain JSON loses types (tuples become lists, dict keys become strings, NaN is not JSON).
Values are therefore encoded with a tag where JSON alone would lose something::

    >>> encode((1, float("nan"), {2: None}))
    {'tuple': [1, {'float': 'nan'}, {'dict': [[2, None]]}]}
    >>> decode(encode((1, 2.5)))
    (1, 2.5)

Only ``None``, ``bool``, ``int``, ``float``, ``str`` and lists, tuples and dicts of them
are accepted; anything else raises :class:`~distckpt.errors.UnsupportedValueError`, unless
the caller opts in with ``allow_pickle=True``: the object is then stored pickled
(``{"pickle": <base64>}``), and reading it back needs ``allow_pickle=True`` again, since
unpickling runs code from the checkpoint. Nothing is unpickled otherwise.
"""

from __future__ import annotations

import base64
import math
import pickle
from typing import Any

from distckpt.errors import UnsupportedValueError

JSON = Any

SCALARS = (type(None), bool, int, float, str)


def is_value(obj: object) -> bool:
    """Whether ``obj`` is a value distckpt stores in the index (checked shallowly)."""
    return isinstance(obj, (*SCALARS, list, tuple, dict))


def encode(value: object, name: str = "", *, allow_pickle: bool = False) -> JSON:
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
        return [encode(v, name, allow_pickle=allow_pickle) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [encode(v, name, allow_pickle=allow_pickle) for v in value]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {
                "map": {k: encode(v, name, allow_pickle=allow_pickle) for k, v in value.items()}
            }
        for k in value:
            if not isinstance(k, (*SCALARS, tuple)) and not allow_pickle:
                raise UnsupportedValueError(
                    f"variable {name or 'value'!r}: dict key {k!r} of type {type(k).__name__} "
                    "cannot be stored"
                )
        return {
            "dict": [
                [
                    encode(k, name, allow_pickle=allow_pickle),
                    encode(v, name, allow_pickle=allow_pickle),
                ]
                for k, v in value.items()
            ]
        }
    if allow_pickle:
        return {"pickle": base64.b64encode(pickle.dumps(value, protocol=4)).decode("ascii")}
    where = f"variable {name!r}: " if name else ""
    raise UnsupportedValueError(
        f"{where}cannot store a {type(value).__module__}.{type(value).__qualname__}; distckpt "
        "stores tensors, Shard, PerRank, and None/bool/int/float/str with lists, tuples and dicts "
        "of them (pass allow_pickle=True to store other objects pickled)"
    )


def decode(data: JSON, *, allow_pickle: bool = False, name: str = "") -> Any:
    """The Python value that :func:`encode` turned into ``data``.

    A pickled object is unpickled only with ``allow_pickle=True``; otherwise it raises
    :class:`~distckpt.errors.UnsupportedValueError` naming the variable (``name``).
    """
    if data is None or isinstance(data, (bool, int, float, str)):
        return data

    def again(v: JSON) -> Any:
        return decode(v, allow_pickle=allow_pickle, name=name)

    if isinstance(data, list):
        return [again(v) for v in data]
    if isinstance(data, dict) and len(data) == 1:
        ((tag, body),) = data.items()
        if tag == "float":
            return float(body)
        if tag == "tuple":
            return tuple(again(v) for v in body)
        if tag == "map":
            return {k: again(v) for k, v in body.items()}
        if tag == "dict":
            return {again(k): again(v) for k, v in body}
        if tag == "pickle":
            if not allow_pickle:
                where = f"variable {name!r}" if name else "a stored value"
                raise UnsupportedValueError(
                    f"{where} holds a pickled Python object; unpickling runs code from the "
                    "checkpoint, so it needs allow_pickle=True (only for checkpoints you trust)"
                )
            return pickle.loads(base64.b64decode(body))
    raise ValueError(f"malformed stored value {data!r}")
