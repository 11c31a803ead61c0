"""dtypes distckpt stores, with their zarr v3 names and NumPy equivalents.

bfloat16 and the float8 types use the names that tensorstore and zarrs use
("bfloat16", "float8_e4m3fn", "float8_e5m2"); :mod:`distckpt.format.zarr_dtypes`
teaches zarr-python 3.1 the same names.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from distckpt.errors import UnsupportedValueError

if TYPE_CHECKING:
    import torch

#: Every stored name with its NumPy dtype. Each name is also the name of its torch dtype
#: (``torch.bfloat16``, ``torch.float8_e4m3fn``, ...), which is looked up only when a
#: torch dtype is asked for: reading a checkpoint's metadata needs no torch.
_NUMPY: dict[str, np.dtype] = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "bool": np.dtype(np.bool_),
    "complex64": np.dtype(np.complex64),
    "complex128": np.dtype(np.complex128),
}


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {name: getattr(torch, name) for name in _NUMPY}


@functools.cache
def _by_torch() -> dict[torch.dtype, str]:
    return {dtype: name for name, dtype in _torch_dtypes().items()}


def __getattr__(name: str) -> Any:
    if name == "SUPPORTED":  # every torch dtype distckpt stores, bit-exactly
        return tuple(_torch_dtypes().values())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def zarr_name(dtype: torch.dtype, variable: str = "") -> str:
    """The zarr v3 ``data_type`` name of a torch dtype; refuses dtypes distckpt cannot store."""
    try:
        return _by_torch()[dtype]
    except KeyError:
        where = f" (variable {variable!r})" if variable else ""
        supported = ", ".join(_NUMPY)
        raise UnsupportedValueError(
            f"cannot store dtype {dtype}{where}; supported: {supported}"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype stored under a zarr v3 ``data_type`` name."""
    try:
        return _torch_dtypes()[name]
    except KeyError:
        raise UnsupportedValueError(f"unknown stored dtype {name!r}") from None


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype (ml_dtypes for bfloat16 and float8) of a zarr v3 name."""
    try:
        return _NUMPY[name]
    except KeyError:
        raise UnsupportedValueError(f"unknown stored dtype {name!r}") from None


def itemsize(name: str) -> int:
    return numpy_dtype(name).itemsize


def fill_value(name: str) -> object:
    """The zarr metadata ``fill_value`` distckpt writes: zero of the type."""
    if name == "bool":
        return False
    if name.startswith("complex"):
        return [0.0, 0.0]
    if name.startswith(("int", "uint")):
        return 0
    return 0.0
