"""The cryptographic hashes of a signed checkpoint's stored bytes.

A signed checkpoint's index records, for every stored piece, a 32-byte hash of the bytes
a reader reads from it (:mod:`distckpt.format.shard_io` says which bytes), and for
every other file of the checkpoint (each group's and array's ``zarr.json``) a hash of
the whole file. The signature over the index then covers every stored byte.

Two algorithms, the index names the one used (``hash_algorithm``):

* ``blake3`` (the default when the ``blake3`` package is installed: the ``sign`` extra
  installs it): about 4 GB/s a core here, and it releases the GIL while it hashes, so
  each I/O worker hashes the chunks it writes beside the others;
* ``sha256`` (``hashlib``, always there; about 1 GB/s a core with the SHA extensions):
  what a save falls back to without ``blake3``, and what a reader of a checkpoint that
  names it uses.

``benchmarks/bench_signing.py`` measures both on every worker count.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Protocol

from distckpt import settings
from distckpt.errors import CorruptCheckpointError

#: Bytes of every hash, whichever the algorithm.
HASH_BYTES = 32
#: The algorithms an index may name, in order of preference for a save.
ALGORITHMS = ("blake3", "sha256")


class Hasher(Protocol):
    """A hash in progress: ``update`` with bytes (any buffer), then ``digest``."""

    def update(self, data: Any, /) -> Any: ...

    def digest(self) -> bytes: ...


def _blake3() -> Callable[[], Hasher] | None:
    try:
        from blake3 import blake3
    except ImportError:
        return None
    return blake3  # type: ignore[no-any-return]


def _sha256() -> Hasher:
    return hashlib.sha256()


def available() -> dict[str, Callable[[], Hasher]]:
    """The algorithms this process can compute, by name."""
    found: dict[str, Callable[[], Hasher]] = {"sha256": _sha256}
    blake3 = _blake3()
    if blake3 is not None:
        found["blake3"] = blake3
    return found


def default_algorithm() -> str:
    """What a signed save hashes with here: ``$DISTCKPT_SIGNING_HASH`` if set (a
    :class:`ValueError` when this process cannot compute it), else ``blake3`` where
    installed, else ``sha256``."""
    made = available()
    chosen = settings.SIGNING_HASH.get()
    if chosen is not None:
        if chosen not in made:
            known = ", ".join(ALGORITHMS)
            raise ValueError(
                f"DISTCKPT_SIGNING_HASH={chosen!r}: this process computes {', '.join(made)} "
                f"(of {known}; blake3 needs pip install 'distckpt[sign]')"
            )
        return chosen
    return next(name for name in ALGORITHMS if name in made)


def hasher(algorithm: str) -> Callable[[], Hasher]:
    """The constructor of ``algorithm``'s hash; an algorithm this process cannot compute
    (named by a checkpoint) is a :class:`CorruptCheckpointError` that says what to
    install, or that the name is unknown."""
    made = available().get(algorithm)
    if made is not None:
        return made
    if algorithm == "blake3":
        raise CorruptCheckpointError(
            "the checkpoint's hashes are BLAKE3: pip install 'distckpt[sign]' (the blake3 "
            "package) to verify them"
        )
    raise CorruptCheckpointError(f"unknown hash algorithm {algorithm!r:.40} in the index")


def digest(algorithm: str, *parts: Any) -> bytes:
    """The hash of ``parts`` (buffers) one after the other."""
    h = hasher(algorithm)()
    for part in parts:
        h.update(part)
    return h.digest()
