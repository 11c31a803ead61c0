"""Small Python values stored in the checkpoint index as typed JSON.

Plain JSON loses types (tuples become lists, dict keys become strings, NaN is not JSON).
Values are therefore encoded with a tag where JSON alone would lose something::

    >>> encode((1, float("nan"), {2: None}))
    {'tuple': [1, {'float': 'nan'}, {'dict': [[2, None]]}]}
    >>> decode(encode((1, 2.5)))
    (1, 2.5)

Only ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, ``io.BytesIO`` (its whole
contents; ``{"bytes": <base64>}`` and ``{"bytesio": <base64>}``) and lists, tuples and dicts
of them are accepted; anything else raises :class:`~distckpt.errors.UnsupportedValueError`, unless
the caller opts in with ``allow_pickle=True``: the object is then stored pickled
(``{"pickle": <base64>}``), and reading it back needs ``allow_pickle=True`` again, since
unpickling runs code from the checkpoint. Nothing is unpickled otherwise.
"""

from __future__ import annotations

import base64
import io
import math
import pickle
from typing import Any

from distckpt.errors import CorruptCheckpointError, UnsupportedValueError

JSON = Any

SCALARS = (type(None), bool, int, float, str)


#: Binary values, stored base64-encoded in the index (no pickle).
BINARY = (bytes, io.BytesIO)


def is_value(obj: object) -> bool:
    """Whether ``obj`` is a value distckpt stores in the index (checked shallowly)."""
    return isinstance(obj, (*SCALARS, *BINARY, list, tuple, dict))


#: Containers nested deeper than this are refused when saved and corrupt when read: a
#: deeper stored value would exhaust the reader's stack.
MAX_DEPTH = 100


def encode(value: object, name: str = "", *, allow_pickle: bool = False, depth: int = 0) -> JSON:
    """Typed JSON for ``value``; ``name`` only serves the error message."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, bytes):
        return {"bytes": base64.b64encode(value).decode("ascii")}
    if isinstance(value, io.BytesIO):
        return {"bytesio": base64.b64encode(value.getvalue()).decode("ascii")}
    if isinstance(value, (list, tuple, dict)) and depth >= MAX_DEPTH:
        raise UnsupportedValueError(
            f"variable {name or 'value'!r}: containers nested more than {MAX_DEPTH} deep "
            "cannot be stored"
        )

    def again(v: object) -> JSON:
        return encode(v, name, allow_pickle=allow_pickle, depth=depth + 1)

    if isinstance(value, list):
        return [again(v) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [again(v) for v in value]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {"map": {k: again(v) for k, v in value.items()}}
        for k in value:
            if not isinstance(k, (*SCALARS, tuple)) and not allow_pickle:
                raise UnsupportedValueError(
                    f"variable {name or 'value'!r}: dict key {k!r} of type {type(k).__name__} "
                    "cannot be stored"
                )
        return {"dict": [[again(k), again(v)] for k, v in value.items()]}
    if allow_pickle:
        return {"pickle": base64.b64encode(pickle.dumps(value, protocol=4)).decode("ascii")}
    where = f"variable {name!r}: " if name else ""
    raise UnsupportedValueError(
        f"{where}cannot store a {type(value).__module__}.{type(value).__qualname__}; distckpt "
        "stores tensors, Shard, PerRank, and None/bool/int/float/str/bytes/BytesIO with lists, "
        "tuples and dicts of them (pass allow_pickle=True to store other objects pickled)"
    )


def has_binary(data: JSON) -> bool:
    """Whether the stored value ``data`` holds a binary value (which older distckpt, of
    format versions up to 3, cannot read)."""
    if isinstance(data, list):
        return any(has_binary(v) for v in data)
    if not isinstance(data, dict) or len(data) != 1:
        return False
    ((tag, body),) = data.items()
    if tag in ("bytes", "bytesio"):
        return True
    if tag == "map" and isinstance(body, dict):
        return any(has_binary(v) for v in body.values())
    if tag in ("tuple", "dict") and isinstance(body, list):
        return any(has_binary(v) for v in body)
    return False


def decode(data: JSON, *, allow_pickle: bool = False, name: str = "") -> Any:
    """The Python value that :func:`encode` turned into ``data``.

    A pickled object is unpickled only with ``allow_pickle=True``; otherwise it raises
    :class:`~distckpt.errors.UnsupportedValueError` naming the variable (``name``). A
    malformed stored value (or one nested over :data:`MAX_DEPTH` deep) is a
    :class:`~distckpt.errors.CorruptCheckpointError`.
    """
    return _Decoder(name, "load" if allow_pickle else "refuse").value(data, 0)


def show(data: JSON, limit: int = 80) -> str:
    """The Python value that ``data`` holds, as ``repr`` writes it, cut to ``limit``
    characters, for a message; nothing is unpickled (a pickled object shows as
    ``<pickled object>``), and a malformed ``data`` shows as it is stored."""
    try:
        text = repr(_Decoder("", "show").value(data, 0))
    except (CorruptCheckpointError, RecursionError):
        text = repr(data)
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."


class _Pickled:
    """A pickled object in a value shown in a message (see :func:`show`)."""

    def __repr__(self) -> str:
        return "<pickled object>"


def check(data: JSON, name: str = "") -> None:
    """Check that ``data`` is a well-formed stored value, without unpickling anything
    (raises :class:`~distckpt.errors.CorruptCheckpointError` naming ``name``)."""
    _Decoder(name, "skip").value(data, 0)


class _Decoder:
    """Typed JSON to Python values; ``pickled``: "load", "refuse", "skip" (check only) or
    "show" (a placeholder, see :func:`show`)."""

    def __init__(self, name: str, pickled: str) -> None:
        self.name = name
        self.pickled = pickled

    def corrupt(self, what: str) -> CorruptCheckpointError:
        where = f"variable {self.name!r}" if self.name else "a stored value"
        return CorruptCheckpointError(f"{where}: malformed stored value ({what})")

    def value(self, data: JSON, depth: int) -> Any:
        if data is None or isinstance(data, (bool, int, float, str)):
            return data
        if depth >= MAX_DEPTH:
            raise self.corrupt(f"nested more than {MAX_DEPTH} deep")
        if isinstance(data, list):
            return [self.value(v, depth + 1) for v in data]
        if not isinstance(data, dict) or len(data) != 1:
            raise self.corrupt(f"{type(data).__name__} {data!r:.60}")
        ((tag, body),) = data.items()
        if tag == "float":
            if body not in ("nan", "inf", "-inf"):
                raise self.corrupt(f"float {body!r:.60}")
            return float(body)
        if tag == "tuple" and isinstance(body, list):
            return tuple(self.value(v, depth + 1) for v in body)
        if tag == "map" and isinstance(body, dict):
            return {k: self.value(v, depth + 1) for k, v in body.items()}
        if tag == "dict" and isinstance(body, list):
            out = {}
            for pair in body:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise self.corrupt(f"dict item {pair!r:.60}")
                key = self.value(pair[0], depth + 1)
                try:
                    out[key] = self.value(pair[1], depth + 1)
                except TypeError:  # a list or dict as a key
                    raise self.corrupt(f"dict key {pair[0]!r:.60}") from None
            return out
        if tag in ("bytes", "bytesio") and isinstance(body, str):
            raw = self.base64(body, tag)
            return raw if tag == "bytes" else io.BytesIO(raw)
        if tag == "pickle" and isinstance(body, str):
            return self.unpickle(body)
        raise self.corrupt(f"{tag!r:.60} of {type(body).__name__}")

    def unpickle(self, body: str) -> Any:
        if self.pickled == "skip":
            return None
        if self.pickled == "show":
            return _Pickled()
        if self.pickled == "refuse":
            where = f"variable {self.name!r}" if self.name else "a stored value"
            raise UnsupportedValueError(
                f"{where} holds a pickled Python object; unpickling runs code from the "
                "checkpoint, so it needs allow_pickle=True (only for checkpoints you trust)"
            )
        return pickle.loads(self.base64(body, "pickle"))

    def base64(self, body: str, what: str) -> bytes:
        try:
            return base64.b64decode(body, validate=True)
        except ValueError:
            raise self.corrupt(f"{what} that is not base64") from None
