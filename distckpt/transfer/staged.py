"""A region of a staging slab that one band (or run) of a tensor passes through, and the
tasks that use it.

Every loop that moves a tensor through the slabs (:mod:`distckpt.transfer.slabs`) does
the same: take a region, fill it (a write: from the tensor) or let the tasks fill it (a
read: from storage), submit the tasks that use it, and release it once they are done,
or at once when something fails before any was submitted. :class:`Staged` does that
once for all of them: the writer's runs (:mod:`distckpt.transfer.writer`), the check for
unchanged pieces (:mod:`distckpt.transfer.unchanged`), the Hugging Face writer's bands,
and, as :class:`Landing`, which also copies the band into its target when its last read
is done, the reader's and the Hugging Face reader's bands (:func:`landings`)::

    with Staged(group, pool.take(nbytes)) as staged:
        staged.event = source.stage(staged.region, band)   # a write: the device copy
        for task in tasks:
            staged.submit(write, task, staged.region.array)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import torch

from distckpt.slices import Box, c_order_bands
from distckpt.transfer import slabs
from distckpt.transfer.arrays import copy_exact
from distckpt.transfer.sources import copy_context, follow_current, record_event
from distckpt.transfer.workers import TaskGroup


class Staged:
    """``region``, held until every task submitted through :meth:`submit` is done (run or
    skipped) and the ``with`` block has ended; then released, after ``event`` (the
    device copy that filled it, if any). A block that raises abandons the region: the
    tasks already submitted still end before it is released."""

    def __init__(self, group: TaskGroup | None, region: slabs.Region) -> None:
        self.group = group
        self.region = region
        #: The device copy that fills the region (a write), waited for before its reuse.
        self.event: Any = None
        self.abandoned = False
        self._lock = threading.Lock()
        self._submitted = 0
        self._done = 0
        self._closed = False

    def submit(self, fn: Callable[..., int | None], *args: Any) -> None:
        """Run ``fn(*args)`` on a worker of the group; the region outlives it."""
        assert self.group is not None
        self.group.submit(fn, *args, release=self._task_done)
        self._submitted += 1  # after: a task whose submission failed holds nothing

    def __enter__(self) -> Staged:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if kind is not None:
            self.abandoned = True
        with self._lock:
            self._closed = True
            last = self._done == self._submitted
        if last:
            self._complete()

    def _task_done(self) -> None:
        with self._lock:
            self._done += 1
            last = self._closed and self._done == self._submitted
        if last:
            self._complete()

    def _complete(self) -> None:
        """Every task that uses the region is done: release it."""
        self.region.release(self.event)


class Landing(Staged):
    """A band read into ``region`` by the tasks, then copied into ``tensor``'s box
    ``band`` by the worker that ends the last of them (asynchronously on a side stream
    for a GPU), unless the band was abandoned or the group cancelled: nothing lands
    from a band not wholly read."""

    def __init__(
        self, group: TaskGroup, region: slabs.Region, tensor: torch.Tensor, band: Box
    ) -> None:
        super().__init__(group, region)
        self.tensor = tensor
        self.band = band

    def _complete(self) -> None:
        assert self.group is not None
        fence = None
        try:
            if not (self.abandoned or self.group.cancelled.is_set()):
                tensor, band = self.tensor, self.band
                source = self.region.typed(0, tensor.dtype, band.lengths)
                with copy_context(tensor.device, wait=False), torch.no_grad():
                    copy_exact(tensor[band.slices()], source, tensor.device.type == "cuda")
                    fence = record_event(tensor.device)
        finally:
            self.region.release(fence)


def landings(
    group: TaskGroup,
    tensor: torch.Tensor,
    lengths: tuple[int, ...],
    itemsize: int,
    used: set[slabs.SlabPool],
) -> Iterator[Landing]:
    """The bands of a box of ``lengths`` (C order, a slab's worth each) that ``tensor``
    (shaped like the box) is read through, each a :class:`Landing` in a region of the
    slab pool (added to ``used``: its copies must be complete before the read returns)."""
    pool = slabs.pool(pinned=tensor.device.type == "cuda")
    used.add(pool)
    # The copies run on the workers, onto a side stream that must first see the work
    # queued on this (the caller's) current stream, such as the target's initialisation.
    follow_current(tensor.device)
    for band in c_order_bands(lengths, itemsize, pool.slab_bytes):
        group.check()
        yield Landing(group, pool.take(band.numel * itemsize), tensor, band)
