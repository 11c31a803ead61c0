"""A Hugging Face weights directory: which tensor lies in which safetensors file, and
how a set of tensors is cut into files of bounded size.

Reading, :func:`open_weights` accepts, in this order:

* a directory with one ``*.safetensors.index.json`` (``model.safetensors.index.json`` as
  ``save_pretrained`` writes it): its ``weight_map`` names each tensor's file;
* a directory with ``*.safetensors`` files and no index (``model.safetensors``): every
  tensor of every file;
* one ``.safetensors`` file.

The index and the files of a directory are read only where they lead inside it (a name
with a ``/`` or a link out is a :class:`~distckpt.errors.UnsafePathError`), except that
a snapshot of the Hugging Face hub's cache (``models--org--name/snapshots/<revision>/``)
may lead into its repository's folder, where its links point (``../../blobs/<hash>``).
Only regular files are opened.

Writing follows ``save_pretrained``: tensors are packed into files in the order given,
a new file starting when the next tensor would exceed ``max_bytes`` (a tensor larger
than that gets a file of its own); one file is ``model.safetensors`` with no index,
several are ``model-00001-of-00003.safetensors`` ... with a
``model.safetensors.index.json`` holding ``{"metadata": {"total_size": N},
"weight_map": {name: file}}``.
"""

from __future__ import annotations

import json
import math
import os
import re
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from distckpt import dtypes
from distckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsafePathError,
)
from distckpt.hf.bounded_json import MAX_KEY_BYTES, Scanner
from distckpt.hf.safetensors import (
    StoredTensor,
    TensorHeader,
    header_length,
    parse_header,
    read_header,
)
from distckpt.storage.backend import Store
from distckpt.storage.beneath import open_resolved
from distckpt.storage.registry import open_store

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
INDEX_SUFFIX = ".safetensors.index.json"
SUFFIX = ".safetensors"
#: The largest weights index read from a store (a 70B model's is about 100 kB).
MAX_INDEX_BYTES = 64 << 20
#: Tensors a weights directory may hold, in all its files (one header holds at most
#: :data:`distckpt.hf.safetensors.MAX_TENSORS`).
MAX_TENSORS = 1 << 20
#: Files a weights directory may have.
MAX_FILES = 1 << 16
_FILE_NAME_BYTES = 4096
_INDEX_KEYS = 16  # top-level entries of a weights index ("metadata", "weight_map")
_W = rb"[ \t\n\r]*"
# One entry of weight_map written without escapes, and what follows it.
_MAPPING = re.compile(
    _W + rb'"([^"\\\x00-\x1f]{0,%d})"' % MAX_KEY_BYTES + _W + rb":" + _W
    + rb'"([^"\\\x00-\x1f]{0,%d})"' % _FILE_NAME_BYTES + _W + rb"([,}]?)"
)  # fmt: skip
#: ``save_pretrained``'s default file size.
DEFAULT_MAX_BYTES = 5 * 10**9
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


@dataclass(frozen=True)
class Weights:
    """Every tensor of a weights directory, by name, and its metadata (first file's).
    In a store (``store`` set), a tensor's ``path`` is its file's key there."""

    root: Path | str
    tensors: dict[str, StoredTensor]
    metadata: dict[str, str]
    store: Store | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def is_stored(path: str | os.PathLike[str] | Store) -> bool:
    """Whether ``path`` is a store or names one by URL (``s3://``, ``az://``, ...)."""
    if isinstance(path, Store):
        return True
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def open_weights(path: str | os.PathLike[str] | Store) -> Weights:
    """The tensors of the Hugging Face weights at ``path`` (see the module doc), a path
    or a location in a store; reads the index and every file's header, nothing else."""
    try:
        return _open_weights(path)
    except CheckpointError as exc:
        # The frames of a refused header hold it (up to 100 MB) and what was read of it,
        # in a cycle with the error: released now, not at the next collection.
        traceback.clear_frames(exc.__traceback__)
        raise


def _open_weights(path: str | os.PathLike[str] | Store) -> Weights:
    if is_stored(path):
        return _open_in_store(open_store(path))  # type: ignore[arg-type]
    root = Path(path)  # type: ignore[arg-type]
    if root.is_file():
        return _from_files(root.parent, [root], None)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"{root}: no such file or directory")
    indexes = sorted(root.glob("*" + INDEX_SUFFIX))
    if len(indexes) > 1:
        raise CorruptCheckpointError(
            f"{root}: several weight indexes ({', '.join(p.name for p in indexes)}); "
            "name the one to read"
        )
    if indexes:
        weight_map = _read_index(root, indexes[0])
        files = sorted({root / f for f in weight_map.values()})
        return _from_files(root, files, (indexes[0], weight_map))
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointNotFoundError(f"{root}: no *.safetensors files and no {INDEX}")
    return _from_files(root, files, None)


def _inside(root: Path, file: Path) -> str:
    """Where ``file`` of the weights directory ``root`` leads (its real path), checked to
    be inside it (or, in the hub's cache, inside the snapshot's repository folder). It
    is opened by that path alone, refusing any link on it
    (:func:`~distckpt.storage.beneath.open_resolved`): a directory swapped for a link
    after this check is never followed."""
    top = Path(os.path.realpath(root))
    if top.parent.name == "snapshots" and "--" in top.parent.parent.name:
        top = top.parent.parent
    real = os.path.realpath(file)
    if not Path(real).is_relative_to(top):
        raise UnsafePathError(f"{root}: {file.name} leads outside the weights directory")
    return real


def _open_in_store(store: Store) -> Weights:
    """:func:`open_weights` of a prefix of a store, or of one ``.safetensors`` object."""
    if store.name.endswith(SUFFIX):
        return _from_objects(store.parent, [store.name], None)
    names = store.list("")
    indexes = sorted(n for n in names if n.endswith(INDEX_SUFFIX))
    if len(indexes) > 1:
        raise CorruptCheckpointError(
            f"{store.url}: several weight indexes ({', '.join(indexes)}); name the one to read"
        )
    if indexes:
        with store.open(indexes[0]) as reader:
            if reader.size > MAX_INDEX_BYTES:
                raise CorruptCheckpointError(
                    f"{store.where(indexes[0])}: a weights index of {reader.size} bytes "
                    f"(at most {MAX_INDEX_BYTES} are read)"
                )
            raw = reader.read(0, reader.size)
        weight_map = _parse_index(store.where(indexes[0]), raw)
        files = sorted(set(weight_map.values()))
        return _from_objects(store, files, (store.where(indexes[0]), weight_map))
    files = sorted(n for n in names if n.endswith(SUFFIX))
    if not files:
        raise CheckpointNotFoundError(f"{store.url}: no *.safetensors objects and no {INDEX}")
    return _from_objects(store, files, None)


def _from_objects(
    store: Store, files: Sequence[str], index: tuple[str, dict[str, str]] | None
) -> Weights:
    """:func:`_from_files` for the objects ``files`` of ``store``: each header is read
    with two ranged reads, its declared length checked first."""
    headers: list[tuple[str, list[StoredTensor], dict[str, str]]] = []
    _check_count(store.url, files, headers)
    for key in files:
        try:
            with store.open(key) as reader:
                size = reader.size
                length = header_length(store.where(key), reader.read(0, 8), size)
                raw = reader.read(8, length)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{store.url}: the index names {key}, which is missing"
            ) from None
        if len(raw) != length:
            raise CorruptCheckpointError(f"{store.where(key)}: the safetensors header is cut")
        found, meta = parse_header(key, raw, size)
        headers.append((key, found, meta))
        _check_count(store.url, files, headers)
    return _gather(store.url, headers, index, store)


def _check_count(
    root: Path | str,
    files: Sequence[object],
    headers: Sequence[tuple[str, list[StoredTensor], dict[str, str]]],
) -> None:
    """A weights directory holds at most :data:`MAX_FILES` files and :data:`MAX_TENSORS`
    tensors (checked after each header: one header is bounded on its own)."""
    if len(files) > MAX_FILES:
        raise CorruptCheckpointError(f"{root}: more than {MAX_FILES} weights files")
    if sum(len(found) for _, found, _ in headers) > MAX_TENSORS:
        raise CorruptCheckpointError(f"{root}: more than {MAX_TENSORS} tensors in its files")


def _parse_index(path: Path | str, raw: bytes) -> dict[str, str]:
    """The ``weight_map`` of a weights index, read at a bounded cost
    (:mod:`distckpt.hf.bounded_json`): at most :data:`MAX_TENSORS` names, each in one
    file only, of files that are names in the directory (at most :data:`MAX_FILES`)."""
    scan = Scanner(raw, str(path), "the weights index")
    if scan.peek() != "{":
        raise scan.fail("not a weights index (not a JSON object)")
    weight_map: dict[str, str] | None = None
    for key in scan.keys(_INDEX_KEYS, "the weights index"):
        if key != "weight_map":
            scan.skip(f"its {key!r}")  # "metadata": {"total_size": ...}
        elif weight_map is not None:
            raise scan.fail("weight_map appears twice")
        else:
            weight_map = _weight_map(scan)
    scan.end()
    if weight_map is None:
        raise scan.fail("not a weights index (no weight_map)")
    return weight_map


def _weight_map(scan: Scanner) -> dict[str, str]:
    bad = scan.fail("weight_map is not a map of names to files")
    if scan.peek() != "{":
        raise bad
    weight_map: dict[str, str] = {}
    files: dict[str, str] = {}  # one string per file, however many tensors name it
    scan.pos += 1
    closed = scan.take("}")
    while not closed:
        if len(weight_map) == MAX_TENSORS:
            raise scan.fail(f"weight_map names more than {MAX_TENSORS} tensors")
        plain = _MAPPING.match(scan.raw, scan.pos)  # no escapes: one match
        if plain is not None:
            scan.pos = plain.end()
            name, file = scan.utf8(plain[1], "a name"), scan.utf8(plain[2], "a file name")
        else:
            name = scan.string(MAX_KEY_BYTES, "a key of weight_map")
            scan.expect(":")
            if scan.peek() != '"':
                raise bad
            file = scan.string(_FILE_NAME_BYTES, f"the file of {name!r}")
        # Untrusted: a file outside the directory is never read.
        if file != os.path.basename(file) or file in ("", ".", ".."):
            raise scan.fail(f"{name!r} names the file {file!r}")
        if name in weight_map:
            raise scan.fail(f"{name!r} appears twice in weight_map ({weight_map[name]} and {file})")
        weight_map[name] = files.setdefault(file, file)
        if len(files) > MAX_FILES:
            raise scan.fail(f"weight_map names more than {MAX_FILES} files")
        closed = scan.member_end(None if plain is None else plain[3], "weight_map")
    return weight_map


def _read_index(root: Path, path: Path) -> dict[str, str]:
    try:
        with os.fdopen(open_resolved(_inside(root, path)), "rb") as f:
            raw = f.read(MAX_INDEX_BYTES + 1)  # read no more than is accepted
    except (CorruptCheckpointError, FileNotFoundError):
        raise
    except OSError as exc:
        raise CorruptCheckpointError(f"{path}: not a weights index ({exc})") from None
    if len(raw) > MAX_INDEX_BYTES:
        raise CorruptCheckpointError(
            f"{path}: a weights index of more than {MAX_INDEX_BYTES} bytes"
        )
    return _parse_index(path, raw)


def _from_files(
    root: Path, files: Sequence[Path], index: tuple[Path, dict[str, str]] | None
) -> Weights:
    headers: list[tuple[str, list[StoredTensor], dict[str, str]]] = []
    _check_count(root, files, headers)
    for file in files:
        if not file.exists():  # (a FIFO or device exists, and is refused when opened)
            raise CorruptCheckpointError(f"{root}: the index names {file.name}, which is missing")
        found, meta = read_header(_inside(root, file))
        headers.append((file.name, found, meta))
        _check_count(root, files, headers)
    return _gather(root, headers, None if index is None else (str(index[0]), index[1]))


def _gather(
    root: Path | str,
    headers: Sequence[tuple[str, list[StoredTensor], dict[str, str]]],
    index: tuple[str, dict[str, str]] | None,
    store: Store | None = None,
) -> Weights:
    """The weights of files ``(name, tensors, metadata)``: those the index places in each
    (every one without an index), each tensor in one file only."""
    tensors: dict[str, StoredTensor] = {}
    files: dict[str, str] = {}
    metadata: dict[str, str] = {}
    for name, found, meta in headers:
        metadata = metadata or meta
        for t in found:
            if index is not None and index[1].get(t.name) != name:
                continue  # the index says it lives elsewhere (or nowhere)
            if t.name in tensors:
                raise CorruptCheckpointError(
                    f"{root}: {t.name!r} is in both {files[t.name]} and {name}"
                )
            tensors[t.name] = t
            files[t.name] = name
    if index is not None:
        absent = sorted(n for n in index[1] if n not in tensors)
        if absent:
            raise CorruptCheckpointError(
                f"{index[0]}: {len(absent)} tensors are not in the files it names: "
                + ", ".join(absent[:8])
            )
    return Weights(root, tensors, metadata, store)


def parse_size(size: int | str) -> int:
    """Bytes from an int or a size such as ``"5GB"``, ``"500MiB"`` (as ``save_pretrained``)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = _SIZE.match(str(size))
        unit = m[2].upper() if m else ""
        if m is None or unit not in _UNITS:
            raise ValueError(f"bad size {size!r}: give bytes or e.g. '5GB', '500MiB'")
        value = int(float(m[1]) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"a file size must be positive, got {size!r}")
    return value


@dataclass
class OutFile:
    """One safetensors file to write: its name, tensors (in file order) and header."""

    name: str
    tensors: list[TensorHeader] = field(default_factory=list)
    header: bytes = b""
    offsets: dict[str, int] = field(default_factory=dict)  # tensor -> offset in the file

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors)


def plan_files(
    tensors: Sequence[tuple[str, str, tuple[int, ...]]],
    max_bytes: int,
    metadata: dict[str, str] | None = None,
) -> list[OutFile]:
    """``(name, dtype, shape)`` packed into files of at most ``max_bytes`` of data, in
    order (see the module doc), each with its header and every tensor's offset. Pure."""
    from distckpt.hf.safetensors import header

    groups: list[list[TensorHeader]] = []
    size = 0
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * dtypes.itemsize(dtype)
        if not groups or (size + nbytes > max_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(TensorHeader(name, dtype, tuple(shape), nbytes))
        size += nbytes
    groups = groups or [[]]
    out = []
    for k, group in enumerate(groups):
        name = (
            WEIGHTS if len(groups) == 1 else f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        )
        head = header(group, metadata if metadata is not None else {"format": "pt"})
        offsets, at = {}, len(head)
        for t in group:
            offsets[t.name] = at
            at += t.nbytes
        out.append(OutFile(name, group, head, offsets))
    return out


def index_document(files: Sequence[OutFile]) -> bytes:
    """The ``model.safetensors.index.json`` of ``files``."""
    doc = {
        "metadata": {"total_size": sum(t.nbytes for f in files for t in f.tensors)},
        "weight_map": {t.name: f.name for f in files for t in f.tensors},
    }
    return (json.dumps(doc, indent=2, sort_keys=False) + "\n").encode()
