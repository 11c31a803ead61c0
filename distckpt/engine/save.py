"""``distckpt.save``: one checkpoint, written by every rank, committed by the coordinator.

A kind of the save pipeline (:mod:`distckpt.pipeline`, which runs the stages, reports a
failure on every rank and runs background saves). The protocol, in the order every rank
runs it (collectives marked *):

1. **Describe** (every rank): flatten the state; describe each leaf (name, dtype, global
   shape, box; a crc32c of each replicated tensor; values as typed JSON).
2. **Plan** (*gather to the coordinator, coordinator, *broadcast): the coordinator checks
   the path (:class:`~distckpt.errors.CheckpointExists`), removes abandoned saves,
   validates the descriptions and plans the writes
   (:func:`~distckpt.planning.save_plan.make_save_plan`), begins the save's transaction
   (:mod:`distckpt.commit.transaction`: a staging directory on a file system, a claim on
   the name on an object store) and broadcasts the plan, or the first error, which every
   rank then raises. Nothing has been written yet when a validation error is raised.
3. **Exchange** (*one gather per writer of small tensors, the start of the pipeline's
   write stage): the ranks holding boxes of a small tensor send their bytes to its writer.
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

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

from distckpt import dtypes, pipeline
from distckpt.comm import Communicator
from distckpt.comm.base import COORDINATOR
from distckpt.comm.outcome import Failure, collect, deliver
from distckpt.commit.transaction import save_root
from distckpt.engine import reuse
from distckpt.engine.agree import Agreed, Target, Terms, abort_begun, agree
from distckpt.engine.commit import Report, commit
from distckpt.engine.gather_small import assemble, send_small
from distckpt.engine.local_state import Described, LocalState, describe_state
from distckpt.errors import interfered
from distckpt.format import zarr_meta
from distckpt.format.index import version_of
from distckpt.format.shard_io import Stored
from distckpt.items import gather_leaves
from distckpt.pipeline import Clock, SaveKind, communicator
from distckpt.pipeline.background import AsyncSave, Snapped
from distckpt.pipeline.options import (
    SAVE,
    CheckpointOptions,
    Resolved,
    SaveKeywords,
    merge_or_refuse,
    resolve_run,
)
from distckpt.pipeline.results import SaveResult
from distckpt.planning.pieces import Piece
from distckpt.signing import hashes
from distckpt.signing.keys import signing_key, wants_signature
from distckpt.storage.backend import Store
from distckpt.storage.registry import location, open_store
from distckpt.transfer.jobs import PieceJob
from distckpt.transfer.sources import HostData, Source, source_for
from distckpt.transfer.writer import write_pieces

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger("distckpt")


@dataclass
class _Planned:
    """What the ranks agreed on, the state it covers, and what an incremental save may
    take from its base."""

    agreed: Agreed
    local: LocalState
    known_base: reuse.Known | None


@dataclass
class _Written:
    """This rank's write: its report for the commit, its pieces as stored (an
    incremental save remembers them) and its counts for the result."""

    report: Report
    stored: dict[str, tuple[Piece, Stored]]
    counts: SaveResult


@dataclass
class _Committed:
    """The commit, as the coordinator saw it: the version of the index it wrote and the
    bytes every rank stored (None and 0 on the other ranks)."""

    written: _Written
    index_version: str | None
    stored_bytes: int


class _CheckpointSave(SaveKind[LocalState, _Planned]):
    """One save of a checkpoint (steps 1 to 5 of the module doc, as a kind of
    :mod:`distckpt.pipeline`): its options, resolved once (store, I/O workers), the
    callback after its commit and the checkpoint it builds on, all fixed when it is made;
    each step hands the next what it made."""

    def __init__(
        self,
        options: CheckpointOptions | None,
        keywords: Mapping[str, Any],
        path: str | os.PathLike[str],
        comm: Communicator,
        where: str,
        *,
        source_of: Callable[[Any, str], Source] = source_for,
        after_commit: Callable[[], None] | None = None,
        base: str | os.PathLike[str] | Store | None = None,
    ) -> None:
        # Options refused on this rank (a bad compression, say) do not raise here: the
        # save reports them on every rank (see ``check``).
        merged, self.error = merge_or_refuse(options, keywords, SAVE, where)
        self.run: Resolved = resolve_run(merged, path, comm)
        self.options: CheckpointOptions = self.run.options
        self.final: Store = self.run.store
        self.where = self.final.url
        self.source_of = source_of
        self.after_commit = after_commit
        # The checkpoint it builds on (an incremental save to a store that can copy).
        self.base: Store | None = None
        try:
            if base is not None and merged.incremental and self.final.capabilities.copies:
                self.base = open_store(base)
        except (TypeError, ValueError) as exc:
            self.error = self.error or exc
        # A signed save: every rank hashes what it stores; the coordinator signs.
        self.hashing: str | None = None
        try:
            if wants_signature(merged.signing_key):
                self.hashing = hashes.default_algorithm()
        except ValueError as exc:
            self.error = self.error or exc

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def capture(self, state: dict[str, Any]) -> LocalState:
        leaves, values = gather_leaves(state, self.options.allow_pickle)
        sources = {
            leaf.name: self.source_of(leaf.tensor, leaf.name)
            for leaf in leaves
            if leaf.tensor is not None
        }
        run = self.run.for_tensors(leaf.tensor for leaf in leaves)
        return LocalState(leaves, sources, values, run.workers)

    def hosted(self, snapped: Snapped) -> LocalState:
        """A snapshot's leaves, read in place from its host copies."""
        leaves, arrays, values = snapped
        sources: dict[str, Source] = {name: HostData(array) for name, array in arrays.items()}
        return LocalState(leaves, sources, values, self.run.workers)

    def describe(self, local: LocalState) -> Described:
        return Described(local, describe_state(local))

    def plan(
        self, comm: Communicator, described: Described | Failure, error: BaseException | None
    ) -> _Planned:
        """Steps 1-2: agree on a plan (the last one, while nothing changed), begin the
        transaction; with a base, learn what may be taken from it."""
        opts = self.options
        terms = Terms(comm.size, opts.small_bytes, opts.inner_bytes, opts.compression)
        agreed = agree(comm, described, error, terms, Target(self.final, opts.overwrite))
        assert not isinstance(described, Failure)  # a rank's failure is raised on every rank
        try:
            known_base = None if self.base is None else reuse.check_base(comm, self.base)
        except BaseException:
            abort_begun(agreed)  # begun on the coordinator: never left behind
            raise
        return _Planned(agreed, described.local, known_base)

    def write(self, comm: Communicator, planned: _Planned, clock: Clock) -> _Written | Failure:
        """Steps 3-4: exchange small tensors, write."""
        try:
            work, sources = planned.agreed.work, planned.local.sources
            received, failure = send_small(comm, work, sources)
            clock.lap("exchange")
            if failure is not None:
                return failure
            return self._write(planned, received, comm.rank, clock)
        except Exception:
            raise  # the commit reports it, and the coordinator aborts the save there
        except BaseException:
            abort_begun(planned.agreed)  # an interrupt: the commit is never reached
            raise

    def commit(
        self,
        comm: Communicator,
        planned: _Planned,
        written: _Written | Failure,
        error: BaseException | None,
    ) -> _Committed:
        """Step 5 (*gather, the coordinator commits, *broadcast): with every rank's report
        in, the coordinator writes the index, or aborts the save; every rank returns or
        raises the same error."""
        agreed = planned.agreed
        published: tuple[str, int] | None = None  # the coordinator's, once committed
        try:
            reports = collect(comm, written if isinstance(written, Failure) else written.report)
            outcome: Any = reports
            if isinstance(reports, list):
                try:
                    published = self._publish(agreed, reports)
                    outcome = None
                    if self.after_commit is not None:
                        self.after_commit()  # its error is every rank's, the save committed
                except Exception as exc:
                    error, outcome = exc, Failure.capture(exc, comm.rank)
        finally:
            if published is None:  # before any rank goes on (a no-op but on the coordinator)
                abort_begun(agreed)
        deliver(comm, outcome, error)
        assert not isinstance(written, Failure)
        index_version, stored_bytes = published or (None, 0)
        if self.options.incremental:
            reuse.remember_saved(self.final, index_version, written.stored, self.hashing)
        return _Committed(written, index_version, stored_bytes)

    def abort(self, exc: BaseException) -> BaseException:
        return interfered(exc, f"saving {self.final.url}")

    def finish(
        self,
        comm: Communicator,
        planned: _Planned,
        committed: _Committed,
        timings: dict[str, float],
    ) -> SaveResult:
        agreed, workers = planned.agreed, planned.local.workers
        result = dataclasses.replace(
            committed.written.counts,
            plan_reused=agreed.reused,
            save_id=agreed.work.token,
            timings=timings,
            io_workers=workers.count,
            io_workers_reason=workers.reason,
        )
        if comm.rank == COORDINATOR:
            assert agreed.plan is not None
            log.info(
                "saved %s: %d variables, %d bytes from %d ranks in %.3fs (%s plan; %s)",
                self.final.url,
                len(agreed.plan.specs),
                committed.stored_bytes,
                comm.size,
                timings["total"],
                "reused" if agreed.reused else "new",
                ", ".join(f"{k} {v:.3f}s" for k, v in timings.items() if k != "total"),
            )
        return result

    def _publish(self, agreed: Agreed, reports: list[Report]) -> tuple[str, int]:
        """The coordinator's commit: the index written through the transaction; returns
        its version and the bytes every rank stored."""
        assert agreed.transaction is not None and agreed.plan is not None
        signer = signing_key(self.options.signing_key) if self.hashing else None
        values = agreed.values or {}
        raw = commit(agreed.plan, reports, values, agreed.transaction, agreed.work.token, signer)
        return version_of(raw), sum(report.nbytes for report in reports)

    def _write(
        self, planned: _Planned, received: dict[int, dict[int, bytes]], rank: int, clock: Clock
    ) -> _Written:
        """Write this rank's pieces into the staging directory with its I/O workers (or
        take them from the base, when unchanged); return what each stores.

        On a terminal, rank 0 shows its own progress (its pieces' bytes before
        compression) when they add up to :data:`distckpt.progress.THRESHOLD` or more."""
        work, workers = planned.agreed.work, planned.local.workers
        sources = planned.local.sources
        root = save_root(self.final, work.token)
        jobs: list[PieceJob] = []
        files: list[tuple[str, bytes]] = []
        like: dict[str, tuple[Store, str]] = {}  # metadata an incremental save may link
        caps = self.final.capabilities
        for piece in work.writes:
            if piece.meta_file is not None and piece.meta is not None:
                files.append((piece.meta_file, zarr_meta.dumps(piece.meta)))
            data = assemble(piece, sources, received.get(piece.id, {}), rank)
            taken = (
                None
                if self.base is None
                else reuse.reuse_for(self.base, planned.known_base, self.final, piece, self.hashing)
            )
            jobs.append(
                PieceJob(piece.id, piece.file, data, piece.block, piece.inner, piece.codec, taken)
            )
            if taken is not None and piece.meta_file is not None and caps.local_files:
                like[piece.meta_file] = (taken.store, piece.meta_file)
        keys = [job.key for job in jobs] + [key for key, _ in files]
        root.prepare(keys)
        total = sum(p.box.numel * dtypes.itemsize(p.dtype) for p in work.writes)
        label = f"saving {self.final.name} (rank 0's share, {workers})"
        with clock.progress(label, total) as bar:
            written = write_pieces(
                root,
                jobs,
                files,
                like,
                workers=workers.count,
                on_bytes=bar.update,
                digests=self.options.incremental,
                hashing=self.hashing,
            )
        reused = [s for s in written.values() if s.reused is not None]
        counts = SaveResult(location(self.final))
        counts.bytes_reused = sum(s.size for s in reused)
        counts.pieces_reused = len(reused)
        counts.bytes_written = sum(s.size for s in written.values()) - counts.bytes_reused
        counts.files_written = len(files) + sum(
            1 for s in written.values() if s.size and s.reused is None
        )
        stored = {piece.file: (piece, written[piece.id]) for piece in work.writes}
        return _Written(Report.of(written, self.hashing), stored, counts)


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
    needs ``allow_pickle=True`` too). Moves no ``latest`` pointer. Returns a
    :class:`~distckpt.SaveResult` once the checkpoint is committed; with
    ``async_save=True``, an :class:`~distckpt.AsyncSave` at once (see below). Example::

        distckpt.save({"model": model.state_dict(), "step": 10}, "run/ckpt-10")

    ``options`` (a :class:`~distckpt.CheckpointOptions`) holds the settings; each of its
    save fields (``compression``, ``small_bytes``, ``inner_bytes``, ``overwrite``,
    ``allow_pickle``, ``io_workers``, ...: :class:`~distckpt.SaveKeywords`)
    may also be given as a keyword argument, which wins.

    ``base`` (a committed checkpoint, typically the previous one of the run) makes the save
    incremental: every piece whose bytes are those ``base`` stores is taken from there (a
    hard link on a file system, a server-side copy on an object store) instead of
    written; only the bytes decide, by a strong hash (see :mod:`distckpt.engine.reuse`).
    The new checkpoint is whole on its own: deleting ``base`` later leaves it intact.
    ``SaveResult.bytes_reused`` says what was taken. With ``incremental=False`` (an
    option) ``base`` is ignored and nothing is hashed.

    ``async_save=True`` copies the tensors into reusable host buffers (pinned for GPU
    tensors) and returns an :class:`~distckpt.pipeline.background.AsyncSave` at once; the
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

    Each rank writes with ``io_workers`` threads (default: the cores this rank may use, at
    most 8 for GPU tensors, see :mod:`distckpt.transfer.workers`; ``$DISTCKPT_IO_WORKERS``
    overrides it). A blocking save copies GPU tensors to host memory a slab at a time
    through a bounded pool of pinned staging slabs (:mod:`distckpt.transfer.slabs`), never
    whole.
    """
    if lazy is not False and not async_save:
        raise ValueError("lazy saves run in the background: pass async_save=True as well")
    comm = communicator(comm)
    kind = _CheckpointSave(
        options, keywords, path, comm, "save", after_commit=after_commit, base=base
    )
    return pipeline.save(kind, state, comm, async_save=async_save, lazy=lazy)


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
    comm = communicator(comm)
    kind = _CheckpointSave(options, keywords, path, comm, "save", source_of=source_of)
    return pipeline.save_blocking(kind, state, comm)
