"""Small tensors travel to their writers before a save writes.

A tensor of at most ``small_bytes`` is one plain chunk written by one rank
(:mod:`distckpt.planning.save_plan`); the ranks holding its boxes send their bytes to
that writer, one gather per writer, in the order the plan lists the writers. Every rank
takes part in every gather, even after a local error, so no rank is left waiting.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from distckpt import dtypes
from distckpt.comm import Communicator
from distckpt.comm.outcome import Failure
from distckpt.format import shard_io
from distckpt.planning.pieces import Piece, RankWork
from distckpt.transfer.sources import HostData, Source


def send_small(
    comm: Communicator, work: RankWork, sources: dict[str, Source]
) -> tuple[dict[int, dict[int, bytes]], Failure | None]:
    """Send the boxes of small tensors to their writers (one gather per writer).

    Every rank takes part in every gather, even after a local error (it then sends
    nothing and reports the error), so no rank is left waiting.
    """
    outgoing: dict[int, dict[tuple[int, int], bytes]] = defaultdict(dict)
    failure: Failure | None = None
    try:
        for piece_id, k, writer, var in work.sends:
            data = sources[var].host()
            outgoing[writer][(piece_id, k)] = shard_io.as_bytes(data).tobytes()
    except Exception as exc:
        failure, outgoing = Failure.capture(exc, comm.rank), defaultdict(dict)
    received: dict[int, dict[int, bytes]] = defaultdict(dict)
    for writer in work.exchange_writers:
        gathered = comm.gather(outgoing.get(writer, {}), root=writer)
        if gathered is not None:
            for part in gathered:
                for (piece_id, k), data in part.items():
                    received[piece_id][k] = data
    return received, failure


def assemble(
    piece: Piece, sources: dict[str, Source], received: dict[int, bytes], rank: int
) -> Source:
    """The bytes ``piece`` stores: this rank's own source when it holds the whole box, else
    the boxes received from their holders (and this rank's) assembled."""
    if len(piece.sources) == 1 and piece.sources[0][0] == rank and piece.sources[0][1] == piece.box:
        return sources[piece.var]
    out = np.zeros(piece.box.lengths, dtype=dtypes.numpy_dtype(piece.dtype))
    for k, (src_rank, box) in enumerate(piece.sources):
        region = out[box.relative_to(piece.box).slices()]
        if src_rank == rank:
            region[...] = sources[piece.var].host()
        else:
            region[...] = np.frombuffer(received[k], dtype=out.dtype).reshape(box.lengths)
    return HostData(out)
