"""Crafting damaged and hostile checkpoints, as an attacker who can write a checkpoint
would: every edit is followed by recomputing what checksums it breaks, so that a test
reaches the checks behind them. Import it in tests only.

A checkpoint directory is edited in place::

    ck = Crafted(path)
    ck.edit_chunks("w", 0, lambda chunks: [b"\\0" * 16] + chunks[1:])  # inner chunk 0 replaced
    ck.edit_index(lambda variables: variables["w"].update(shape=[9]))

Each edit rewrites the piece's shard (checksum table, the crc32c after each inner chunk,
the shard index and its crc32c), then the index's crc and size of the piece, then the
index's own checksum: only what the edit changed is wrong.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import crc32c as _crc
import numpy as np

from distckpt.format import seal

#: A shard index entry of an inner chunk that is absent.
EMPTY = 2**64 - 1
#: Pieces of a regular entry listed inline (more: a base64 column).
INLINE_PIECES = 64
#: :func:`edit_json`'s stand-in for an array nested 100,000 deep.
DEEP = "__deep__"
#: Values an attacker puts in a metadata document: paths out, huge, negative and
#: ill-typed counts, empty containers, deep nesting, a non-ASCII digit, terminal control
#: characters; "grow" and "delete" are edits (see :func:`edit_json`).
HOSTILE_VALUES: list[Any] = [
    "../outside/victim/w/c.0.0", "../../outside/victim", "/etc/hostname", "", ".",
    "a/../../b", 10**15, -1, 2**64, 0, True, 1.5, "7", None, [], {}, {"a": 1},
    [[0], [10**15]], DEEP, "grow", "delete", "ckpt-\u0664", "\x1b[31mred\x07",
]  # fmt: skip


def reseal(raw: bytes) -> bytes:
    """``raw``, a metadata document (an index, a pointer, a manifest) edited by hand, with
    its checksum recomputed in place (see :mod:`distckpt.format.seal`); a document that
    carries none is returned as it is.

    ::

        doc = json.loads(path.read_bytes())
        doc["attributes"]["distckpt"]["variables"]["w"]["shape"] = [10**15]
        path.write_bytes(reseal(json.dumps(doc).encode()))  # json.dumps keeps it first
    """
    try:
        return seal.seal(raw)
    except ValueError:
        return raw


def json_paths(doc: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """The path (keys and indices) of every node of a JSON document, the root first."""
    yield at
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from json_paths(v, (*at, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from json_paths(v, (*at, i))


def edit_json(path: Path, pick: int, what: Any) -> str:
    """Replace the ``pick``-th node (modulo their number; never the root nor a checksum)
    of the JSON document at ``path`` by ``what`` (``"delete"``: remove it; ``"grow"``: an
    int times 2**40 plus one, anything else thrice in a list; :data:`DEEP`: an array
    nested 100,000 deep), and reseal it as an attacker would. Returns where it was (a
    ``/``-joined path of keys)."""
    doc = json.loads(path.read_bytes())
    paths = [p for p in json_paths(doc) if p and p[-1] != "checksum"]
    at = paths[pick % len(paths)]
    parent = doc
    for k in at[:-1]:
        parent = parent[k]
    key = at[-1]
    if what == "delete":
        del parent[key]
    elif what == "grow":
        old = parent[key]
        parent[key] = old * 2**40 + 1 if type(old) is int else [old] * 3
    else:
        parent[key] = what
    text = json.dumps(doc)
    if what == DEEP:
        text = text.replace(json.dumps(DEEP), "[" * 100_000 + "]" * 100_000)
    path.write_bytes(reseal(text.encode()))
    return "/".join(map(str, at))


def crc32c(data: bytes) -> int:
    """The crc32c of ``data``, as distckpt's checksum tables and seals store it."""
    return int(_crc.crc32c(data))


def read_shard(raw: bytes, nchunks: int) -> list[bytes | None]:
    """The stored bytes of each inner chunk of a shard (without the crc32c that follows
    each), in shard-index order; None for an absent one."""
    index = np.frombuffer(raw[len(raw) - 16 * nchunks - 4 : -4], dtype="<u8").reshape(nchunks, 2)
    out: list[bytes | None] = []
    for offset, length in index.tolist():
        out.append(None if offset == EMPTY else raw[offset : offset + length - 4])
    return out


def build_shard(chunks: list[bytes | None]) -> bytes:
    """A shard holding ``chunks`` (stored bytes, None: absent), every checksum right: the
    checksum table, each chunk with its crc32c, the shard index and its crc32c."""
    table = np.zeros(len(chunks), dtype="<u4")
    index = np.full((len(chunks), 2), EMPTY, dtype="<u8")
    body = bytearray()
    offset = 4 * len(chunks)
    for k, chunk in enumerate(chunks):
        if chunk is None:
            continue
        crc = crc32c(chunk)
        table[k] = crc
        body += chunk + crc.to_bytes(4, "little")
        index[k] = (offset, len(chunk) + 4)
        offset += len(chunk) + 4
    raw_index = index.tobytes()
    return table.tobytes() + bytes(body) + raw_index + crc32c(raw_index).to_bytes(4, "little")


class Crafted:
    """A committed checkpoint directory, edited in place as an attacker would."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    # The index
    def document(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads((self.path / "zarr.json").read_bytes())
        return doc

    def write_document(self, doc: dict[str, Any]) -> None:
        (self.path / "zarr.json").write_bytes(reseal(json.dumps(doc).encode()))

    def edit_index(self, edit: Callable[[dict[str, Any]], Any]) -> None:
        """Call ``edit`` on the index's variables table, then write the index back."""
        doc = self.document()
        edit(doc["attributes"]["distckpt"]["variables"])
        self.write_document(doc)

    def entry(self, variable: str) -> dict[str, Any]:
        entry: dict[str, Any] = self.document()["attributes"]["distckpt"]["variables"][variable]
        return entry

    # Pieces
    def pieces(self, variable: str) -> int:
        """How many pieces ``variable`` has."""
        entry = self.entry(variable)
        if "pieces" in entry:
            return len(entry["pieces"])
        return math.prod(-(-n // c) for n, c in zip(entry["shape"], entry["chunks"]))

    def piece(self, variable: str, k: int) -> tuple[str, tuple[int, ...], tuple[int, ...] | None]:
        """Piece ``k`` of ``variable``: its file (relative), block and inner chunk shape."""
        entry = self.entry(variable)
        if "pieces" in entry:
            p = entry["pieces"][k]
            inner = p.get("inner")
            return p["file"], tuple(p["block"]), None if inner is None else tuple(inner)
        grid = [-(-n // c) for n, c in zip(entry["shape"], entry["chunks"])]
        if not 0 <= k < math.prod(grid):
            raise IndexError(f"{variable!r} has no piece {k}")
        coord: list[int] = []
        for n in reversed(grid):  # C order, by arithmetic: a grid may be huge
            k, i = divmod(k, n)
            coord.insert(0, i)
        name = ".".join(["c", *map(str, coord)])
        inner = entry.get("inner")
        return (
            f"{entry['path']}/{name}",
            tuple(entry["chunks"]),
            None if inner is None else tuple(inner),
        )

    def chunks(self, variable: str, k: int = 0) -> list[bytes | None]:
        """The stored bytes of each inner chunk of piece ``k`` (a shard)."""
        file, block, inner = self.piece(variable, k)
        if inner is None:
            raise ValueError(f"piece {k} of {variable!r} is a plain chunk, not a shard")
        nchunks = math.prod(b // i for b, i in zip(block, inner))
        return read_shard((self.path / file).read_bytes(), nchunks)

    def edit_chunks(
        self,
        variable: str,
        k: int,
        edit: Callable[[list[bytes | None]], list[bytes | None]],
    ) -> None:
        """Replace the inner chunks of piece ``k`` by ``edit(chunks)`` and make every
        checksum that covers them agree again."""
        file, _block, _inner = self.piece(variable, k)
        self.write_piece(variable, k, build_shard(edit(self.chunks(variable, k))))

    def write_plain(self, variable: str, k: int, data: bytes) -> None:
        """Replace plain chunk ``k`` of ``variable`` by ``data`` (its crc32c appended)."""
        self.write_piece(variable, k, data + crc32c(data).to_bytes(4, "little"))

    def write_piece(self, variable: str, k: int, raw: bytes) -> None:
        """Replace the file of piece ``k`` by ``raw`` and record its crc and size."""
        file, block, inner = self.piece(variable, k)
        (self.path / file).write_bytes(raw)
        if inner is None:
            crc = crc32c(raw[:-4])
        else:
            nchunks = math.prod(b // i for b, i in zip(block, inner))
            crc = crc32c(raw[: 4 * nchunks])

        def record(variables: dict[str, Any]) -> None:
            entry = variables[variable]
            if "pieces" in entry:
                entry["pieces"][k].update(crc=crc, size=len(raw))
                return
            for name, dtype, value in (("crc", "<u4", crc), ("size", "<u8", len(raw))):
                values = _column(entry[name], dtype)
                values[k] = value
                entry[name] = _encode_column(values)

        self.edit_index(record)


def _column(data: Any, dtype: str) -> np.ndarray:
    if isinstance(data, str):
        return np.frombuffer(base64.b64decode(data), dtype=dtype).copy()
    return np.asarray(data, dtype=dtype)


def _encode_column(values: np.ndarray) -> list[int] | str:
    if len(values) <= INLINE_PIECES:
        return [int(v) for v in values.tolist()]
    return base64.b64encode(values.tobytes()).decode()
