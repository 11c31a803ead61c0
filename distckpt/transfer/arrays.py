"""Zero-copy NumPy views of torch tensors, ml_dtypes included; exact copies through
conjugate and negative views (sign bits flipped, never arithmetic)."""

from __future__ import annotations

import numpy as np
import torch

from distckpt import dtypes

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NO_NUMPY = {torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2}


def host_array(t: torch.Tensor, name: str = "") -> np.ndarray:
    """A C-contiguous NumPy array with ``t``'s values: a view when ``t`` is a contiguous CPU
    tensor, else a copy (device tensors come to host memory)."""
    t = resolved(t.detach())  # where it is: ``to`` would resolve a view arithmetically
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    return numpy_view(t, name)


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values, its conjugate and negative bits applied by flipping sign bits: the
    same bits on every device, every NaN's payload kept (IEEE negation). Arithmetic would
    change NaNs: CUDA's kernels make them canonical, the host's complex negation quiets
    them. ``t`` itself when it has neither bit."""
    stored, conj, neg = stored_view(t)
    return with_bits(stored, conj, neg)


def stored_view(t: torch.Tensor) -> tuple[torch.Tensor, bool, bool]:
    """The memory of ``t`` as a tensor without conjugate or negative bits (a view), and
    the bits: ``t``'s values are that memory with the bits applied (:func:`with_bits`)."""
    conj, neg = t.is_conj(), t.is_neg()
    stored = t.conj() if conj else t
    return (torch._neg_view(stored) if neg else stored), conj, neg


def with_bits(t: torch.Tensor, conj: bool, neg: bool) -> torch.Tensor:
    """A new tensor: ``t`` conjugated if ``conj``, negated if ``neg``, by sign bits
    (each is its own inverse, so this also undoes them)."""
    if not (conj or neg):
        return t
    out = t.clone(memory_format=torch.contiguous_format)
    flip_signs(out, conj, neg)
    return out


def flip_signs(t: torch.Tensor, conj: bool, neg: bool) -> None:
    """Conjugate (``conj``) and negate (``neg``) ``t`` in place, where it is, by flipping
    sign bits. ``t`` has neither bit itself."""
    if not (conj or neg):
        return
    cplx = t.is_complex()
    parts = torch.view_as_real(t) if cplx else t
    ints = parts.view(_SAME_SIZE_INT[parts.element_size()])
    sign = torch.iinfo(ints.dtype).min  # the sign bit alone
    if not cplx:
        ints ^= sign
        return
    if neg:
        ints[..., 0] ^= sign
    if conj != neg:
        ints[..., 1] ^= sign


def copy_exact(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """``dst[...] = src``, conjugate and negative bits on either side applied by sign bits
    where the tensors are: ``copy_`` would apply them arithmetically (CUDA makes NaNs
    canonical), and for an asynchronous copy between devices on the host before the bytes
    arrive."""
    src = resolved(src)
    stored, conj, neg = stored_view(dst)
    flip = conj or neg
    with torch.no_grad():
        if flip and stored.device.type == "cpu":
            non_blocking = False  # flipped on the host: the bytes must be there first
        stored.copy_(src, non_blocking=non_blocking)
        flip_signs(stored, conj, neg)


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
