"""``distckpt.load_hf``: Hugging Face weights straight into a state, on any world size.

Every rank reads only the bytes of its own boxes: a safetensors header gives each
tensor's offsets, and a box of a C-order tensor is a list of byte runs
(:func:`distckpt.slices.byte_runs`): one run for a row shard (FSDP's ``Shard(0)``), one
per row for a column shard. The runs are read with the rank's I/O workers, straight into
the target where it is a contiguous host tensor, else a band at a time through the
staging slabs (GPU targets, views), as :func:`distckpt.load` does. Names, shapes and
dtypes are checked before anything is read, with the errors of a checkpoint load.

A kind of the restore pipeline (:mod:`distckpt.pipeline`): rank 0 reads the index and
every file's header and broadcasts them (one reader of the metadata however many ranks);
each rank then plans on its own; one collective (the pipeline's names agreement) tells
every rank whether all can read and which weights no rank loads; each rank reads on its
own; a last collective makes every rank raise if any rank failed.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from distckpt import dtypes
from distckpt.comm import Communicator
from distckpt.comm.outcome import announce
from distckpt.errors import ValidationError
from distckpt.hf.directory import Weights, is_stored, open_weights
from distckpt.hf.names import Rename, for_loading
from distckpt.hf.safetensors import StoredTensor
from distckpt.items import Leaf, flatten
from distckpt.pipeline import RestoreKind, communicator, restore
from distckpt.pipeline.matching import assign, check_leaf, target_box
from distckpt.pipeline.options import HF_LOAD, CheckpointOptions, merge_or_refuse
from distckpt.pipeline.results import LoadResult
from distckpt.progress import progress
from distckpt.slices import Box, byte_runs
from distckpt.transfer import ranges, slabs
from distckpt.transfer import workers as transfer_workers
from distckpt.transfer.arrays import writable_view
from distckpt.transfer.staged import landings
from distckpt.transfer.workers import TaskGroup

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from distckpt.pipeline.options import HFLoadKeywords

log = logging.getLogger("distckpt")


def load_hf(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    comm: Communicator | None = None,
    *,
    prefix: str = "",
    rename: Rename | None = None,
    options: CheckpointOptions | None = None,
    **keywords: Unpack[HFLoadKeywords],
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
    what matches and reports the rest in the result (``missing``, ``unexpected``). As for
    :func:`distckpt.load`, strictness is over the job: a weight is unexpected only when
    no rank loads it (ranks may hold different layers: pipeline stages). A
    state tensor that shares its memory with another loaded one (tied embeddings) is
    filled with it and not reported missing. dtypes must match exactly (no casts).
    ``options`` (or the keywords ``strict``, ``io_workers``) as for :func:`distckpt.load`;
    ``path`` may be a store (``s3://bucket/model``, ``az://...``, ``gs://...``).
    """
    comm = communicator(comm)
    for_loading(prefix, rename)  # checks the pair before any communication
    opts, error = merge_or_refuse(options, keywords, HF_LOAD, "load_hf")
    return restore(comm, _Weights(path, prefix, rename, opts, error), state)


@dataclass
class _Matched:
    """A rank's reads from the weights, checked before anything is read."""

    jobs: list[tuple[Leaf, StoredTensor, Box]]
    aliases: list[str]  # names filled by a loaded tensor they share memory with


@dataclass(frozen=True)
class _Opened:
    """The weights, their tensors by the state's names, and the I/O workers to read with."""

    weights: Weights
    stored: dict[str, StoredTensor]
    workers: int


class _Weights(RestoreKind[_Opened, _Matched]):
    """A restore from Hugging Face weights (:mod:`distckpt.pipeline`): rank 0 reads the
    metadata for every rank, each rank reads its own boxes."""

    source = "weights"

    def __init__(
        self,
        path: str | os.PathLike[str],
        prefix: str,
        rename: Rename | None,
        options: CheckpointOptions,
        error: BaseException | None,
    ) -> None:
        self.at = path
        self.path = path if is_stored(path) else Path(path).absolute()  # type: ignore[assignment]
        self.prefix = prefix
        self.rename = rename
        self.options = options
        self.error = error  # this rank's arguments were refused

    def read_metadata(self, comm: Communicator) -> _Opened:
        weights = announce(comm, open_weights, self.at)
        workers = transfer_workers.resolve_io_workers(
            self.options.io_workers, comm, network=is_stored(self.at)
        )
        return _Opened(weights, _stored(weights, self.prefix, self.rename), workers)

    def match(
        self, comm: Communicator, source: _Opened, state: dict[str, Any], result: LoadResult
    ) -> _Matched | None:
        if self.error is not None:
            raise self.error
        return _match(state, source.stored, self.prefix, self.rename, result, self.options.strict)

    def offer(self, comm: Communicator, matched: _Matched) -> Any:
        return True

    def read(
        self,
        comm: Communicator,
        source: _Opened,
        matched: _Matched,
        offers: list[Any],
        result: LoadResult,
    ) -> None:
        _read_local(matched, result, source.workers, comm.rank, _reader(source.weights))


def _alias_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (
        t.device,
        t.dtype,
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        t.shape,
        t.stride(),
    )


def _stored(weights: Weights, prefix: str, rename: Rename | None) -> dict[str, StoredTensor]:
    """The weights by the state's names (the same on every rank)."""
    to_state = for_loading(prefix, rename)
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
    return stored


def _match(
    state: dict[str, Any],
    stored: dict[str, StoredTensor],
    prefix: str,
    rename: Rename | None,
    result: LoadResult,
    strict: bool,
) -> _Matched | None:
    """Match the state's tensors to ``stored`` and check each; sets ``result.missing``
    and this rank's ``result.unexpected``. None when ``strict`` and a name is missing
    (raised once the job agrees on the names)."""
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
    if strict and result.missing:
        return None
    jobs: list[tuple[Leaf, StoredTensor, Box]] = []
    for leaf in found:
        entry = stored[leaf.name]
        doc = {"kind": "tensor", "shape": list(entry.shape), "dtype": entry.dtype}
        check_leaf(leaf, doc, "the weights")
        box = target_box(leaf, doc)
        assert box is not None
        jobs.append((leaf, entry, box))
    return _Matched(jobs, aliases)


def _reader(weights: Any) -> Any:
    """What reads runs of a tensor's file: ``(path, runs, out, what)``."""
    if isinstance(weights, Weights) and weights.store is not None:
        return functools.partial(ranges.read_store_runs, weights.store)
    return ranges.read_runs


def _read_local(matched: _Matched, result: LoadResult, workers: int, rank: int, read: Any) -> None:
    """Read this rank's boxes with its I/O workers (``read``: see :func:`_reader`); put
    new tensors in place."""
    jobs, aliases = matched.jobs, matched.aliases
    total = sum(box.numel * dtypes.itemsize(e.dtype) for _, e, box in jobs)
    fresh: list[tuple[Leaf, torch.Tensor]] = []
    used: set[slabs.SlabPool] = set()
    with progress(f"loading {Path(result.path).name} (rank 0's share)", total, rank=rank) as bar:
        group = TaskGroup(workers, bar.update)

        try:
            with group:
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
                        group.submit(read, entry.path, task, flat, repr(entry.name))
                for entry, box, tensor in staged:
                    _submit_staged(group, entry, box, tensor, used, read)
        finally:
            for pool in used:
                pool.drain()
    result.bytes_read = total
    result.loaded = [leaf.name for leaf, _, _ in jobs] + aliases
    for leaf, new in fresh:
        assign(leaf, new)


def _submit_staged(
    group: TaskGroup,
    entry: StoredTensor,
    box: Box,
    tensor: torch.Tensor,
    used: set[slabs.SlabPool],
    read: Any,
) -> None:
    """Read ``box`` of ``entry`` a band at a time into a slab, then into ``tensor``."""
    itemsize = dtypes.itemsize(entry.dtype)
    for landing in landings(group, tensor, box.lengths, itemsize, used):
        with landing:
            band = landing.band
            flat = landing.region.array[: band.numel * itemsize]
            runs = byte_runs(entry.shape, band.shifted(box.offsets), itemsize)
            for task in ranges.split(runs, entry.offset):
                landing.submit(read, entry.path, task, flat, repr(entry.name))
