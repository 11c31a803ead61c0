"""A communicator over an initialized ``torch.distributed`` process group.

distckpt's collectives carry small pickled Python objects, so they always run on a gloo
(CPU) process group: for the world, a *side group* of distckpt's own over every rank;
for a subgroup, the group itself when it is a gloo group with the wanted time-out, else
a side group over the same ranks. Side groups are created once per (group, time-out)
and cached. With NCCL this keeps metadata off the GPU and out of NCCL's streams, and
gives gloo's time-outs: a rank that died or never arrives makes the others raise
:class:`~distckpt.errors.CommTimeoutError` after ``timeout`` seconds. A group distckpt
owns is one it can destroy at exit, before the interpreter finalizes (see
:func:`_release_groups`).

``torch.distributed`` is imported when a :class:`TorchComm` is constructed.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from distckpt import settings
from distckpt.comm.base import resolve_timeout
from distckpt.errors import CommTimeoutError

logger = logging.getLogger(__name__)

# The caches below are keyed by the global ranks of the program's group (None for the
# world), not by the group itself: a program that makes new groups over the same ranks
# again and again (Megatron-LM's tests make them for every test, and destroy few) reuses
# distckpt's groups rather than piling up more of them, each with its threads. Destroying
# them instead would not do: torch names a group created by its members alone after its
# ranks and the number of groups alive, so a new group could take a destroyed one's name,
# and the rendezvous keys it left in the store.

#: Gloo side groups already created: (default group, ranks, timeout) -> side group.
_SIDE_GROUPS: dict[tuple[Any, tuple[int, ...] | None, float], Any] = {}

#: Background communicators already created: (default group, ranks, timeout) -> comm.
_BACKGROUND: dict[tuple[Any, tuple[int, ...] | None, float], TorchComm] = {}

#: Lower-cased fragments of gloo / c10d error messages that mean "a peer is gone or late".
_PEER_LOST = (
    "timed out",
    "timeout",
    "connection closed",
    "connection reset",
    "broken pipe",
    "connection refused",
)


def _gloo_timeout(group: Any) -> float | None:
    """The time-out (seconds) of ``group`` if it is a plain gloo group, else None."""
    import torch
    import torch.distributed as dist

    if str(dist.get_backend(group)) != "gloo":
        return None
    try:  # private attribute; without it we simply create a side group
        return float(group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    except Exception:  # noqa: BLE001
        return None


def _world(cache: dict[Any, Any]) -> Any:
    """The default group, with the entries of ``cache`` (keyed first by the default group
    they were made under) that belong to a destroyed one dropped."""
    import torch.distributed as dist

    world = dist.group.WORLD
    for stale in [k for k in cache if k[0] is not world]:
        del cache[stale]
    return world


def _ranks_of(group: Any, world: Any) -> tuple[int, ...] | None:
    """The cache key of ``group``: its global ranks, or None for the world."""
    import torch.distributed as dist

    return None if group is world else tuple(dist.get_process_group_ranks(group))


def _members_group(ranks: Sequence[int], seconds: float, desc: str) -> Any:
    """A new gloo group of the global ``ranks``, created by its members alone
    (``use_local_synchronization``: they call this at the same point, nobody else does)."""
    return _new_group(ranks=list(ranks), seconds=seconds, local=True, desc=desc)


#: Every process group distckpt created, destroyed at exit (:func:`_release_groups`).
_OWN_GROUPS: list[Any] = []


def _new_group(*, ranks: list[int] | None, seconds: float, local: bool, desc: str) -> Any:
    """A new gloo group of distckpt's own over ``ranks`` (None: the world's)."""
    import torch.distributed as dist

    group = dist.new_group(
        ranks=ranks,
        backend="gloo",
        timeout=timedelta(seconds=seconds),
        use_local_synchronization=local,
        group_desc=desc,
    )
    if group is not dist.GroupMember.NON_GROUP_MEMBER:
        _OWN_GROUPS.append(group)
    return group


def _metadata_group(group: Any, timeout: float | None) -> tuple[Any, float]:
    """Return the gloo group distckpt's collectives use for ``group``, and its time-out.

    Creates a side group (a collective, see :class:`TorchComm`) unless one was created
    before for the same group and time-out. Without a ``timeout``, a gloo ``group``'s own
    time-out is kept.
    """

    own = _gloo_timeout(group)
    if own is not None and any(g is group for g in _OWN_GROUPS):
        return group, own  # a group of distckpt's own (each made for its time-out)
    world = _world(_SIDE_GROUPS)
    if own is not None and group is not world and (timeout is None or abs(own - timeout) < 1e-3):
        # A gloo subgroup of the program's, used as it is: a side group of it would be
        # made by its members alone, under a name torch derives from how many groups
        # each member has, which differs by rank in Megatron-LM's layouts.
        return group, own
    seconds = own if timeout is None and own is not None else resolve_timeout(timeout)
    ranks = _ranks_of(group, world)
    key = (world, ranks, seconds)
    side = _SIDE_GROUPS.get(key)
    if side is None:
        is_world = ranks is None
        logger.debug("creating a gloo side group over ranks %s, timeout %s s", ranks, seconds)
        side = _new_group(
            ranks=None if ranks is None else list(ranks),
            seconds=seconds,
            # a subgroup's side group is created by its members only (a hashed name);
            # the world's by every rank (torch's ordinary numbered name)
            local=not is_world,
            desc="distckpt_metadata",
        )
        _SIDE_GROUPS[key] = side
    return side, seconds


#: Every TorchComm alive, so that their groups can be let go of at exit.
_LIVE: weakref.WeakSet[TorchComm] = weakref.WeakSet()


#: Exchange groups split off before: (world, ranks, time-out, colors) -> this rank's.
_SPLITS: dict[tuple[Any, tuple[int, ...] | None, float, tuple[int, ...]], TorchComm | None] = {}

#: Communicators over sets of global ranks: (world, ranks, time-out) -> communicator.
_MEMBERS: dict[tuple[Any, tuple[int, ...], float], TorchComm] = {}


def over_ranks(ranks: Sequence[int], timeout: float | None = None) -> TorchComm:
    """A communicator over the global ``ranks`` (this rank among them), on a gloo group
    that only they create: each of them calls this at the same point, the other ranks
    not at all. Cached per set of ranks and time-out."""
    seconds = resolve_timeout(timeout)
    key = (_world(_MEMBERS), tuple(ranks), seconds)
    if key not in _MEMBERS:
        _MEMBERS[key] = TorchComm(_members_group(ranks, seconds, "distckpt_members"), seconds)
    return _MEMBERS[key]


#: How long, at exit, a rank waits for the others before tearing its process group down.
_EXIT_BARRIER_SECONDS = 30.0


def tear_down_at_exit() -> None:
    """At exit, tear down the default process group distckpt just started (:func:`auto`
    under torchrun, :func:`~distckpt.comm.init_torch_from_mpi`), unless the program did:
    every rank first waits for the others (30 s at most: a rank that died is not waited
    for long), so that no rank closes its connections under another's feet, then
    destroys it. Left to the interpreter's teardown, gloo can abort a process ("terminate
    called without an active exception") after its work is done."""
    atexit.register(_destroy_own_group)


def _destroy_own_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=_EXIT_BARRIER_SECONDS))
        except Exception as exc:  # noqa: BLE001  (exiting anyway)
            logger.debug("the barrier at exit failed: %r", exc)
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001  (exiting anyway)
            logger.debug("destroying the process group at exit failed: %r", exc)


def _release_groups() -> None:
    """At exit, destroy every process group distckpt created and drop every reference
    it holds to a process group, while the interpreter is still whole.

    A gloo group's worker threads can still hold the tensors of the last collective for
    a moment after it returned; freeing them takes the GIL. A group destroyed while the
    interpreter finalizes lets such a thread take the GIL then, and the process aborts
    ("terminate called without an active exception") after its work is done. Destroying
    the group here joins its threads first. Registered when this module is imported, so
    it runs after the exit handlers registered later (the program's, and
    :func:`~distckpt.comm.auto`'s teardown).
    """
    import torch.distributed as dist

    _SIDE_GROUPS.clear()
    _BACKGROUND.clear()
    _SPLITS.clear()
    _MEMBERS.clear()
    for comm in list(_LIVE):
        comm._pg = None
        comm.group = None
        comm._broken = "this communicator was released at interpreter exit"
    groups, _OWN_GROUPS[:] = _OWN_GROUPS[::-1], []
    while groups:
        group = groups.pop(0)
        try:  # a group the program destroyed (all of them, with the world) is gone already
            if dist.is_initialized() and group in dist.distributed_c10d._world.pg_map:
                dist.destroy_process_group(group)
        except Exception as exc:  # noqa: BLE001  (exiting anyway)
            logger.debug("destroying a distckpt process group at exit failed: %r", exc)
        del group  # the last reference: the group's threads are joined here


atexit.register(_release_groups)


class TorchComm:
    """A :class:`~distckpt.comm.base.Communicator` over a ``torch.distributed`` group.

    The collectives run on a gloo side group of distckpt's own over the ranks of
    ``group`` (destroyed at exit, before the interpreter finalizes: see
    :func:`_release_groups`), or on a gloo subgroup itself when its time-out is the one
    wanted. Constructing a TorchComm may create a side group, which is itself a
    collective: every rank of ``group`` must construct its TorchComm at the same point of
    the program (for the world group, every rank of the job). Side groups are cached, so
    constructing another TorchComm for the same group and time-out communicates no more.
    A side group of a subgroup is created with ``use_local_synchronization=True``: torch
    derives its name from the ranks and the number of groups each member created so far,
    so members must have created the same number of process groups before (torch's usual
    rule).

    After a collective failed with :class:`~distckpt.errors.CommTimeoutError` the
    communicator is unusable and every later call raises that error at once.

    :param group: a process group this rank belongs to; the default (world) group if
        None. ``rank`` and ``size`` are this process's rank in it and its size.
    :param timeout: seconds a collective waits for every rank. None:
        ``$DISTCKPT_TIMEOUT`` when set, else a gloo ``group``'s own time-out, else
        :data:`~distckpt.comm.base.DEFAULT_TIMEOUT`.
    """

    def __init__(self, group: Any = None, timeout: float | None = None) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "TorchComm needs an initialized torch.distributed default process group "
                "(init_process_group, torchrun, or distckpt.comm.init_torch_from_mpi)"
            )
        self.group = dist.group.WORLD if group is None else group
        #: This process's rank in ``group``.
        self.rank: int = dist.get_rank(self.group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the given process group")
        #: The size of ``group``.
        self.size: int = dist.get_world_size(self.group)
        if timeout is None and settings.TIMEOUT.is_set():
            timeout = settings.TIMEOUT.value()  # the user's setting wins over the group's
        #: Seconds every collective waits for the other ranks.
        self._pg, self.timeout = _metadata_group(self.group, timeout)
        self._broken: str | None = None
        _LIVE.add(self)

    def __repr__(self) -> str:
        return f"TorchComm(rank={self.rank}, size={self.size}, timeout={self.timeout})"

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} is out of range for a communicator of size {self.size}")

    @contextmanager
    def _guard(self, op: str) -> Iterator[None]:
        """Turn gloo's time-out and lost-peer errors of collective ``op`` into CommTimeoutError."""
        if self._broken is not None:
            raise CommTimeoutError(self._broken)
        try:
            yield
        except RuntimeError as exc:  # DistBackendError derives from RuntimeError
            text = str(exc).lower()
            if not any(fragment in text for fragment in _PEER_LOST):
                raise
            self._broken = (
                f"torch.distributed {op} on rank {self.rank} of {self.size} failed "
                f"(timeout {self.timeout:g} s): a rank died, hangs, or called another "
                f"collective; this communicator is no longer usable. gloo said: {exc}"
            )
            logger.debug("%s", self._broken)
            raise CommTimeoutError(self._broken) from exc

    def background(self) -> TorchComm:
        """Collective at first use: the communicator of distckpt's background thread.

        A TorchComm over a new gloo group of the same ranks, created on the first call and
        cached per (group, time-out). Its collectives never mix with this one's nor with
        training's, so a background thread uses it while the training thread runs
        collectives of its own. Every rank of the group must make the first call at the
        same point of the program.
        """

        world = _world(_BACKGROUND)
        ranks = _ranks_of(self.group, world)
        key = (world, ranks, self.timeout)
        if key in _BACKGROUND:
            return _BACKGROUND[key]
        is_world = ranks is None
        group = _new_group(
            ranks=None if ranks is None else list(ranks),
            seconds=self.timeout,
            local=not is_world,
            desc="distckpt_background",
        )
        _BACKGROUND[key] = TorchComm(group, self.timeout)
        return _BACKGROUND[key]

    def split(self, color: int) -> TorchComm | None:
        """Collective: a communicator over a new gloo group of the ranks that pass the
        same ``color``; None for a negative color. Cached per colors, so a job restoring
        the same way again creates no group.

        Over the world group every rank creates every such group, in order (torch's
        numbered names, which agree on every rank however many groups of its own each
        rank is a member of); over a subgroup only the members create theirs
        (``use_local_synchronization``, see :class:`TorchComm`)."""
        import torch.distributed as dist

        colors = tuple(self.allgather(int(color)))
        world = _world(_SPLITS)
        key = (world, _ranks_of(self.group, world), self.timeout, colors)
        if key not in _SPLITS:
            sub = None
            assert self.group is not None
            for each in sorted({c for c in colors if c >= 0}):
                if self.group is not world and each != color:
                    continue
                members = [r for r, c in enumerate(colors) if c == each]
                ranks = [dist.get_global_rank(self.group, r) for r in members]
                group = _new_group(
                    ranks=ranks,
                    seconds=self.timeout,
                    local=self.group is not world,
                    desc="distckpt_exchange",
                )
                if each == color:
                    sub = TorchComm(group, self.timeout)
            _SPLITS[key] = sub
        return _SPLITS[key]

    def broadcast_array(self, array: Any, root: int = 0) -> None:
        """Collective: fill ``array`` (a contiguous NumPy array, the same size on every
        rank) with ``root``'s, in place."""
        import torch
        import torch.distributed as dist

        self._check_root(root)
        if self.size == 1:
            return
        with self._guard("broadcast_array"):
            dist.broadcast(torch.from_numpy(array), group=self._pg, group_src=root)

    def sendrecv(self, sends: list[tuple[int, Any]], recvs: list[tuple[int, Any]]) -> None:
        """Collective: send each ``(peer, array)`` of ``sends`` and fill each ``(peer,
        array)`` of ``recvs`` (contiguous NumPy byte arrays, at most one of each per peer,
        sized alike on both ends) at once, over the gloo group; returns when all are done."""
        import torch
        import torch.distributed as dist

        ops = [
            dist.P2POp(dist.isend, torch.from_numpy(a), group=self._pg, group_peer=peer)
            for peer, a in sends
        ]
        ops += [
            dist.P2POp(dist.irecv, torch.from_numpy(a), group=self._pg, group_peer=peer)
            for peer, a in recvs
        ]
        if not ops:
            return
        with self._guard("sendrecv"):
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def barrier(self) -> None:
        """Collective: return once every rank has called it."""
        import torch.distributed as dist

        with self._guard("barrier"):
            dist.barrier(group=self._pg)

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        """Collective: return ``root``'s ``obj`` on every rank (others' ``obj`` is ignored)."""
        import torch.distributed as dist

        self._check_root(root)
        if self.size == 1:
            return obj
        box = [obj if self.rank == root else None]
        with self._guard("broadcast"):
            dist.broadcast_object_list(box, group=self._pg, group_src=root)
        return box[0]

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Collective: every rank's ``obj`` in rank order on ``root``; None on the others."""
        import torch.distributed as dist

        self._check_root(root)
        if self.size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.rank == root else None
        with self._guard("gather"):
            dist.gather_object(obj, out, group=self._pg, group_dst=root)
        return out

    def scatter(self, objs: list[Any] | None, root: int = 0) -> Any:
        """Collective: ``objs[r]`` (``objs`` given on ``root``) on each rank ``r``."""
        import torch.distributed as dist

        self._check_root(root)
        if self.size == 1:
            assert objs is not None
            return objs[0]
        out: list[Any] = [None]
        with self._guard("scatter"):
            dist.scatter_object_list(
                out, objs if self.rank == root else None, group=self._pg, group_src=root
            )
        return out[0]

    def allgather(self, obj: Any) -> list[Any]:
        """Collective: every rank's ``obj``, in rank order, on every rank."""
        import torch.distributed as dist

        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        with self._guard("allgather"):
            dist.all_gather_object(out, obj, group=self._pg)
        return out

    def gather_bytes(self, data: bytes, root: int = 0) -> list[bytes] | None:
        """Collective: every rank's ``data`` (any length, empty too) on ``root``; else None."""
        return self.gather(bytes(data), root=root)
