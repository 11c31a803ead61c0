"""Where a part of a piece fetched from the node-local tier lands in a rank's target
(:mod:`distckpt.local.restore`): straight into the target's memory when it can, else
copied into its place."""

from __future__ import annotations

import numpy as np
import torch

from distckpt.local.manifests import Piece
from distckpt.slices import Box, byte_runs
from distckpt.transfer.arrays import copy_exact, writable_view
from distckpt.transfer.reader import ReadTarget


def direct(t: ReadTarget, box: Box, piece: Piece) -> np.ndarray | None:
    """The bytes of target ``t`` that ``box`` of ``piece`` fills, when it is the whole
    piece and they are one contiguous run of host memory: read straight there, and
    checked there."""
    if box != piece.box:
        return None
    view = writable_view(t.tensor) if t.tensor is not None else t.out
    if view is None or not view.flags.c_contiguous:
        return None
    runs = byte_runs(t.box.lengths, box.relative_to(t.box), piece.itemsize)
    first = next(runs, None)
    if first is None or next(runs, None) is not None:
        return None
    start, length = first
    return view.reshape(-1).view(np.uint8)[start : start + length]


def put(t: ReadTarget, box: Box, data: np.ndarray, itemsize: int) -> None:
    """Copy ``data`` (the bytes of ``box``, C order) into its place in target ``t``."""
    rel = box.relative_to(t.box).slices()
    shape = (*box.lengths, itemsize)
    view = writable_view(t.tensor) if t.tensor is not None else t.out
    if view is not None and view.flags.c_contiguous:
        whole = view.reshape(-1).view(np.uint8).reshape(*t.box.lengths, itemsize)
        whole[rel] = data.reshape(shape)
        return
    assert t.tensor is not None
    region = t.tensor[rel]
    # (data is this process's own writable memory: a checked copy, or a message received)
    values = torch.from_numpy(np.ascontiguousarray(data).reshape(-1)).view(region.dtype)
    copy_exact(region, values.reshape(region.shape))
