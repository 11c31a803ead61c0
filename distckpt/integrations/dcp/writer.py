"""``DistckptWriter``: DCP's ``StorageWriter`` that writes what DCP's plan says as one
committed distckpt checkpoint.

DCP calls, on every rank: ``reset`` (with ``checkpoint_id`` when given),
``set_up_storage_writer`` and ``prepare_local_plan``; on the coordinator
``prepare_global_plan``; then on every rank ``write_data``, and on the coordinator
``finish``. Each step's part here:

* ``prepare_local_plan`` tags this rank's plan with its rank in the default process group
  (``torch.distributed``'s global rank; 0 without one);
* ``prepare_global_plan`` (coordinator, every rank's plan in hand) tells each rank who
  takes part in this save (the global ranks of the plans: DCP's ``process_group``, one rank
  with ``no_dist=True`` or ``use_collectives=False``) and which values any rank's plan
  holds;
* ``write_data`` builds this rank's share from its final plan: each tensor item is
  ``planner.resolve_data(item)`` (so a planner that transforms what is saved, as the FP16
  planner of ``SavePlanner``'s docstring does, is obeyed) placed at the item's chunk; each
  value DCP's plans hold is this rank's own value (``planner.lookup_object``). A tensor
  that some rank holds several chunks of is first regrouped into one band of rows per
  rank (:func:`regroup`): distckpt stores one box of a tensor per rank. Every rank
  of the save then calls :func:`distckpt.save` over a communicator of exactly those ranks;
  distckpt writes and commits atomically before ``write_data`` returns, so ``finish``
  has nothing left to do. With ``use_collectives=False`` each rank commits its own
  checkpoint at ``path/rank-<r>``, which :class:`~distckpt.integrations.dcp.DistckptReader`
  finds as DCP's own reader finds per-rank metadata.
"""

from __future__ import annotations

import os
import threading
import uuid
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint import Metadata, SavePlan, SavePlanner, StorageWriter
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

import distckpt
from distckpt.comm import Communicator, SingleComm, auto
from distckpt.comm.base import background
from distckpt.format.index import is_committed
from distckpt.integrations.dcp.common import Location, done, location, rank_location
from distckpt.items import Branch, BranchList
from distckpt.slices import Box, chunk_bounds

#: ``FileSystemWriter`` settings that distckpt's own layout makes moot (it writes its
#: pieces with its I/O workers and always syncs before the commit): accepted and unused, so
#: a script written for DCP's writer runs unchanged.
MOOT = (
    "single_file_per_rank",
    "sync_files",
    "per_thread_copy_ahead",
    "cache_staged_state_dict",
    "serialization_format",
)


@dataclass(frozen=True)
class _Member:
    """A local plan's tag: the global rank of the rank that made it."""

    rank: int


Path = tuple[str | int, ...]


@dataclass(frozen=True)
class _Save:
    """What the coordinator tells each rank: the global ranks of the save (in the order of
    DCP's group), the keys of the values any rank's plan holds, and the paths of the
    containers that hold a tensor on some rank."""

    ranks: tuple[int, ...]
    values: tuple[str, ...]
    branches: frozenset[Path] = frozenset()
    #: The tensors some rank holds several chunks of (a ShardedTensor placing several
    #: shards on one rank), by global shape: regrouped into one box per rank first.
    regroup: tuple[tuple[str, tuple[int, ...]], ...] = ()


class CheckpointAlreadyExists(distckpt.CheckpointExists, RuntimeError):
    """A save with ``overwrite=False`` to a path that holds a committed checkpoint, in
    DCP's words (its message starts as ``FileSystemWriter``'s: "Checkpoint already exists
    and overwrite=False"). Both distckpt's :class:`~distckpt.errors.CheckpointExists` (a
    ``FileExistsError``) and the ``RuntimeError`` that ``FileSystemWriter`` raises; DCP
    wraps it in its ``CheckpointException``, as it wraps its own."""


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _comm_of(ranks: tuple[int, ...]) -> Communicator:
    """A communicator over the global ``ranks`` (this rank among them): one rank needs
    none; the whole default group is :func:`distckpt.comm.auto`'s; another set gets a
    gloo group its members create, once (:func:`~distckpt.comm.torch_dist.over_ranks`)."""
    import torch.distributed as dist

    if len(ranks) == 1:
        return SingleComm()
    if ranks == tuple(range(dist.get_world_size())):
        return auto()
    from distckpt.comm.torch_dist import over_ranks

    return over_ranks(ranks)


class DistckptWriter(StorageWriter):
    """A DCP ``StorageWriter`` that saves a committed distckpt checkpoint at ``path`` (a
    directory or any store's URL) from DCP's plan.

    ``comm``: the ranks of the save (default: the ranks DCP saves with, from its
    ``process_group``, ``no_dist`` and ``use_collectives``). ``options`` and keywords: as
    for :func:`distckpt.save` (``compression``, ``io_workers``, ...). ``overwrite``
    defaults to True, as DCP's ``FileSystemWriter`` does; distckpt's overwrite is atomic
    (the old checkpoint stays whole until the new one commits). With
    ``overwrite=False`` an existing checkpoint is refused with
    :class:`CheckpointAlreadyExists` (distckpt's ``CheckpointExists``, a
    ``FileExistsError``, and the ``RuntimeError`` DCP raises, with DCP's wording
    "Checkpoint already exists"), which DCP wraps in its ``CheckpointException`` as it wraps
    its own refusal. Objects that are not typed values are stored pickled (as DCP stores
    every non-tensor).

    ``FileSystemWriter``'s arguments are taken too: ``thread_count`` sets ``io_workers``,
    ``_extensions=[ZStandard()]`` sets ``compression="zstd"``, and those of :data:`MOOT`
    change nothing. Another stream extension (an encryption, say) is refused, unless
    ``ignore_extensions=True`` says to save without it (distckpt's stored bytes are its
    own codecs', checksummed)."""

    def __init__(
        self,
        path: Location | None = None,
        *,
        comm: Communicator | None = None,
        options: distckpt.CheckpointOptions | None = None,
        thread_count: int | None = None,
        _extensions: Any = None,
        ignore_extensions: bool = False,
        **keywords: Any,
    ) -> None:
        super().__init__()
        self.path = path
        self.comm = comm
        for name in MOOT:
            keywords.pop(name, None)
        if thread_count is not None:
            keywords.setdefault("io_workers", thread_count)
        for extension in _extensions or ():
            if type(extension).__name__ == "ZStandard":
                keywords.setdefault("compression", "zstd")
            elif not ignore_extensions:
                raise ValueError(
                    f"DCP extension {type(extension).__name__} has no distckpt equivalent "
                    "(ZStandard maps to compression='zstd'); pass ignore_extensions=True to "
                    "save without it"
                )
        keywords.setdefault("overwrite", True)
        self.options = (options or distckpt.CheckpointOptions()).replace(
            allow_pickle=True, **keywords
        )
        self.save_id = uuid.uuid4().hex
        self.rank = 0
        self.use_collectives = True
        self.result: distckpt.SaveResult | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = checkpoint_id
        self.save_id = uuid.uuid4().hex
        self.result = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        location(self.path)
        self.rank = kwargs.get("rank") or 0
        self.use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return replace(plan, storage_data=_Member(_global_rank()))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        ranks = tuple(
            p.storage_data.rank if isinstance(p.storage_data, _Member) else i
            for i, p in enumerate(plans)
        )
        values = sorted(
            {i.index.fqn for p in plans for i in p.items if i.type == WriteItemType.BYTE_IO}
        )
        branches = {
            path[:n]
            for p in plans
            for item in p.items
            if item.type != WriteItemType.BYTE_IO
            for path in [_path_of(p, item.index.fqn)]
            for n in range(1, len(path))
        }
        regroup: dict[str, tuple[int, ...]] = {}
        for p in plans:
            seen: set[str] = set()
            for item in p.items:
                if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                    continue
                if item.index.fqn in seen:
                    regroup[item.index.fqn] = tuple(item.tensor_data.size)
                seen.add(item.index.fqn)
        told = _Save(ranks, tuple(values), frozenset(branches), tuple(sorted(regroup.items())))
        return [replace(p, storage_data=told) for p in plans]

    @property
    def target(self) -> Location:
        """Where this rank's save commits: ``path``, or with ``use_collectives=False``
        this rank's own checkpoint in it."""
        path = location(self.path)
        return path if self.use_collectives else rank_location(path, self.rank)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Collective over the ranks of the save: ``distckpt.save`` of what this rank's
        plan holds, committed on return."""
        told = plan.storage_data
        if not isinstance(told, _Save):  # a plan that did not pass prepare_global_plan
            told = _Save((_global_rank(),), ())
        comm = self.comm or _comm_of(told.ranks)
        if threading.current_thread() is not threading.main_thread():
            # dcp.async_save's thread: never mix with the collectives training runs
            comm = background(comm)
        regrouped = regroup(plan, planner, dict(told.regroup), comm)
        state = planned_state(plan, planner, told, regrouped)
        try:
            saved = distckpt.save(state, self.target, comm, options=self.options)
        except distckpt.CheckpointExists as exc:
            # Every rank raised it: every rank finds the same committed checkpoint.
            if self.options.overwrite or not is_committed(self.target):
                raise  # a directory that is not a checkpoint: distckpt's words say so
            raise CheckpointAlreadyExists(
                f"Checkpoint already exists and overwrite=False: {exc}"
            ) from exc
        self.result = saved
        self.save_id = saved.save_id or self.save_id  # the one the index records
        return done([])

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing: every rank's ``write_data`` returned after the commit."""

    def storage_meta(self) -> StorageMeta | None:
        path = None if self.path is None else str(self.path)
        return StorageMeta(checkpoint_id=path, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


def _path_of(plan: SavePlan, fqn: str) -> Path:
    """Where DCP's key ``fqn`` lies in the nested state (the planner's flattening)."""
    mappings = plan.planner_data if isinstance(plan.planner_data, dict) else {}
    return tuple(mappings.get(fqn, (fqn,)))


def regroup(
    plan: SavePlan, planner: SavePlanner, shapes: dict[str, tuple[int, ...]], comm: Communicator
) -> dict[str, distckpt.Shard | None]:
    """Collective: the tensors ``shapes`` names (some rank holds several chunks of them,
    which distckpt saves as one box per rank), each regrouped into this rank's band of rows
    (``torch.chunk``'s split of the first dimension over the ranks of the save): every rank
    sends each of its chunks' rows to the ranks whose bands they fall in, one gather per
    receiving rank. None where this rank's band is empty."""
    if not shapes:
        return {}
    bands = {
        fqn: [_band(shape, comm.size, r) for r in range(comm.size)] for fqn, shape in shapes.items()
    }
    outgoing: list[list[tuple[str, Box, torch.Tensor]]] = [[] for _ in range(comm.size)]
    for item in plan.items:
        fqn = item.index.fqn
        if fqn not in shapes or item.tensor_data is None:
            continue
        data = _shard(item, planner.resolve_data(item)).tensor
        chunk = Box(tuple(item.tensor_data.chunk.offsets), tuple(item.tensor_data.chunk.sizes))
        for r, band in enumerate(bands[fqn]):
            part = chunk.intersect(band)
            if part is not None and not part.empty:
                rows = data[part.relative_to(chunk).slices()].contiguous().cpu()
                outgoing[r].append((fqn, part, rows))
    received: list[Any] | None = None
    for r in range(comm.size):
        got = comm.gather(outgoing[r], root=r)
        if r == comm.rank:
            received = got
    out: dict[str, distckpt.Shard | None] = {}
    for fqn, shape in shapes.items():
        band = bands[fqn][comm.rank]
        parts = [(box, rows) for sent in received or [] for name, box, rows in sent if name == fqn]
        if band.empty or not parts:
            out[fqn] = None
            continue
        whole = torch.empty(band.lengths, dtype=parts[0][1].dtype)
        covered = 0
        for box, rows in parts:
            whole[box.relative_to(band).slices()] = rows
            covered += box.numel
        if covered != band.numel:
            raise distckpt.ValidationError(
                f"{fqn}: the ranks' chunks cover {covered} of the {band.numel} elements of "
                f"rows {band} (chunks that overlap or leave gaps)"
            )
        out[fqn] = distckpt.Shard(whole, shape, band.offsets)
    return out


def _band(shape: tuple[int, ...], parts: int, index: int) -> Box:
    """Band ``index`` of ``parts`` of the rows of a tensor of ``shape`` (torch.chunk's)."""
    if not shape:  # a scalar is one chunk: never regrouped
        return Box((), ())
    start, length = chunk_bounds(shape[0], parts, index)
    return Box((start, *[0] * (len(shape) - 1)), (length, *shape[1:]))


def planned_state(
    plan: SavePlan,
    planner: SavePlanner,
    told: _Save,
    regrouped: dict[str, distckpt.Shard | None],
) -> dict[str, Any]:
    """This rank's state for :func:`distckpt.save`, nested as the caller gave it: each
    tensor item of ``plan`` as the planner resolves it, placed at its chunk (or its
    ``regrouped`` band), and each value of the save this rank holds. A container that
    holds a tensor on any rank is a :class:`~distckpt.items.Branch` here, so every rank
    names its values alike."""
    flat: dict[str, Any] = {fqn: s for fqn, s in regrouped.items() if s is not None}
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO or item.index.fqn in regrouped:
            continue
        flat[item.index.fqn] = _shard(item, planner.resolve_data(item))
    lookup = getattr(planner, "lookup_object", None)
    held = getattr(planner, "state_dict", None)
    for fqn in told.values:
        if isinstance(held, dict) and fqn not in held:
            continue  # another rank's value (a pipeline stage this rank is not)
        if lookup is None:
            raise TypeError(
                f"{type(planner).__name__} has no lookup_object: DistckptWriter stores the "
                "values a DefaultSavePlanner (or a subclass of it) holds"
            )
        flat[fqn] = lookup(MetadataIndex(fqn))
    nested = unflatten_state_dict(flat, {fqn: _path_of(plan, fqn) for fqn in flat})
    return _branched(nested, (), told.branches)


def _branched(node: Any, path: Path, branches: frozenset[Path]) -> Any:
    """``node`` with the containers at ``branches`` (and above them) made branches."""
    if isinstance(node, dict):
        kids = {k: _branched(v, (*path, k), branches) for k, v in node.items()}
        return Branch(kids) if path in branches else kids
    if isinstance(node, list):
        items = [_branched(v, (*path, i), branches) for i, v in enumerate(node)]
        return BranchList(items) if path in branches else items
    return node


def _shard(item: WriteItem, data: Any) -> distckpt.Shard:
    """A tensor item's data at its chunk of the global tensor."""
    if not isinstance(data, torch.Tensor):
        raise TypeError(
            f"{item.index.fqn}: the planner resolved a tensor item to a {type(data).__name__}"
        )
    meta = item.tensor_data
    assert meta is not None
    return distckpt.Shard(data.detach(), tuple(meta.size), tuple(meta.chunk.offsets))
