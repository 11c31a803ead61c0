"""Where a save reads a rank's tensor from: in place, or through the staging slabs.

* :class:`HostData`: a C-contiguous tensor in host memory (or a snapshot's copy of one),
  read in place by the workers: no copy at all.
* :class:`StagedData`: a tensor on a GPU, or a host tensor that cannot be read in place
  (a non-contiguous view, a conjugate or negative view). Its inner chunks are copied
  into staging slabs (:mod:`distckpt.transfer.slabs`) a slab at a time, for GPU tensors
  asynchronously on a side stream, while the workers write the slabs copied before.
* :class:`FileData`: a tensor in a file (an import), read into the slabs likewise.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from distckpt import dtypes
from distckpt.format.shard_io import ChunkPart, as_bytes, crc32c
from distckpt.slices import Box, byte_runs, c_order_bands
from distckpt.storage.backend import Store
from distckpt.transfer import ranges, slabs
from distckpt.transfer.arrays import copy_exact, numpy_view, resolved
from distckpt.transfer.slabs import Region

_streams: dict[torch.device, Any] = {}
_streams_lock = threading.Lock()


def side_stream(device: torch.device) -> Any:
    """The CUDA stream distckpt copies on for ``device`` (one per device, kept)."""
    with _streams_lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.cuda.Stream(device=device)
        return stream


def copy_context(device: torch.device, wait: bool = True) -> Any:
    """Enter it around device copies: the side stream, which first (``wait``) waits for
    the work already queued on this thread's current stream, so the copies see, or land
    after, every pending kernel; a no-op on the CPU."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    if wait:
        follow_current(device)
    return torch.cuda.stream(side_stream(device))


def follow_current(device: torch.device) -> None:
    """Make ``device``'s side stream wait for the work queued so far on this thread's
    current stream (no-op on the CPU)."""
    if device.type == "cuda":
        side_stream(device).wait_stream(torch.cuda.current_stream(device))


def record_event(device: torch.device) -> Any:
    """An event after the copies queued so far on ``device``'s side stream (None on CPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(blocking=True)  # waiting workers sleep, not spin
    event.record(side_stream(device))
    return event


class HostData:
    """A C-contiguous host array, read in place."""

    staged = False

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.shape: tuple[int, ...] = tuple(array.shape)
        self.dtype = array.dtype

    def host(self) -> np.ndarray:
        return self.array

    def crc(self) -> int:
        return crc32c(as_bytes(self.array))


class StagedData:
    """A tensor read through staging slabs (see the module doc)."""

    staged = True

    def __init__(self, tensor: torch.Tensor, name: str) -> None:
        self.tensor = tensor.detach()
        self.name = name
        self.shape = tuple(self.tensor.shape)
        self.dtype = dtypes.numpy_dtype(dtypes.zarr_name(self.tensor.dtype, name))
        self.device = self.tensor.device
        plain = self.tensor.is_contiguous() and not (self.tensor.is_conj() or self.tensor.is_neg())
        # Its bytes in C order, when one flat copy of them is right.
        self.flat = self.tensor.reshape(-1).view(torch.uint8) if plain else None

    def host(self) -> np.ndarray:
        """A whole host copy (small tensors only: those gathered to a writer)."""
        t = resolved(self.tensor).to("cpu").contiguous()
        return numpy_view(t, self.name)

    def fill(self, region: Region, parts: Sequence[ChunkPart]) -> Any:
        """Copy the data of ``parts`` (consecutive chunks) into ``region``, back to back;
        returns the event after which the region holds them (None: it does now)."""
        cuda = self.device.type == "cuda"
        with copy_context(self.device):
            runs = self.flat is not None and all(
                p.start is not None and (k == 0 or p.start == parts[k - 1].end)
                for k, p in enumerate(parts)
            )
            if runs:
                first, end = parts[0].start, parts[-1].end
                assert self.flat is not None and first is not None and end is not None
                region.tensor[: end - first].copy_(self.flat[first:end], non_blocking=cuda)
            else:
                offset = 0
                for p in parts:
                    dst = region.typed(offset, self.tensor.dtype, p.lengths)
                    copy_exact(dst, self.tensor[p.slices], non_blocking=cuda)
                    offset += p.nbytes
            return record_event(self.device)

    def stage(self, region: Region, band: Box) -> Any:
        """Copy the box ``band`` of the tensor into ``region``, C order; returns the event
        after which the region holds it (None: it does now)."""
        with copy_context(self.device):
            dst = region.typed(0, self.tensor.dtype, band.lengths)
            copy_exact(dst, self.tensor[band.slices()], non_blocking=True)
            return record_event(self.device)

    def crc(self) -> int:
        """crc32c of the tensor's bytes in C order, streamed through the slabs: with two
        slabs or more, the next band is copied while the previous one is checksummed."""
        pool = slabs.pool(pinned=self.device.type == "cuda")
        itemsize = self.dtype.itemsize
        crc = 0
        copied: list[tuple[Region, Any]] = []  # in flight, oldest first

        def checksum_oldest() -> None:
            nonlocal crc
            region, event = copied[0]
            if event is not None:
                event.synchronize()
            crc = crc32c(region.array, crc)
            copied.pop(0)
            region.release()

        try:
            for band in c_order_bands(self.shape, itemsize, pool.slab_bytes):
                if band.empty:
                    continue
                if copied and pool.count == 1:  # one slab: it must be free for the next
                    checksum_oldest()
                region = pool.take(band.numel * itemsize)
                copied.append((region, None))
                copied[-1] = (region, self.stage(region, band))
                if len(copied) > 1:
                    checksum_oldest()
            while copied:
                checksum_oldest()
        finally:
            for region, event in copied:  # after a failure
                region.release(event)
        return crc


class FileData:
    """A tensor stored whole, C order, at ``offset`` of the file ``path`` (a safetensors
    file being imported; with ``store``, the key of one of its objects): read as the
    writer asks for it, a run of inner chunks at a time into a staging slab, so it is
    never whole in memory."""

    staged = True
    device = torch.device("cpu")

    def __init__(
        self,
        path: str,
        offset: int,
        shape: tuple[int, ...],
        dtype: str,
        name: str,
        store: Store | None = None,
    ):
        self.path, self.offset, self.name, self.store = path, offset, name, store
        self.shape = tuple(shape)
        self.dtype = dtypes.numpy_dtype(dtype)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize

    def _read(self, runs: Iterator[tuple[int, int]], out: np.ndarray, nbytes: int) -> None:
        for task in ranges.split(runs, self.offset, max(1, nbytes)):
            if self.store is None:
                ranges.read_runs(self.path, task, out, repr(self.name))
            else:
                ranges.read_store_runs(self.store, self.path, task, out, repr(self.name))

    def host(self) -> np.ndarray:
        """A whole copy (small tensors only: those stored as one plain chunk)."""
        out = np.empty(self.nbytes, dtype=np.uint8)
        self._read(iter([(0, self.nbytes)]), out, self.nbytes)
        return out.view(self.dtype).reshape(self.shape)

    def fill(self, region: Region, parts: Sequence[ChunkPart]) -> None:
        """Read the data of ``parts`` into ``region``, back to back."""
        itemsize = self.dtype.itemsize
        runs = (
            run for p in parts for run in byte_runs(self.shape, Box(p.offsets, p.lengths), itemsize)
        )
        self._read(runs, region.array, sum(p.nbytes for p in parts))

    def crc(self) -> int:
        """crc32c of the tensor's bytes, read a task's worth at a time."""
        crc = 0
        buffer = np.empty(max(1, min(self.nbytes, ranges.TASK_BYTES)), dtype=np.uint8)
        for start in range(0, self.nbytes, buffer.nbytes):
            n = min(buffer.nbytes, self.nbytes - start)
            self._read(iter([(start, n)]), buffer, n)
            crc = crc32c(buffer[:n], crc)
        return crc


#: Where a save reads one tensor.
Source = HostData | StagedData | FileData


def source_for(tensor: torch.Tensor, name: str) -> HostData | StagedData:
    """How a save reads ``tensor``: in place when it is C-contiguous in host memory."""
    t = tensor.detach()
    if t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        return HostData(numpy_view(t, name))
    return StagedData(t, name)
