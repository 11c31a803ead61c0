"""Zero-copy NumPy views of torch tensors, ml_dtypes included."""

from __future__ import annotations

import numpy as np
import torch

from distckpt import dtypes

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NO_NUMPY = {torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2}


def host_array(t: torch.Tensor, name: str = "") -> np.ndarray:
    """A C-contiguous NumPy array with ``t``'s values: a view when ``t`` is a contiguous CPU
    tensor, else a copy (device tensors come to host memory)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return numpy_view(t, name)


def numpy_view(t: torch.Tensor, name: str = "") -> np.ndarray:
    """A NumPy view sharing memory with a contiguous CPU tensor."""
    npd = dtypes.numpy_dtype(dtypes.zarr_name(t.dtype, name))
    if t.dtype in _NO_NUMPY:
        return t.view(_SAME_SIZE_INT[t.element_size()]).numpy().view(npd)
    return t.numpy()


def writable_view(t: torch.Tensor) -> np.ndarray | None:
    """A NumPy view to read into ``t`` directly, or None when ``t`` needs a staging copy."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    return numpy_view(t.detach())
