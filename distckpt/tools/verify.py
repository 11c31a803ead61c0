"""``distckpt verify``: re-read every stored byte of a checkpoint and check it.

For every tensor (per-rank ones included) it checks, in order:

1. coverage, without I/O: the pieces' boxes lie inside the global shape, do not overlap,
   and together cover it exactly once; each piece's block holds its box, and its inner
   chunks divide the block;
2. each piece's file: present, of the size the index records, and every byte of it read
   back through the same code a restore uses (:mod:`distckpt.format.piece_reader`): the
   piece's crc32c in the index, the shard's checksum table and index, and the crc32c of
   every inner chunk (of the whole chunk, for a plain piece); a compressed inner chunk
   is also decompressed, and must give exactly one inner chunk of bytes.

The index itself is checked first, as by every reader: its own checksum
(:mod:`distckpt.format.seal`; a mismatch raises, naming the file; an index without one,
of a distckpt that did not seal it, is reported in :attr:`VerifyReport.notes`), then its
well-formedness.

Problems are collected, not raised, so one run reports every damaged piece; each names
the variable and the file. Memory: one inner chunk (or one plain chunk) at a time.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from distckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    UnsupportedValueError,
    UntrustedCheckpointError,
)
from distckpt.format import seal
from distckpt.format.piece_reader import PieceReader
from distckpt.signing.keys import TrustedKeys
from distckpt.signing.trust import file_problems
from distckpt.slices import Box
from distckpt.tiling import tiling_problem
from distckpt.tools.catalog import Catalog, TensorVar, open_catalog
from distckpt.tools.summary import signer_of
from distckpt.values import decode


@dataclass
class VerifyReport:
    """What :func:`verify` checked, and every problem it found (empty when all is well)."""

    variables: int = 0
    pieces: int = 0
    bytes_read: int = 0
    problems: list[str] = field(default_factory=list)
    #: Whether the index carries its checksum (checked before anything else was read);
    #: False for an index written by a distckpt that did not seal it.
    sealed: bool = True
    #: The key id that signed the checkpoint, as the index names it (None: unsigned);
    #: ``trusted``: whether that signature was checked against trusted keys and holds.
    signer: str | None = None
    trusted: bool = False

    @property
    def notes(self) -> list[str]:
        """What is worth saying that is not a problem."""
        notes = [] if self.sealed else [seal.UNSEALED]
        if self.trusted:
            notes.append(f"signed by trusted key {self.signer}, every byte as signed")
        elif self.signer is not None:
            notes.append(f"signed by key {self.signer} (not checked: no trusted keys given)")
        return notes

    @property
    def ok(self) -> bool:
        return not self.problems


def coverage_problems(name: str, shape: tuple[int, ...], boxes: list[Box]) -> list[str]:
    """Why ``boxes`` do not tile ``shape`` exactly once (pure; empty when they do)."""
    full = Box.full(shape)
    problems = [
        f"variable {name!r}: piece box {box} lies outside the shape {list(shape)}"
        for box in boxes
        if not full.contains(box)
    ]
    if problems:
        return problems
    problem = tiling_problem(boxes, full)
    if problem is None:
        return []
    if problem.kind == "overlap":
        a, b = problem.boxes
        both = f"{a} is listed twice" if a == b else f"{a} and {b} overlap in {a.intersect(b)}"
        return [f"variable {name!r}: pieces {both}"]
    if problem.kind == "gap":  # (the pieces are disjoint: their count is what they cover)
        covered = sum(b.numel for b in boxes)
        return [
            f"variable {name!r}: pieces cover {covered} of its {full.numel} elements "
            f"(shape {list(shape)}); none covers {problem.boxes[0]}"
        ]
    return [f"variable {name!r}: pieces: {problem}"]


def check_slabs(catalog: Catalog, var: TensorVar, max_slab_bytes: int) -> None:
    """Refuse ``var`` unless it can be read a slab at a time from stored bytes alone
    (``export``, ``diff``): its pieces must cover its shape exactly once, else some bytes
    of a slab would come from no stored byte. (A compressed inner chunk, decompressed
    whole, is at most :data:`~distckpt.format.wellformed.MAX_CODEC_CHUNK`: the index's
    own checks refuse a larger one, so ``max_slab_bytes`` bounds the rest.)"""
    problems = coverage_problems(var.name, var.shape, [p.box for p in var.pieces])
    if problems:
        raise CorruptCheckpointError(f"{catalog.root.url}: {problems[0]}")


def stored_bytes(catalog: Catalog) -> int:
    """The bytes :func:`verify` reads: every piece's file, as the index records its size."""
    return sum(p.size for var in catalog.tensors.values() for p in var.pieces)


def verify(
    path: str | os.PathLike[str],
    on_bytes: Callable[[int], None] | None = None,
    *,
    trusted: TrustedKeys | None = None,
) -> VerifyReport:
    """Check every byte of the checkpoint at ``path``; ``on_bytes(n)`` reports progress
    (the bytes read so far add up to the pieces' file sizes, :func:`stored_bytes`).

    Raises :class:`~distckpt.errors.CheckpointError` only when the index itself cannot
    be read; damage to the data is reported in the result::

        report = verify("run/ckpt-10")
        for problem in report.problems:
            print(problem)

    A signed checkpoint's hashes are checked too (every piece, every file it lists);
    with ``trusted`` (keys, see :mod:`distckpt.signing`) a checkpoint that is not signed
    by one of them is a problem, named first.
    """
    problems: list[str] = []
    try:
        catalog = open_catalog(path, tiling=False, trusted=trusted)  # coverage: below
    except UntrustedCheckpointError as exc:
        problems.append(str(exc))
        catalog = open_catalog(path, tiling=False)  # the data is still checked
    index = catalog.index
    signed_by = getattr(index, "signed_by", None)
    report = VerifyReport(
        variables=len(catalog.tensors) + len(catalog.values),
        problems=problems,
        sealed=getattr(index, "sealed", False),
        signer=signed_by or signer_of(index),
        trusted=signed_by is not None,
    )
    if signed_by is None:  # (checked with the signature otherwise)
        report.problems.extend(file_problems(catalog.root, index))
    for var in catalog.tensors.values():
        _verify_tensor(catalog, var, report, on_bytes)
    for value in catalog.values.values():
        try:
            decode(value.value, name=value.name)
        except UnsupportedValueError:
            pass  # a pickled value: well-formed, and never unpickled here
        except (ValueError, TypeError, KeyError) as exc:
            report.problems.append(f"variable {value.name!r}: malformed stored value ({exc})")
    return report


def _verify_tensor(
    catalog: Catalog,
    var: TensorVar,
    report: VerifyReport,
    on_bytes: Callable[[int], None] | None,
) -> None:
    problems = coverage_problems(var.name, var.shape, [p.box for p in var.pieces])
    for piece in var.pieces:
        where = f"({catalog.root.where(piece.file)})"
        if any(b < n for b, n in zip(piece.block, piece.box.lengths, strict=True)):
            problems.append(
                f"variable {var.name!r}: block {list(piece.block)} is smaller "
                f"than its box {piece.box} {where}"
            )
        elif piece.inner is not None and any(
            i <= 0 or b % i for b, i in zip(piece.block, piece.inner, strict=True)
        ):
            problems.append(
                f"variable {var.name!r}: inner chunks {list(piece.inner)} do not "
                f"divide the block {list(piece.block)} {where}"
            )
    if problems:
        report.problems.extend(problems)
        return
    for piece in var.pieces:
        report.pieces += 1
        if piece.box.empty:
            continue  # a tensor with no elements: no file is written for it
        file = catalog.root.where(piece.file)
        try:
            with catalog.root.open(piece.file) as handle:
                size = handle.size
        except FileNotFoundError:
            report.problems.append(
                f"variable {var.name!r}: a file the index names is missing ({file})"
            )
            continue
        if size != piece.size:
            report.problems.append(
                f"variable {var.name!r}: file is {size} bytes, the index says {piece.size} ({file})"
            )
            continue
        algorithm = catalog.index.get("hash_algorithm")
        auth = None
        if isinstance(algorithm, str):
            if piece.hash is None:
                report.problems.append(
                    f"variable {var.name!r}: the signed index records no hash of its piece ({file})"
                )
                continue
            auth = (algorithm, piece.hash)
        reader = PieceReader(
            var.name, catalog.root, piece.file, var.numpy_dtype, piece.crc, piece.codec, size, auth
        )
        try:
            if piece.inner is None:
                out = np.empty(piece.box.lengths, dtype=var.numpy_dtype)
                got = reader.read_plain(piece.block, Box.full(piece.box.lengths), out)
                if on_bytes is not None:
                    on_bytes(got)
            else:
                got = reader.verify_sharded(piece.block, piece.inner, piece.box.lengths, on_bytes)
        except (CheckpointError, OSError) as exc:
            report.problems.append(str(exc))
            continue
        report.bytes_read += got
