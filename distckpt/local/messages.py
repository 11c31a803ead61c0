"""How the node-local tier's bytes travel between ranks: in messages of at most
:data:`MESSAGE_BYTES`, whether a save sends a rank's data file to its peers
(:mod:`distckpt.local.save`) or a restore fetches the parts of pieces other ranks hold
(:mod:`distckpt.local.restore`)."""

from __future__ import annotations

from concurrent import futures
from typing import Any

import numpy as np

from distckpt.errors import CorruptCheckpointError
from distckpt.format.wellformed import MAX_BYTES
from distckpt.transfer.exchange import aligned

#: The largest message of a replica transfer (bytes).
MESSAGE_BYTES = 64 << 20
#: The largest manifest a peer may send with its replica (bytes; some four million
#: tensors): a receiver allocates for the length the peer announces, so it is bounded.
MANIFEST_BYTES = 1 << 30

#: Pieces smaller than this travel several to a message (copied into one buffer);
#: larger ones in messages of their own bytes, sent without a copy.
SMALL_PIECE = 1 << 20


def split(pieces: list[tuple[int, np.ndarray]]) -> list[tuple[int, int]]:
    """The (offset, length) in the data file of each message that sends it: a large
    piece in parts of at most :data:`MESSAGE_BYTES`, runs of small ones together."""
    out: list[tuple[int, int]] = []
    run: tuple[int, int] | None = None  # the small pieces gathered so far
    for offset, data in pieces:
        n = int(data.size)
        if n >= SMALL_PIECE:
            if run is not None:
                out.append(run)
                run = None
            out += [(offset + lo, min(MESSAGE_BYTES, n - lo)) for lo in range(0, n, MESSAGE_BYTES)]
            continue
        if run is not None and offset + n - run[0] <= MESSAGE_BYTES:
            run = (run[0], offset + n - run[0])
        else:
            if run is not None:
                out.append(run)
            run = (offset, n)
    if run is not None:
        out.append(run)
    return [(lo, n) for lo, n in out if n]


def checked_plans(plans: list[Any]) -> list[list[tuple[int, int]]]:
    """Every rank's messages (:func:`split`) as the ranks shared them, each checked to be
    a part of a data file that a receiver can take: an offset, and a length of at most
    :data:`MESSAGE_BYTES`. Every rank checks the same plans alike, so a rank that sent
    lying ones fails the save on every rank, before any byte travels."""
    out = []
    for rank, plan in enumerate(plans):
        if not isinstance(plan, (list, tuple)):
            raise CorruptCheckpointError(f"local tier: rank {rank} sent no plan: {plan!r:.60}")
        parts = []
        for part in plan:
            lo, n = part if isinstance(part, (list, tuple)) and len(part) == 2 else (None, None)
            if not (type(lo) is int and type(n) is int and lo >= 0 and 0 < n <= MESSAGE_BYTES):
                raise CorruptCheckpointError(
                    f"local tier: rank {rank} plans a message {part!r:.60}, not an offset and "
                    f"a length of at most {MESSAGE_BYTES} bytes"
                )
            if lo + n > MAX_BYTES:
                raise CorruptCheckpointError(
                    f"local tier: rank {rank} plans a message at byte {lo}, past any file"
                )
            parts.append((lo, n))
        out.append(parts)
    return out


def manifest_length(announced: np.ndarray, rank: int) -> int:
    """The length of the manifest rank ``rank`` announced, checked before a buffer is
    allocated for it."""
    n = int(announced[0])
    if not 0 < n <= MANIFEST_BYTES:
        raise CorruptCheckpointError(
            f"local tier: rank {rank} announced a manifest of {n} bytes (at most {MANIFEST_BYTES})"
        )
    return n


def message(pieces: list[tuple[int, np.ndarray]], lo: int, n: int) -> np.ndarray:
    """Bytes ``lo .. lo + n`` of the data file, from its ``pieces`` in memory: a view of
    one piece, or a copy of consecutive small ones."""
    for offset, data in pieces:
        if offset <= lo and lo + n <= offset + data.size:
            return data[lo - offset : lo - offset + n]
    out = np.zeros(n, dtype=np.uint8)
    for offset, data in pieces:
        a, b = max(lo, offset), min(lo + n, offset + data.size)
        if a < b:
            out[a - lo : b - lo] = data[a - offset : b - offset]
    return out


def pack(messages: list[list[Any]], item: Any, nbytes: int) -> None:
    """Append ``item`` to the last message, or start a new one when it would pass
    :data:`MESSAGE_BYTES` (each item starts at an aligned offset)."""
    if messages:
        used = sum(aligned(n) for _, n in messages[-1])
        if used + nbytes <= MESSAGE_BYTES:
            messages[-1].append((item, nbytes))
            return
    messages.append([(item, nbytes)])


def packed_size(message: list[Any]) -> int:
    """The bytes of a message :func:`pack` made."""
    return sum(aligned(n) for _, n in message)


class Buffers:
    """Receive buffers of :data:`MESSAGE_BYTES`, kept from one save to the next (fresh
    memory costs a first touch of every page on every save), at most ``WINDOW`` per
    source rank in flight: a receiver waits for older writes before taking more."""

    WINDOW = 2
    _free: list[np.ndarray] = []

    def __init__(self) -> None:
        self._busy: list[tuple[Any, np.ndarray]] = []  # (write future, buffer), oldest first

    def take(self, sources: int) -> np.ndarray:
        """A whole buffer; give it back with :meth:`writing` or :meth:`give_back`."""
        while len(self._busy) >= self.WINDOW * max(1, sources):
            future, buffer = self._busy.pop(0)
            futures.wait([future])
            self._free.append(buffer)
        return self._free.pop() if self._free else np.empty(MESSAGE_BYTES, np.uint8)

    def writing(self, future: Any, buffer: np.ndarray) -> None:
        self._busy.append((future, buffer))

    def give_back(self, buffer: np.ndarray) -> None:
        self._free.append(buffer)

    def release(self) -> None:
        """Once every write is done: the buffers go back for the next save."""
        for future, buffer in self._busy:
            futures.wait([future])
            self._free.append(buffer)
        self._busy.clear()
        del self._free[self.WINDOW * 4 :]  # what a few sources need, no more
