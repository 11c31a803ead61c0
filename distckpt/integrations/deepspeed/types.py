"""The objects DeepSpeed puts in its checkpoint dicts, as typed values of a closed table.

Besides tensors and plain values, DeepSpeed's dicts hold a few objects: ``torch.Size``
(``param_shapes``), ``torch.dtype`` and ``torch.device``, the ZeRO stage
(``ZeroStageEnum``), ``fragment_address`` dataclasses (``param_slice_mappings``) and loss
scalers (``LossScaler``, ``DynamicLossScaler``). Each is stored as a dict that names its
row of :func:`table` under :data:`TYPE_TAG`, with its data as plain values::

    {"__distckpt_type__": "deepspeed.utils.tensor_fragment:fragment_address",
     "fields": {"numel": 30, "start": 2}}

A load rebuilds a typed value only from its row: the class is the one this module
imported, never one named by stored bytes; every stored field must be one of the row's,
with a value of the row's plain type; and the object is made by the row's constructor
(the enum's lookup by value, the dataclass's ``__init__``, or a bare instance whose
``__dict__`` receives the checked fields), none of which opens a file, imports, starts a
process or touches the network. Any other tag, a field the row does not know, or a value
of another type is a :class:`~distckpt.errors.CorruptCheckpointError` naming where the
value lies in the file. A save stores only what a load rebuilds: an object of a type
outside the table is left to :func:`distckpt.save` (refused, or pickled with
``allow_pickle=True``), and a loss scaler with an attribute the row does not know is
refused the same way (:class:`~distckpt.errors.UnsupportedValueError`).

DeepSpeed's classes are imported when the table is first used, so this module imports
without DeepSpeed. The tags are those distckpt has always written (``module:qualname``
of the class), so checkpoints written before the table existed load as they did.
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from distckpt.errors import CorruptCheckpointError, UnsupportedValueError

#: The key of a typed value's dict that names its row of :func:`table`.
TYPE_TAG = "__distckpt_type__"
#: The most dimensions a stored ``torch.Size`` may have (as for a stored tensor).
MAX_DIMS = 64

#: Every torch dtype, by the name ``str(dtype)`` gives it without ``torch.``; read from
#: torch's own namespace when this module is imported, never by a stored name.
DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}
#: A stored device: a type torch knows and an optional index.
DEVICE = re.compile(r"(cpu|cuda|xpu|mps|meta|hpu|npu|mtia|privateuseone)(:[0-9]{1,5})?")


def _corrupt(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {what}")


# -- checks of plain stored values: each returns the value or raises ----------------------


def _integer(value: Any, where: str) -> int:
    if type(value) is not int:
        raise _corrupt(where, f"{value!r:.60} is not an integer")
    return value


def _count(value: Any, where: str) -> int:
    if _integer(value, where) < 0:
        raise _corrupt(where, f"{value!r:.60} is negative")
    return int(value)


def _number(value: Any, where: str) -> float | int:
    if type(value) not in (int, float):
        raise _corrupt(where, f"{value!r:.60} is not a number")
    return value  # type: ignore[no-any-return]


def _boolean(value: Any, where: str) -> bool:
    if type(value) is not bool:
        raise _corrupt(where, f"{value!r:.60} is not a bool")
    return value  # type: ignore[no-any-return]


def _dtype(value: Any, where: str) -> torch.dtype:
    if not isinstance(value, torch.dtype):  # a nested typed value, already rebuilt
        raise _corrupt(where, f"{value!r:.60} is not a torch dtype")
    return value


Check = Callable[[Any, str], Any]


@dataclass(frozen=True)
class Row:
    """One type of :func:`table`: ``form`` is the key of the stored dict that holds its
    data (``value``, ``enum``, ``fields`` or ``attributes``); ``required`` and
    ``optional`` check the fields of ``fields`` and ``attributes`` forms."""

    tag: str
    cls: type
    form: str
    store: Callable[[Any], Any]
    build: Callable[[Any, str], Any]
    required: Mapping[str, Check] | None = None
    optional: Mapping[str, Check] | None = None

    def known(self) -> dict[str, Check]:
        return {**(self.required or {}), **(self.optional or {})}

    def fields(self, stored: Any, where: str) -> dict[str, Any]:
        """``stored`` (a ``fields`` or ``attributes`` dict, values rebuilt) checked
        against the row: every name known, every required one present, each value of its
        type."""
        if not isinstance(stored, dict):
            raise _corrupt(where, f"{self.form} of {self.tag!r} is not a dict")
        known = self.known()
        unknown = sorted(set(stored) - set(known), key=str)
        if unknown:
            raise _corrupt(where, f"{self.tag!r} has no field {unknown[0]!r:.60}")
        missing = sorted(set(self.required or {}) - set(stored))
        if missing:
            raise _corrupt(where, f"{self.tag!r} lacks its field {missing[0]!r}")
        return {k: known[k](v, f"{where}.{k}") for k, v in stored.items()}


def _size(value: Any, where: str) -> torch.Size:
    if not isinstance(value, list) or len(value) > MAX_DIMS:
        raise _corrupt(where, f"a torch.Size of {value!r:.60}")
    dims = [_count(n, where) for n in value]
    if any(n >= 2**63 for n in dims):
        raise _corrupt(where, f"a torch.Size of {value!r:.60}: a dimension over 2**63")
    return torch.Size(dims)


def _dtype_named(value: Any, where: str) -> torch.dtype:
    dtype = DTYPES.get(value) if isinstance(value, str) else None
    if dtype is None:
        raise _corrupt(where, f"not a torch dtype: {value!r:.60}")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _device(value: Any, where: str) -> torch.device:
    if not isinstance(value, str) or not DEVICE.fullmatch(value):
        raise _corrupt(where, f"not a torch device: {value!r:.60}")
    return torch.device(value)


def _member(cls: type[enum.Enum]) -> Callable[[Any, str], enum.Enum]:
    def build(value: Any, where: str) -> enum.Enum:
        for member in cls:
            if type(member.value) is type(value) and member.value == value:
                return member
        raise _corrupt(where, f"{value!r:.60} is no {cls.__name__}")

    return build


def _instance(row_of: Callable[[], Row]) -> Callable[[Any, str], Any]:
    """A bare instance of the row's class whose ``__dict__`` receives the checked fields:
    no ``__init__`` or ``__setattr__`` of the class runs."""

    def build(stored: Any, where: str) -> Any:
        row = row_of()
        made: Any = object.__new__(row.cls)
        made.__dict__.update(row.fields(stored, where))
        return made

    return build


def _dataclass(row_of: Callable[[], Row]) -> Callable[[Any, str], Any]:
    def build(stored: Any, where: str) -> Any:
        row = row_of()
        return row.cls(**row.fields(stored, where))

    return build


_SCALER = {"cur_scale": _number, "dynamic": _boolean}
_DYNAMIC = {
    **_SCALER,
    "cur_iter": _integer,
    "last_overflow_iter": _integer,
    "scale_factor": _number,
    "scale_window": _integer,
    "min_scale": _number,
    "delayed_shift": _integer,
    "cur_hysteresis": _integer,
    "consecutive_hysteresis": _boolean,
}
# Attributes that some DeepSpeed versions have and others do not.
_DYNAMIC_OPTIONAL = {"raise_error_at_min_scale": _boolean, "dtype": _dtype}


def _tag(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


#: What importing DeepSpeed's classes asks for when DeepSpeed is missing.
NEEDS_DEEPSPEED = (
    "distckpt.integrations.deepspeed needs DeepSpeed: pip install 'distckpt[deepspeed]' "
    "(DeepSpeed builds against the installed torch: install torch first)"
)


@functools.cache
def table() -> dict[str, Row]:
    """The closed table: every type a DeepSpeed checkpoint's typed values may name, by
    tag (DeepSpeed's classes are imported on first use; :class:`ImportError` naming the
    extra without DeepSpeed)."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError as exc:
        raise ImportError(NEEDS_DEEPSPEED) from exc
    rows = [
        Row("torch.Size", torch.Size, "value", list, _size),
        Row("torch.dtype", torch.dtype, "value", _dtype_name, _dtype_named),
        Row("torch.device", torch.device, "value", str, _device),
        Row(_tag(ZeroStageEnum), ZeroStageEnum, "enum", lambda e: e.value, _member(ZeroStageEnum)),
        Row(
            _tag(fragment_address),
            fragment_address,
            "fields",
            lambda f: {"numel": f.numel, "start": f.start},
            _dataclass(lambda: table()[_tag(fragment_address)]),
            {"numel": _count, "start": _count},
        ),
        Row(
            _tag(LossScaler),
            LossScaler,
            "attributes",
            lambda s: dict(vars(s)),
            _instance(lambda: table()[_tag(LossScaler)]),
            _SCALER,
        ),
        Row(
            _tag(DynamicLossScaler),
            DynamicLossScaler,
            "attributes",
            lambda s: dict(vars(s)),
            _instance(lambda: table()[_tag(DynamicLossScaler)]),
            _DYNAMIC,
            _DYNAMIC_OPTIONAL,
        ),
    ]
    return {row.tag: row for row in rows}


@functools.cache
def _by_type() -> dict[type, Row]:
    return {row.cls: row for row in table().values()}


def encode(obj: Any, where: str = "") -> Any:
    """``obj`` with the objects of :func:`table` as typed values; other objects are left
    as they are (for :func:`distckpt.save` to store, refuse or pickle)."""
    if isinstance(obj, torch.Tensor):
        return obj
    row = _by_type().get(type(obj))
    if row is None and isinstance(obj, torch.dtype):
        row = table()["torch.dtype"]
    if row is not None:
        data = row.store(obj)
        if row.form in ("fields", "attributes"):
            _storable(row, data, where)
            data = {k: encode(v, f"{where}.{k}") for k, v in data.items()}
        return {TYPE_TAG: row.tag, row.form: data}
    if isinstance(obj, dict):
        if TYPE_TAG in obj:
            raise UnsupportedValueError(
                f"{where or 'a dict'}: the key {TYPE_TAG!r} is reserved for typed values"
            )
        return {k: encode(v, f"{where}/{k}") for k, v in obj.items()}
    if type(obj) in (list, tuple):
        items = [encode(v, f"{where}/{i}") for i, v in enumerate(obj)]
        return tuple(items) if isinstance(obj, tuple) else items
    return obj


def _storable(row: Row, data: dict[str, Any], where: str) -> None:
    """Refuse at save what a load would refuse: a field the row does not know."""
    unknown = sorted(set(data) - set(row.known()), key=str)
    if unknown:
        raise UnsupportedValueError(
            f"{where or 'a value'}: a {row.cls.__qualname__} with the attribute "
            f"{unknown[0]!r}, which distckpt does not know how to rebuild safely (pass "
            "allow_pickle=True to store it pickled)"
        )


def decode(obj: Any, where: str = "") -> Any:
    """``obj`` (a dict from storage) with each typed value rebuilt from its row of
    :func:`table` (see the module docstring); ``where`` names its place in messages."""
    if isinstance(obj, dict):
        tag = obj.get(TYPE_TAG)
        if isinstance(tag, str):
            return _typed(tag, obj, where)
        return {k: decode(v, f"{where}/{k}") for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v, f"{where}/{i}") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(decode(v, f"{where}/{i}") for i, v in enumerate(obj))
    return obj


def _typed(tag: str, obj: dict[str, Any], where: str) -> Any:
    """The object a typed value (``tag`` and its dict, as read from storage) stands for."""
    row = table().get(tag)
    if row is None:
        raise _corrupt(
            where,
            f"{TYPE_TAG} {tag!r:.120} is not a type distckpt rebuilds "
            f"(it rebuilds {', '.join(table())})",
        )
    if set(obj) != {TYPE_TAG, row.form}:
        raise _corrupt(where, f"{TYPE_TAG} {tag!r} is stored with {sorted(obj, key=str)!r:.120}")
    data = obj[row.form]
    if row.form in ("fields", "attributes") and isinstance(data, dict):
        data = {k: decode(v, f"{where}.{k}") for k, v in data.items()}
    return row.build(data, where)


__all__ = ["TYPE_TAG", "decode", "encode", "table"]
