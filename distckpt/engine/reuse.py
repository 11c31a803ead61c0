"""Incremental saves: a save built on an earlier checkpoint (its *base*) takes the pieces
whose bytes did not change from there instead of writing them again.

**What each rank knows of a base.** A process remembers, per checkpoint, what it knows
of its pieces (at most :data:`KEEP` checkpoints, the newest):

* after a save it committed, each rank the pieces it stored itself (written or reused):
  their size, crc, content digest and each inner chunk's digest;
* after a load or restore, every rank the whole index (which every rank then holds);
* for a base it neither saved nor loaded, the coordinator reads the index and every rank
  receives it, at the save.

**Is the base still that checkpoint?** At every incremental save the coordinator reads
the base's index and compares its bytes with those remembered (one read, one broadcast:
:func:`check_base`). If the base is gone, damaged or another checkpoint now (another run
saved one of the same name), the save writes every piece, and says so in the log.

**Is a piece unchanged?** Only its bytes decide: the rank hashes the data it would
store and compares the digest with the base's (:mod:`distckpt.format.digests`;
:mod:`distckpt.transfer.unchanged` does it, stopping at the first chunk that differs when
it knows the base's chunk digests). The dtype, box, block, inner chunks and codec must
be those of the base's piece too. An unchanged piece is copied from the base by the
store (a hard link, a server-side copy), and the copy is checked against the base's
index (its size, and the crc of its checksum table, or of a plain chunk's bytes) before
it counts: a base replaced between the check and the copy is caught there, and the
piece written.

Every checkpoint stays whole on its own: deleting the base (or any other checkpoint)
never touches the pieces another one took from it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from distckpt.comm.outcome import announce
from distckpt.errors import CheckpointError
from distckpt.format import digests
from distckpt.format.index import Index, parse_index, pieces_of, read_index_bytes, version_of
from distckpt.format.shard_io import Stored
from distckpt.format.stored import Pieces
from distckpt.planning.pieces import Piece
from distckpt.signing.keys import TrustedKeys
from distckpt.signing.trust import verified_signer
from distckpt.storage.backend import Store
from distckpt.transfer.jobs import Reuse

log = logging.getLogger("distckpt")

#: Checkpoints a process remembers the pieces of (a base is the newest, or the one before).
KEEP = 2


def _layout(dtype: str, piece: Any) -> tuple[Any, ...]:
    """What must be equal for a stored piece to be taken for a planned one."""
    codec = None if piece.codec is None else repr(piece.codec.to_json())
    return (dtype, piece.box, tuple(piece.block), piece.inner and tuple(piece.inner), codec)


@dataclass
class Known:
    """What this process knows of one committed checkpoint's pieces (see the module)."""

    version: str | None  # its index's bytes, as read or written (the coordinator's)
    stored: dict[str, tuple[tuple[Any, ...], Stored]] = field(default_factory=dict)
    index: Index | None = None  # the whole index, after a load or restore
    hashing: str | None = None  # what this process's save hashed its pieces with

    def lookup(self, piece: Piece, hashing: str | None = None) -> Stored | None:
        """What the checkpoint stores for ``piece`` if it is the same piece (file, dtype,
        box, block, inner chunks, codec) with a digest, else None. A signed save
        (``hashing``) takes only pieces whose hash of that algorithm it knows from a save
        of its own or from an index whose signature was checked."""
        layout = _layout(piece.dtype, piece)
        found = self.stored.get(piece.file)
        if found is not None:
            same = found[0] == layout and found[1].digest is not None
            if hashing is not None and (found[1].hash is None or self.hashing != hashing):
                return None
            return found[1] if same else None
        if self.index is None or self.index.get("digests") != digests.ALGORITHM:
            return None  # no digests, or made by another algorithm
        if hashing is not None and (
            self.index.signed_by is None or self.index.get("hash_algorithm") != hashing
        ):
            return None  # hashes not known to be the signer's
        entry = self.index["variables"].get(piece.var)
        if isinstance(entry, dict) and entry.get("kind") == "per_rank":
            entry = entry.get("ranks", {}).get(str(piece.rank))
        if not isinstance(entry, dict) or entry.get("kind") != "tensor":
            return None
        if entry.get("dtype") != piece.dtype:
            return None
        try:
            pieces = pieces_of(self.index, entry, piece.var)
            hit = _matching(pieces, piece)
        except CheckpointError:
            return None
        if hit is None:
            return None
        stored, digest, origin = hit
        if digest is None or _layout(piece.dtype, stored) != layout:
            return None
        if hashing is not None and stored.hash is None:
            return None
        return Stored(stored.size, stored.crc, digest, reused=origin, hash=stored.hash)


def _matching(pieces: Pieces, piece: Piece) -> tuple[Any, bytes | None, str | None] | None:
    """The stored piece of ``pieces`` in ``piece``'s file, its digest and origin."""
    for stored in pieces.covering(piece.box):
        if stored.file == piece.file and stored.box == piece.box:
            return (stored, *pieces.provenance(pieces.position(stored)))
    return None


_lock = threading.Lock()
_known: OrderedDict[str, Known] = OrderedDict()


def _remember(url: str, known: Known) -> None:
    with _lock:
        _known.pop(url, None)
        _known[url] = known
        while len(_known) > KEEP:
            _known.popitem(last=False)


def known(url: str) -> Known | None:
    with _lock:
        return _known.get(url)


def remember_saved(
    store: Store,
    version: str | None,
    stored: dict[str, tuple[Piece, Stored]],
    hashing: str | None = None,
) -> None:
    """After a committed save: what this rank stored in it (by file key), and (the
    coordinator) the version of its index; ``hashing``: what its pieces were hashed with."""
    pieces = {key: (_layout(p.dtype, p), s) for key, (p, s) in stored.items()}
    _remember(store.url, Known(version, pieces, hashing=hashing))


def remember_index(store: Store, index: Index) -> None:
    """After a load or restore: the checkpoint's whole index (on every rank)."""
    _remember(store.url, Known(index.version, index=index))


def forget(url: str) -> None:
    with _lock:
        _known.pop(url, None)


def origin_name(base: Store, final: Store) -> str:
    """How the new index names where a piece came from: the base's name when it lies
    beside the new checkpoint, else its location."""
    return base.name if base.parent.url == final.parent.url else base.url


def _read_base(
    base: Store, trust: Callable[[], TrustedKeys] | None
) -> tuple[str, bytes | None, str | None]:
    """The coordinator's part of :func:`check_base`: why the base is not usable (empty
    when it is), its index when this process does not know it yet, and its signer."""
    try:
        raw = read_index_bytes(base)
    except (OSError, CheckpointError) as exc:
        return f"its index cannot be read ({exc})", None, None
    mine = known(base.url)
    version = version_of(raw)
    if mine is not None and mine.version is not None:
        if mine.version == version:
            return "", None, None
        return "its index is not the one this job wrote or read", None, None
    return "", raw, None if trust is None else verified_signer(raw, base, trust())


def check_base(
    comm: Any, base: Store, trust: Callable[[], TrustedKeys] | None = None
) -> Known | None:
    """Collective: what every rank may take from ``base`` for this save, or None when
    nothing (the coordinator found it gone, damaged or replaced). The coordinator reads
    the base's index; when it knows the base, it compares the bytes with those it
    remembered, else every rank receives the index and remembers it, with whether its
    signature is by ``trust()`` (a signed save's own public key, asked for on the
    coordinator only): only then may a signed save take pieces by their stored hashes."""

    # a failure of the job (a dead rank) is raised
    reason, raw, signer = announce(comm, _read_base, base, trust)
    if reason:
        forget(base.url)
        if comm.rank == 0:
            log.warning("saving in full: the base %s is not usable: %s", base.url, reason)
        return None
    if raw is not None:
        try:
            index = parse_index(raw, base)
        except CheckpointError as exc:
            if comm.rank == 0:
                log.warning("saving in full: the base %s is not usable: %s", base.url, exc)
            return None
        index.signed_by = signer
        remember_index(base, index)
    return known(base.url)


def reuse_for(
    base: Store, known_base: Known | None, final: Store, piece: Piece, hashing: str | None = None
) -> Reuse | None:
    """The :class:`~distckpt.transfer.jobs.Reuse` of ``piece`` from ``base``, if the base
    has the same piece with a digest (and, for a signed save, a hash it can vouch for)."""
    if known_base is None:
        return None
    stored = known_base.lookup(piece, hashing)
    if stored is None:
        return None
    return Reuse(base, piece.file, stored, stored.chunks, origin_name(base, final))
