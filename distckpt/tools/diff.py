"""``distckpt diff``: which variables of two checkpoints differ, and how.

Variables are matched by name (per-rank entries as ``name/rank<r>``) and compared by
presence, kind, dtype, shape, then value. Tensor values are compared bit for bit, one
slab of each side at a time (memory: two slabs of at most ``max_slab_bytes``); for
floating and complex tensors that differ, the largest absolute difference over the
elements where it is finite is reported too. Python values are compared as stored
(typed JSON, so ``nan`` equals ``nan`` and a tuple differs from a list).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from distckpt.engine.load import read_region
from distckpt.tools.catalog import Catalog, TensorVar, open_catalog
from distckpt.tools.slabs import DEFAULT_SLAB_BYTES, slabs
from distckpt.tools.verify import check_slabs

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
#: Characters of a differing Python value shown (its repr, cut).
SHOWN = 200


@dataclass(frozen=True)
class Difference:
    """One variable that differs; ``what`` is "only in A", "only in B", "kind", "dtype",
    "shape" or "value"."""

    name: str
    what: str
    detail: str = ""

    def __str__(self) -> str:
        if self.what.startswith("only in"):
            return f"{self.what}: {self.name}"
        return f"{self.name}: {self.what} {self.detail}".rstrip()


def diff(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    max_slab_bytes: int = DEFAULT_SLAB_BYTES,
) -> list[Difference]:
    """The differences between the checkpoints at ``a`` and ``b``, sorted by name
    (empty when they hold the same names, dtypes, shapes and bits)."""
    left, right = open_catalog(a), open_catalog(b)
    names = sorted(set(left.names) | set(right.names))
    out: list[Difference] = []
    for name in names:
        found = _compare(name, left, right, max_slab_bytes)
        if found is not None:
            out.append(found)
    return out


def _compare(name: str, left: Catalog, right: Catalog, max_slab_bytes: int) -> Difference | None:
    in_a = name in left.tensors or name in left.values
    in_b = name in right.tensors or name in right.values
    if not in_b:
        return Difference(name, "only in A")
    if not in_a:
        return Difference(name, "only in B")
    ta, tb = left.tensors.get(name), right.tensors.get(name)
    if ta is None and tb is None:
        va, vb = left.values[name].value, right.values[name].value
        return None if va == vb else Difference(name, "value", f"{_short(va)} vs {_short(vb)}")
    if ta is None or tb is None:
        kinds = ["tensor" if t is not None else "value" for t in (ta, tb)]
        return Difference(name, "kind", f"{kinds[0]} vs {kinds[1]}")
    if ta.dtype != tb.dtype:
        return Difference(name, "dtype", f"{ta.dtype} vs {tb.dtype}")
    if ta.shape != tb.shape:
        return Difference(name, "shape", f"{list(ta.shape)} vs {list(tb.shape)}")
    check_slabs(left, ta, max_slab_bytes)
    check_slabs(right, tb, max_slab_bytes)
    return _compare_values(left, ta, right, tb, max_slab_bytes)


def _compare_values(
    left: Catalog, ta: TensorVar, right: Catalog, tb: TensorVar, max_slab_bytes: int
) -> Difference | None:
    dtype = ta.numpy_dtype
    differing = 0
    max_abs: float | None = None
    nonfinite = 0
    for box in slabs(ta.shape, dtype.itemsize, max_slab_bytes):
        xa = np.empty(box.lengths, dtype=dtype)
        xb = np.empty(box.lengths, dtype=dtype)
        read_region(left.root, ta.name, ta.entry, box, xa)
        read_region(right.root, tb.name, tb.entry, box, xb)
        unequal = _bits(xa) != _bits(xb)
        if dtype.kind == "c":  # real and imaginary parts
            unequal = unequal.reshape(-1, 2).any(axis=1)
        count = int(np.count_nonzero(unequal))
        if not count:
            continue
        differing += count
        if _is_inexact(dtype):
            wide = np.complex128 if dtype.kind == "c" else np.float64
            delta = np.abs(xa.astype(wide) - xb.astype(wide)).reshape(-1)[unequal]
            finite = delta[np.isfinite(delta)]
            nonfinite += delta.size - finite.size
            if finite.size:
                top = float(finite.max())
                max_abs = top if max_abs is None else max(max_abs, top)
    if not differing:
        return None
    total = int(np.prod(ta.shape))
    detail = f"{differing} of {total} elements differ"
    if max_abs is not None:
        detail += f", max abs difference {max_abs:g}"
    if nonfinite:
        detail += f" ({nonfinite} with NaN or infinity)"
    return Difference(ta.name, "value", detail)


def _short(value: object) -> str:
    """A stored value as its repr, cut to :data:`SHOWN` characters: a value of any size
    is one line of the report."""
    text = repr(value)  # values nest at most 100 deep (checked when the index was read)
    return text if len(text) <= SHOWN else f"{text[: SHOWN - 3]}..."


def _bits(x: np.ndarray) -> np.ndarray:
    """The elements as unsigned integers of their size (complex: two per element)."""
    flat = x.reshape(-1)
    if x.dtype.kind == "c":
        return flat.view(_UINT[x.dtype.itemsize // 2])
    return flat.view(_UINT[x.dtype.itemsize])


def _is_inexact(dtype: np.dtype) -> bool:
    return dtype.kind in "fc" or "float" in dtype.name  # ml_dtypes floats too
