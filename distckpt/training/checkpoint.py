"""``distckpt.Checkpoint``: an object graph saved and restored by name, as
``tf.train.Checkpoint``.

Names come from keyword and attribute names, then from what each object holds:
``Checkpoint(net=net, optimizer=opt, step=step)`` saves ``net/l1/weight`` for
``net.l1.weight``, Adam's moment of it as ``optimizer/state/net/l1/weight/exp_avg``, and
the counter as ``step`` (see :mod:`distckpt.training.tracking` for what can be tracked,
:mod:`distckpt.training.optim` for the optimizer layout). Next to the graph a checkpoint
holds ``save_counter`` and, when tensors are tied, ``_aliases`` (alias name to the name
the tensor was saved under).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distckpt.comm import Communicator, auto
from distckpt.engine.save import save as engine_save
from distckpt.errors import CorruptCheckpointError
from distckpt.pipeline import background
from distckpt.pipeline.background import AsyncSave
from distckpt.pipeline.background import prepare_async as engine_prepare_async
from distckpt.pipeline.options import (
    RESTORE,
    WRITE,
    CheckpointOptions,
    RestoreKeywords,
    WriteKeywords,
    merge,
)
from distckpt.training.handlers import collect, plan_restore
from distckpt.training.lazy import guard_optimizer_steps
from distckpt.training.names import nest
from distckpt.training.plan import Plan, Slot
from distckpt.training.pointer import advance_pointer
from distckpt.training.session import (
    ALIASES,
    SAVE_COUNTER,
    RestoreSession,
    Source,
    StoredCheckpoint,
)
from distckpt.training.status import CheckpointLoadStatus, InitializationOnlyStatus
from distckpt.training.tracking import Node, ObjectGraphError, track, walk

if TYPE_CHECKING:
    from typing_extensions import Unpack


class Checkpoint(Node):
    """Save and restore a graph of tracked objects, named by attribute, as TensorFlow.

    A training loop that resumes where it stopped::

        ckpt = distckpt.Checkpoint(step=torch.tensor(1), optimizer=opt, net=net,
                                   iterator=distckpt.training.SampleCursor(10, 2))
        status = ckpt.restore(distckpt.latest_checkpoint("run"))  # no-op on a fresh start
        for _ in range(50):
            train_step(); ckpt.step.add_(1)
            if int(ckpt.step) % 10 == 0:
                path = ckpt.save("run/ckpt")                      # run/ckpt-1, run/ckpt-2 ...

    Restoring into a new graph built from stand-ins fills just what it names::

        bias = torch.zeros(5)
        part = distckpt.Checkpoint(net=distckpt.Checkpoint(l1=distckpt.Checkpoint(bias=bias)))
        part.restore("run/ckpt-5").assert_existing_objects_matched()

    Attributes assigned later are tracked too (``ckpt.extra = ...``); after a restore they
    are filled the moment they are assigned (delayed restore), as are entries appended
    to tracked lists and dicts and the parameters of lazy modules at their first call.
    A name is restored once: assigning again to a name the restore already filled
    (``ckpt.epoch = ckpt.epoch + 1``) keeps what is assigned.
    Attribute names starting with ``_`` are not tracked; method names are refused.

    Every method that reads or writes is collective: call it on every rank, in the same
    order. ``comm`` defaults to :func:`distckpt.comm.auto`.
    """

    _tracked: dict[str, Any]
    _save_counter: int
    _session: RestoreSession | None
    _finalizer: weakref.finalize | None
    _base: str | None

    def __init__(self, **objects: Any) -> None:
        object.__setattr__(self, "_tracked", {})
        object.__setattr__(self, "_positions", [])
        object.__setattr__(self, "_save_counter", 0)
        object.__setattr__(self, "_session", None)
        object.__setattr__(self, "_finalizer", None)
        # The last checkpoint saved or restored: the base of the next incremental save.
        object.__setattr__(self, "_base", None)
        for name, obj in objects.items():
            setattr(self, name, obj)

    # ------------------------------------------------------------ tracking

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        if hasattr(type(self), name):
            raise ObjectGraphError(
                f"{name!r} is a Checkpoint method or property; pick another attribute name"
            )
        value = track(value, name)
        self._tracked[name] = value
        self._arrived(name, value)

    def __getattr__(self, name: str) -> Any:
        tracked = self.__dict__.get("_tracked", {})
        if name in tracked:
            return tracked[name]
        raise AttributeError(f"Checkpoint has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        if name in self._tracked:
            del self._tracked[name]
        else:
            object.__delattr__(self, name)

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self._tracked})

    def __repr__(self) -> str:
        return f"Checkpoint({', '.join(self._tracked)})"

    def _children(self) -> list[tuple[Any, Any]]:
        return list(self._tracked.items())

    def _replace(self, key: Any, value: Any) -> None:
        self._tracked[key] = value

    @property
    def save_counter(self) -> int:
        """How many times :meth:`save` has numbered a checkpoint (restored with the graph)."""
        return int(self._save_counter)

    # ------------------------------------------------------------ saving

    def write(
        self,
        path: str | os.PathLike[str],
        comm: Communicator | None = None,
        *,
        options: CheckpointOptions | None = None,
        async_save: bool = False,
        lazy: bool = False,
        **keywords: Unpack[WriteKeywords],
    ) -> Any:
        """Save the graph as a checkpoint at ``path``; no numbering, no pointer. Collective.

        Returns ``path`` (with ``async_save=True``, an
        :class:`~distckpt.pipeline.background.AsyncSave` whose ``path`` it is). Fails with
        :class:`~distckpt.errors.CheckpointExists` if a checkpoint is already committed
        there. Objects that are neither tensors nor typed Python values are refused unless
        ``allow_pickle=True`` (then stored pickled, and :meth:`restore` needs
        ``allow_pickle=True`` to read them). See :meth:`save` for ``options``,
        ``async_save`` and ``lazy``.
        """
        opts = merge(options, keywords, WRITE, "write")
        handle = self._write(path, comm, opts, async_save, lazy, None)
        return handle if async_save else os.fspath(path)

    def _write(
        self,
        path: str | os.PathLike[str],
        comm: Communicator | None,
        options: CheckpointOptions,
        async_save: bool,
        lazy: bool,
        after_commit: Callable[[], None] | None,
        base: str | None = None,
    ) -> Any:
        """Save the graph at ``path``, incrementally on ``base`` (default: the last
        checkpoint this graph saved or restored) when ``options.incremental``."""
        comm = comm or auto()
        state, lazy_names = self._to_save(options.allow_pickle, lazy)
        handle = engine_save(
            state,
            path,
            comm,
            options=options,
            base=base or self._base,
            async_save=async_save or lazy,
            lazy=lazy_names,
            after_commit=after_commit,
        )
        done = os.fspath(path)

        def saved(error: BaseException | None) -> None:
            if error is None:
                self._base = done

        if isinstance(handle, AsyncSave):
            handle.add_done_callback(saved)
        else:
            saved(None)
        return handle

    def _to_save(self, allow_pickle: bool, lazy: bool) -> tuple[dict[str, Any], Any]:
        """The state a save writes, and (``lazy``) the predicate naming the tensors that
        the background copies (the next step of a tracked optimizer waits for them)."""
        self._warn_unresolved()
        stable: set[str] = set()
        state = self._state(allow_pickle, stable)
        if not lazy:
            return state, False
        guard_optimizer_steps(v.obj for v in walk(self) if v.kind == "optimizer")
        return state, stable.__contains__

    def _state(self, allow_pickle: bool, stable: set[str] | None = None) -> dict[str, Any]:
        """The graph as the nested state the engine saves."""
        leaves, aliases = collect(self, allow_pickle=allow_pickle, stable=stable)
        leaves[SAVE_COUNTER] = self._save_counter
        if aliases:
            leaves[ALIASES] = aliases
        return nest(leaves)

    def prepare_async(self) -> int:
        """Allocate the host buffers of background saves now (see
        :func:`distckpt.prepare_async`); returns their bytes. Local. Call it after the
        first optimizer step, once the optimizer's state exists."""
        return engine_prepare_async(self._state(allow_pickle=True))

    def save(
        self,
        file_prefix: str | os.PathLike[str],
        comm: Communicator | None = None,
        *,
        options: CheckpointOptions | None = None,
        async_save: bool = False,
        lazy: bool = False,
        **keywords: Unpack[WriteKeywords],
    ) -> Any:
        """Save as ``{file_prefix}-{N}`` and make it its directory's latest. Collective.

        ``N`` is :attr:`save_counter` after incrementing it (1 for the first save of a
        fresh run; after a restore it continues from the restored counter). Once the
        checkpoint is committed, rank 0 replaces the directory's ``latest`` pointer (see
        :mod:`distckpt.training.pointer`). Returns the checkpoint's path::

            path = ckpt.save("run/ckpt")   # "run/ckpt-1"

        ``async_save=True`` copies the tensors into host buffers and returns an
        :class:`~distckpt.pipeline.background.AsyncSave` (``.path``, ``.wait()``,
        ``.done()``) while writing, commit and pointer go on in the background; the next
        save or restore (or :meth:`sync`) waits for it and raises its error.
        ``lazy=True`` (implies ``async_save``) returns without copying parameters and
        optimizer state at all: they are copied in the background, and the next
        ``optimizer.step()`` of a tracked optimizer first waits for those copies. Buffers,
        counters and other state are copied before ``save`` returns. Change parameters in
        place yourself between a lazy save and the next step only after :meth:`sync` (or
        ``handle.wait_snapshot()``).

        ``options`` (a :class:`~distckpt.CheckpointOptions`) and the keyword arguments
        ``compression`` (``"zstd"``, ``"blosc-zstd"``, ``"blosc-lz4"`` or a mapping of name
        patterns, such as ``{"optimizer/*": "zstd"}``), ``small_bytes``, ``inner_bytes``,
        ``allow_pickle`` and ``io_workers`` are as in :func:`distckpt.save`.
        """
        opts = merge(options, keywords, WRITE, "save")
        comm = comm or auto()
        counter = self._save_counter + 1
        path = f"{os.fspath(file_prefix)}-{counter}"
        self._save_counter = counter

        def undo(error: BaseException | None) -> None:
            if error is not None and self._save_counter == counter:
                self._save_counter = counter - 1

        def move_pointer() -> None:  # coordinator, once committed
            advance_pointer(path)

        try:
            handle = self._write(path, comm, opts, async_save, lazy, move_pointer)
        except BaseException as exc:
            undo(exc)
            raise
        if isinstance(handle, AsyncSave):
            handle.add_done_callback(undo)
            return handle
        return path

    def sync(self) -> None:
        """Wait for a background save to commit; raise its error if it failed. Local."""
        background.finish_pending()

    # ------------------------------------------------------------ restoring

    def restore(
        self,
        path: str | os.PathLike[str] | None,
        comm: Communicator | None = None,
        *,
        options: CheckpointOptions | None = None,
        **keywords: Unpack[RestoreKeywords],
    ) -> CheckpointLoadStatus | InitializationOnlyStatus:
        """Fill the graph from the checkpoint at ``path``; collective.

        ``path`` None (no checkpoint yet) restores nothing and returns a status whose
        assertions fail. Otherwise every object the checkpoint names is restored now:
        tensors in place (resharded), Python values by replacement, objects with
        ``state_dict`` through ``load_state_dict``, optimizers by parameter name (their
        state is created first if they have not stepped yet). Values for objects that do
        not exist yet are applied when they appear. Returns a
        :class:`~distckpt.training.status.CheckpointLoadStatus`.

        A tensor whose shape or dtype differs from the checkpoint raises
        :class:`~distckpt.errors.ShapeMismatchError` naming the variable and both shapes.
        A value saved pickled is refused unless ``allow_pickle=True`` (unpickling runs code
        from the checkpoint: only for checkpoints you trust). ``io_workers`` is each rank's
        number of I/O threads (see :func:`distckpt.load`); ``trusted_keys`` refuses a
        checkpoint not signed by one of them (:mod:`distckpt.signing`); each may come in
        ``options``.
        """
        opts = merge(options, keywords, RESTORE, "restore")
        if path is None:
            self._warn_unresolved()
            background.finish_pending()
            return InitializationOnlyStatus()
        comm = comm or auto()
        background.finish_pending()
        source = StoredCheckpoint(path, comm, opts.trusted_keys)
        status = self._restore_from(source, comm, opts)
        self._base = os.fspath(path)
        return status

    def _restore_from(
        self, source: Source, comm: Communicator, options: CheckpointOptions
    ) -> CheckpointLoadStatus:
        """Fill the graph from ``source`` (a persistent checkpoint or a local step)."""
        self._warn_unresolved()
        background.finish_pending()
        if self._session is not None:
            self._session.deactivate()
        if self._finalizer is not None:
            self._finalizer.detach()
        session = RestoreSession(source, comm, self, options)
        self._session = session
        plan = Plan([Slot(SAVE_COUNTER, None, self._set_counter)])
        try:
            plan_restore(self, "", None, None, session, plan)
            session.execute(plan)
        except BaseException:
            session.deactivate()  # nothing more is applied from a restore that failed
            raise
        self._finalizer = weakref.finalize(self, session.warn_unresolved)
        return CheckpointLoadStatus(session, self)

    def _set_counter(self, value: Any) -> None:
        if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:
            value = value.item()
        if type(value) is not int or value < 0:
            raise CorruptCheckpointError(f"the stored {SAVE_COUNTER} is not a count: {value!r:.60}")
        self._save_counter = value

    def _warn_unresolved(self) -> None:
        if self._session is not None:
            self._session.warn_unresolved()
