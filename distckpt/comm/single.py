"""The communicator of a job with one process: every collective is trivial."""

from __future__ import annotations

from typing import Any

from distckpt.comm.base import resolve_timeout


def _check_root(root: int) -> None:
    if root != 0:
        raise ValueError(f"root {root} is out of range for a communicator of size 1")


class SingleComm:
    """A :class:`~distckpt.comm.base.Communicator` of one rank (rank 0, size 1).

    Nothing is sent anywhere, so nothing can time out; ``timeout`` is kept only so the
    object has the protocol's attributes. Objects are returned as given, not copied.
    """

    def __init__(self, timeout: float | None = None) -> None:
        #: Always 0.
        self.rank = 0
        #: Always 1.
        self.size = 1
        #: ``timeout``, else ``$DISTCKPT_TIMEOUT``, else
        #: :data:`~distckpt.comm.DEFAULT_TIMEOUT` (nothing waits).
        self.timeout = resolve_timeout(timeout)

    def __repr__(self) -> str:
        return "SingleComm()"

    def background(self) -> SingleComm:
        """This communicator: one process has no collectives to keep apart."""
        return self

    def sendrecv(self, sends: list[tuple[int, Any]], recvs: list[tuple[int, Any]]) -> None:
        """One rank has no peers: only empty lists are accepted."""
        if sends or recvs:
            raise ValueError("a SingleComm has no peer to send to or receive from")

    def barrier(self) -> None:
        """Return at once."""

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        """Return ``obj``."""
        _check_root(root)
        return obj

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Return ``[obj]``."""
        _check_root(root)
        return [obj]

    def scatter(self, objs: list[Any] | None, root: int = 0) -> Any:
        """Return ``objs[0]``."""
        _check_root(root)
        assert objs is not None
        return objs[0]

    def allgather(self, obj: Any) -> list[Any]:
        """Return ``[obj]``."""
        return [obj]

    def gather_bytes(self, data: bytes, root: int = 0) -> list[bytes] | None:
        """Return ``[bytes(data)]``."""
        _check_root(root)
        return [bytes(data)]
