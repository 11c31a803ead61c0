"""distckpt under ``torch.distributed.checkpoint`` (DCP): a ``StorageWriter`` that makes
``dcp.save`` write a committed distckpt checkpoint, and a ``StorageReader`` that makes
``dcp.load`` read any distckpt checkpoint (whatever wrote it, on any world size)::

    from distckpt.integrations.dcp import DistckptReader, DistckptWriter

    dcp.save(state, storage_writer=DistckptWriter("s3://bucket/run/step-100"))
    dcp.load(state, storage_reader=DistckptReader("s3://bucket/run/step-100"))

**Writing.** DCP calls, on every rank: ``reset`` (with ``checkpoint_id`` when given),
``set_up_storage_writer``, ``prepare_local_plan``; on the coordinator
``prepare_global_plan``; then on every rank ``write_data``, and on the coordinator
``finish``. :meth:`DistckptWriter.write_data` is where the checkpoint is made: every rank
calls :func:`distckpt.save` (a collective) with the state the planner holds, nested again
as the caller gave it (DCP's flattening undone with the planner's mappings). distckpt
plans, deduplicates replicas, writes each rank's boxes (DTensor shards as they lie) and
commits atomically before ``write_data`` returns on any rank, so ``finish`` has nothing
left to do. DCP's own write plan (its dedup and its file layout) is not used: the
result is an ordinary distckpt checkpoint that ``distckpt.load``, ``distckpt verify``
and zarr readers open. Python values in the state are stored as typed JSON; an object
that is not one is stored pickled, as DCP itself stores every non-tensor (and reading it
back needs ``allow_pickle=True``).

**Reading.** DCP calls, on every rank: ``reset``, ``read_metadata``,
``set_up_storage_reader``, ``prepare_local_plan``; on the coordinator
``prepare_global_plan``; then on every rank ``read_data``. :meth:`DistckptReader.read_metadata`
translates distckpt's index: each tensor is one whole chunk (so DCP asks each rank for
exactly the box its target holds, and distckpt reads only the stored chunks that box
touches), and each Python value is spread into the entries DCP's flattening makes of it
(``optim.param_groups.0.lr``). :meth:`~DistckptReader.read_data` loads each rank's boxes
with :func:`distckpt.load` into DCP's destination tensors in place, and hands DCP each
value it asks for; a value stored pickled is refused unless the reader was made with
``allow_pickle=True``.

Names: distckpt names a nested entry ``model/layer.weight``; DCP's flattened key for it is
``model.layer.weight``. Two distckpt names that flatten to one DCP key are an error.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint import (
    LoadPlan,
    LoadPlanner,
    Metadata,
    SavePlan,
    SavePlanner,
    StorageReader,
    StorageWriter,
)
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

import distckpt
from distckpt import dtypes
from distckpt.comm import Communicator, SingleComm
from distckpt.tools.catalog import open_catalog
from distckpt.training.names import nest, parts
from distckpt.values import decode

T = TypeVar("T")


def _done(value: T) -> Future[T]:
    future: Future[T] = Future()
    future.set_result(value)
    return future


Location = str | os.PathLike[str]


def _location(checkpoint_id: Location | None) -> Location:
    if checkpoint_id is None:
        raise ValueError("no checkpoint location: pass one to the constructor or as checkpoint_id")
    return checkpoint_id


class DistckptWriter(StorageWriter):
    """A DCP ``StorageWriter`` that saves a committed distckpt checkpoint at ``path`` (a
    directory or any store's URL). ``comm``: the ranks of the save (default: those of
    the default process group, as DCP's). ``options`` and keywords: as for
    :func:`distckpt.save` (``overwrite``, ``compression``, ``io_workers``, ...)."""

    def __init__(
        self,
        path: Location | None = None,
        *,
        comm: Communicator | None = None,
        options: distckpt.CheckpointOptions | None = None,
        **keywords: Any,
    ) -> None:
        super().__init__()
        self.path = path
        self.comm = comm
        self.options = (options or distckpt.CheckpointOptions()).replace(
            allow_pickle=True, **keywords
        )
        self.result: distckpt.SaveResult | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = checkpoint_id
        self.result = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        _location(self.path)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Collective: ``distckpt.save`` of the planner's state, committed on return."""
        state = getattr(planner, "state_dict", None)
        if not isinstance(state, dict):
            raise TypeError(
                f"{type(planner).__name__} keeps no state_dict: DistckptWriter saves the state "
                "a DefaultSavePlanner (or a subclass of it) holds"
            )
        mappings = getattr(planner, "mappings", None)
        if getattr(planner, "flatten_state_dict", False) and mappings:
            state = unflatten_state_dict(state, mappings)
        saved = distckpt.save(state, _location(self.path), self.comm, options=self.options)
        assert isinstance(saved, distckpt.SaveResult)
        self.result = saved
        return _done([])

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing: every rank's ``write_data`` returned after the commit."""

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path)) if self.path is not None else None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


@dataclass(frozen=True)
class _Value:
    """Where a DCP byte entry lies: in the distckpt value ``name``, at ``path`` in it."""

    name: str
    path: tuple[str | int, ...]


class DistckptReader(StorageReader):
    """A DCP ``StorageReader`` of the distckpt checkpoint at ``path`` (a directory or any
    store's URL), whatever world size wrote it. ``allow_pickle=True`` lets values that
    were stored pickled be read (unpickling runs code from the checkpoint). ``io_workers``
    as for :func:`distckpt.load`."""

    def __init__(
        self,
        path: Location | None = None,
        *,
        allow_pickle: bool = False,
        io_workers: int | None = None,
    ) -> None:
        super().__init__()
        self.path = path
        self.allow_pickle = allow_pickle
        self.io_workers = io_workers
        self.tensors: dict[str, str] = {}  # DCP key: distckpt name
        self.values: dict[str, _Value] = {}
        self.found: dict[str, Any] = {}  # distckpt name: its value

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = checkpoint_id
        self.tensors, self.values, self.found = {}, {}, {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata, from distckpt's index: a tensor is one whole chunk; a value
        becomes the entries DCP's flattening makes of it."""
        if kwargs.get("rank") is not None:
            raise FileNotFoundError("a distckpt checkpoint has no per-rank metadata")
        location = _location(self.path)
        catalog = open_catalog(location)
        entries: dict[str, Any] = {}
        tensors: dict[str, str] = {}
        values: dict[str, _Value] = {}
        found: dict[str, Any] = {}
        for name, var in catalog.tensors.items():
            key = ".".join(parts(name))
            _claim(entries, key, name)
            entries[key] = TensorStorageMetadata(
                TensorProperties(dtype=dtypes.torch_dtype(var.dtype)),
                torch.Size(var.shape),
                [ChunkStorageMetadata(torch.Size([0] * len(var.shape)), torch.Size(var.shape))],
            )
            tensors[key] = name
        for name, stored in catalog.values.items():
            try:
                found[name] = decode(stored.value, allow_pickle=self.allow_pickle, name=name)
            except distckpt.UnsupportedValueError:
                found[name] = _Pickled  # refused when asked for, not before
            for path in _spread(found[name]):
                key = ".".join([*parts(name), *map(str, path)])
                _claim(entries, key, name)
                entries[key] = BytesStorageMetadata()
                values[key] = _Value(name, path)
        self.tensors, self.values, self.found = tensors, values, found
        return Metadata(state_dict_metadata=entries, storage_meta=StorageMeta(str(location)))

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """This rank's boxes, each read into DCP's destination in place (``distckpt.load``
        on this rank alone), and the values it asks for."""
        location = _location(self.path)
        tensors = [item for item in plan.items if item.type == LoadItemType.TENSOR]
        for batch in _batches(tensors, lambda item: self.tensors[item.storage_index.fqn]):
            flat: dict[str, Any] = {}
            targets = []
            for item in batch:
                name = self.tensors[item.storage_index.fqn]
                target = planner.resolve_tensor(item)
                shape = torch.Size(distckpt_shape(planner, item))
                shard = distckpt.Shard(target.detach(), shape, tuple(item.storage_offsets))
                flat[name] = shard
                targets.append((item, target))
            distckpt.load(
                nest(flat), location, SingleComm(), strict=False, io_workers=self.io_workers
            )
            for item, target in targets:
                planner.commit_tensor(item, target)
        for item in plan.items:
            if item.type != LoadItemType.BYTE_IO:
                continue
            where = self.values[item.storage_index.fqn]
            value = self.found[where.name]
            if value is _Pickled:
                raise distckpt.UnsupportedValueError(
                    f"{location}: variable {where.name!r} was stored pickled; reading it runs "
                    "code from the checkpoint: pass allow_pickle=True to DistckptReader if you "
                    "trust it"
                )
            buffer = io.BytesIO()
            torch.save(_get(value, where.path), buffer)  # made here, from typed JSON
            buffer.seek(0)
            planner.load_bytes(item, buffer)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


class _PickledValue:
    """A value stored pickled, not read (no ``allow_pickle``)."""


_Pickled: Any = _PickledValue()


def distckpt_shape(planner: LoadPlanner, item: ReadItem) -> tuple[int, ...]:
    """The stored tensor's global shape, from the metadata DCP planned with."""
    metadata = getattr(planner, "metadata", None)
    entry = metadata.state_dict_metadata[item.storage_index.fqn] if metadata else None
    if not isinstance(entry, TensorStorageMetadata):
        raise TypeError(f"{item.storage_index.fqn}: the planner holds no tensor metadata for it")
    return tuple(entry.size)


def _batches(items: list[ReadItem], name_of: Any) -> Iterator[list[ReadItem]]:
    """``items`` in batches with each distckpt name at most once (a state names a variable
    once; a rank with several boxes of one variable reads them in turn)."""
    pending = list(items)
    while pending:
        seen: set[str] = set()
        batch: list[ReadItem] = []
        rest: list[ReadItem] = []
        for item in pending:
            name = name_of(item)
            (rest if name in seen else batch).append(item)
            seen.add(name)
        yield batch
        pending = rest


def _claim(entries: dict[str, Any], key: str, name: str) -> None:
    if key in entries:
        raise distckpt.ValidationError(
            f"distckpt variable {name!r} and another one both flatten to the DCP key {key!r}"
        )


def _spread(value: Any) -> list[tuple[str | int, ...]]:
    """The paths DCP's flattening makes inside ``value`` (``()``: the value whole)."""
    if value is _Pickled or not isinstance(value, (dict, list, tuple)):
        return [()]
    flat, mappings = flatten_state_dict({"": value})
    return [tuple(mappings[key][1:]) for key in flat]


def _get(value: Any, path: Any) -> Any:
    for part in path:
        if isinstance(value, dict):
            value = value[part] if part in value else value[int(part)]
        else:
            value = value[int(part)]
    return value
