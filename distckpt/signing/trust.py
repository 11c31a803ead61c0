"""Checking a signed checkpoint's index, and the files it names, against trusted keys.

A reader that requires a signature calls :func:`check_index` on the index's bytes as
read (a load: rank 0, before it shares them), then verifies every piece it reads against
the hash the index records (:mod:`distckpt.format.piece_reader`). :func:`check_index`
checks the seal, the signature (:mod:`distckpt.signing.signature`) and the hash of every
other file the index lists under ``files`` (each group's and array's ``zarr.json``,
which distckpt itself does not read, but zarr readers do): a checkpoint passes only if
every byte of it is as its signer wrote it.
"""

from __future__ import annotations

import json
from typing import Any

from distckpt.errors import CheckpointError, CorruptCheckpointError, UntrustedCheckpointError
from distckpt.format import seal, wellformed
from distckpt.signing import hashes, signature
from distckpt.signing.keys import TrustedKeys
from distckpt.storage.backend import Store

#: The index member that lists every other file's hash (path: hex digits).
FILES = "files"
#: The index member that names the hash algorithm.
ALGORITHM = "hash_algorithm"
#: The largest metadata file whose hash is checked (a group's or array's zarr.json).
MAX_META_BYTES = 1 << 20


def _sealed_object(raw: bytes, where: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
        index = doc["attributes"]["distckpt"]
    except (ValueError, RecursionError, KeyError, TypeError):
        raise CorruptCheckpointError(f"{where}: not a readable distckpt index") from None
    if not isinstance(index, dict):
        raise CorruptCheckpointError(f"{where}: not a readable distckpt index")
    return index


def check_index(raw: bytes, store: Store, trusted: TrustedKeys) -> str:
    """Check the index ``raw`` of the checkpoint at ``store`` and every file it lists
    against ``trusted``; return the signer's key id. Raises
    :class:`UntrustedCheckpointError` (or :class:`CorruptCheckpointError` for damage the
    seal finds first), naming the checkpoint and what is wrong."""
    where = store.where("zarr.json")
    index = _sealed_object(raw, where)
    if not seal.check(raw, where, index):
        raise UntrustedCheckpointError(
            f"{where}: the index carries no checksum, so no signature: a signature by "
            f"{trusted.source} is required"
        )
    kid = signature.verify(raw, index, trusted, store.url)
    algorithm = index.get(ALGORITHM)
    files = index.get(FILES)
    if not isinstance(algorithm, str) or not isinstance(files, dict):
        raise UntrustedCheckpointError(
            f"{store.url}: the signed index records no hashes of its files"
        )
    problems = file_problems(store, index)
    if problems:
        raise UntrustedCheckpointError(problems[0])
    return kid


def file_problems(store: Store, index: dict[str, Any]) -> list[str]:
    """Why each file a signed index lists (``files``) is not as hashed there: missing,
    too large for a metadata file, or of another hash (empty: all as hashed)."""
    algorithm = index.get(ALGORITHM)
    files = index.get(FILES)
    if not isinstance(algorithm, str) or not isinstance(files, dict):
        return []
    problems = []
    for name, expected in files.items():
        try:
            _check_file(store, name, expected, algorithm)
        except CheckpointError as exc:
            problems.append(str(exc))
    return problems


def _check_file(store: Store, name: str, expected: Any, algorithm: str) -> None:
    key = wellformed.check_file(name, "files")
    if not isinstance(expected, str) or len(expected) != 2 * hashes.HASH_BYTES:
        raise CorruptCheckpointError(f"{store.url}: the hash of {key!r} is malformed")
    try:
        with store.open(key) as handle:
            if handle.size > MAX_META_BYTES:
                raise UntrustedCheckpointError(
                    f"{store.where(key)}: {handle.size} bytes, more than a metadata file holds"
                )
            raw = handle.read(0, handle.size)
    except FileNotFoundError:
        raise UntrustedCheckpointError(
            f"{store.where(key)}: a file the signed index lists is missing"
        ) from None
    if hashes.digest(algorithm, raw).hex() != expected:
        raise UntrustedCheckpointError(
            f"{store.where(key)}: does not match its signed hash (edited since it was signed)"
        )


def verified_signer(raw: bytes, store: Store, trusted: TrustedKeys) -> str | None:
    """The signer of the index ``raw`` if its signature is by ``trusted`` (files not
    read), else None: what an incremental signed save asks of its base."""
    try:
        index = _sealed_object(raw, store.url)
        if not seal.check(raw, store.url, index):
            return None
        return signature.verify(raw, index, trusted, store.url)
    except CheckpointError:
        return None
