"""Snapshots for background saves: each rank's tensors copied into reusable host buffers.

A background save must not read tensors that training goes on changing, so the save first
copies them. The copies go into a :class:`BufferPool` that lives as long as the process
and is reused by every background save: one buffer per variable, allocated at the first
save and again only when a variable's dtype or shape changes, so the memory a snapshot
needs is allocated once (at most one background save runs at a time). Tensors on a GPU are
copied into pinned host buffers, asynchronously, and the copy is awaited once for all.

*Lazy* tensors (parameters and optimizer state, which training leaves untouched until the
next ``optimizer.step()``) are not copied when the save starts: the background thread
copies them, and whoever is about to change them first calls
:meth:`~distckpt.pipeline.background.AsyncSave.wait_snapshot`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from distckpt.items import Leaf
from distckpt.transfer.arrays import copy_exact, numpy_view


class BufferPool:
    """Host buffers kept from one snapshot to the next, keyed by variable name."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, like: torch.Tensor, *, touch: bool = False) -> torch.Tensor:
        """The buffer for ``name``, shaped and typed as ``like`` (pinned for a GPU tensor);
        a new one is written to once (its pages made resident) if ``touch``."""
        pinned = like.device.type == "cuda"
        buf = self._buffers.get(name)
        if (
            buf is None
            or buf.dtype != like.dtype
            or buf.shape != like.shape
            or (pinned and not buf.is_pinned())
        ):
            self._buffers.pop(name, None)  # free the old one before allocating
            buf = torch.empty(tuple(like.shape), dtype=like.dtype, pin_memory=pinned)
            if touch:
                buf.reshape(-1).view(torch.uint8).zero_()
            self._buffers[name] = buf
        return buf

    def keep_only(self, names: set[str]) -> None:
        """Free the buffers of variables that the last snapshot no longer had."""
        for name in [n for n in self._buffers if n not in names]:
            del self._buffers[name]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


@dataclass
class Snapshot:
    """One rank's leaves with host copies of its tensors (``arrays``, by name).

    ``pending`` lists the lazy tensors still to copy: (name, source, buffer).
    """

    leaves: list[Leaf]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    pending: list[tuple[str, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    ready: Any = None  # a CUDA event after which the lazy sources may be read
    nbytes: int = 0


def prepare(leaves: list[Leaf], pool: BufferPool) -> int:
    """Allocate (and touch) the buffers a snapshot of ``leaves`` needs, ahead of the first
    background save; returns their bytes. Buffers already there are kept."""
    total = 0
    for leaf in leaves:
        if leaf.tensor is not None:
            buf = pool.take(leaf.name, leaf.tensor.detach(), touch=True)
            total += buf.numel() * buf.element_size()
    return total


def take(leaves: list[Leaf], pool: BufferPool, lazy: Callable[[str], bool]) -> Snapshot:
    """Copy every tensor leaf not ``lazy`` into ``pool``'s buffers; note the lazy ones.

    Runs on the training thread: when it returns, the eager tensors may change.
    """
    snap = Snapshot(leaves)
    on_gpu = False
    for leaf in leaves:
        src = leaf.tensor
        if src is None:
            continue
        src = src.detach()
        buf = pool.take(leaf.name, src)
        snap.nbytes += buf.numel() * buf.element_size()
        if lazy(leaf.name):
            snap.pending.append((leaf.name, src, buf))
            continue
        cuda = src.device.type == "cuda"
        on_gpu = on_gpu or cuda
        copy_exact(buf, src, non_blocking=cuda)
        snap.arrays[leaf.name] = numpy_view(buf, leaf.name)
    pool.keep_only({leaf.name for leaf in leaves if leaf.tensor is not None})
    if on_gpu:
        torch.cuda.current_stream().synchronize()
    if any(src.device.type == "cuda" for _, src, _ in snap.pending):
        # the lazy copies run on another stream: they must see the values as of now
        snap.ready = torch.cuda.Event()
        snap.ready.record(torch.cuda.current_stream())
    return snap


def finish(snap: Snapshot) -> None:
    """Copy the lazy tensors (on the background thread); then ``snap.arrays`` is complete."""
    if not snap.pending:
        return
    stream = None
    if snap.ready is not None:
        stream = torch.cuda.Stream()
        stream.wait_event(snap.ready)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for name, src, buf in snap.pending:
            copy_exact(buf, src, non_blocking=src.device.type == "cuda")
            snap.arrays[name] = numpy_view(buf, name)
    if stream is not None:
        stream.synchronize()
    snap.pending.clear()
