"""Ed25519 keys for signed checkpoints: a private key signs a save, public keys a load
trusts.

Keys live in files, as the ecosystem keeps them:

* a **private key** is a PEM file (PKCS #8, ``-----BEGIN PRIVATE KEY-----``, what
  ``openssl genpkey -algorithm ed25519`` and ``distckpt keygen`` write) or an OpenSSH
  private key (``ssh-keygen -t ed25519``), unencrypted, or encrypted with the password
  given to :meth:`SigningKey.from_file`;
* a **trusted-keys file** holds one or more public keys: PEM blocks
  (``-----BEGIN PUBLIC KEY-----``) and OpenSSH lines (``ssh-ed25519 AAAA... comment``),
  in any mix, as an ``authorized_keys`` file does; blank lines and ``#`` comments are
  skipped.

``$DISTCKPT_SIGNING_KEY`` names the private key file a save signs with when none is
given, ``$DISTCKPT_TRUSTED_KEYS`` the trusted-keys file a load requires a signature by
(:mod:`distckpt.settings`). A key is named in a signature, and in messages, by its id:
the first 16 hexadecimal digits of the SHA-256 of its 32 raw bytes.

Needs the ``cryptography`` package (``pip install 'distckpt[sign]'``).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections.abc import Mapping
from typing import Any

from distckpt import settings
from distckpt.errors import CheckpointError

#: The largest key file read (a trusted-keys file of a few thousand keys).
MAX_KEY_FILE = 1 << 20
_PEM = re.compile(rb"-----BEGIN PUBLIC KEY-----\s+.*?-----END PUBLIC KEY-----", re.S)
_SSH = re.compile(rb"^\s*(ssh-ed25519\s+[A-Za-z0-9+/=]+)", re.M)


class KeyFileError(CheckpointError, ValueError):
    """A key file that cannot be used: missing, not a key, or not an Ed25519 key."""


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise ImportError(
            "signed checkpoints need the cryptography package: pip install 'distckpt[sign]'"
        ) from None
    return serialization, ed25519


def key_id(public: Any) -> str:
    """The id of an Ed25519 public key (see the module docstring)."""
    serialization, _ = _crypto()
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def _read(path: str | os.PathLike[str], what: str) -> bytes:
    """A key file's bytes: a regular file of at most :data:`MAX_KEY_FILE` bytes."""
    where = os.fspath(path)
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise KeyFileError(f"{what} {where}: {exc.strerror or exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise KeyFileError(f"{what} {where}: not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(MAX_KEY_FILE + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_KEY_FILE:
        raise KeyFileError(f"{what} {where}: larger than {MAX_KEY_FILE} bytes")
    return raw


class SigningKey:
    """An Ed25519 private key that signs checkpoints (its files: see the module docstring).

    Make one, write it, and save with it::

        key = distckpt.SigningKey.generate()
        key.write("signing.pem", public="signing.pub")
        distckpt.save(state, "run/ckpt-1", signing_key="signing.pem")
    """

    def __init__(self, private: Any, source: str = "a key in memory") -> None:
        _, ed25519 = _crypto()
        if not isinstance(private, ed25519.Ed25519PrivateKey):
            raise KeyFileError(f"{source}: not an Ed25519 private key")
        self._private = private
        self.source = source
        self.id = key_id(private.public_key())

    @classmethod
    def generate(cls) -> SigningKey:
        """A new random key."""
        _, ed25519 = _crypto()
        return cls(ed25519.Ed25519PrivateKey.generate(), "a new key")

    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], *, password: bytes | None = None
    ) -> SigningKey:
        """The key in a PEM (PKCS #8) or OpenSSH private key file."""
        serialization, _ = _crypto()
        raw = _read(path, "signing key")
        where = os.fspath(path)
        try:
            if b"OPENSSH PRIVATE KEY" in raw:
                private = serialization.load_ssh_private_key(raw, password)
            else:
                private = serialization.load_pem_private_key(raw, password)
        except (ValueError, TypeError) as exc:
            raise KeyFileError(f"signing key {where}: not a readable private key ({exc})") from None
        return cls(private, where)

    def sign(self, message: bytes) -> bytes:
        """The 64-byte Ed25519 signature of ``message``."""
        return bytes(self._private.sign(message))

    def trusted(self) -> TrustedKeys:
        """Its public key, as the keys a load trusts."""
        return TrustedKeys(
            {self.id: self._private.public_key()}, f"the public key of {self.source}"
        )

    def public_pem(self) -> bytes:
        serialization, _ = _crypto()
        return bytes(
            self._private.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )

    def write(self, path: str | os.PathLike[str], *, public: str | os.PathLike[str]) -> None:
        """Write the private key (PEM, PKCS #8, unencrypted, readable by its owner only)
        to ``path`` and its public key (PEM) to ``public``; neither may exist yet."""
        serialization, _ = _crypto()
        pem = self._private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        with open(os.fspath(public), "xb") as f:
            f.write(self.public_pem())

    def __repr__(self) -> str:
        return f"SigningKey(id={self.id!r}, source={self.source!r})"


class TrustedKeys:
    """The Ed25519 public keys a load accepts signatures of, by key id."""

    def __init__(self, keys: Mapping[str, Any], source: str) -> None:
        if not keys:
            raise KeyFileError(f"{source}: no Ed25519 public key")
        self.keys = dict(keys)
        self.source = source

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> TrustedKeys:
        """The keys of a trusted-keys file (see the module docstring)."""
        return cls.from_bytes(_read(path, "trusted keys"), os.fspath(path))

    @classmethod
    def from_bytes(cls, raw: bytes, source: str = "trusted keys") -> TrustedKeys:
        serialization, ed25519 = _crypto()
        keys: dict[str, Any] = {}
        blocks = [m.group(0) for m in _PEM.finditer(raw)]
        lines = [m.group(1) for m in _SSH.finditer(raw)]
        for block in blocks + lines:
            try:
                if block.startswith(b"ssh-"):
                    public = serialization.load_ssh_public_key(block)
                else:
                    public = serialization.load_pem_public_key(block)
            except (ValueError, TypeError, serialization.UnsupportedAlgorithm) as exc:
                raise KeyFileError(f"{source}: a key that cannot be read ({exc})") from None
            if not isinstance(public, ed25519.Ed25519PublicKey):
                raise KeyFileError(f"{source}: a public key that is not Ed25519")
            keys[key_id(public)] = public
        return cls(keys, source)

    def public_key(self, kid: str) -> Any:
        """The key of id ``kid``, or None."""
        return self.keys.get(kid)

    def __repr__(self) -> str:
        return f"TrustedKeys({sorted(self.keys)!r}, source={self.source!r})"


KeySource = SigningKey | str | os.PathLike[str] | None
TrustSource = TrustedKeys | SigningKey | str | os.PathLike[str] | None


def signing_key(given: KeySource) -> SigningKey | None:
    """The key a save signs with: ``given`` (a key or its file), else the file
    ``$DISTCKPT_SIGNING_KEY`` names, else None (the save is not signed)."""
    if isinstance(given, SigningKey):
        return given
    path = given if given is not None else settings.SIGNING_KEY.get()
    return None if path is None else SigningKey.from_file(path)


def wants_signature(given: KeySource) -> bool:
    """Whether a save is to be signed, without reading the key (every rank hashes what it
    writes; only the coordinator reads the key and signs)."""
    return given is not None or settings.SIGNING_KEY.is_set()


def requires_signature(given: TrustSource) -> bool:
    """Whether a load is to require a signature, without reading the keys."""
    return given is not None or settings.TRUSTED_KEYS.is_set()


def trusted_keys(given: TrustSource) -> TrustedKeys | None:
    """The keys a load requires a signature by: ``given`` (keys, a signing key's public
    key, or a trusted-keys file), else the file ``$DISTCKPT_TRUSTED_KEYS`` names, else
    None (no signature is required)."""
    if isinstance(given, TrustedKeys):
        return given
    if isinstance(given, SigningKey):
        return given.trusted()
    path = given if given is not None else settings.TRUSTED_KEYS.get()
    return None if path is None else TrustedKeys.from_file(path)
