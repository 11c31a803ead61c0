"""The signature of a checkpoint's index: where it is written and what it covers.

Specification
-------------
A **signed index** is a sealed index (:mod:`distckpt.format.seal`) whose sealed object
has as its SECOND member, right after ``checksum``::

    "signature": "ed25519:<key id>:<signature>"

written exactly in that byte form: the 22 bytes ``"signature": "ed25519:`` (one space
after the colon), the key's id (16 lowercase hex digits, :func:`~distckpt.signing.keys.key_id`),
``:``, the 64-byte Ed25519 signature in standard base64 (88 characters), then ``"``. It
follows the checksum member and the comma, with nothing between: ``"checksum":
"crc32c:<8 digits>","signature": "ed25519:``.

*What is signed*: the index document's bytes as stored, with the checksum's 8 digits
read as ``00000000`` and the signature's 88 characters read as 88 ``0`` characters:
every other byte of the root ``zarr.json``. The index records a hash of every stored
piece and of every other file (``hash_algorithm``, ``hash`` on each piece or regular
entry, ``files``: :mod:`distckpt.signing.hashes`), so the signature covers every byte
of the checkpoint. The seal is computed last, over the signed bytes.

*Checking it*, given trusted keys: the seal first; then the member must be where this
says, its key one of the trusted ones, and the signature valid for those bytes.
Anything else is an :class:`~distckpt.errors.UntrustedCheckpointError` saying which.

A reader that does not check signatures reads a signed index as any other: the member is
one more it skips.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from distckpt.errors import UntrustedCheckpointError
from distckpt.format import seal
from distckpt.signing.keys import SigningKey, TrustedKeys

MEMBER = "signature"
ALGORITHM = "ed25519"
MARK = b'"signature": "ed25519:'
#: Characters of a signature's base64 (64 bytes).
SIGNATURE_CHARS = 88
_ZEROS = b"0" * SIGNATURE_CHARS
_VALUE = re.compile(rb"([0-9a-f]{16}):([A-Za-z0-9+/]{86}==)\"")
#: Where the member begins, from the checksum member's digits: the digits, the closing
#: quote and the comma.
_AFTER_DIGITS = seal.DIGITS + 2


def _invalid_signature() -> type[Exception]:
    from cryptography.exceptions import InvalidSignature

    return InvalidSignature


def placeholder(kid: str) -> str:
    """The member's value while the index is serialised, before :func:`sign` fills it."""
    return f"{ALGORITHM}:{kid}:{_ZEROS.decode()}"


def with_member(index: dict[str, Any], kid: str) -> dict[str, Any]:
    """``index`` (already made by :func:`seal.sealed`) with the signature member second."""
    items = list(index.items())
    return dict([items[0], (MEMBER, placeholder(kid)), *items[1:]])


def _member_at(raw: bytes) -> int | None:
    """Where the signature member's mark begins: right after the checksum member."""
    found = raw.find(seal.MARK)
    if found < 0:
        return None
    at = found + len(seal.MARK) + _AFTER_DIGITS
    return at if raw[at : at + len(MARK)] == MARK else None


def sign(raw: bytes, key: SigningKey) -> bytes:
    """``raw`` (a sealed index serialised with :func:`with_member`'s placeholder, compact)
    signed with ``key`` and sealed again."""
    compact = b'"signature":"' + ALGORITHM.encode() + b":"
    raw = raw.replace(compact, MARK, 1)  # the member's one byte form
    at = _member_at(raw)
    if at is None:
        raise ValueError("the index holds no signature member right after its checksum")
    start = at + len(MARK) + 17  # the key id and its colon
    digits = raw.find(seal.MARK) + len(seal.MARK)
    message = _message(raw, digits, start)
    value = base64.b64encode(key.sign(message))
    return seal.seal(raw[:start] + value + raw[start + SIGNATURE_CHARS :])


def _message(raw: bytes, digits: int, start: int) -> bytes:
    """What is signed: ``raw`` with the checksum digits at ``digits`` and the signature at
    ``start`` zeroed."""
    return b"".join(
        (
            raw[:digits],
            b"0" * seal.DIGITS,
            raw[digits + seal.DIGITS : start],
            _ZEROS,
            raw[start + SIGNATURE_CHARS :],
        )
    )


def signer(raw: bytes) -> str | None:
    """The key id the index in ``raw`` names as its signer, or None when it is unsigned
    (not checked: see :func:`verify`)."""
    at = _member_at(raw)
    if at is None:
        return None
    found = _VALUE.match(raw, at + len(MARK))
    return None if found is None else found.group(1).decode()


def verify(raw: bytes, index: dict[str, Any], trusted: TrustedKeys, where: str) -> str:
    """Check that ``raw`` (an index whose seal was checked; ``index``, its sealed object
    parsed) is signed by one of ``trusted``; return the signer's key id. Raises
    :class:`UntrustedCheckpointError` naming ``where`` and what is wrong."""
    member = index.get(MEMBER)
    if member is None:
        raise UntrustedCheckpointError(
            f"{where}: the checkpoint is not signed, and a signature by {trusted.source} "
            "is required"
        )
    at = _member_at(raw)
    found = None if at is None else _VALUE.match(raw, at + len(MARK))
    if (
        found is None
        or member != f"{ALGORITHM}:{found.group(1).decode()}:{found.group(2).decode()}"
    ):
        raise UntrustedCheckpointError(
            f"{where}: the signature member is malformed or not where it must be (second, "
            f'written as {MARK.decode()}<key id>:<base64>")'
        )
    kid = found.group(1).decode()
    public = trusted.public_key(kid)
    if public is None:
        raise UntrustedCheckpointError(
            f"{where}: signed by key {kid}, which is not among {trusted.source} "
            f"({', '.join(sorted(trusted.keys))})"
        )
    try:
        signature = base64.b64decode(found.group(2), validate=True)
    except binascii.Error:
        raise UntrustedCheckpointError(f"{where}: the signature is not base64") from None
    digits = raw.find(seal.MARK) + len(seal.MARK)
    start = found.start(2)
    try:
        public.verify(signature, _message(raw, digits, start))
    except _invalid_signature():
        raise UntrustedCheckpointError(
            f"{where}: the signature by key {kid} does not match the index (edited since "
            "it was signed)"
        ) from None
    return kid
