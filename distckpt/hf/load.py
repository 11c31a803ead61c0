"""``distckpt.load_hf``: Hugging Face weights straight into a state, on any world size.

Every rank reads only the bytes of its own boxes: a safetensors header gives each
tensor's offsets, and a box of a C-order tensor is a list of byte runs
(:func:`distckpt.slices.byte_runs`): one run for a row shard (FSDP's ``Shard(0)``), one
per row for a column shard. The runs are read with the rank's I/O workers, straight into
the target where it is a contiguous host tensor, else a band at a time through the
staging slabs (GPU targets, views), as :func:`distckpt.load` does. Names, shapes and
dtypes are checked before anything is read, with the errors of a checkpoint load.

Protocol: rank 0 reads the index and every file's header and broadcasts them (one
reader of the metadata however many ranks); each rank then plans and reads on its own;
a last collective makes every rank raise if any rank failed.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distckpt import dtypes
from distckpt.comm import Communicator, auto
from distckpt.comm.outcome import Failure
from distckpt.engine import background
from distckpt.engine.arrays import writable_view
from distckpt.engine.load import (
    LoadResult,
    assign,
    check_leaf,
    check_names,
    settle,
    target_box,
)
from distckpt.errors import ValidationError
from distckpt.hf import names as names_mod
from distckpt.hf.directory import Weights, open_weights
from distckpt.hf.safetensors import StoredTensor
from distckpt.items import Leaf, flatten
from distckpt.progress import progress
from distckpt.slices import Box, byte_runs, c_order_bands
from distckpt.transfer import ranges, slabs
from distckpt.transfer import workers as transfer_workers
from distckpt.transfer.reader import Landing
from distckpt.transfer.sources import follow_current
from distckpt.transfer.workers import TaskGroup

log = logging.getLogger("distckpt")


def load_hf(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    comm: Communicator | None = None,
    *,
    prefix: str = "",
    rename: names_mod.Rename | None = None,
    strict: bool = True,
    io_workers: int | None = None,
) -> LoadResult:
    """Fill ``state`` in place from the Hugging Face weights at ``path`` (a directory
    with ``model.safetensors`` or an index and its files, or one ``.safetensors`` file);
    every rank calls it, with its own boxes: DTensors (FSDP2, tensor parallel),
    :class:`~distckpt.Shard` or plain tensors (read whole)::

        model = build_model()               # e.g. on the meta device, then
        fully_shard(model)                  # FSDP2, then model.to_empty(device=...)
        distckpt.load_hf(model.state_dict(), "Llama-3.2-1B/")
        distckpt.load_hf({"net": model.state_dict()}, "Llama-3.2-1B/", prefix="net/")

    ``prefix`` is put before every weights name to find it in the state; ``rename`` maps
    a weights name to the state's name, or to None to skip it (give one or neither).
    Only the state's tensors (and ``None`` placeholders) under ``prefix`` count: Python
    values and :class:`~distckpt.PerRank` entries are left as they are.
    ``strict=True`` fails listing every name on one side only; ``strict=False`` loads
    what matches and reports the rest in the result (``missing``, ``unexpected``). A
    state tensor that shares its memory with another loaded one (tied embeddings) is
    filled with it and not reported missing. dtypes must match exactly (no casts).
    ``io_workers`` as for :func:`distckpt.load`.
    """
    background.finish_pending()
    comm = comm or auto()
    names_mod.for_loading(prefix, rename)  # checks the pair before any communication
    result = LoadResult(Path(path).absolute())
    t0 = time.perf_counter()
    weights: Weights | Failure | None = None
    if comm.rank == 0:
        try:
            weights = open_weights(path)
        except Exception as exc:
            weights = Failure.capture(exc, 0)
    weights = comm.broadcast(weights)
    error: BaseException | None = None
    try:
        if isinstance(weights, Failure):
            weights.raise_here(comm.rank)
        assert isinstance(weights, Weights)
        workers = transfer_workers.resolve(io_workers, comm)
        _load_local(state, weights, (prefix, rename), result, strict, workers, comm.rank)
    except Exception as exc:
        error = exc
    return settle(comm, result, error, t0)


def _alias_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (
        t.device,
        t.dtype,
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        t.shape,
        t.stride(),
    )


def _load_local(
    state: dict[str, Any],
    weights: Weights,
    naming: tuple[str, names_mod.Rename | None],
    result: LoadResult,
    strict: bool,
    workers: int,
    rank: int,
) -> None:
    t0 = time.perf_counter()
    prefix, rename = naming
    to_state = names_mod.for_loading(prefix, rename)
    stored: dict[str, StoredTensor] = {}
    for name, tensor in weights.tensors.items():
        mapped = to_state(name)
        if mapped is None:
            continue
        if mapped in stored:
            raise ValidationError(
                f"{weights.root}: both {stored[mapped].name!r} and {name!r} map to {mapped!r}"
            )
        stored[mapped] = tensor
    # Only tensors (and None placeholders for new ones) can come from weights: Python
    # values and per-rank entries are not theirs to fill, nor names outside the prefix.
    leaves = [
        leaf
        for leaf in flatten(state)
        if (leaf.kind == "tensor" or (leaf.kind == "value" and leaf.value is None))
        and (rename is not None or leaf.name.startswith(prefix))
    ]
    found = [leaf for leaf in leaves if leaf.name in stored]
    # Tied weights: a leaf sharing its memory with a loaded one is filled by it.
    loaded_views = {_alias_key(leaf.tensor) for leaf in found if leaf.tensor is not None}
    aliases = [
        leaf.name
        for leaf in leaves
        if leaf.name not in stored
        and leaf.tensor is not None
        and leaf.tensor.numel() > 0
        and _alias_key(leaf.tensor) in loaded_views
    ]
    names = {leaf.name for leaf in leaves}
    result.missing = sorted(n for n in names if n not in stored and n not in aliases)
    result.unexpected = sorted(n for n in stored if n not in names)
    if strict:
        check_names(result.path, result.missing, result.unexpected, "weights")
    jobs: list[tuple[Leaf, StoredTensor, Box]] = []
    for leaf in found:
        entry = stored[leaf.name]
        doc = {"kind": "tensor", "shape": list(entry.shape), "dtype": entry.dtype}
        check_leaf(leaf, doc, "the weights")
        box = target_box(leaf, doc)
        assert box is not None
        jobs.append((leaf, entry, box))
    total = sum(box.numel * dtypes.itemsize(e.dtype) for _, e, box in jobs)
    t_plan = time.perf_counter()
    fresh: list[tuple[Leaf, torch.Tensor]] = []
    used: set[slabs.SlabPool] = set()
    with progress(f"loading {Path(result.path).name} (rank 0's share)", total, rank=rank) as bar:
        group = TaskGroup(workers, bar.update)

        def feed() -> None:
            staged = []
            for leaf, entry, box in jobs:
                tensor = leaf.tensor
                if tensor is None:  # a None placeholder: takes a new tensor
                    tensor = torch.empty(box.lengths, dtype=dtypes.torch_dtype(entry.dtype))
                    fresh.append((leaf, tensor))
                out = writable_view(tensor)
                if out is None:
                    staged.append((entry, box, tensor))
                    continue
                flat = out.reshape(-1).view(np.uint8)
                runs = byte_runs(entry.shape, box, dtypes.itemsize(entry.dtype))
                for task in ranges.split(runs, entry.offset):
                    group.submit(ranges.read_runs, entry.path, task, flat, repr(entry.name))
            for entry, box, tensor in staged:
                _submit_staged(group, entry, box, tensor, used)

        try:
            group.drive(feed)
        finally:
            for pool in used:
                pool.drain()
    result.bytes_read = total
    result.loaded = [leaf.name for leaf, _, _ in jobs] + aliases
    for leaf, new in fresh:
        assign(leaf, new)
    result.timings["plan"] = t_plan - t0
    result.timings["read"] = time.perf_counter() - t_plan


def _submit_staged(
    group: TaskGroup, entry: StoredTensor, box: Box, tensor: torch.Tensor, used: set[slabs.SlabPool]
) -> None:
    """Read ``box`` of ``entry`` a band at a time into a slab, then into ``tensor``."""
    itemsize = dtypes.itemsize(entry.dtype)
    pool = slabs.pool(pinned=tensor.device.type == "cuda")
    used.add(pool)
    follow_current(tensor.device)
    for band in c_order_bands(box.lengths, itemsize, pool.slab_bytes):
        group.check()
        nbytes = band.numel * itemsize
        landing = Landing(group, pool.take(nbytes), tensor, band)
        count = 0
        try:
            where = band.shifted(box.offsets)
            flat = landing.region.array[:nbytes]
            for task in ranges.split(byte_runs(entry.shape, where, itemsize), entry.offset):
                group.submit(
                    ranges.read_runs, entry.path, task, flat, repr(entry.name), release=landing.done
                )
                count += 1
        except BaseException:
            landing.abandon()
            raise
        finally:
            landing.expect(count)
