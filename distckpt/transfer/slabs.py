"""Staging slabs: a bounded, reused pool of host memory that device tensors pass through.

A blocking save does not copy a GPU state to host memory whole: it copies a slab's worth
at a time (on a side stream) while the workers checksum and write the slabs copied
before, and a load reads into slabs and copies them to the device while the next slabs
are read. Tensors in host memory that cannot be read in place (non-contiguous views,
conjugate or negative views) take the same path through unpinned slabs.

The pool holds ``slabs`` slabs of ``slab_bytes`` each (default 4 x 64 MiB; pinned when
CUDA is available), allocated on first use and kept for the life of the process, so host
memory for staging is bounded by the pool whatever the state's size. Configure it with
:func:`set_staging` or ``$DISTCKPT_SLAB_MIB`` and ``$DISTCKPT_SLABS``; allocate it ahead
of the first save with :func:`prepare`. An inner chunk larger than a slab (with
``inner_bytes`` above the slab size) gets a buffer of its own, one at a time.

Regions are handed out in order, packed into the current slab; a slab is reused once
every region in it was released and the device copies that read or fill them (their
``fence`` events) are complete.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from distckpt import settings

MiB = 1 << 20
DEFAULT_SLAB_BYTES = settings.SLAB_MIB.built_in * MiB
DEFAULT_SLABS = settings.SLABS.built_in
ALIGN = 64  # every region starts at a multiple of this (any dtype's alignment)


@dataclass
class _Slab:
    tensor: torch.Tensor | None = None  # uint8, allocated at first use
    used: int = 0  # bytes handed out since the slab was last reset
    holders: int = 0  # regions not yet released
    fences: list[Any] = field(default_factory=list)  # events to wait for before reuse


class Region:
    """``nbytes`` of a slab: ``tensor`` (uint8 torch) and ``array`` (uint8 NumPy) share it."""

    def __init__(self, pool: SlabPool, slab: _Slab | None, tensor: torch.Tensor) -> None:
        self._pool = pool
        self._slab = slab
        self.tensor = tensor
        self.array: np.ndarray = tensor.numpy()
        self._released = False

    @property
    def nbytes(self) -> int:
        return int(self.tensor.numel())

    def typed(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A torch view of ``shape`` and ``dtype`` starting ``offset`` bytes in."""
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        return self.tensor[offset : offset + n].view(dtype).view(shape)

    def release(self, fence: Any = None) -> None:
        """Give the region back; ``fence`` (a CUDA event) must complete before reuse."""
        if self._released:
            return
        self._released = True
        self._pool._release(self._slab, fence)


class SlabPool:
    """``count`` slabs of ``slab_bytes`` (pinned if ``pinned``); see the module doc."""

    def __init__(self, slab_bytes: int, count: int, pinned: bool) -> None:
        if slab_bytes < ALIGN or count < 1:
            raise ValueError(f"staging needs slabs of at least {ALIGN} bytes and at least one")
        self.slab_bytes = slab_bytes
        self.pinned = pinned
        self._slabs = [_Slab() for _ in range(count)]
        self._current = 0
        self._oversize = False  # a buffer larger than a slab is out
        self._cond = threading.Condition()

    @property
    def count(self) -> int:
        return len(self._slabs)

    @property
    def allocated_bytes(self) -> int:
        return sum(s.tensor.numel() for s in self._slabs if s.tensor is not None)

    def _alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def prepare(self) -> None:
        """Allocate (and touch) every slab now rather than at first use."""
        with self._cond:
            for slab in self._slabs:
                if slab.tensor is None:
                    slab.tensor = self._alloc(self.slab_bytes)
                    slab.tensor.zero_()

    def take(self, nbytes: int) -> Region:
        """A region of ``nbytes``; blocks until a slab is free when all are in use.

        A region larger than a slab (an inner chunk bigger than a slab) is a buffer of
        its own, and only one such buffer exists at a time: the next one waits."""
        if nbytes > self.slab_bytes:
            with self._cond:
                while self._oversize:
                    self._cond.wait()
                self._oversize = True
            try:
                return Region(self, None, self._alloc(nbytes))
            except BaseException:
                self._release(None, None)
                raise
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        with self._cond:
            slab = self._slabs[self._current]
            if slab.used + size > self.slab_bytes:
                self._current = (self._current + 1) % len(self._slabs)
                slab = self._slabs[self._current]
                while slab.holders:
                    self._cond.wait()
                for fence in slab.fences:
                    fence.synchronize()
                slab.fences.clear()
                slab.used = 0
            if slab.tensor is None:
                slab.tensor = self._alloc(self.slab_bytes)
            start = slab.used
            slab.used += size
            slab.holders += 1
            assert slab.tensor is not None
            return Region(self, slab, slab.tensor[start : start + nbytes])

    def _release(self, slab: _Slab | None, fence: Any) -> None:
        if slab is None:
            if fence is not None:
                fence.synchronize()  # a one-off buffer: free it only after its copy
            with self._cond:
                self._oversize = False
                self._cond.notify_all()
            return
        with self._cond:
            if fence is not None:
                slab.fences.append(fence)
            slab.holders -= 1
            if not slab.holders:
                self._cond.notify_all()

    def drain(self) -> None:
        """Wait for every fence (the end of a load: its device copies are done)."""
        with self._cond:
            for slab in self._slabs:
                for fence in slab.fences:
                    fence.synchronize()
                slab.fences.clear()


_lock = threading.Lock()
_pools: dict[bool, SlabPool] = {}
_config: dict[str, int] = {}


def _forget_pools() -> None:
    """In a forked child: the parent's slabs may be in use by its threads; new ones."""
    global _lock
    _pools.clear()
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def set_staging(slab_bytes: int | None = None, slabs: int | None = None) -> None:
    """Size the staging pool (bytes per slab, number of slabs) for the next save or load.

    ``None`` keeps the environment's value (``$DISTCKPT_SLAB_MIB``, ``$DISTCKPT_SLABS``)
    or the default. The old pool is freed. Example::

        distckpt.set_staging(slab_bytes=256 << 20, slabs=3)   # 768 MiB of pinned memory
    """
    with _lock:
        _config.clear()
        if slab_bytes is not None:
            _config["slab_bytes"] = int(slab_bytes)
        if slabs is not None:
            _config["slabs"] = int(slabs)
        _pools.clear()


def _sizes() -> tuple[int, int]:
    slab_bytes = _config.get("slab_bytes") or settings.SLAB_MIB.value() * MiB
    count = _config.get("slabs") or settings.SLABS.value()
    return slab_bytes, count


def pool(pinned: bool) -> SlabPool:
    """The process's staging pool (pinned: for device tensors; else for host copies)."""
    pinned = pinned and torch.cuda.is_available()
    with _lock:
        found = _pools.get(pinned)
        if found is None:
            slab_bytes, count = _sizes()
            found = SlabPool(slab_bytes, count, pinned)
            _pools[pinned] = found
        return found


def prepare(pinned: bool | None = None) -> SlabPool:
    """Allocate the staging pool now (pinned when CUDA is available, unless told)."""
    found = pool(torch.cuda.is_available() if pinned is None else pinned)
    found.prepare()
    return found
