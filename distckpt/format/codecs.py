"""Optional compression of inner chunks: zarr v3's ``zstd`` and ``blosc`` codecs.

A save chooses a compression per variable (:func:`choose`): ``None`` (raw), ``"zstd"``,
``"blosc-zstd"`` (zstd after byte shuffling, blosc's) or ``"blosc-lz4"``, for the whole
checkpoint or by name pattern (benchmarks/bench_compression.py measures them per dtype;
the README says which to use when)::

    distckpt.save(state, path, compression="zstd")
    distckpt.save(state, path, compression={"optimizer/*": "zstd", "*": None})

Patterns are :func:`fnmatch.fnmatchcase` patterns over variable names (``*`` also
matches ``/``), tried in the mapping's order: the first that matches wins, and a name
that none matches is stored raw.

A compressed array's inner codecs are ``[bytes, zstd | blosc, crc32c]``, configured the
way zarr-python 3 writes them, so zarr-python and tensorstore decode it; the index records
the same codec JSON on each piece (:class:`~distckpt.format.stored.StoredPiece`), and a
reader refuses a codec it does not know with :class:`~distckpt.errors.UnsupportedFormatError`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

import numpy as np

from distckpt.errors import UnsupportedFormatError
from distckpt.format import frames

#: What a save's ``compression`` accepts: one choice, or patterns to choices.
Compression: TypeAlias = str | None | Mapping[str, str | None]
CHOICES = ("zstd", "blosc-zstd", "blosc-lz4")
#: blosc's zstd level: 3 gives bf16 weights about 1.35x at a few hundred MB/s per core,
#: where 5 gives 1.42x at a third of that speed (benchmarks/bench_compression.py).
BLOSC_ZSTD_LEVEL = 3


class Codec(Protocol):
    """A bytes-to-bytes compressor of whole inner chunks."""

    @property
    def name(self) -> str: ...

    def to_json(self) -> dict[str, Any]: ...

    def encode(self, raw: np.ndarray) -> bytes:
        """The compressed bytes of ``raw`` (a flat uint8 array)."""
        ...

    def decode(self, stored: np.ndarray, out: np.ndarray) -> None:
        """Decompress ``stored`` into ``out`` (flat uint8), which it must fill exactly:
        a frame that would not (or whose header lies) raises ``ValueError`` before any
        decoder reads it (:mod:`distckpt.format.frames`)."""
        ...


@dataclass(frozen=True)
class Zstd:
    level: int = 0  # zstd's default level (3)
    checksum: bool = False
    name: str = "zstd"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "configuration": {"level": self.level, "checksum": self.checksum},
        }

    def _codec(self) -> Any:
        from numcodecs import Zstd as Numcodec

        return Numcodec(level=self.level, checksum=self.checksum)

    def encode(self, raw: np.ndarray) -> bytes:
        return bytes(self._codec().encode(raw))

    def decode(self, stored: np.ndarray, out: np.ndarray) -> None:
        frames.check_zstd(stored, out.nbytes)
        _decode_exactly(self._codec(), stored, out)


_SHUFFLES = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}


@dataclass(frozen=True)
class Blosc:
    typesize: int
    cname: str = "lz4"
    clevel: int = 5
    shuffle: str = "shuffle"
    blocksize: int = 0
    name: str = "blosc"

    def to_json(self) -> dict[str, Any]:
        config = {
            "typesize": self.typesize,
            "cname": self.cname,
            "clevel": self.clevel,
            "shuffle": self.shuffle,
            "blocksize": self.blocksize,
        }
        return {"name": self.name, "configuration": config}

    def _codec(self) -> Any:
        from numcodecs import Blosc as Numcodec

        return Numcodec(
            cname=self.cname,
            clevel=self.clevel,
            shuffle=_SHUFFLES[self.shuffle],
            blocksize=self.blocksize,
            typesize=self.typesize,
        )

    def encode(self, raw: np.ndarray) -> bytes:
        return bytes(self._codec().encode(raw))

    def decode(self, stored: np.ndarray, out: np.ndarray) -> None:
        frames.check_blosc(stored, out.nbytes, self.cname, self.typesize, self.shuffle)
        _decode_exactly(self._codec(), stored, out)


def _decode_exactly(codec: Any, stored: np.ndarray, out: np.ndarray) -> None:
    """Decode a checked frame into ``out``. The frame declares ``out``'s size (checked),
    and the decoders produce exactly what a frame declares or fail: zstd compares what it
    made with the declared content size, c-blosc each block with its size. numcodecs
    hands back ``out`` itself, so its length alone would prove nothing."""
    got = np.frombuffer(codec.decode(stored, out=out), dtype=np.uint8)
    if got.nbytes != out.nbytes:
        raise ValueError(f"decompressed to {got.nbytes} bytes, expected {out.nbytes}")
    if not np.shares_memory(got, out):
        out[...] = got


def check(compression: Compression) -> None:
    """Raise ValueError unless ``compression`` is a valid choice or pattern mapping."""
    choices = compression.values() if isinstance(compression, Mapping) else [compression]
    for choice in choices:
        if choice is not None and choice not in CHOICES:
            raise ValueError(
                f"unknown compression {choice!r}: use None, " + ", ".join(map(repr, CHOICES))
            )
    if isinstance(compression, Mapping) and not all(isinstance(p, str) for p in compression):
        raise ValueError("compression patterns must be strings (fnmatch patterns of names)")


def choose(compression: Compression, name: str) -> str | None:
    """The compression of variable ``name``: the first pattern that matches it wins."""
    if not isinstance(compression, Mapping):
        return compression
    for pattern, choice in compression.items():
        if fnmatch.fnmatchcase(name, pattern):
            return choice
    return None


def make(choice: str | None, itemsize: int) -> Codec | None:
    """The codec of a :data:`CHOICES` entry for elements of ``itemsize`` bytes, configured
    as zarr-python configures it for that data type (blosc: shuffle bytes of multi-byte
    elements, bits of single bytes)."""
    if choice is None:
        return None
    if choice == "zstd":
        return Zstd()
    shuffle = "bitshuffle" if itemsize == 1 else "shuffle"
    if choice == "blosc-lz4":
        return Blosc(typesize=itemsize, shuffle=shuffle)
    if choice == "blosc-zstd":
        return Blosc(typesize=itemsize, cname="zstd", clevel=BLOSC_ZSTD_LEVEL, shuffle=shuffle)
    raise ValueError(f"unknown compression {choice!r}")


def from_json(doc: Any, variable: str) -> Codec:
    """The codec an index entry records; UnsupportedFormatError names ``variable`` when
    this distckpt cannot decode it."""
    name = doc.get("name") if isinstance(doc, dict) else None
    config = doc.get("configuration", {}) if isinstance(doc, dict) else {}
    try:
        if name == "zstd":
            return Zstd(
                level=int(config.get("level", 0)), checksum=bool(config.get("checksum", False))
            )
        if name == "blosc" and config.get("shuffle") in _SHUFFLES:
            return Blosc(
                typesize=int(config.get("typesize", 1)),
                cname=str(config["cname"]),
                clevel=int(config["clevel"]),
                shuffle=str(config["shuffle"]),
                blocksize=int(config.get("blocksize", 0)),
            )
    except (KeyError, TypeError, ValueError, AttributeError):
        pass
    raise UnsupportedFormatError(
        f"variable {variable!r} is stored with codec {doc!r:.80}, which this distckpt cannot "
        "decode (it reads zstd and blosc): upgrade distckpt to read it"
    )
