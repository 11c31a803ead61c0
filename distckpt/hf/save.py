"""``distckpt.save_hf`` and ``distckpt.export_hf``: Hugging Face weights written by the
ranks in parallel, in bounded memory.

The layout follows ``save_pretrained`` (:mod:`distckpt.hf.directory`): files of at most
``max_shard_size`` and, when there are several, ``model.safetensors.index.json``.

The protocol, in the order every rank runs it (collectives marked *):

1. **Describe** (every rank): the tensors to write, by weights name, with dtype, global
   shape and this rank's box (:func:`save_hf`); or nothing (:func:`export_hf`: the
   coordinator reads the checkpoint's index).
2. **Plan** (*gather, coordinator, *broadcast): the coordinator checks the descriptions as
   a save does (every box of every tensor, no overlap, no gap), packs the tensors into
   files, picks one writer for each box (replicas write once; for an export, each file
   goes whole to one rank), checks the directory, and creates every file beside its final
   name (``.<name>.tmp-<token>``) with its header and its full size.
3. **Write** (every rank): each rank writes its boxes at their offsets with its I/O
   workers (``pwrite``, from host tensors in place, from GPU tensors a slab at a time),
   then fsyncs what it wrote.
4. **Finish** (*gather, coordinator, *broadcast): with every rank's report in, the
   coordinator renames the files to their names and writes the index last; after a
   failure anywhere it removes them instead. Every rank returns, or raises the same error.

Other files in the directory (``config.json`` ...) are left alone. Existing weights
(``model.safetensors``, ``model-*-of-*.safetensors``, the index) are an error unless
``overwrite=True``, which removes them just before the new files are renamed in: a
reader at that moment may find the directory incomplete (never a mix of two saves'
files under one index: the index is written last).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from distckpt import dtypes
from distckpt.comm import Communicator, auto
from distckpt.comm.outcome import Failure, first_failure
from distckpt.engine import background
from distckpt.engine.results import SaveResult
from distckpt.errors import CheckpointExists, ValidationError
from distckpt.hf import names as names_mod
from distckpt.hf.directory import (
    DEFAULT_MAX_BYTES,
    INDEX,
    OutFile,
    index_document,
    parse_size,
    plan_files,
)
from distckpt.items import flatten
from distckpt.planning.describe import Desc
from distckpt.planning.save_plan import Balancer
from distckpt.planning.validate import owners, validate
from distckpt.slices import Box, byte_runs, c_order_bands
from distckpt.storage.fsutil import atomic_write, fsync_dir
from distckpt.storage.shard_io import as_bytes
from distckpt.transfer import ranges, slabs
from distckpt.transfer import workers as transfer_workers
from distckpt.transfer.sources import HostData, StagedData, source_for
from distckpt.transfer.workers import Countdown, TaskGroup, interleaved

log = logging.getLogger("distckpt")

COORDINATOR = 0
_OLD_WEIGHTS = re.compile(r"^model(-\d+-of-\d+)?\.safetensors$|^model\.safetensors\.index\.json$")


@dataclass
class _Write:
    """One box this rank writes: ``local`` (its leaf name) at ``offset`` of ``file``."""

    local: str
    file: str
    offset: int  # of the tensor in the file
    shape: tuple[int, ...]
    dtype: str
    box: Box


@dataclass
class _Plan:
    token: str
    files: list[OutFile]
    work: list[list[Any]] = field(default_factory=list)  # per rank


def save_hf(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    comm: Communicator | None = None,
    *,
    prefix: str = "",
    rename: names_mod.Rename | None = None,
    max_shard_size: int | str = DEFAULT_MAX_BYTES,
    overwrite: bool = False,
    io_workers: int | None = None,
) -> SaveResult:
    """Write the tensors of ``state`` as Hugging Face weights in the directory ``path``;
    every rank calls it with its own boxes (DTensors, :class:`~distckpt.Shard`, plain
    tensors), and each box is written once, by a rank that holds it::

        distckpt.save_hf(model.state_dict(), "out/")          # FSDP2 model, every rank
        model.config.save_pretrained("out/")                  # then from_pretrained("out/")

    ``prefix`` (stripped; names without it are left out) or ``rename`` (state name to
    weights name, None to leave out) name the tensors. Python values and
    :class:`~distckpt.PerRank` entries are left out. ``max_shard_size`` (bytes, or
    ``"5GB"``, ``"500MiB"``) bounds each file. Host memory: the staging slabs and the
    I/O workers' buffers, whatever the state's size.
    """
    background.finish_pending()
    comm = comm or auto()
    to_weights = names_mod.for_saving(prefix, rename)
    descs: list[Desc] | Failure
    local: dict[str, Any] = {}
    try:
        max_bytes = parse_size(max_shard_size)
        descs = []
        for leaf in flatten(state, allow_pickle=True):
            name = to_weights(leaf.name)
            if name is None or leaf.kind != "tensor" or leaf.tensor is None:
                continue
            local[leaf.name] = leaf
            descs.append(Desc(name, "tensor", leaf.dtype, leaf.shape, leaf.box, value=leaf.name))
    except Exception as exc:
        descs = Failure.capture(exc, comm.rank)

    def plan(gathered: list[Any]) -> _Plan:
        sources: dict[str, str] = {}
        for rank_descs in gathered:
            for d in rank_descs:
                first = sources.setdefault(d.name, d.value)
                if first != d.value:
                    raise ValidationError(f"both {first!r} and {d.value!r} map to {d.name!r}")
        by_name = validate(gathered)
        tensors = [(n, held[0][1].dtype, held[0][1].shape) for n, held in by_name.items()]
        files = plan_files(tensors, max_bytes)  # type: ignore[arg-type]
        where = {t.name: (f, f.offsets[t.name]) for f in files for t in f.tensors}
        balancer = Balancer(comm.size)
        work: list[list[Any]] = [[] for _ in range(comm.size)]
        for name, held in by_name.items():
            d0 = held[0][1]
            assert d0.dtype is not None and d0.shape is not None
            out, offset = where[name]
            for box, ranks in owners(held).items():
                if box.empty:
                    continue
                rank = balancer.pick(ranks, box.numel * dtypes.itemsize(d0.dtype))
                leaf_name = next(d.value for r, d in held if r == rank and d.box == box)
                work[rank].append(_Write(leaf_name, out.name, offset, d0.shape, d0.dtype, box))
        return _Plan(uuid.uuid4().hex[:16], files, work)

    def write(work: list[_Write], root: Path, token: str, workers: int) -> int:
        return _write_boxes(work, local, root, token, workers)

    return _run(comm, Path(path), descs, plan, write, overwrite, io_workers)


def export_hf(
    checkpoint: str | os.PathLike[str],
    path: str | os.PathLike[str],
    comm: Communicator | None = None,
    *,
    prefix: str = "",
    rename: names_mod.Rename | None = None,
    max_shard_size: int | str = DEFAULT_MAX_BYTES,
    overwrite: bool = False,
    io_workers: int | None = None,
) -> SaveResult:
    """Write the tensors of the checkpoint at ``checkpoint`` as Hugging Face weights in
    the directory ``path``; with several ranks (every rank calls it), each writes whole
    files of its own. ``prefix`` / ``rename`` as in :func:`save_hf`: a checkpoint saved
    from ``{"net": model.state_dict()}`` is exported with ``prefix="net/"``. Memory: one
    slab of at most 64 MiB per rank plus the I/O workers' buffers::

        distckpt.export_hf("run/ckpt-100", "out/", prefix="net/")
    """
    from distckpt.tools.catalog import open_catalog

    background.finish_pending()
    comm = comm or auto()
    to_weights = names_mod.for_saving(prefix, rename)
    descs: Any = []

    def plan(gathered: list[Any]) -> _Plan:
        max_bytes = parse_size(max_shard_size)
        catalog = open_catalog(checkpoint)
        tensors = []
        sources: dict[str, str] = {}
        for var in catalog.tensors.values():
            name = to_weights(var.name)
            if name is not None:
                if name in sources:
                    raise ValidationError(
                        f"both {sources[name]!r} and {var.name!r} map to {name!r}"
                    )
                tensors.append((name, var.dtype, var.shape))
                sources[name] = var.name
        files = plan_files(tensors, max_bytes)
        balancer = Balancer(comm.size)
        work: list[list[Any]] = [[] for _ in range(comm.size)]
        for f in sorted(files, key=lambda f: -f.size):
            rank = balancer.pick(range(comm.size), f.size)
            work[rank].append((f.name, [(sources[t.name], f.offsets[t.name]) for t in f.tensors]))
        return _Plan(uuid.uuid4().hex[:16], files, work)

    def write(work: list[Any], root: Path, token: str, workers: int) -> int:
        return _copy_tensors(checkpoint, work, root, token, workers)

    return _run(comm, Path(path), descs, plan, write, overwrite, io_workers)


def _tmp(root: Path, name: str, token: str) -> Path:
    return root / f".{name}.tmp-{token}"


def _run(
    comm: Communicator,
    root: Path,
    descs: Any,
    plan_fn: Any,
    write_fn: Any,
    overwrite: bool,
    io_workers: int | None,
) -> SaveResult:
    """Steps 2 to 4 of the protocol (see the module doc)."""
    root = root.absolute()
    result = SaveResult(root)
    t0 = time.perf_counter()
    gathered = comm.gather(descs, root=COORDINATOR)
    decision: Any = None
    plan: _Plan | None = None
    if comm.rank == COORDINATOR:
        assert gathered is not None
        decision = first_failure(gathered)
        if decision is None:
            try:
                plan = plan_fn(gathered)
                assert plan is not None
                prepare(root, plan, overwrite)
                decision = (plan.token, plan.work)
            except Exception as exc:
                decision = Failure.capture(exc, comm.rank)
    decision = comm.broadcast(decision, root=COORDINATOR)
    if isinstance(decision, Failure):
        decision.raise_here(comm.rank)
    token, work = decision
    t_plan = time.perf_counter()
    report: Any = None
    try:
        workers = transfer_workers.resolve(io_workers, comm)
        report = write_fn(work[comm.rank], root, token, workers)
        result.bytes_written = report
    except Exception as exc:
        report = Failure.capture(exc, comm.rank)
    reports = comm.gather(report, root=COORDINATOR)
    t_write = time.perf_counter()
    outcome: Failure | None = None
    if comm.rank == COORDINATOR:
        assert plan is not None and reports is not None
        outcome = first_failure(reports)
        try:
            if outcome is None:
                _finish(root, plan, overwrite)
        except Exception as exc:
            outcome = Failure.capture(exc, comm.rank)
        finally:
            for f in plan.files:
                _tmp(root, f.name, plan.token).unlink(missing_ok=True)
    outcome = comm.broadcast(outcome, root=COORDINATOR)
    if outcome is not None:
        outcome.raise_here(comm.rank)
    t_end = time.perf_counter()
    result.timings = {
        "plan": t_plan - t0,
        "write": t_write - t_plan,
        "finish": t_end - t_write,
        "total": t_end - t0,
    }
    if comm.rank == COORDINATOR:
        assert plan is not None
        result.files_written = len(plan.files)
        log.info("wrote %d weight files to %s in %.3fs", len(plan.files), root, t_end - t0)
    return result


def _existing(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _OLD_WEIGHTS.match(p.name))


def prepare(root: Path, plan: _Plan, overwrite: bool) -> None:
    """Coordinator: check the directory, then create every file with its header, full size."""
    if root.exists() and not root.is_dir():
        raise CheckpointExists(f"{root} exists and is not a directory")
    old = _existing(root)
    if old and not overwrite:
        raise CheckpointExists(
            f"{root} already holds weights ({', '.join(p.name for p in old[:3])}); pass "
            "overwrite=True to replace them"
        )
    if not any(f.tensors for f in plan.files):
        raise ValidationError(
            f"no tensor to write to {root}: none of the state's names is under the prefix, "
            "or the rename function left every one out"
        )
    root.mkdir(parents=True, exist_ok=True)
    try:
        for f in plan.files:
            path = _tmp(root, f.name, plan.token)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.pwrite(fd, f.header, 0)
                os.ftruncate(fd, f.size)
            finally:
                os.close(fd)
    except BaseException:
        for f in plan.files:
            _tmp(root, f.name, plan.token).unlink(missing_ok=True)
        raise


def _finish(root: Path, plan: _Plan, overwrite: bool) -> None:
    """Coordinator: the files under their names, then the index (several files) last."""
    for old in _existing(root) if overwrite else []:
        old.unlink()
    for f in plan.files:
        os.replace(_tmp(root, f.name, plan.token), root / f.name)
    if len(plan.files) > 1:
        atomic_write(root / INDEX, index_document(plan.files))
    fsync_dir(root)


class _Files:
    """This rank's open files, by name, each fsynced and closed by :meth:`close`."""

    def __init__(self, root: Path, token: str) -> None:
        self.root, self.token = root, token
        self.fds: dict[str, int] = {}

    def fd(self, name: str) -> int:
        if name not in self.fds:
            self.fds[name] = os.open(_tmp(self.root, name, self.token), os.O_WRONLY)
        return self.fds[name]

    def close(self, sync: bool) -> None:
        try:
            for fd in self.fds.values():
                if sync:
                    os.fsync(fd)
        finally:
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()


def _write_boxes(
    work: list[_Write], local: dict[str, Any], root: Path, token: str, workers: int
) -> int:
    """Write this rank's boxes at their offsets, host data in place, GPU data by bands."""
    files = _Files(root, token)
    group = TaskGroup(workers)
    used: set[slabs.SlabPool] = set()
    written = 0

    def feed() -> None:
        nonlocal written
        # Host data first, file by file in turns: one file's writes take turns in the
        # kernel (its inode lock), so each worker keeps mostly to a file of its own.
        streams: dict[str, list[tuple[int, list[ranges.Run], Any]]] = {}
        staged: list[tuple[StagedData, _Write, int]] = []
        for w in work:
            source = source_for(local[w.local].tensor, w.local)
            fd = files.fd(w.file)
            itemsize = dtypes.itemsize(w.dtype)
            written += w.box.numel * itemsize
            if isinstance(source, HostData):
                flat = as_bytes(source.array).reshape(-1)
                stream = streams.setdefault(w.file, [])
                for task in ranges.split(byte_runs(w.shape, w.box, itemsize), w.offset):
                    stream.append((fd, task, flat))
            else:
                staged.append((source, w, fd))
        for fd, task, flat in interleaved(streams.values(), workers):
            group.submit(ranges.write_runs, fd, task, flat)
        for source, w, fd in staged:
            _submit_staged(group, source, w, fd, used)

    ok = False
    try:
        group.drive(feed)
        ok = True
    finally:
        for pool in used:
            pool.drain()
        files.close(sync=ok)
    return written


def _submit_staged(
    group: TaskGroup, source: StagedData, w: _Write, fd: int, used: set[slabs.SlabPool]
) -> None:
    itemsize = dtypes.itemsize(w.dtype)
    pool = slabs.pool(pinned=source.device.type == "cuda")
    used.add(pool)
    for band in c_order_bands(w.box.lengths, itemsize, pool.slab_bytes):
        group.check()
        region = pool.take(band.numel * itemsize)
        event = None
        try:
            event = source.stage(region, band)
            where = band.shifted(w.box.offsets)
            tasks = ranges.split(byte_runs(w.shape, where, itemsize), w.offset)
            done = Countdown(len(tasks), functools.partial(region.release, event))
            for task in tasks:
                group.submit(_write_staged, fd, task, region.array, event, release=done.done)
        except BaseException:
            region.release(event)
            raise


def _write_staged(fd: int, runs: list[ranges.Run], data: np.ndarray, event: Any) -> int:
    if event is not None:
        event.synchronize()
    return ranges.write_runs(fd, runs, data)


def _copy_tensors(
    checkpoint: str | os.PathLike[str],
    work: list[tuple[str, list[tuple[str, int]]]],
    root: Path,
    token: str,
    workers: int,
) -> int:
    """Export: write this rank's whole files, each tensor a slab at a time."""
    from distckpt.tools.catalog import open_catalog
    from distckpt.tools.export import tensor_slabs

    if not work:
        return 0
    catalog = open_catalog(checkpoint)
    files = _Files(root, token)
    written = 0
    ok = False
    try:
        for name, tensors in work:
            fd = files.fd(name)
            for var_name, offset in tensors:
                var = catalog.tensors[var_name]
                for raw in tensor_slabs(catalog, var, io_workers=workers):
                    flat = raw.reshape(-1)
                    ranges.write_runs(fd, [(offset, flat.nbytes, 0)], flat)
                    offset += flat.nbytes
                    written += flat.nbytes
        ok = True
    finally:
        files.close(sync=ok)
    return written
