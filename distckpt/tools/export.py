"""``distckpt export``: a checkpoint as one consolidated file, streamed: each tensor is
read a slab at a time (:mod:`distckpt.tools.slabs`) and written at its place, so memory
is one slab of at most ``max_slab_bytes`` (64 MiB by default) plus an inner chunk per I/O
worker (a compressed one declares at most 64 MiB), whatever the model's size or what a
checkpoint declares. A tensor whose pieces do not cover it exactly once
(:func:`~distckpt.tools.verify.check_slabs`), or whose files cannot fill it
(:func:`~distckpt.format.backed.check_stored`), is refused before anything is written
or allocated: every byte written is a verified stored byte.

* ``.safetensors``: the header (every tensor's dtype, shape and offsets) first, then each
  tensor's bytes. Python values go into the header's ``__metadata__``, each as a JSON
  string of distckpt's typed JSON (:mod:`distckpt.values`; plain JSON for ints, floats,
  strings, lists and string-keyed dicts of them). complex128 has no safetensors dtype:
  refused.
* ``.pt`` / ``.pth``: ``torch.save`` of a flat dict ``{name: tensor or value}``, the file
  ``torch.save`` writes (:mod:`distckpt.tools.torch_file`: the archive with room for
  each tensor, then each tensor's bytes). With torch older than 2.6, which cannot leave
  that room, the tensors are built in memory first. Pickled values are included only
  with ``allow_pickle=True`` (unpickling runs code from the checkpoint), else skipped.

Names are the checkpoint's variable names (nested keys joined by ``/``); rank ``r``'s
entry of a per-rank variable ``name`` is exported as ``name/rank<r>``. The output appears
under its name only once it is complete (written beside it, then renamed).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from distckpt import dtypes
from distckpt.engine.load import read_region
from distckpt.errors import ConversionError, UnsupportedValueError
from distckpt.format.backed import check_stored
from distckpt.hf.safetensors import TensorHeader, header
from distckpt.slices import Box
from distckpt.tools import torch_file
from distckpt.tools.catalog import Catalog, TensorVar, open_catalog
from distckpt.tools.slabs import DEFAULT_SLAB_BYTES, slabs
from distckpt.tools.verify import check_slabs
from distckpt.transfer.arrays import writable_view
from distckpt.values import decode

log = logging.getLogger("distckpt")

#: The suffixes of the files :func:`export` writes: safetensors, or ``torch.save``'s.
FORMATS = (".safetensors", ".pt", ".pth")


@dataclass
class ExportReport:
    """What :func:`export` wrote; ``largest_buffer`` is the biggest slab buffer it used."""

    path: Path
    tensors: int = 0
    values: int = 0
    skipped: list[str] = field(default_factory=list)
    bytes_written: int = 0
    largest_buffer: int = 0


def export(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    max_slab_bytes: int = DEFAULT_SLAB_BYTES,
    overwrite: bool = False,
    allow_pickle: bool = False,
    on_bytes: Callable[[int], None] | None = None,
) -> ExportReport:
    """Write the checkpoint at ``checkpoint`` as one file; the suffix of ``out`` picks the
    format. ``on_bytes(n)`` is called as tensor bytes are written::

        export("run/ckpt-10", "model.safetensors")
    """
    target = Path(out)
    suffix = target.suffix.lower()
    if suffix not in FORMATS:
        raise ConversionError(
            f"cannot export to {target.name!r}: the file name must end in " + ", ".join(FORMATS)
        )
    if not target.parent.is_dir():
        raise ConversionError(f"cannot write {target}: no directory {target.parent}")
    if max_slab_bytes < 1:
        raise ConversionError(f"max_slab_bytes must be positive, got {max_slab_bytes}")
    if target.exists() and not overwrite:
        raise ConversionError(f"{target} exists (pass --overwrite to replace it)")
    catalog = open_catalog(checkpoint)
    for var in catalog.tensors.values():  # before a byte is written or allocated
        check_slabs(catalog, var, max_slab_bytes)
        check_stored(catalog.root, var.pieces)
    report = ExportReport(target)
    if suffix == ".safetensors":
        _export_safetensors(catalog, target, report, max_slab_bytes, on_bytes)
    else:
        _export_torch(catalog, target, report, allow_pickle, max_slab_bytes, on_bytes)
    return report


@contextmanager
def _replacing(target: Path) -> Iterator[IO[bytes]]:
    """A file written beside ``target`` and renamed onto it once complete."""
    tmp = target.with_name(f".{target.name}.tmp-{secrets.token_hex(8)}")
    try:
        # A fresh name, created here and never through a link another process put there.
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(tmp, flags, 0o644), "w+b") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _export_safetensors(
    catalog: Catalog,
    target: Path,
    report: ExportReport,
    max_slab_bytes: int,
    on_bytes: Callable[[int], None] | None,
) -> None:
    tensors = [catalog.tensors[n] for n in sorted(catalog.tensors)]
    metadata = {name: _json_text(v.value) for name, v in sorted(catalog.values.items())}
    head = header([TensorHeader(v.name, v.dtype, v.shape, v.nbytes) for v in tensors], metadata)
    with _replacing(target) as f:
        f.write(head)
        for var in tensors:
            for raw in tensor_slabs(catalog, var, max_slab_bytes):
                f.write(raw.data)
                report.bytes_written += raw.nbytes
                if on_bytes is not None:
                    on_bytes(raw.nbytes)
                report.largest_buffer = max(report.largest_buffer, raw.nbytes)
            report.tensors += 1
    report.values = len(metadata)


def _json_text(value: Any) -> str:
    """``value`` (typed JSON) as JSON text in UTF-8, escaped only where it must be: a
    string may hold a lone surrogate, which no UTF-8 encodes but JSON's escapes do."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value)
    return text


def tensor_slabs(
    catalog: Catalog,
    var: TensorVar,
    max_slab_bytes: int = DEFAULT_SLAB_BYTES,
    *,
    io_workers: int | None = None,
) -> Iterator[np.ndarray]:
    """The C-order bytes of the stored tensor ``var``, as consecutive flat uint8 arrays of
    at most ``max_slab_bytes`` (or one element), read and verified a slab at a time into
    one buffer that each next slab reuses: use each before asking for the next. The
    caller has refused, before writing anything, a tensor whose slabs stored bytes cannot
    fill alone (:func:`check_slabs`), as :func:`export` and ``export_hf`` do."""
    itemsize = var.numpy_dtype.itemsize
    buffer = np.empty(0, dtype=np.uint8)
    for box in slabs(var.shape, itemsize, max_slab_bytes):
        nbytes = box.numel * itemsize
        if buffer.nbytes < nbytes:
            buffer = np.empty(nbytes, dtype=np.uint8)
        raw = buffer[:nbytes]
        shaped = raw.view(var.numpy_dtype).reshape(box.lengths)
        read_region(catalog.root, var.name, var.entry, box, shaped, io_workers=io_workers)
        yield raw


def _export_torch(
    catalog: Catalog,
    target: Path,
    report: ExportReport,
    allow_pickle: bool,
    max_slab_bytes: int,
    on_bytes: Callable[[int], None] | None,
) -> None:
    """``torch.save`` of ``{name: tensor or value}``, streamed where torch allows
    (:mod:`distckpt.tools.torch_file`): the archive is written with room for each
    tensor, then each tensor a slab at a time. Older torch: built in memory."""
    streamed = torch_file.supported()
    state: dict[str, Any] = {}
    tensors: list[TensorVar] = []
    for name in catalog.names:
        if name in catalog.tensors:
            var = catalog.tensors[name]
            dtype = dtypes.torch_dtype(var.dtype)
            state[name] = torch_file.placeholder(var.shape, dtype) if streamed else None
            tensors.append(var)
            continue
        try:
            state[name] = decode(catalog.values[name].value, allow_pickle=allow_pickle, name=name)
        except UnsupportedValueError:
            report.skipped.append(f"{name} (a pickled value: pass --allow-pickle to include it)")
            continue
        report.values += 1
    with _replacing(target) as f:
        if streamed:
            torch_file.save_skeleton(state, f)
            f.flush()
            records = _records(f.fileno(), tensors)
            streamed = records is not None
        if streamed:
            assert records is not None
            _fill_records(catalog, tensors, records, f.fileno(), report, max_slab_bytes, on_bytes)
        else:  # built in memory: an older torch, or a pickled value holding a tensor
            f.seek(0)
            f.truncate()
            for var in tensors:
                state[var.name] = _whole(catalog, var)
                _count(report, var.nbytes, on_bytes)
            torch.save(state, f)
            report.largest_buffer = max((v.nbytes for v in tensors), default=0)
    report.tensors = len(tensors)


def _records(fd: int, tensors: list[TensorVar]) -> list[torch_file.Record] | None:
    """The storage record of each of ``tensors`` in the archive at ``fd``; None when
    the archive holds other storages too."""
    try:
        records = torch_file.storage_records(fd)
    except torch_file.LayoutError as exc:
        raise ConversionError(f"cannot write into this torch's .pt files ({exc})") from None
    # Storages are numbered in the order the pickle meets them: the state's order, when
    # the tensors are the only storages (a pickled value may hold one of its own).
    if [r.size for r in records] != [var.nbytes for var in tensors]:
        log.info("a value holds a tensor of its own: the .pt export is built in memory")
        return None
    return records


def _fill_records(
    catalog: Catalog,
    tensors: list[TensorVar],
    records: list[torch_file.Record],
    fd: int,
    report: ExportReport,
    max_slab_bytes: int,
    on_bytes: Callable[[int], None] | None,
) -> None:
    """Write each tensor's bytes into its storage record, a slab at a time."""
    for var, record in zip(tensors, records, strict=True):

        def counted(var: TensorVar = var) -> Iterator[np.ndarray]:
            for raw in tensor_slabs(catalog, var, max_slab_bytes):
                yield raw
                _count(report, raw.nbytes, on_bytes)
                report.largest_buffer = max(report.largest_buffer, raw.nbytes)

        torch_file.fill(fd, record, counted())


def _whole(catalog: Catalog, var: TensorVar) -> torch.Tensor:
    tensor = torch.empty(var.shape, dtype=dtypes.torch_dtype(var.dtype))
    view = writable_view(tensor)
    assert view is not None  # a fresh contiguous CPU tensor
    read_region(catalog.root, var.name, var.entry, Box.full(var.shape), view)
    return tensor


def _count(report: ExportReport, nbytes: int, on_bytes: Callable[[int], None] | None) -> None:
    report.bytes_written += nbytes
    if on_bytes is not None:
        on_bytes(nbytes)
