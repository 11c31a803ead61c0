"""The restore pipeline: what a kind of restore implements (:class:`RestoreKind`) and the
driver that runs its stages on every rank (:func:`restore`); the call order is in
:mod:`distckpt.pipeline`."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any, Protocol, TypeVar

from distckpt.comm import Communicator, raise_if_any_failed
from distckpt.pipeline.matching import agree_names
from distckpt.pipeline.options import CheckpointOptions
from distckpt.pipeline.results import LoadResult

log = logging.getLogger("distckpt")

M = TypeVar("M")  # a rank's reads, checked


class Source(Protocol):
    """What a restore reads from, as :meth:`RestoreKind.read_metadata` found it."""

    #: The stored names, the same on every rank.
    @property
    def stored(self) -> Collection[str]: ...


S = TypeVar("S", bound=Source)


class RestoreKind(Protocol[S, M]):
    """One restore of one kind (an object per stored source). Every rank makes these
    calls, in this order, each handed what the one before returned: :meth:`read_metadata`
    (collective) gives the source; then :meth:`match` and :meth:`offer` (this rank alone),
    one agreement on the names (collective), and :meth:`read` when every rank can read;
    :meth:`again` says whether to match and read once more. A kind that subclasses this
    protocol inherits :meth:`again` (never).
    """

    #: The restore's settings: ``strict`` for the names agreement, the rest the kind's.
    options: CheckpointOptions
    #: What the result names as the place restored from.
    path: Path | str
    #: What a names error calls the stored side (``"checkpoint"``, ``"weights"``).
    source: str

    def read_metadata(self, comm: Communicator) -> S:
        """Collective: what is stored (read once, for every rank), or raise (the same
        error on every rank: the restore then fails once the ranks agree)."""
        ...

    def match(
        self, comm: Communicator, source: S, state: dict[str, Any], result: LoadResult
    ) -> M | None:
        """This rank's reads, every leaf checked before anything is read; sets
        ``result.missing`` and ``result.unexpected`` (this rank's). None when
        ``options.strict`` and a name is missing (the job then fails with the names)."""
        ...

    def offer(self, comm: Communicator, matched: M) -> Any:
        """What this rank tells every other in the names agreement (never None)."""
        ...

    def read(
        self, comm: Communicator, source: S, matched: M, offers: list[Any], result: LoadResult
    ) -> None:
        """Read into the targets (every rank's ``offers`` in rank order); every rank
        calls it, or none does."""
        ...

    def again(self, comm: Communicator) -> bool:
        """After a read (on every rank alike): whether to match and read once more."""
        return False


def restore(comm: Communicator, kind: RestoreKind[Any, Any], state: dict[str, Any]) -> LoadResult:
    """Fill ``state`` in place through ``kind`` as its options say; every rank returns its
    result or raises the same error. Collective."""
    t0 = time.perf_counter()
    unopened: BaseException | None = None
    source: Any = None
    try:
        source = kind.read_metadata(comm)
    except Exception as exc:  # the same on every rank: raised once the ranks agree
        unopened = exc
    stored: Collection[str] = () if source is None else source.stored
    while True:
        result = LoadResult(kind.path)
        error = unopened
        matched: Any = None
        offer: Any = None  # None: this rank cannot read
        try:
            if error is None:
                matched = kind.match(comm, source, state, result)
            if matched is not None:
                offer = kind.offer(comm, matched)
        except Exception as exc:
            error = exc
        try:
            try:
                strict = kind.options.strict
                offers = agree_names(comm, offer, stored, result, strict, kind.source)
            finally:
                t_plan = time.perf_counter()
            if all(o is not None for o in offers):
                kind.read(comm, source, matched, offers, result)
        except Exception as exc:
            error = error or exc
        if not kind.again(comm):
            break
    result.timings["plan"] = t_plan - t0
    result.timings["read"] = time.perf_counter() - t_plan
    return _settle(comm, result, error, t0)


def _settle(
    comm: Communicator, result: LoadResult, error: BaseException | None, t0: float
) -> LoadResult:
    """The end of a restore on every rank: raise if any rank failed, else time and log it."""
    raise_if_any_failed(comm, error)
    result.timings["total"] = time.perf_counter() - t0
    if comm.rank == 0:
        log.info(
            "restored %s: %d variables, %d bytes read by rank 0 in %.3fs (%s)",
            result.path,
            len(result.loaded),
            result.bytes_read,
            result.timings["total"],
            ", ".join(f"{k} {v:.3f}s" for k, v in result.timings.items() if k != "total"),
        )
    return result
