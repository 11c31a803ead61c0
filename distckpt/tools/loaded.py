"""What ``torch.load`` made of a file, checked before ``distckpt import`` saves it.

``torch.load(weights_only=True)`` runs no code from the file, but it builds whatever its
allowed types describe, and a file describes what it likes: containers nested a hundred
thousand deep, tensors with no data (on the ``meta`` device), and views whose elements
share bytes (a stride of 0: ``torch.zeros(1).expand(2**40)`` is four stored bytes and
four TiB to save). Saved as they are, these exhaust the stack, or write far more than
the file holds. :func:`checked_tensors` refuses them first, walking the state without
recursion: nesting of at most :data:`~distckpt.values.MAX_DEPTH`, every tensor's
elements distinct bytes of its storage, and all tensors together at most
:data:`MAX_SHARING` times the bytes of the storages they view (tied weights view one
storage twice).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from distckpt.errors import ConversionError
from distckpt.values import MAX_DEPTH

#: How many times the bytes of the storages in a file its tensors may add up to: views
#: of one storage (tied embeddings) are saved once each.
MAX_SHARING = 16


def checked_tensors(state: dict[str, Any], source: Path) -> dict[str, Any]:
    """``state``, as ``torch.load`` read it from ``source``, once checked (see the
    module); else a :class:`~distckpt.errors.ConversionError` naming what is wrong."""
    storages: dict[tuple[str, int], int] = {}
    total = 0
    stack: list[tuple[Any, int, str]] = [(state, 0, "")]
    while stack:
        obj, depth, where = stack.pop()
        if depth > MAX_DEPTH:
            raise ConversionError(f"{source}: {where!r:.200} nests more than {MAX_DEPTH} deep")
        if isinstance(obj, dict):
            stack.extend((v, depth + 1, f"{where}/{k!s:.100}") for k, v in obj.items())
        elif isinstance(obj, (list, tuple)):
            stack.extend((v, depth + 1, f"{where}/{i}") for i, v in enumerate(obj))
        elif isinstance(obj, torch.Tensor):
            total += _tensor_bytes(obj, source, where, storages)
    stored = sum(storages.values())
    if total > MAX_SHARING * max(stored, 1):
        raise ConversionError(
            f"{source}: its tensors add up to {total} bytes, views of {stored} stored bytes "
            f"(at most {MAX_SHARING} times as many): refused"
        )
    return state


def _tensor_bytes(
    tensor: torch.Tensor, source: Path, where: str, storages: dict[tuple[str, int], int]
) -> int:
    """The bytes ``tensor`` saves as, once its elements are seen to be distinct bytes of
    its storage (noted in ``storages``, by device and address)."""
    if tensor.is_meta:
        raise ConversionError(f"{source}: tensor {where!r:.200} holds no data (a meta tensor)")
    if tensor.layout is not torch.strided or tensor.is_nested:
        return 0  # refused by name when saved (distckpt.items.dense)
    nbytes = tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    if nbytes > storage.nbytes():
        raise ConversionError(
            f"{source}: tensor {where!r:.200} of shape {list(tensor.shape)} views "
            f"{storage.nbytes()} stored bytes as {nbytes} (its elements share bytes: a "
            "stride of 0); torch.save tensor.contiguous() if that is meant"
        )
    storages[(str(storage.device), storage.data_ptr())] = storage.nbytes()
    return nbytes
