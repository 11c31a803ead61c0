"""dtypes distckpt stores, with their zarr v3 names and NumPy equivalents.

bfloat16 and the float8 types use the names that tensorstore and zarrs use
("bfloat16", "float8_e4m3fn", "float8_e5m2"); :mod:`distckpt.format.zarr_dtypes`
teaches zarr-python 3.1 the same names.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from distckpt.errors import UnsupportedValueError

_TABLE: list[tuple[torch.dtype, str, np.dtype]] = [
    (torch.float64, "float64", np.dtype(np.float64)),
    (torch.float32, "float32", np.dtype(np.float32)),
    (torch.float16, "float16", np.dtype(np.float16)),
    (torch.bfloat16, "bfloat16", np.dtype(ml_dtypes.bfloat16)),
    (torch.float8_e4m3fn, "float8_e4m3fn", np.dtype(ml_dtypes.float8_e4m3fn)),
    (torch.float8_e5m2, "float8_e5m2", np.dtype(ml_dtypes.float8_e5m2)),
    (torch.int8, "int8", np.dtype(np.int8)),
    (torch.int16, "int16", np.dtype(np.int16)),
    (torch.int32, "int32", np.dtype(np.int32)),
    (torch.int64, "int64", np.dtype(np.int64)),
    (torch.uint8, "uint8", np.dtype(np.uint8)),
    (torch.bool, "bool", np.dtype(np.bool_)),
    (torch.complex64, "complex64", np.dtype(np.complex64)),
    (torch.complex128, "complex128", np.dtype(np.complex128)),
]
#: Every torch dtype distckpt stores, bit-exactly.
SUPPORTED: tuple[torch.dtype, ...] = tuple(t for t, _, _ in _TABLE)
_BY_TORCH = {t: (name, npd) for t, name, npd in _TABLE}
_BY_NAME = {name: (t, npd) for t, name, npd in _TABLE}


def zarr_name(dtype: torch.dtype, variable: str = "") -> str:
    """The zarr v3 ``data_type`` name of a torch dtype; refuses dtypes distckpt cannot store."""
    try:
        return _BY_TORCH[dtype][0]
    except KeyError:
        where = f" (variable {variable!r})" if variable else ""
        supported = ", ".join(name for _, name, _ in _TABLE)
        raise UnsupportedValueError(
            f"cannot store dtype {dtype}{where}; supported: {supported}"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype stored under a zarr v3 ``data_type`` name."""
    try:
        return _BY_NAME[name][0]
    except KeyError:
        raise UnsupportedValueError(f"unknown stored dtype {name!r}") from None


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype (ml_dtypes for bfloat16 and float8) of a zarr v3 name."""
    try:
        return _BY_NAME[name][1]
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
