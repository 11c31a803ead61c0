"""Signed checkpoints: authenticity, not only integrity.

crc32c and the metadata seals stop accidents; whoever can write the storage can
recompute them. A save given a private key (``signing_key``, or ``$DISTCKPT_SIGNING_KEY``)
hashes every byte it stores with a cryptographic hash (:mod:`distckpt.signing.hashes`),
records the hashes in the index and signs the index with Ed25519
(:mod:`distckpt.signing.signature`); a load, a restore, ``distckpt verify`` and the DCP
reader given trusted public keys (``trusted_keys``, or ``$DISTCKPT_TRUSTED_KEYS``)
refuse any checkpoint that is not signed by one of them, and check every byte they read
against its signed hash. Keys are files (:mod:`distckpt.signing.keys`).

See the documentation's "Signed checkpoints" page for what a signature proves and what
it does not.
"""

from __future__ import annotations

from distckpt.signing.keys import KeyFileError, SigningKey, TrustedKeys

__all__ = ["KeyFileError", "SigningKey", "TrustedKeys"]
