"""Metadata documents sealed with their own checksum.

Tensor data carries crc32c; so does every JSON document that distckpt writes and later
trusts: a checkpoint's index, the ``latest`` pointer (with the manager's state), the
node-local tier's manifests and marks, and the owner files and leases of saves in
progress. This module is the whole of the format.

Specification
-------------
A **sealed document** is a JSON text whose *sealed object* (for the index, the object
``attributes["distckpt"]`` of the root ``zarr.json``; for every other document, the
top-level object) has as its FIRST member::

    "checksum": "crc32c:<8 lowercase hex digits>"

written exactly in that byte form: the 20 bytes ``"checksum": "crc32c:`` (one space
after the colon), the 8 digits, then ``"``. Nothing before the sealed object's first
member in the text may hold those 20 bytes.

*Computing it.* Locate the FIRST occurrence of the byte string ``"checksum": "crc32c:``
in the document's bytes as stored; the 8 bytes that follow are the digits. The checksum
is the CRC-32C (Castagnoli, reflected, initial value and final xor ``0xFFFFFFFF``: the
``crc32c`` of iSCSI, ext4 and the ``crc32c`` Python package) of the document's bytes with
those 8 bytes replaced by ``00000000``, written as 8 lowercase hexadecimal digits. It
therefore covers every byte of the file (a zarr group's wrapper around the index
included) except its own digits, and needs no canonical form of the JSON: a writer
serialises the document with ``00000000`` as the digits, computes the checksum of those
bytes and writes it in their place.

*Checking it.* A reader parses the JSON as it would without a seal. If the sealed object
has a ``checksum`` member:

1. its value must be a string ``<algorithm>:<digits>``; an algorithm other than
   ``crc32c`` is a format this reader does not know (:class:`UnsupportedFormatError`);
   ``crc32c:`` followed by anything but 8 lowercase hex digits is malformed;
2. the document's bytes must hold ``"checksum": "crc32c:`` and its first occurrence must
   be followed by those same 8 digits;
3. the checksum computed as above must equal them.

Any failure is :class:`CorruptCheckpointError` naming the file. A document with no
``checksum`` member was written by a distckpt that did not seal (before this module): it
is read as before, logged once per location at INFO, and ``distckpt verify`` and
``distckpt inspect`` say "no metadata checksum (written by an older distckpt)".

The member is an addition that readers which predate it ignore (they see one more
member of an object whose unknown members they skip), so sealing changes no format
version.

What the checksum proves: that the bytes are those a distckpt wrote, against accidents
(a flipped bit, a torn or misdirected write, an edit by hand). Anyone who can write the
document can recompute it, or remove it: an adversary is stopped by the checks behind
it, never by the seal.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import Any

import crc32c as _crc32c

from distckpt.errors import CheckpointError, CorruptCheckpointError, UnsupportedFormatError

log = logging.getLogger(__name__)

#: The member a seal is: the first of the sealed object.
MEMBER = "checksum"
#: The checksum's algorithm, named in the member's value.
ALGORITHM = "crc32c"
#: What precedes the digits, byte for byte.
MARK = b'"checksum": "crc32c:'
#: The number of lowercase hexadecimal digits of the checksum.
DIGITS = 8
_ZEROS = b"0" * DIGITS
#: The member's value while a document is serialised, before :func:`seal` fills it in.
PLACEHOLDER = f"{ALGORITHM}:{_ZEROS.decode()}"
_COMPACT = b'"checksum":"' + PLACEHOLDER.encode() + b'"'
_VALUE = re.compile(r"[0-9a-f]{8}")
#: What a tool says of a document that carries no checksum.
UNSEALED = "no metadata checksum (written by an older distckpt)"


def sealed(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` with the checksum member first (to be filled in by :func:`dumps`); a
    ``checksum`` member it had is dropped."""
    return {MEMBER: PLACEHOLDER, **{k: v for k, v in obj.items() if k != MEMBER}}


def dumps(doc: Any, *, indent: int | None = None) -> bytes:
    """``doc`` serialised (compact, or indented by ``indent``) and sealed: ``doc`` is, or
    holds, an object made by :func:`sealed`, the first in document order that has a
    ``checksum`` member::

        raw = seal.dumps(seal.sealed({"format": "distckpt-pointer", "latest": "ckpt-3"}))
    """
    # distckpt builds these documents afresh (values through distckpt.values, which
    # bounds their depth), so none can hold itself: the encoder's check for cycles, a
    # tenth of the time of a large index, would find nothing.
    if indent is None:
        raw = json.dumps(doc, separators=(",", ":"), allow_nan=False, check_circular=False).encode()
        # The member is written in its one byte form whatever the separators, and the
        # document copied only once more (an index of thousands of ranks is tens of MB).
        found = raw.find(_COMPACT)
        if found < 0:
            raise ValueError('the document holds no "checksum" member to seal')
        head = raw[:found] + MARK
        tail = memoryview(raw)[found + len(_COMPACT) - 1 :]  # from the closing quote
        crc = _crc32c.crc32c(tail, _crc32c.crc32c(_ZEROS, _crc32c.crc32c(head)))
        return head + f"{crc:08x}".encode() + tail
    return seal(json.dumps(doc, indent=indent, allow_nan=False, check_circular=False).encode())


def encode(obj: dict[str, Any], *, indent: int | None = None) -> bytes:
    """The sealed bytes of the document ``obj`` (its checksum member first): what
    ``dumps(sealed(obj))`` gives."""
    return dumps(sealed(obj), indent=indent)


def load_or_unknown(raw: bytes, where: str, role: str) -> dict[str, Any]:
    """The JSON object in ``raw`` (stored at ``where``) without its checksum member, or {}
    when it is none or its seal fails (logged, naming ``role``, such as "holder"): for a
    document that only informs a judgement (a lease, an owner file), where a damaged
    one must count as naming nobody rather than stop anything."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return {}
    if not isinstance(obj, dict):
        return {}
    try:
        check(raw, where, obj)
    except CheckpointError as exc:
        log.warning("%s; taking its %s for unknown", exc, role)
        return {}
    return strip(obj)


def crc_of(raw: bytes, at: int) -> int:
    """The crc32c of ``raw`` with the 8 bytes at ``at`` read as ``00000000``."""
    view = memoryview(raw)
    crc = _crc32c.crc32c(view[:at])
    crc = _crc32c.crc32c(_ZEROS, crc)
    return int(_crc32c.crc32c(view[at + DIGITS :], crc))


def seal(raw: bytes) -> bytes:
    """``raw`` with the digits after its first ``"checksum": "crc32c:`` set to its checksum
    (whatever they were). Raises ValueError when ``raw`` holds no such member."""
    at = _digits_at(raw)
    if at is None:
        raise ValueError('the document holds no "checksum": "crc32c:…" member to seal')
    return raw[:at] + f"{crc_of(raw, at):08x}".encode() + memoryview(raw)[at + DIGITS :]


def _digits_at(raw: bytes) -> int | None:
    found = raw.find(MARK)
    if found < 0 or len(raw) < found + len(MARK) + DIGITS:
        return None
    return found + len(MARK)


def check(raw: bytes, where: str, obj: Any = None) -> bool:
    """Check the seal of the document ``raw`` (stored at ``where``) whose sealed object,
    already parsed, is ``obj`` (None: ``raw``'s top-level object, parsed here).

    True: sealed, and the checksum matches. False: no ``checksum`` member, a document of
    a distckpt that did not seal (logged once per ``where``). Raises
    :class:`CorruptCheckpointError` naming ``where`` when the checksum does not match or
    is malformed, :class:`UnsupportedFormatError` for an algorithm other than crc32c.
    """
    if obj is None:
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            raise CorruptCheckpointError(f"{where}: not readable JSON") from None
    if not isinstance(obj, dict):
        return False  # not a document of distckpt's: the caller's checks say so
    if MEMBER not in obj:
        _unsealed(where)
        return False
    value = obj[MEMBER]
    if not isinstance(value, str) or ":" not in value:
        raise CorruptCheckpointError(
            f"{where}: the metadata checksum {value!r:.60} is malformed (expected "
            f"'{ALGORITHM}:' and 8 hex digits)"
        )
    algorithm, _, digits = value.partition(":")
    if algorithm != ALGORITHM:
        raise UnsupportedFormatError(
            f"{where}: the metadata checksum is of algorithm {algorithm!r:.40}; this distckpt "
            f"knows {ALGORITHM} only: upgrade distckpt to read it"
        )
    if not _VALUE.fullmatch(digits):
        raise CorruptCheckpointError(
            f"{where}: the metadata checksum {value!r:.60} is malformed (expected "
            f"'{ALGORITHM}:' and 8 lowercase hex digits)"
        )
    at = _digits_at(raw)
    if at is None or raw[at : at + DIGITS] != digits.encode():
        raise CorruptCheckpointError(
            f"{where}: the metadata checksum is malformed (its member is not written as "
            f'{MARK.decode()}{digits}")'
        )
    computed = crc_of(raw, at)
    if computed != int(digits, 16):
        raise CorruptCheckpointError(
            f"{where}: the metadata checksum does not match: the document records "
            f"{ALGORITHM}:{digits}, its bytes give {ALGORITHM}:{computed:08x} (damaged or "
            "edited since it was written)"
        )
    return True


def strip(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` without its ``checksum`` member (a copy when it had one)."""
    if MEMBER not in obj:
        return obj
    return {k: v for k, v in obj.items() if k != MEMBER}


_logged: set[str] = set()
_logged_lock = threading.Lock()
_LOGGED_MAX = 10_000  # locations remembered; a long job that reads more logs some again


def _unsealed(where: str) -> None:
    """Log, once per location, that the document there carries no checksum: expected of
    a checkpoint written before distckpt sealed them, so INFO and never repeated for a
    document re-read every step."""
    with _logged_lock:
        if where in _logged:
            return
        if len(_logged) >= _LOGGED_MAX:
            _logged.clear()
        _logged.add(where)
    log.info("%s: %s; read without checking it", where, UNSEALED)
