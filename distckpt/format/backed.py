"""Allocating what a checkpoint declares: a reader that makes a tensor of the size the
index says (a ``None`` placeholder of :func:`distckpt.load`, a slot of a restored object
graph, a framework's tree) first checks that what is stored can fill it.

An index of a few hundred bytes may declare a tensor of any size, and its pieces' sizes
are declarations too. :func:`check_stored` checks the declared sizes
(:meth:`~distckpt.format.stored.Pieces.check_backed`) and, for a tensor of more than
:data:`TRUSTED_BYTES`, the files themselves: each is opened (as the read would) and must
be of the size the index records, until they hold the whole tensor. So the memory a
reader allocates follows the bytes stored, not the bytes declared.
"""

from __future__ import annotations

import math

from distckpt.format import wellformed
from distckpt.format.stored import Pieces
from distckpt.storage.backend import Store

#: Bytes of a tensor allocated on the index's word alone (its pieces' declared sizes);
#: a larger one is allocated once its files are found to hold it.
TRUSTED_BYTES = 64 << 20


def check_stored(store: Store, pieces: Pieces) -> None:
    """Raise :class:`~distckpt.errors.CorruptCheckpointError`, naming the variable and the
    file, unless the pieces stored in ``store`` can fill the tensor ``pieces`` declare
    (a compressed piece counts for :data:`~distckpt.format.wellformed.MAX_RATIO` times
    its bytes): checked before a tensor of that shape is allocated."""
    pieces.check_backed()
    declared = math.prod(pieces.shape) * pieces.itemsize
    if declared <= TRUSTED_BYTES:
        return
    held = 0
    for piece in pieces:
        if piece.box.empty:
            continue
        try:
            with store.open(piece.file) as handle:
                size = handle.size
        except FileNotFoundError:
            raise wellformed.corrupt(
                pieces.variable, f"a file the index names is missing ({store.where(piece.file)})"
            ) from None
        if size != piece.size:
            raise wellformed.corrupt(
                pieces.variable,
                f"file is {size} bytes, the index says {piece.size} ({store.where(piece.file)})",
            )
        held += size * (wellformed.MAX_RATIO if piece.codec is not None else 1)
        if held >= declared:
            return
    raise wellformed.corrupt(
        pieces.variable,
        f"a shape {list(pieces.shape)} of {declared} bytes cannot be filled from "
        f"the {held} bytes its files hold",
    )
