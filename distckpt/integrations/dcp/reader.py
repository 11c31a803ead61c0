"""``DistckptReader``: DCP's ``StorageReader`` of any distckpt checkpoint, whatever world
size or entry point wrote it.

DCP calls, on every rank: ``reset``, ``read_metadata``, ``set_up_storage_reader``,
``prepare_local_plan``; on the coordinator ``prepare_global_plan``; then on every rank
``read_data``. :meth:`DistckptReader.read_metadata` translates distckpt's index: each
tensor is one whole chunk (so DCP asks each rank for exactly the box its target holds, and
distckpt reads only the stored chunks that box touches), each Python value is spread into
the entries DCP's flattening makes of it (``optim.param_groups.0.lr``), and
``planner_data`` maps each DCP key to its path in the nested state (what
``_load_state_dict_from_keys`` and DCP's load planner unflatten with).
:meth:`~DistckptReader.read_data` loads each rank's boxes with :func:`distckpt.load` into
DCP's destination tensors in place (through a host buffer of the stored dtype where
DCP's destination has another: the copy casts, as DCP's own reader's does), and hands DCP each
value it asks for; a value stored pickled is refused unless the reader was made with
``allow_pickle=True``.
"""

from __future__ import annotations

import io
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import (
    LoadPlan,
    LoadPlanner,
    Metadata,
    StorageReader,
)
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.futures import Future

import distckpt
from distckpt import dtypes
from distckpt.comm import SingleComm
from distckpt.integrations.dcp.common import Location, done, location, rank_location
from distckpt.signing.keys import TrustSource, trusted_keys
from distckpt.tools.catalog import open_catalog
from distckpt.training.names import nest, parts
from distckpt.values import decode

#: The version DCP's own writer stamps on its metadata (``filesystem.CURRENT_DCP_VERSION``).
DCP_VERSION = "1.0.0"


@dataclass(frozen=True)
class _Value:
    """Where a DCP byte entry lies: in the distckpt value ``name``, at ``path`` in it."""

    name: str
    path: tuple[str | int, ...]


class DistckptReader(StorageReader):
    """A DCP ``StorageReader`` of the distckpt checkpoint at ``path`` (a directory or any
    store's URL), whatever world size wrote it. ``allow_pickle=True`` lets values that
    were stored pickled be read (unpickling runs code from the checkpoint). ``io_workers``
    as for :func:`distckpt.load`. ``trusted_keys`` (or ``$DISTCKPT_TRUSTED_KEYS``):
    refuse a checkpoint not signed by one of them, and check every byte read
    (:mod:`distckpt.signing`). ``_extension_registry`` (``FileSystemReader``'s) is
    accepted and unused: the checkpoint's index names its codecs."""

    def __init__(
        self,
        path: Location | None = None,
        *,
        allow_pickle: bool = False,
        io_workers: int | None = None,
        trusted_keys: TrustSource = None,
        _extension_registry: Any = None,
    ) -> None:
        super().__init__()
        self.path = path
        self.allow_pickle = allow_pickle
        self.io_workers = io_workers
        self.trusted_keys = trusted_keys
        self.load_id = uuid.uuid4().hex
        self.source: Location | None = None  # what read_metadata read: path or a rank's
        self.tensors: dict[str, str] = {}  # DCP key: distckpt name
        self.values: dict[str, _Value] = {}
        self.found: dict[str, Any] = {}  # distckpt name: its value
        self.refused: distckpt.CheckpointError | None = None  # the last read of path's
        self.stand_in = Metadata(state_dict_metadata={})  # (see read_metadata)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = checkpoint_id
        self.load_id = uuid.uuid4().hex
        self.source = None
        self.tensors, self.values, self.found = {}, {}, {}
        self.refused = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata, from distckpt's index: a tensor is one whole chunk; a value
        becomes the entries DCP's flattening makes of it. ``rank=r`` (DCP's fallback when
        a checkpoint saved without collectives has no global metadata): the checkpoint
        rank ``r`` committed at ``path/rank-<r>``.

        A checkpoint at ``path`` that is refused (damaged, not absent) is the one error
        DCP's load raises: DCP catches the failure, logs it and asks for ``rank=r``; with
        no checkpoint there, this returns an empty stand-in that
        :meth:`set_up_storage_reader` (DCP's next call) answers with the refusal itself,
        rather than "no checkpoint at path/rank-<r>" beside it."""
        rank = kwargs.get("rank")
        source = location(self.path)
        if rank is None:
            self.refused = None
            try:
                return self._metadata(source)
            except distckpt.CheckpointNotFoundError:
                raise
            except distckpt.CheckpointError as exc:
                self.refused = exc
                raise
        try:
            return self._metadata(rank_location(source, rank))
        except distckpt.CheckpointNotFoundError:
            if self.refused is None:
                raise
            return self.stand_in

    def _metadata(self, source: Location) -> Metadata:
        catalog = open_catalog(source, trusted=trusted_keys(self.trusted_keys))
        entries: dict[str, Any] = {}
        paths: dict[str, tuple[str | int, ...]] = {}
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
            paths[key] = tuple(parts(name))
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
                paths[key] = (*parts(name), *path)
        self.source = source
        self.tensors, self.values, self.found = tensors, values, found
        save_id = catalog.index.get("save_id")
        meta = StorageMeta(checkpoint_id=str(source), save_id=save_id, load_id=self.load_id)
        return Metadata(
            state_dict_metadata=entries,
            planner_data=paths,
            storage_meta=meta,
            version=DCP_VERSION,
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if metadata is self.stand_in and self.refused is not None:
            raise self.refused  # (see read_metadata)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """This rank's boxes, each read into DCP's destination in place (``distckpt.load``
        on this rank alone), and the values it asks for."""
        source = self.source if self.source is not None else location(self.path)
        tensors = [item for item in plan.items if item.type == LoadItemType.TENSOR]
        for batch in _batches(tensors, lambda item: self.tensors[item.storage_index.fqn]):
            flat: dict[str, Any] = {}
            targets = []
            for item in batch:
                key = item.storage_index.fqn
                target = planner.resolve_tensor(item).detach()
                entry = stored_entry(planner, item)
                stored = entry.properties.dtype
                # DCP copies into whatever the planner resolves, from a host tensor of the
                # stored dtype (the copy casts): a destination of another dtype is filled
                # the same way, so the cast is DCP's to the bit (NaN payloads included)
                into = (
                    target
                    if target.dtype == stored
                    else torch.empty(target.shape, dtype=stored, device="cpu")
                )
                offsets = tuple(item.storage_offsets)
                flat[self.tensors[key]] = distckpt.Shard(into, entry.size, offsets)
                targets.append((item, target, into))
            distckpt.load(
                nest(flat),
                source,
                SingleComm(),
                strict=False,
                io_workers=self.io_workers,
                trusted_keys=self.trusted_keys,
            )
            for item, target, into in targets:
                if into is not target:
                    target.copy_(into)
                planner.commit_tensor(item, target)
        for item in plan.items:
            if item.type != LoadItemType.BYTE_IO:
                continue
            where = self.values[item.storage_index.fqn]
            value = self.found[where.name]
            if value is _Pickled:
                raise distckpt.UnsupportedValueError(
                    f"{source}: variable {where.name!r} was stored pickled; reading it runs "
                    "code from the checkpoint: pass allow_pickle=True to DistckptReader if you "
                    "trust it"
                )
            buffer = io.BytesIO()
            torch.save(_get(value, where.path), buffer)  # made here, from typed JSON
            buffer.seek(0)
            planner.load_bytes(item, buffer)
        return done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


class _PickledValue:
    """A value stored pickled, not read (no ``allow_pickle``)."""


_Pickled: Any = _PickledValue()


def stored_entry(planner: LoadPlanner, item: ReadItem) -> TensorStorageMetadata:
    """The stored tensor's entry (global shape, dtype) in the metadata DCP planned with."""
    metadata = getattr(planner, "metadata", None)
    entry = metadata.state_dict_metadata[item.storage_index.fqn] if metadata else None
    if not isinstance(entry, TensorStorageMetadata):
        raise TypeError(f"{item.storage_index.fqn}: the planner holds no tensor metadata for it")
    return entry


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
