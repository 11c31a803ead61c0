"""The save pipeline: what a kind of save implements (:class:`SaveKind`) and the driver
that runs its stages on every rank (:func:`save`); the call order is in
:mod:`distckpt.pipeline`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from distckpt.comm import Communicator
from distckpt.comm.outcome import Failure
from distckpt.pipeline.background import AsyncSave, Snapped, save_in_background
from distckpt.pipeline.clock import Clock
from distckpt.pipeline.options import CheckpointOptions
from distckpt.pipeline.results import SaveResult

L = TypeVar("L")  # this rank's state as the kind reads it
P = TypeVar("P")  # the plan the ranks agreed on


class SaveKind(Protocol[L, P]):
    """One save of one kind (an object per save, used once). Every rank makes these
    calls, in this order:

    1. :meth:`check`, :meth:`capture` (or, in the background, :meth:`hosted`),
       :meth:`describe`: this rank alone;
    2. :meth:`plan`: collective, every rank returns the same plan or raises;
    3. :meth:`write`: this rank's share (collectives allowed, as long as every rank
       makes them whatever failed);
    4. :meth:`commit`: collective, every rank returns or raises the same error;
    5. :meth:`finish`: this rank's result;

    and :meth:`abort` when an exception escapes steps 2 to 4. Each step hands the next
    what it made (``capture`` the state ``describe`` reads, ``plan`` the plan, ``write``
    the report ``commit`` gathers, ``commit`` what ``finish`` reports), so a kind keeps
    nothing between steps but what it was made with. A kind that subclasses
    this protocol inherits the defaults of :meth:`check`, :meth:`hosted` and
    :meth:`abort`.
    """

    #: The save's settings: ``allow_pickle`` and ``yielding()`` shape a background save.
    options: CheckpointOptions
    #: What the save makes, as a background save's handle names it.
    where: str

    def check(self) -> None:
        """Raise this rank's refusal of the save's arguments, before anything is read (the
        plan step reports it on every rank)."""
        return None

    def capture(self, state: Any) -> L:
        """A blocking save: this rank's ``state`` as the save reads it (no communication)."""
        ...

    def hosted(self, snapped: Snapped) -> L:
        """A background save: the same, from a snapshot's host copies."""
        raise TypeError(f"{type(self).__name__} does not save in the background")

    def describe(self, local: L) -> Any:
        """What this rank contributes to the plan (no communication)."""
        ...

    def plan(self, comm: Communicator, described: Any, error: BaseException | None) -> P:
        """Collective: the plan every rank follows, or the same error on every rank.
        ``described`` is :meth:`describe`'s result or the :class:`Failure` of ``error``
        (this rank's own exception, which it raises as itself)."""
        ...

    def write(self, comm: Communicator, plan: P, clock: Clock) -> Any:
        """This rank's share of ``plan``; returns its report (or a :class:`Failure` that
        replaced it). ``clock`` times sub-stages and shows progress."""
        ...

    def commit(self, comm: Communicator, plan: P, report: Any, error: BaseException | None) -> Any:
        """Collective: with every rank's ``report`` in (each the :class:`Failure` of its
        ``error`` where its write failed), make the save durable, or raise the first
        failure on every rank having removed what the save wrote. Returns what
        :meth:`finish` reports."""
        ...

    def finish(
        self, comm: Communicator, plan: P, committed: Any, timings: dict[str, float]
    ) -> SaveResult:
        """This rank's result, from what :meth:`commit` returned and the stages' ``timings``
        (``plan``, ``write``, ``commit``, ``total`` and any :meth:`Clock.lap` of the kind's
        own)."""
        ...

    def abort(self, exc: BaseException) -> BaseException:
        """``exc`` escaped a stage on this rank (a collective failed): undo what this rank
        began and return the exception to raise (``exc`` itself, or one raised from it)."""
        return exc


def save(
    kind: SaveKind[Any, Any],
    state: Any,
    comm: Communicator,
    *,
    async_save: bool = False,
    lazy: bool | Callable[[str], bool] = False,
) -> SaveResult | AsyncSave:
    """Run ``kind`` on ``state``: blocking (:func:`save_blocking`), or with ``async_save``
    in the background after a snapshot of ``state`` (``lazy``: which tensors the
    background thread copies; see :func:`distckpt.save`). Collective."""
    if not async_save:
        return save_blocking(kind, state, comm)
    return save_in_background(
        state,
        comm,
        kind.options.allow_pickle,
        lazy,
        kind.where,
        lambda bg_comm, snapped, error: _run(bg_comm, kind, _hosted(kind, snapped), error),
        check=kind.check,
        yielding=kind.options.yielding(),
    )


def save_blocking(kind: SaveKind[Any, Any], state: Any, comm: Communicator) -> SaveResult:
    """Run ``kind`` on ``state`` on this thread, every stage. Collective."""
    local: Any
    error: BaseException | None = None
    try:
        kind.check()
        local = kind.capture(state)
    except Exception as exc:
        local, error = Failure.capture(exc, comm.rank), exc
    return _run(comm, kind, local, error, show_progress=True)


def _hosted(kind: SaveKind[Any, Any], snapped: Snapped | Failure) -> Any:
    return snapped if isinstance(snapped, Failure) else kind.hosted(snapped)


def _run(
    comm: Communicator,
    kind: SaveKind[Any, Any],
    local: Any,
    error: BaseException | None,
    *,
    show_progress: bool = False,
) -> SaveResult:
    """Stages 1 to 5 from this rank's captured state, or the :class:`Failure` that
    replaced it (``error``, the exception, is raised as itself on this rank)."""
    clock = Clock(comm.rank, show_progress=show_progress)
    described: Any = local
    if not isinstance(local, Failure):
        try:
            described = kind.describe(local)
        except Exception as exc:
            error, described = exc, Failure.capture(exc, comm.rank)
    try:
        plan = kind.plan(comm, described, error)
        clock.lap("plan")
        report: Any
        try:
            report, error = kind.write(comm, plan, clock), None
        except Exception as exc:
            report, error = Failure.capture(exc, comm.rank), exc
        clock.lap("write")
        committed = kind.commit(comm, plan, report, error)
        clock.lap("commit")
    except BaseException as exc:
        raised = kind.abort(exc)
        if raised is exc:
            raise
        raise raised from exc
    return kind.finish(comm, plan, committed, clock.timings())
