"""``distckpt.save``: one checkpoint, written by every rank, committed by the coordinator.

The protocol, in the order every rank runs it (collectives marked *):

1. **Describe** (every rank): flatten the state; describe each leaf (name, dtype, global
   shape, box; a crc32c of each replicated tensor; values as typed JSON).
2. **Plan** (*gather to the coordinator, coordinator, *broadcast): the coordinator checks
   the path (:class:`~distckpt.errors.CheckpointExists`), removes abandoned saves,
   validates the descriptions and plans the writes
   (:func:`~distckpt.planning.save_plan.make_save_plan`), begins the save's transaction
   (:mod:`distckpt.commit.transaction`: a staging directory on a file system, a claim on
   the name on an object store) and broadcasts the plan, or the first error, which every
   rank then raises. Nothing has been written yet when a validation error is raised.
3. **Exchange** (*one gather per writer of small tensors): the ranks holding boxes of a
   small tensor send their bytes to its writer.
4. **Write** (every rank): each rank writes its pieces and the ``zarr.json`` of the arrays
   it starts, durably, through the store (:mod:`distckpt.storage.backend`). No two ranks
   write one file.
5. **Commit** (*gather to the coordinator, coordinator, *broadcast): with every rank's
   report in, the coordinator writes the group metadata and the index through the
   transaction, which makes it the checkpoint (a rename, or the index object created only
   if absent); on any failure it aborts the transaction instead. Every rank returns, or
   raises the same error.

A failure anywhere leaves every committed checkpoint, including one at ``path``, as it was.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

from distckpt import dtypes
from distckpt.comm import Communicator, auto
from distckpt.comm.outcome import Failure, coordinate
from distckpt.commit.transaction import Transaction, begin, save_root
from distckpt.engine import background, reuse
from distckpt.engine.agree import agree
from distckpt.engine.background import AsyncSave, Snapped, save_in_background
from distckpt.engine.commit import Report, commit
from distckpt.engine.gather_small import assemble, send_small
from distckpt.engine.local_state import LocalState, describe_state, replica_checksums
from distckpt.engine.options import (
    SAVE,
    CheckpointOptions,
    Resolved,
    SaveKeywords,
    merge_or_refuse,
    resolve,
)
from distckpt.engine.results import SaveResult
from distckpt.errors import interfered
from distckpt.format import index as index_mod
from distckpt.format import zarr_meta
from distckpt.format.shard_io import Stored
from distckpt.items import gather_leaves
from distckpt.planning.describe import Desc
from distckpt.planning.pieces import Piece, RankWork
from distckpt.planning.save_plan import plan_save
from distckpt.progress import progress
from distckpt.storage.backend import Store
from distckpt.storage.registry import location
from distckpt.storage.registry import open_store as resolve_store
from distckpt.transfer.sources import HostData, Source, source_for
from distckpt.transfer.writer import PieceJob, write_pieces

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger("distckpt")

COORDINATOR = 0


@dataclass
class _Job:
    """One save as it runs: its options, resolved once (store, I/O workers), the callback
    after its commit, and whether rank 0 may show progress."""

    run: Resolved
    after_commit: Callable[[], None] | None = None
    show_progress: bool = True  # rank 0's progress on a terminal (not for background saves)
    error: BaseException | None = None  # the options were refused on this rank
    base: Store | None = None  # the checkpoint it builds on (an incremental save)

    @classmethod
    def of(
        cls,
        options: CheckpointOptions | None,
        keywords: Mapping[str, Any],
        path: str | os.PathLike[str],
        comm: Communicator,
        where: str,
        **job: Any,
    ) -> _Job:
        """The job of a save to ``path``. Options refused on this rank (a bad compression,
        say) do not raise here: the save reports them on every rank (see ``error``)."""
        merged, error = merge_or_refuse(options, keywords, SAVE, where)
        base = job.pop("base", None)
        try:
            job["base"] = None if base is None or not merged.incremental else resolve_store(base)
        except (TypeError, ValueError) as exc:
            error = error or exc
        return cls(resolve(merged, path, comm), error=error, **job)

    @property
    def final(self) -> Store:
        return self.run.store

    @property
    def options(self) -> CheckpointOptions:
        return self.run.options


@overload
def save(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    comm: Communicator | None = ...,
    *,
    options: CheckpointOptions | None = ...,
    base: str | os.PathLike[str] | Store | None = ...,
    async_save: Literal[False] = ...,
    lazy: bool | Callable[[str], bool] = ...,
    after_commit: Callable[[], None] | None = ...,
    **keywords: Unpack[SaveKeywords],
) -> SaveResult: ...


@overload
def save(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    comm: Communicator | None = ...,
    *,
    options: CheckpointOptions | None = ...,
    base: str | os.PathLike[str] | Store | None = ...,
    async_save: Literal[True],
    lazy: bool | Callable[[str], bool] = ...,
    after_commit: Callable[[], None] | None = ...,
    **keywords: Unpack[SaveKeywords],
) -> AsyncSave: ...


@overload
def save(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    comm: Communicator | None = ...,
    *,
    options: CheckpointOptions | None = ...,
    base: str | os.PathLike[str] | Store | None = ...,
    async_save: bool,
    lazy: bool | Callable[[str], bool] = ...,
    after_commit: Callable[[], None] | None = ...,
    **keywords: Unpack[SaveKeywords],
) -> SaveResult | AsyncSave: ...


def save(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    comm: Communicator | None = None,
    *,
    options: CheckpointOptions | None = None,
    base: str | os.PathLike[str] | Store | None = None,
    async_save: bool = False,
    lazy: bool | Callable[[str], bool] = False,
    after_commit: Callable[[], None] | None = None,
    **keywords: Unpack[SaveKeywords],
) -> SaveResult | AsyncSave:
    """Save ``state`` as a committed checkpoint at ``path``; every rank calls it.

    ``state`` is a dict of tensors, DTensors, :class:`~distckpt.Shard`,
    :class:`~distckpt.PerRank` and small Python values, nested in dicts and lists. Plain
    tensors must hold the same value on every rank. ``path`` must not hold a committed
    checkpoint unless ``overwrite=True``, which replaces it atomically. Other Python objects
    are refused unless ``allow_pickle=True`` (they are then stored pickled, and loading them
    needs ``allow_pickle=True`` too). Moves no ``latest`` pointer. Example::

        distckpt.save({"model": model.state_dict(), "step": 10}, "run/ckpt-10")

    ``options`` (a :class:`~distckpt.CheckpointOptions`) holds the settings; each of its
    save fields (``compression``, ``small_bytes``, ``inner_bytes``, ``overwrite``,
    ``allow_pickle``, ``io_workers``) may also be given as a keyword argument, which wins.

    ``base`` (a committed checkpoint, typically the previous one of the run) makes the save
    incremental: every piece whose bytes are those ``base`` stores is taken from there (a
    hard link on a file system, a server-side copy on an object store) instead of
    written; only the bytes decide, by a strong hash (see :mod:`distckpt.engine.reuse`).
    The new checkpoint is whole on its own: deleting ``base`` later leaves it intact.
    ``SaveResult.bytes_reused`` says what was taken. With ``incremental=False`` (an
    option) ``base`` is ignored and nothing is hashed.

    ``async_save=True`` copies the tensors into reusable host buffers (pinned for GPU
    tensors) and returns an :class:`~distckpt.engine.background.AsyncSave` at once; the
    writing and the commit run on a background thread. Training may change the tensors
    as soon as the call returns. ``lazy=True`` (or a predicate on variable names) does not
    even copy those tensors before returning: the background thread copies them, and the
    caller must not change them before ``handle.wait_snapshot()`` returns (the training
    layer does this from an ``optimizer.step()`` hook). Every save, load and restore waits
    for the previous background save first, and raises its error if nobody waited.

    ``after_commit`` is called on the coordinator once the checkpoint is committed and
    before any rank returns (the training layer moves its ``latest`` pointer there); an
    error it raises is raised on every rank, the checkpoint staying committed.

    ``compression`` compresses the stored tensors: ``"zstd"``, ``"blosc-zstd"`` or
    ``"blosc-lz4"`` for all of them, or a mapping of name patterns (:mod:`fnmatch`, ``*``
    also matches ``/``) to a choice or None, where the first pattern that matches a name
    wins and a name none matches is stored raw::

        distckpt.save(state, path, compression={"optimizer/*": "zstd", "*": None})

    Tensors of at most ``small_bytes`` (plain chunks) are always stored raw. The
    coordinator's ``compression`` is the one used. Checksums cover the stored bytes,
    compressed or not.

    Each rank writes with ``io_workers`` threads (default: the cores this rank may use,
    see :mod:`distckpt.transfer.workers`; ``$DISTCKPT_IO_WORKERS`` overrides it). A
    blocking save copies GPU tensors to host memory a slab at a time through a bounded
    pool of pinned staging slabs (:mod:`distckpt.transfer.slabs`), never whole.
    """
    if lazy is not False and not async_save:
        raise ValueError("lazy saves run in the background: pass async_save=True as well")
    background.finish_pending()
    comm = comm or auto()
    job = _Job.of(
        options,
        keywords,
        path,
        comm,
        "save",
        after_commit=after_commit,
        show_progress=not async_save,
        base=base,
    )
    if not async_save:
        return _save_blocking(state, comm, job, source_for)

    def check() -> None:
        if job.error is not None:
            raise job.error

    return save_in_background(
        state,
        comm,
        job.options.allow_pickle,
        lazy,
        job.final.url,
        lambda bg_comm, snapped, error: _protocol(bg_comm, _hosted(snapped), job, error),
        check=check,
        yielding=job.options.yielding(),
    )


def _hosted(snapped: Snapped | Failure) -> LocalState | Failure:
    """A snapshot's leaves, read in place from its host copies."""
    if isinstance(snapped, Failure):
        return snapped
    leaves, arrays, values = snapped
    return LocalState(leaves, {name: HostData(array) for name, array in arrays.items()}, values)


def _save_blocking(
    state: dict[str, Any],
    comm: Communicator,
    job: _Job,
    source_of: Callable[[Any, str], Source],
) -> SaveResult:
    local: LocalState | Failure
    error: BaseException | None = None
    try:
        if job.error is not None:
            raise job.error
        leaves, values = gather_leaves(state, job.options.allow_pickle)
        sources = {
            leaf.name: source_of(leaf.tensor, leaf.name)
            for leaf in leaves
            if leaf.tensor is not None
        }
        local = LocalState(leaves, sources, values)
    except Exception as exc:
        local, error = Failure.capture(exc, comm.rank), exc
    return _protocol(comm, local, job, error=error)


def save_from(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    source_of: Callable[[Any, str], Source],
    comm: Communicator | None = None,
    *,
    options: CheckpointOptions | None = None,
    **keywords: Unpack[SaveKeywords],
) -> SaveResult:
    """A blocking :func:`save` that reads each tensor leaf through ``source_of(tensor,
    name)``: an import's state holds meta tensors (their shapes and dtypes) whose bytes
    come from the source files (:class:`~distckpt.transfer.sources.FileData`) as the
    writer asks for them, through the staging slabs, so the state is never in memory."""
    background.finish_pending()
    comm = comm or auto()
    return _save_blocking(state, comm, _Job.of(options, keywords, path, comm, "save"), source_of)


def _protocol(
    comm: Communicator, local: LocalState | Failure, job: _Job, error: BaseException | None
) -> SaveResult:
    """Steps 1 to 5 of the protocol, from this rank's leaves or the failure that replaced
    them (``error``, the local exception, is re-raised as itself on this rank)."""
    final = job.final
    opts = job.options
    result = SaveResult(location(final))
    stored_bytes = 0  # by every rank: known to the coordinator
    t0 = time.perf_counter()

    # 1-2. Describe, and agree on a plan (the last one, while nothing changed).
    descs: list[Desc] | Failure = local if isinstance(local, Failure) else []
    if isinstance(local, LocalState):
        try:
            descs = describe_state(local)
        except Exception as exc:
            error, descs = exc, Failure.capture(exc, comm.rank)
    # What a cached plan must have been made with (a mapping of compression choices is
    # ordered: its first matching pattern wins).
    made_with = (opts.small_bytes, opts.inner_bytes, opts.compression_key(), comm.size)
    staging: Transaction | None = None
    try:
        agreed = agree(
            comm,
            descs,
            lambda names: replica_checksums(local, names, job.run.io_workers),  # type: ignore[arg-type]
            made_with,
            lambda ranks: plan_save(
                ranks,
                small_bytes=opts.small_bytes,
                inner_bytes=opts.inner_bytes,
                compression=opts.compression,
            ),
            lambda token: begin(final, token, comm.size, overwrite=opts.overwrite),
            error,
        )
        staging = agreed.begun
        known_base = None if job.base is None else reuse.check_base(comm, job.base)
        stored: dict[str, tuple[Piece, Stored]] = {}  # this rank's pieces, as stored
        work = agreed.work
        local_error: BaseException | None = error
        assert isinstance(local, LocalState)
        t_plan = time.perf_counter()

        # 3-4. Exchange small tensors, write.
        report: Any
        received, report = send_small(comm, work, local.sources)
        t_exchange = time.perf_counter()
        if not isinstance(report, Failure):
            try:
                report = _write(work, local, received, comm.rank, job, result, known_base, stored)
            except Exception as exc:
                local_error, report = exc, Failure.capture(exc, comm.rank)
        t_write = time.perf_counter()

        # 5. Commit (the coordinator, once every rank's report is in).
        index_version: str | None = None

        def commit_all(reports: list[Report]) -> None:
            nonlocal staging, stored_bytes, index_version
            assert staging is not None and agreed.plan is not None
            stored_bytes = sum(report.nbytes for report in reports)
            raw = commit(agreed.plan, reports, agreed.values or {}, staging, work.token)
            index_version = index_mod.version_of(raw)
            staging = None  # committed: nothing left to abort
            if job.after_commit is not None:
                job.after_commit()  # its error is every rank's, the checkpoint committed

        def abort_unless_committed(failure: Failure | None) -> None:
            nonlocal staging
            if staging is not None:
                staging.abort()
                staging = None

        coordinate(comm, report, commit_all, error=local_error, settle=abort_unless_committed)
        if job.options.incremental:
            reuse.remember_saved(final, index_version, stored)
    except BaseException as exc:
        # A collective that failed (a dead rank, a time-out) skips the normal abort: never
        # leave a staging directory whose heartbeat would keep it looking alive.
        if staging is not None:
            staging.abort()
        error = interfered(exc, f"saving {final.url}")
        if error is exc:
            raise
        raise error from exc
    t_end = time.perf_counter()
    result.plan_reused = agreed.reused
    result.save_id = work.token
    result.timings = {
        "plan": t_plan - t0,
        "exchange": t_exchange - t_plan,
        "write": t_write - t_exchange,
        "commit": t_end - t_write,
        "total": t_end - t0,
    }
    if comm.rank == COORDINATOR:
        assert agreed.plan is not None
        log.info(
            "saved %s: %d variables, %d bytes from %d ranks in %.3fs (%s plan; %s)",
            final.url,
            len(agreed.plan.specs),
            stored_bytes,
            comm.size,
            result.timings["total"],
            "reused" if agreed.reused else "new",
            ", ".join(f"{k} {v:.3f}s" for k, v in result.timings.items() if k != "total"),
        )
    return result


def _write(
    work: RankWork,
    local: LocalState,
    received: dict[int, dict[int, bytes]],
    rank: int,
    job: _Job,
    result: SaveResult,
    known_base: reuse.Known | None,
    stored: dict[str, tuple[Piece, Stored]],
) -> Report:
    """Write this rank's pieces into the staging directory with its I/O workers (or take
    them from the base, when unchanged); return what each stores.

    On a terminal, rank 0 shows its own progress (its pieces' bytes before compression)
    when they add up to :data:`distckpt.progress.THRESHOLD` or more."""
    root = save_root(job.final, work.token)
    jobs: list[PieceJob] = []
    files: list[tuple[str, bytes]] = []
    like: dict[str, tuple[Store, str]] = {}  # metadata an incremental save may link
    caps = job.final.capabilities
    for piece in work.writes:
        if piece.meta_file is not None and piece.meta is not None:
            files.append((piece.meta_file, zarr_meta.dumps(piece.meta)))
        data = assemble(piece, local.sources, received.get(piece.id, {}), rank)
        taken = (
            None if job.base is None else reuse.reuse_for(job.base, known_base, job.final, piece)
        )
        jobs.append(
            PieceJob(piece.id, piece.file, data, piece.block, piece.inner, piece.codec, taken)
        )
        if taken is not None and piece.meta_file is not None and caps.local_files:
            like[piece.meta_file] = (taken.store, piece.meta_file)
    keys = [job.key for job in jobs] + [key for key, _ in files]
    root.prepare(keys)
    total = sum(p.box.numel * dtypes.itemsize(p.dtype) for p in work.writes)
    label = f"saving {job.final.name} (rank 0's share)"
    with progress(label, total if job.show_progress else 0, rank=rank) as bar:
        written = write_pieces(
            root,
            jobs,
            files,
            like,
            workers=job.run.io_workers,
            on_bytes=bar.update,
            digests=job.options.incremental,
        )
    reused = [s for s in written.values() if s.reused is not None]
    result.bytes_reused += sum(s.size for s in reused)
    result.pieces_reused += len(reused)
    result.bytes_written += sum(s.size for s in written.values()) - result.bytes_reused
    result.files_written += len(files) + sum(
        1 for s in written.values() if s.size and s.reused is None
    )
    stored.update((piece.file, (piece, written[piece.id])) for piece in work.writes)
    return Report.of(written)
