"""Teach zarr-python 3.1 the ``bfloat16``, ``float8_e4m3fn`` and ``float8_e5m2`` data types.

distckpt stores bfloat16 and float8 tensors in zarr v3 arrays whose ``zarr.json`` names the
data type ``"bfloat16"``, ``"float8_e4m3fn"`` or ``"float8_e5m2"``: the names tensorstore's
``zarr3`` driver (and zarrs) use. zarr-python 3.1 ships no data type under these names, so
without help ``zarr.open_array`` refuses such arrays ("No Zarr data type found that matches
'bfloat16'"). zarr-python does have a pluggable data type registry
(``zarr.core.dtype.data_type_registry``); :func:`register` adds a ``ZDType`` subclass for each
of the three types there, backed by the NumPy dtypes of ``ml_dtypes``. After it, zarr-python
reads these arrays as ``ml_dtypes`` arrays and can create and write them too, with the same
``data_type`` names and fill value JSON that tensorstore accepts.

Fill values follow the zarr v3 rules for floating point types: a JSON number, ``"NaN"``
(the canonical quiet NaN), ``"Infinity"``, ``"-Infinity"``, or ``"0x..."``, the value's bytes in
big-endian order as exactly ``2 * itemsize`` hexadecimal digits (``"0x7fc0"`` for a bfloat16
NaN; other NaN payloads can only be written this way). Values the type cannot hold convert as
``ml_dtypes`` (and tensorstore) convert them: rounded to nearest, overflowing to infinity, or for
``float8_e4m3fn``, which has no infinities, to NaN, so ``"Infinity"`` reads as NaN there, as in
tensorstore. zarr-python's own hex parser cannot be reused: it reads any 4-digit hex string as
an IEEE float16, which is wrong for bfloat16.

The classes match only their own ``ml_dtypes`` dtype (by exact dtype class), so NumPy dtypes
such as ``np.dtype("V2")`` keep resolving to zarr-python's own data types. Only zarr format 3
is supported: zarr v2 has no portable name for these types.
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, SupportsFloat, SupportsIndex, TypeGuard

import ml_dtypes
import numpy as np
from zarr.core.dtype import data_type_registry
from zarr.core.dtype.common import (
    DataTypeValidationError,
    DTypeJSON,
    HasEndianness,
    HasItemSize,
)
from zarr.core.dtype.npy.common import (
    endianness_to_numpy_str,
    get_endianness_from_numpy_dtype,
)
from zarr.core.dtype.wrapper import ZDType

if TYPE_CHECKING:
    from typing import Self

    from zarr.core.common import JSON, ZarrFormat

__all__ = ["BFloat16", "Float8E4M3FN", "Float8E5M2", "register"]

_UINT_OF_SIZE: dict[int, np.dtype[Any]] = {1: np.dtype(">u1"), 2: np.dtype(">u2")}


class _MLFloat(ZDType[np.dtype[Any], np.generic], HasItemSize):
    """Shared behaviour of the ml_dtypes-backed floating point data types (zarr v3 only)."""

    _ml_type: ClassVar[type[np.generic]]

    # -- native dtype -------------------------------------------------------------------------

    def _base_dtype(self) -> np.dtype[Any]:
        return np.dtype(self._ml_type)

    @property
    def item_size(self) -> int:
        return self._base_dtype().itemsize

    # -- data type JSON -----------------------------------------------------------------------

    @classmethod
    def _check_json_v3(cls, data: DTypeJSON) -> TypeGuard[str]:
        return isinstance(data, str) and data == cls._zarr_v3_name

    @classmethod
    def _from_json_v2(cls, data: DTypeJSON) -> Self:
        raise DataTypeValidationError(
            f"{cls._zarr_v3_name} has no zarr format 2 representation; got {data!r}"
        )

    @classmethod
    def _from_json_v3(cls, data: DTypeJSON) -> Self:
        if cls._check_json_v3(data):
            return cls()
        raise DataTypeValidationError(
            f"Invalid JSON representation of {cls.__name__}. Got {data!r}, "
            f"expected {cls._zarr_v3_name!r}."
        )

    def to_json(self, zarr_format: ZarrFormat) -> str:  # type: ignore[override]
        if zarr_format == 3:
            return self._zarr_v3_name
        raise ValueError(
            f"data type {self._zarr_v3_name} can only be stored in zarr format 3, not {zarr_format}"
        )

    # -- scalars ------------------------------------------------------------------------------

    def _check_scalar(self, data: object) -> bool:
        if isinstance(data, bool):
            return False
        if isinstance(data, str):
            try:
                self._ml_type(data)  # type: ignore[call-arg]
            except (ValueError, OverflowError, TypeError):
                return False
            return True
        return isinstance(data, np.generic | SupportsFloat | SupportsIndex)

    def cast_scalar(self, data: object) -> np.generic:
        if self._check_scalar(data):
            return self._cast(data)
        raise TypeError(
            f"Cannot convert object {data!r} with type {type(data)} to a scalar compatible "
            f"with the data type {self}."
        )

    def _cast(self, data: Any) -> np.generic:
        if isinstance(data, str):
            return self._ml_type(data)  # type: ignore[call-arg]
        if isinstance(data, int):  # Python ints beyond int64 would make an object array
            data = float(data)
        # Through a 0-d array so the result has the (byte order free) scalar type. Overflow to
        # infinity (or NaN for float8_e4m3fn) is the intended conversion, not worth a warning.
        with np.errstate(over="ignore", invalid="ignore"):
            return np.asarray(data).astype(self._base_dtype())[()]  # type: ignore[return-value]

    def default_scalar(self) -> np.generic:
        return self._cast(0.0)

    def _bits(self, value: np.generic) -> int:
        raw = np.asarray(value, dtype=self._base_dtype()).reshape(1)
        return int(raw.view(_UINT_OF_SIZE[self.item_size].newbyteorder("="))[0])

    def _from_bits(self, bits: int) -> np.generic:
        raw = np.array([bits], dtype=_UINT_OF_SIZE[self.item_size]).view(np.uint8)
        return raw.view(self._base_dtype().newbyteorder(">"))[0].astype(self._base_dtype())

    def _canonical_nan_bits(self) -> int:
        return self._bits(self._cast(float("nan")))

    def from_json_scalar(self, data: JSON, *, zarr_format: ZarrFormat) -> np.generic:
        if zarr_format != 3:
            raise ValueError(f"{self._zarr_v3_name} exists only in zarr format 3")
        if isinstance(data, bool) or not isinstance(data, int | float | str):
            raise TypeError(
                f"Invalid fill value {data!r} for {self._zarr_v3_name}: expected a number, "
                "'NaN', 'Infinity', '-Infinity' or a '0x' hex string"
            )
        if isinstance(data, str):
            if data == "NaN":
                return self._cast(float("nan"))
            if data in ("Infinity", "-Infinity"):
                return self._cast(float("inf") if data == "Infinity" else float("-inf"))
            if data.startswith(("0x", "0X")):
                digits = data[2:]
                if len(digits) != 2 * self.item_size:
                    raise ValueError(
                        f"Invalid hex fill value {data!r} for {self._zarr_v3_name}: expected "
                        f"'0x' and {2 * self.item_size} hex digits"
                    )
                if not all(c in string.hexdigits for c in digits):
                    raise ValueError(f"Invalid hex fill value {data!r} for {self._zarr_v3_name}")
                return self._from_bits(int(digits, 16))
            try:
                number = float(data)
            except ValueError:
                raise ValueError(f"Invalid fill value {data!r} for {self._zarr_v3_name}") from None
        elif isinstance(data, int):
            try:
                number = float(data)
            except OverflowError:  # an integer beyond float64: as out of range as infinity
                number = math.copysign(math.inf, data)
        else:
            number = data
        return self._cast(number)

    def to_json_scalar(self, data: object, *, zarr_format: ZarrFormat) -> float | str:
        if zarr_format != 3:
            raise ValueError(f"{self._zarr_v3_name} exists only in zarr format 3")
        value = self.cast_scalar(data)
        as_float = float(value)  # type: ignore[arg-type]
        if math.isnan(as_float):
            bits = self._bits(value)
            if bits == self._canonical_nan_bits():
                return "NaN"
            return f"0x{bits:0{2 * self.item_size}x}"
        if math.isinf(as_float):
            return "Infinity" if as_float > 0 else "-Infinity"
        # Every finite value of these types is exactly a Python float, and converts back exactly.
        return as_float


@dataclass(frozen=True, kw_only=True)
class BFloat16(_MLFloat, HasEndianness):
    """zarr v3 ``bfloat16`` (1 sign, 8 exponent, 7 mantissa bits), as ``ml_dtypes.bfloat16``."""

    dtype_cls: ClassVar[type[np.dtype[Any]]] = type(np.dtype(ml_dtypes.bfloat16))
    _zarr_v3_name: ClassVar[Literal["bfloat16"]] = "bfloat16"
    _ml_type: ClassVar[type[np.generic]] = ml_dtypes.bfloat16

    @classmethod
    def from_native_dtype(cls, dtype: np.dtype[Any]) -> Self:
        if cls._check_native_dtype(dtype):
            return cls(endianness=get_endianness_from_numpy_dtype(dtype))
        raise DataTypeValidationError(
            f"Invalid data type: {dtype}. Expected an instance of {cls.dtype_cls}"
        )

    def to_native_dtype(self) -> np.dtype[Any]:
        return self._base_dtype().newbyteorder(endianness_to_numpy_str(self.endianness))


@dataclass(frozen=True, kw_only=True)
class _Float8(_MLFloat):
    """A single-byte ml_dtypes float: no endianness."""

    @classmethod
    def from_native_dtype(cls, dtype: np.dtype[Any]) -> Self:
        if cls._check_native_dtype(dtype):
            return cls()
        raise DataTypeValidationError(
            f"Invalid data type: {dtype}. Expected an instance of {cls.dtype_cls}"
        )

    def to_native_dtype(self) -> np.dtype[Any]:
        return self._base_dtype()


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FN(_Float8):
    """zarr v3 ``float8_e4m3fn`` (no infinities, one NaN per sign), as ``ml_dtypes``'."""

    dtype_cls: ClassVar[type[np.dtype[Any]]] = type(np.dtype(ml_dtypes.float8_e4m3fn))
    _zarr_v3_name: ClassVar[Literal["float8_e4m3fn"]] = "float8_e4m3fn"
    _ml_type: ClassVar[type[np.generic]] = ml_dtypes.float8_e4m3fn


@dataclass(frozen=True, kw_only=True)
class Float8E5M2(_Float8):
    """zarr v3 ``float8_e5m2`` (IEEE-like, with infinities and NaNs), as ``ml_dtypes``'."""

    dtype_cls: ClassVar[type[np.dtype[Any]]] = type(np.dtype(ml_dtypes.float8_e5m2))
    _zarr_v3_name: ClassVar[Literal["float8_e5m2"]] = "float8_e5m2"
    _ml_type: ClassVar[type[np.generic]] = ml_dtypes.float8_e5m2


_CLASSES: tuple[type[_MLFloat], ...] = (BFloat16, Float8E4M3FN, Float8E5M2)


def register() -> None:
    """Register the three data types with zarr-python's data type registry.

    Idempotent and cheap (three dict lookups once done); call it before zarr-python opens or
    creates an array that may hold bfloat16 or float8 data. Replaces any other class registered
    under the same names.
    """
    contents = data_type_registry.contents
    for cls in _CLASSES:
        if contents.get(cls._zarr_v3_name) is not cls:
            data_type_registry.register(cls._zarr_v3_name, cls)  # type: ignore[arg-type]
