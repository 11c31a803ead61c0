"""A structure-aware fuzzer of hostile checkpoints: what an attacker who can write a
checkpoint (or race a live job) crafts, every checksum recomputed after each edit.

Where ``tests/hostile/test_fuzz.py`` damages bytes and documents as an accident would, this one
builds what a naive fuzzer cannot reach, in eight families:

* ``frame``: a compressed inner chunk (zstd, blosc-lz4, blosc-zstd) whose frame lies: a
  header field, a block start, a stream length, a content size; a valid frame of fewer or
  more bytes, of another codec, cut short or extended;
* ``boxes``: listed pieces (an irregular partition, per-rank tensors) that overlap, repeat
  or leave a gap, and the node-local tier's manifests likewise (the data's crc32c right);
* ``index``: an index, a pointer or a manifest whose values are replaced by hostile ones
  (paths out, huge or negative counts, wrong types, deep nesting), resealed;
* ``safetensors``: Hugging Face weights whose header lies: millions of dimensions, many
  entries, overlapping or outlying offsets, unknown dtypes, a huge header length, an
  index that points outside;
* ``race``: a thread that swaps a variable's directory, a piece or a save's staging
  directory for a link out, a FIFO or a truncated copy, and back, while loads and saves
  run;
* ``values``: a stored Python value replaced by a deep or huge one;
* ``typed``: typed values that name hostile classes with hostile fields, pickles that
  would run a command, Megatron objects that would (``tests/support/hostile_typed.py``),
  read by DeepSpeed's and Megatron's loaders, ``load``, the DCP reader and the CLI under
  an audit hook: no import of a named module, no process, no pickled global;
* ``grids``: a regular entry that declares more than it stores: a dimension of zero
  beside huge ones, a huge grid whose columns claim to match it, thousands of shards or
  listed pieces, 64 dimensions, a one-byte dtype over a huge shape
  (``tests/support/hostile_grids.py``), read also through the DCP reader's metadata,
  ``load`` into ``None`` placeholders (tensors the checkpoint sizes) and ``ls``.

Every example runs in a child of its own (forked from a driver that has imported torch
and distckpt, so an example costs milliseconds to start) with its address space bounded.
The property: each reader (``load`` whole and a box of it, ``Checkpoint.restore``, the
manager, the DCP reader, ``load_hf``, and the CLI's ``inspect``, ``verify``, ``export``,
``import``, ``diff``, ``ls`` and ``gc``) ends with the right values (bit for bit) or a
:class:`distckpt.CheckpointError` (the CLI: exit 0, 1 or 2, one line for 2, no raw
control character), within a deadline; nothing outside the checkpoint's directory is
touched; and the child ends normally, never by a signal.

``tests/hostile/test_hostile_fuzz.py`` runs a fixed set of examples in the suite;
``python tests/support/hostile_fuzz.py --examples 5000 --seed 1`` runs a campaign (``--family
grids`` runs one family alone; repeat it for several).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import logging
import os
import random
import resource
import select
import shutil
import signal
import stat
import struct
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import torch

import distckpt
from distckpt import cli
from distckpt.testing.hostile import DEEP, HOSTILE_VALUES, Crafted, crc32c, edit_json, reseal

# Run as a file, it finds tests.support from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.support import make_golden  # noqa: E402
from tests.support.hostile_grids import damage_grids  # noqa: E402
from tests.support.hostile_typed import (  # noqa: E402
    build_typed,
    damage_typed,
    preload_typed,
    read_typed,
)
from tests.support.hostile_util import run_manager as manager  # noqa: E402
from tests.support.hostile_util import run_model as model  # noqa: E402

FAMILIES = ("frame", "boxes", "index", "safetensors", "race", "values", "grids", "typed")
#: Seconds one reader may take (a loaded machine included); the example's child is
#: killed at :data:`EXAMPLE_BOUND`.
READER_BOUND = 20
EXAMPLE_BOUND = 120
#: Address space a child may add to what the driver holds: a reader that allocates for
#: a declared size instead of a stored one runs out of it (MemoryError: a violation).
MEMORY_BOUND = 1536 << 20

# ---------------------------------------------------------------- the pristine tree


def ck_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    ramp = torch.linspace(0, 1, 32 * 64).reshape(32, 64) + seed
    return {
        "w": torch.randn(64, 48, generator=g),  # raw, 12 inner chunks of 1 KiB
        "z": torch.randint(0, 3, (40, 50), generator=g).to(torch.int16),  # zstd
        "zb": ramp.clone(),  # blosc-lz4
        "zz": torch.randint(0, 5, (40, 50), generator=g).to(torch.int16),  # blosc-zstd
        "b": torch.randn(3, generator=g).to(torch.bfloat16),  # one plain chunk
        "cfg": {"lr": 0.5, "betas": (0.9, 0.99), "ids": {1: "one"}},
        "step": 7,
    }


COMPRESSION = {"z": "zstd", "zb": "blosc-lz4", "zz": "blosc-zstd"}


def hf_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(16, 8, generator=g),
        "layer.0.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "layer.0.bias": torch.randn(8, generator=g),
        "head.weight": torch.randn(4, 8, generator=g),
    }


def build(root: Path) -> None:
    """The pristine tree: ``ck`` (compressed and raw), ``golden`` (listed pieces, per-rank
    entries, written by an older distckpt), ``hf`` (weights in two files and an index),
    ``run`` and ``local`` (a manager's persistent and node-local steps) and ``outside``,
    which holds what the damage may point at and must never change."""
    options = {"small_bytes": 64, "inner_bytes": 1024, "compression": COMPRESSION}
    distckpt.save(ck_state(0), root / "ck", **options)  # type: ignore[arg-type]
    shutil.copytree(make_golden.TWO_RANKS, root / "golden")
    distckpt.save_hf(hf_state(0), root / "hf", max_shard_size=600)
    outside = root / "outside"
    distckpt.save(ck_state(1), outside / "victim", **options)  # type: ignore[arg-type]
    distckpt.save_hf(hf_state(1), outside / "hf", max_shard_size=600)
    (outside / "precious.txt").write_text("not the run's")
    ckpt = model()
    with manager(root, ckpt) as keeper:
        for step in range(1, 6):  # persistent at 1 and 4, local at 2, 3, 5
            ckpt.step.fill_(step)
            ckpt.w.fill_(step)
            keeper.save()
    build_typed(root)


def fingerprint(top: Path) -> dict[str, str]:
    """Every entry under ``top``: its kind, a regular file's bytes (hashed) and mtime."""
    out = {}
    for dirpath, dirs, files in os.walk(top):
        for name in dirs + files:
            path = Path(dirpath, name)
            st = path.lstat()
            if stat.S_ISREG(st.st_mode):
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                out[str(path.relative_to(top))] = f"{digest}:{st.st_mtime_ns}"
            else:
                out[str(path.relative_to(top))] = stat.filemode(st.st_mode)
    return out


# ---------------------------------------------------------------- family: frame

PLAUSIBLE = (0, 1, 3, 16, -1, -16, 2**31 - 1, 2**30, 2**16)


def _plausible(rng: random.Random, orig: int) -> int:
    value = rng.choice([*PLAUSIBLE, orig - 1, orig + 1, orig * 2, orig // 2, orig + 16])
    return max(min(value, 2**31 - 1), -(2**31))


def _lie_blosc(
    rng: random.Random, frame: bytes, content: bytes, itemsize: int
) -> tuple[bytes, str]:
    b = bytearray(frame)
    size = len(b)
    nbytes, blocksize = struct.unpack_from("<ii", b, 4)
    nblocks = max(1, -(-nbytes // max(blocksize, 1)))
    kind = rng.choice(
        [
            "field",
            "byte",
            "start",
            "stream",
            "pair",
            "truncate",
            "extend",
            "short",
            "long",
            "other-codec",
            "memcpy",
        ]
    )
    if kind == "field":
        at = rng.choice([4, 8, 12])
        struct.pack_into("<i", b, at, _plausible(rng, struct.unpack_from("<i", b, at)[0]))
        return bytes(b), f"blosc header int at {at}"
    if kind == "byte":
        at = rng.randrange(4)
        b[at] = rng.choice([0, 1, 2, 0x7F, 0x80, 0xFF, b[at] ^ (1 << rng.randrange(8))])
        return bytes(b), f"blosc header byte {at} = {b[at]}"
    if kind == "start" and 16 + 4 * nblocks <= size:
        i = rng.randrange(nblocks)
        orig = struct.unpack_from("<i", b, 16 + 4 * i)[0]
        table_end = 16 + 4 * nblocks
        value = rng.choice([0, 15, table_end - 1, size - 4, size - 3, size, 2**30, -5, orig + 1])
        struct.pack_into("<i", b, 16 + 4 * i, value)
        return bytes(b), f"blosc block {i} start = {value}"
    if kind == "stream" and 16 + 4 * nblocks <= size:
        start = struct.unpack_from("<i", b, 16)[0]
        if 0 <= start <= size - 4:
            orig = struct.unpack_from("<i", b, start)[0]
            value = rng.choice([-1, 0, orig + 1, orig - 1, size, 2**31 - 1])
            struct.pack_into("<i", b, start, value)
            return bytes(b), f"blosc stream length = {value}"
    if kind == "pair":
        struct.pack_into("<i", b, 12, 2**31 - 1 - rng.randrange(2**16))
        struct.pack_into("<i", b, 16, 2**30 + rng.randrange(2**20))
        return bytes(b), "blosc compressed size and first block start both lie"
    if kind == "truncate":
        return bytes(b[: rng.randrange(size)]), "blosc frame cut short"
    if kind == "extend":
        return bytes(b) + bytes(rng.randrange(1, 64)), "blosc frame extended"
    if kind == "memcpy":
        b[2] |= 0x02
        return bytes(b), "blosc frame marked as stored raw"
    codec = numcodecs.Blosc(cname="lz4", typesize=itemsize)
    if kind == "short":
        n = rng.randrange(len(content))
        return bytes(codec.encode(content[:n])), f"a valid blosc frame of {n} bytes"
    if kind == "long":
        return bytes(codec.encode(content + content[:64])), "a valid blosc frame of more bytes"
    return bytes(numcodecs.Zstd().encode(content)), "a zstd frame in a blosc variable"


def _lie_zstd(rng: random.Random, frame: bytes, content: bytes) -> tuple[bytes, str]:
    b = bytearray(frame)
    descriptor = b[4]
    single = descriptor >> 5 & 1
    fcs_at = 5 + (0 if single else 1)
    fcs_size = (1 if single else 0, 2, 4, 8)[descriptor >> 6]
    kind = rng.choice(
        [
            "fcs",
            "descriptor",
            "block",
            "truncate",
            "extend",
            "short",
            "long",
            "other-codec",
            "second-frame",
            "skippable",
        ]
    )
    if kind == "fcs" and fcs_size:
        orig = int.from_bytes(b[fcs_at : fcs_at + fcs_size], "little")
        value = rng.choice([0, 1, orig - 1, orig + 1, orig * 2, orig // 2]) % (1 << (8 * fcs_size))
        b[fcs_at : fcs_at + fcs_size] = value.to_bytes(fcs_size, "little")
        return bytes(b), f"zstd content size {orig} -> {value}"
    if kind == "descriptor":
        b[4] = rng.choice(
            [0x00, 0x20, 0x24, 0x28, 0x21, 0xE0, descriptor ^ (1 << rng.randrange(8))]
        )
        return bytes(b), f"zstd frame descriptor = {b[4]:#x}"
    if kind == "block":
        at = fcs_at + fcs_size
        header = int.from_bytes(b[at : at + 3], "little")
        choice = rng.randrange(4)
        if choice == 0:
            header = (header & 7) | (rng.choice([0, 1, 2**20, 2**21 - 1, (header >> 3) + 1]) << 3)
        elif choice == 1:
            header |= 6  # the reserved block type
        elif choice == 2:
            header ^= 1  # the last-block flag
        else:
            header = (header & ~6) | (rng.choice([0, 2, 4]))  # raw, RLE, compressed
        b[at : at + 3] = (header & 0xFFFFFF).to_bytes(3, "little")
        return bytes(b), f"zstd first block header = {header:#x}"
    if kind == "truncate":
        return bytes(b[: rng.randrange(len(b))]), "zstd frame cut short"
    if kind == "extend":
        return bytes(b) + bytes(rng.randrange(1, 64)), "zstd frame extended"
    if kind == "short":
        n = rng.randrange(1, len(content))
        return bytes(numcodecs.Zstd().encode(content[:n])), f"a valid zstd frame of {n} bytes"
    if kind == "long":
        return bytes(numcodecs.Zstd().encode(content + content)), "a valid zstd frame of more"
    if kind == "second-frame":
        return bytes(b) + bytes(numcodecs.Zstd().encode(content[:32])), "two zstd frames"
    if kind == "skippable":
        skip = (0x184D2A50).to_bytes(4, "little") + (4).to_bytes(4, "little") + b"\0" * 4
        return skip + bytes(b), "a skippable frame first"
    return bytes(numcodecs.Blosc(cname="lz4").encode(content)), "a blosc frame in a zstd variable"


def damage_frame(rng: random.Random, root: Path) -> dict[str, Any]:
    var = rng.choice(["z", "zb", "zz"])
    crafted = Crafted(root / "ck")
    entry = crafted.entry(var)
    itemsize = 2 if var in ("z", "zz") else 4
    chunks = crafted.chunks(var, 0)
    present = [j for j, c in enumerate(chunks) if c is not None]
    j = rng.choice(present)
    frame = chunks[j]
    assert frame is not None
    content = bytes(_decode(entry["codec"], frame, 1024))
    if entry["codec"]["name"] == "blosc":
        lie, what = _lie_blosc(rng, frame, content, itemsize)
    else:
        lie, what = _lie_zstd(rng, frame, content)
    crafted.edit_chunks(var, 0, lambda cs: [*cs[:j], lie, *cs[j + 1 :]])
    return {"damage": f"{var} inner chunk {j}: {what}", "readers": "ck", "changed": None}


def _decode(codec: dict[str, Any], frame: bytes, size: int) -> np.ndarray:
    out = np.empty(size, np.uint8)
    if codec["name"] == "zstd":
        numcodecs.Zstd().decode(frame, out=out)
    else:
        numcodecs.Blosc().decode(frame, out=out)
    return out


# ---------------------------------------------------------------- family: boxes


def damage_boxes(rng: random.Random, root: Path) -> dict[str, Any]:
    if rng.random() < 0.3:
        return _damage_manifest_boxes(rng, root)
    crafted = Crafted(root / "golden")
    variables = crafted.document()["attributes"]["distckpt"]["variables"]
    candidates = [("opt/flat", None)] + [("rng", r) for r in variables["rng"]["ranks"]]
    name, rank = rng.choice(candidates)
    kind = rng.choice(["shift", "duplicate", "repeat", "drop", "grow-shape", "same-origin"])

    def edit(vs: dict[str, Any]) -> None:
        entry = vs[name] if rank is None else vs[name]["ranks"][rank]
        pieces = entry["pieces"]
        k = rng.randrange(len(pieces))
        box = pieces[k]["box"]
        if kind == "shift" and box[0]:
            d = rng.randrange(len(box[0]))
            box[0][d] = max(0, box[0][d] + rng.choice([-1, 1]))
        elif kind == "duplicate":
            pieces.append(json.loads(json.dumps(pieces[k])))
        elif kind == "repeat" and len(pieces) > 1:
            other = pieces[(k + 1) % len(pieces)]
            box[0] = list(other["box"][0])
        elif kind == "drop" and len(pieces) > 1:
            del pieces[k]
        elif kind == "grow-shape" and entry["shape"]:
            entry["shape"][0] += 1
        elif kind == "same-origin" and box[0]:
            box[0] = [0] * len(box[0])

    crafted.edit_index(edit)
    return {"damage": f"golden {name} (rank {rank}): {kind}", "readers": "golden", "changed": None}


def _damage_manifest_boxes(rng: random.Random, root: Path) -> dict[str, Any]:
    """A node-local manifest whose tensor ``w`` (rows 0..40) is listed as two boxes that
    overlap or leave a gap, each pointing at the right bytes with the right crc32c."""
    manifests = sorted((root / "local").rglob("o*.json"))
    path = rng.choice(manifests)
    doc = json.loads(path.read_bytes())
    data = (path.with_suffix(".data")).read_bytes()
    entries = [t for t in doc["tensors"] if t["name"] == "w"]
    if not entries:
        return {"damage": "no w", "readers": "run", "changed": None}
    whole = entries[0]
    rows, cols = whole["box"][1]
    row_bytes = cols * 4
    cut, start = rng.choice([(20, 10), (20, 25), (40, 0), (10, 10), (30, 30)])

    def part(first: int, end: int) -> dict[str, Any]:
        offset = whole["offset"] + first * row_bytes
        nbytes = (end - first) * row_bytes
        return {
            **whole,
            "box": [[first, 0], [end - first, cols]],
            "offset": offset,
            "nbytes": nbytes,
            "crc": crc32c(data[offset : offset + nbytes]),
        }

    doc["tensors"].remove(whole)
    doc["tensors"] += [part(0, cut), part(start, rows)]
    path.write_bytes(reseal(json.dumps(doc).encode()))
    return {
        "damage": f"{path.parent.name}/{path.name}: w as rows 0:{cut} and {start}:{rows}",
        "readers": "run",
        "changed": None,
    }


# ---------------------------------------------------------------- family: index


def damage_index(rng: random.Random, root: Path) -> dict[str, Any]:
    target = rng.choice(["ck/zarr.json", "golden/zarr.json", "run/latest", "run/ckpt-4/zarr.json",
                         "manifest"])  # fmt: skip
    if target == "manifest":
        path = rng.choice(sorted((root / "local").rglob("o*.json")))
    else:
        path = root / target
    what = rng.choice(HOSTILE_VALUES)
    where = edit_json(path, rng.randrange(1 << 30), what)
    parts = set(where.split("/"))
    changed = "*" if parts & {"value", "values", "per_rank_values", "name", "cfg"} else None
    if what == "delete" or what in ([], {}):
        changed = "*"  # a well-formed document that holds less
    readers = (
        "golden" if target.startswith("golden") else "ck" if target.startswith("ck") else "run"
    )
    return {"damage": f"{target}: {where} = {str(what)[:40]!r}", "readers": readers,
            "changed": changed}  # fmt: skip


# ---------------------------------------------------------------- family: values


def damage_values(rng: random.Random, root: Path) -> dict[str, Any]:
    crafted = Crafted(root / "ck")
    kind = rng.choice(["deep", "wide", "long-string", "big-int", "pickle"])

    def edit(vs: dict[str, Any]) -> None:
        if kind == "deep":
            vs["step"]["value"] = DEEP
        elif kind == "wide":
            vs["step"]["value"] = {"list": [0] * 200_000}
        elif kind == "long-string":
            vs["step"]["value"] = "x" * 5_000_000
        elif kind == "big-int":
            vs["step"]["value"] = 10**4000
        else:
            vs["step"]["value"] = {"pickle": "gASVBQAAAAAAAABLAS4="}

    doc = crafted.document()
    edit(doc["attributes"]["distckpt"]["variables"])
    text = json.dumps(doc).replace(json.dumps(DEEP), "[" * 50_000 + "]" * 50_000)
    (root / "ck" / "zarr.json").write_bytes(reseal(text.encode()))
    return {"damage": f"ck value step: {kind}", "readers": "ck", "changed": "*"}


# ---------------------------------------------------------------- family: safetensors


def _st_parts(raw: bytes) -> tuple[dict[str, Any], bytes]:
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _st_join(header: dict[str, Any] | bytes, data: bytes) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


def damage_safetensors(rng: random.Random, root: Path) -> dict[str, Any]:
    files = sorted((root / "hf").glob("*.safetensors"))
    path = rng.choice(files)
    header, data = _st_parts(path.read_bytes())
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    kind = rng.choice(["dims", "entries", "offsets", "dtype", "shape", "deep", "length",
                       "index", "metadata", "duplicate"])  # fmt: skip
    raw: bytes | None = None
    if kind == "dims":
        n = rng.choice([65, 1000, 2_000_000])
        header[name]["shape"] = [1] * n
    elif kind == "entries":
        for i in range(rng.choice([10_000, 200_000])):
            header[f"e{i}"] = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
    elif kind == "offsets":
        lo, hi = header[name]["data_offsets"]
        header[name]["data_offsets"] = rng.choice(
            [[0, hi], [lo, hi + 4], [hi, lo], [lo, len(data) + 4096], [-4, hi], [lo, 2**62]]
        )
    elif kind == "dtype":
        header[name]["dtype"] = rng.choice(["F33", "", 4, None, "U1", "F8_E4M3"])
    elif kind == "shape":
        header[name]["shape"] = rng.choice([[-1], [2**62, 2**62], [1.5], [True], "8", {}])
    elif kind == "deep":
        header[name]["shape"] = DEEP
        text = json.dumps(header).replace(json.dumps(DEEP), "[" * 100_000 + "]" * 100_000)
        raw = _st_join(text.encode(), data)
    elif kind == "length":
        text = json.dumps(header).encode()
        value = rng.choice([2**63, len(text) + 8, 10**8, 0, len(text) - 1])
        raw = value.to_bytes(8, "little") + text + data
    elif kind == "index":
        index_path = root / "hf" / "model.safetensors.index.json"
        doc = json.loads(index_path.read_bytes())
        doc["weight_map"][name] = rng.choice(
            ["../outside/hf/" + path.name, "/etc/hostname", "missing.safetensors", "..", ""]
        )
        index_path.write_text(json.dumps(doc))
    elif kind == "metadata":
        header["__metadata__"] = rng.choice([{"format": 1}, [], "pt", {"a": {"b": "c"}}])
    else:
        raw = _st_join(json.dumps(header)[:-1].encode() + b", " + json.dumps(name).encode()
                       + b": " + json.dumps(header[name]).encode() + b"}", data)  # fmt: skip
    if kind != "index":
        path.write_bytes(raw if raw is not None else _st_join(header, data))
    return {"damage": f"hf {path.name} {name}: {kind}", "readers": "hf", "changed": None}


# ---------------------------------------------------------------- family: race


class Racer(threading.Thread):
    """Swaps ``target`` for something else and back, at most ``rounds`` times, until
    stopped; leaves it as it found it."""

    def __init__(self, root: Path, rng: random.Random) -> None:
        super().__init__(daemon=True)
        self.root, self.stop, self.rounds = root, threading.Event(), 2000
        self.kind = rng.choice(["var-dir", "piece-link", "piece-fifo", "piece-truncated",
                                "staging", "run-ckpt"])  # fmt: skip
        self.swaps = 0

    def describe(self) -> str:
        return f"race: {self.kind}"

    def _swap(self, target: Path, make: Callable[[Path], None]) -> None:
        aside = target.with_name(target.name + ".aside")
        try:
            os.rename(target, aside)
        except OSError:
            return
        try:
            make(target)
            self.swaps += 1
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                else:
                    target.unlink()
            os.rename(aside, target)

    def run(self) -> None:
        outside = self.root / "outside" / "victim"
        piece = self.root / "ck" / "w" / "c.0.0"
        half = (outside / "w" / "c.0.0").read_bytes()[:100]
        for _ in range(self.rounds):
            if self.stop.is_set():
                return
            if self.kind == "var-dir":
                self._swap(self.root / "ck" / "w", lambda t: t.symlink_to(outside / "w"))
            elif self.kind == "piece-link":
                self._swap(piece, lambda t: t.symlink_to(outside / "w" / "c.0.0"))
            elif self.kind == "piece-fifo":
                self._swap(piece, lambda t: os.mkfifo(t))
            elif self.kind == "piece-truncated":
                self._swap(piece, lambda t: t.write_bytes(half))
            elif self.kind == "run-ckpt":
                self._swap(self.root / "run" / "ckpt-4", lambda t: t.symlink_to(outside))
            else:
                with contextlib.suppress(OSError):
                    for name in os.listdir(self.root / "run"):
                        if ".staging" in name and not name.endswith(".aside"):
                            self._swap(self.root / "run" / name,
                                       lambda t: t.symlink_to(self.root / "outside"))  # fmt: skip


# ---------------------------------------------------------------- the readers


class Outcomes:
    """What each reader did; ``violations`` lists what broke the property."""

    def __init__(self) -> None:
        self.done: dict[str, str] = {}
        self.violations: list[str] = []
        self.value: Any = None

    def settle(self, what: str, fn: Callable[[], Any]) -> bool:
        """Whether ``fn()`` returned (its result in :attr:`value`); False when it raised a
        CheckpointError (DCP's wrapping of one included). Anything else, or more than
        :data:`READER_BOUND`, is a violation."""
        old = signal.signal(signal.SIGALRM, _expired)
        signal.alarm(READER_BOUND)
        self.value = None
        try:
            self.value = fn()
            self.done[what] = "ok"
            return True
        except distckpt.CheckpointError as exc:
            self.done[what] = type(exc).__name__
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - the property: nothing else (DCP's
            inner = _dcp_inner(exc)  # CheckpointException is a BaseException)
            if isinstance(inner, distckpt.CheckpointError) or _dcp_refused(inner):
                self.done[what] = type(inner).__name__
            else:
                self.done[what] = f"!{type(exc).__name__}"
                self.violations.append(
                    f"{what}: {type(inner).__name__}: {str(inner)[:300]}\n"
                    + "".join(traceback.format_exception(inner)[-6:])
                )
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
        return False

    def check(self, condition: bool, what: str) -> None:
        if not condition:
            self.violations.append(what)

    def cli(self, *argv: str | Path) -> int:
        out, err = io.StringIO(), io.StringIO()
        args = [str(a) for a in argv]

        def run() -> int:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                return cli.main(args)

        if not self.settle(f"distckpt {args[0]}", run):
            return -1
        rc = self.value
        self.check(rc in (0, 1, 2), f"distckpt {args[0]} exit {rc}")
        lines = err.getvalue().strip().splitlines()
        if rc == 2:
            errors = [line for line in lines if ": error: " in line]
            self.check(len(errors) == 1, f"distckpt {args[0]}: {len(errors)} error lines")
        raw = [c for c in out.getvalue() + err.getvalue() if ord(c) < 32 and c not in "\n\t"]
        self.check(not raw, f"distckpt {args[0]} printed control characters {raw[:3]!r}")
        return int(rc)


class ReaderTimeout(Exception):
    pass


def _expired(signum: int, frame: Any) -> None:
    raise ReaderTimeout(f"a reader took more than {READER_BOUND} s")


def _dcp_refused(exc: BaseException) -> bool:
    """DCP's own report of a storage reader's failed ``read_metadata`` (it catches the
    reader's error and raises an AssertionError quoting it, for its own files too), or
    its planner's refusal of a stored shape other than the target's (as distckpt's
    ShapeMismatchError)."""
    if isinstance(exc, AssertionError) and "global metadata read failed: " in str(exc):
        return True
    return isinstance(exc, ValueError) and str(exc).startswith("Size mismatch between saved")


def _dcp_inner(exc: BaseException) -> BaseException:
    """What DCP's CheckpointException (perhaps wrapping another) wraps, else ``exc``."""
    for _ in range(8):
        failures = getattr(exc, "failures", None)
        if not isinstance(failures, dict) or not failures:
            break
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) else first
    return exc


def same(a: Any, b: torch.Tensor) -> bool:
    """Bit for bit."""
    if not isinstance(a, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(-1).view(torch.uint8),
                       b.contiguous().view(-1).view(torch.uint8))  # fmt: skip


TENSORS = ("w", "z", "zb", "zz", "b")


def read_ck(root: Path, o: Outcomes, changed: str | None) -> None:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from distckpt.integrations.dcp import DistckptReader

    ck, want = root / "ck", ck_state(0)
    kept = [k for k in TENSORS if k != changed]  # (a tensor the damage made another)
    got: dict[str, Any] = {k: torch.zeros_like(want[k]) for k in TENSORS}
    got.update(cfg=None, step=None)
    if o.settle("load", lambda: distckpt.load(got, ck)):
        for k in kept:
            o.check(same(got[k], want[k]), f"load gave wrong values of {k}")
        if changed is None or changed in TENSORS:
            o.check(got["cfg"] == want["cfg"] and got["step"] == want["step"], "load: values")
    boxes = {
        "w": distckpt.Shard(torch.zeros(20, 48), (64, 48), (10, 0)),
        "zb": distckpt.Shard(torch.zeros(15, 64), (32, 64), (5, 0)),
        "z": distckpt.Shard(torch.zeros(40, 7, dtype=torch.int16), (40, 50), (0, 3)),
    }
    if o.settle("load box", lambda: distckpt.load(boxes, ck, strict=False, io_workers=1)):
        o.check(same(boxes["w"].tensor, want["w"][10:30]), "load box: wrong w")
        o.check(same(boxes["zb"].tensor, want["zb"][5:20]), "load box: wrong zb")
        o.check(same(boxes["z"].tensor, want["z"][:, 3:10]), "load box: wrong z")
    restored = distckpt.Checkpoint(**{k: torch.zeros_like(want[k]) for k in TENSORS})
    if o.settle("Checkpoint.restore", lambda: restored.restore(ck)):
        for k in kept:
            o.check(same(getattr(restored, k), want[k]), f"restore gave wrong values of {k}")
    via_dcp = {k: torch.zeros_like(want[k]) for k in TENSORS}
    if o.settle("dcp.load", lambda: dcp.load(via_dcp, storage_reader=DistckptReader(ck))):
        for k in kept:
            o.check(same(via_dcp[k], want[k]), f"dcp.load gave wrong values of {k}")
    o.cli("inspect", ck)
    o.cli("verify", ck)
    out = root / "export.safetensors"
    if o.cli("export", ck, out) == 0:
        exported = load_file(str(out))
        for k in kept:
            o.check(same(exported.get(k), want[k]), f"export wrote wrong values of {k}")
    o.cli("diff", ck, root / "outside" / "victim")


def read_grids(root: Path, o: Outcomes, changed: str | None) -> None:
    """Every reader of ``ck`` (:func:`read_ck`), the DCP reader's metadata alone, a load
    into ``None`` placeholders (a tensor the checkpoint sizes: allocated only once its
    files can fill it) and ``ls`` of the example's directory; ``changed``: the tensor
    replaced (read as whatever it now is, when well-formed: its values are not asked)."""
    from distckpt.integrations.dcp import DistckptReader

    read_ck(root, o, changed)
    ck, want = root / "ck", ck_state(0)
    o.settle("dcp read_metadata", lambda: DistckptReader(ck).read_metadata())
    held: dict[str, Any] = dict.fromkeys(TENSORS)
    if o.settle("load placeholders", lambda: distckpt.load(held, ck, strict=False)):
        for k in TENSORS:
            o.check(k == changed or same(held[k], want[k]), f"load placeholders: wrong {k}")
    o.cli("ls", root)


def read_golden(root: Path, o: Outcomes, changed: str | None) -> None:
    g = root / "golden"
    state = make_golden.target(torch.zeros(5, 8), torch.zeros(6, 8, dtype=torch.bfloat16),
                               torch.zeros(6, 4, dtype=torch.int32))  # fmt: skip
    if o.settle("load golden", lambda: distckpt.load(state, g)):
        o.check(same(state["model"]["l1.weight"], make_golden.weight()), "golden: l1.weight")
        o.check(same(state["opt"]["flat"], make_golden.flat()), "golden: opt/flat")
        o.check(same(state["rng"].value, make_golden.rng(0)), "golden: rng")
    box = distckpt.Shard(torch.zeros(3, 4, dtype=torch.int32), (6, 4), (2, 0))
    if o.settle("load golden box", lambda: distckpt.load({"opt": {"flat": box}}, g,
                                                         strict=False)):  # fmt: skip
        o.check(same(box.tensor, make_golden.flat()[2:5]), "golden box: opt/flat")
    o.cli("verify", g)
    o.cli("export", g, root / "golden.safetensors")


def read_run(root: Path, o: Outcomes, changed: str | None) -> None:
    ckpt = model()
    holder: list[distckpt.CheckpointManager] = []

    def restore() -> Any:
        holder.append(manager(root, ckpt))
        return holder[0].restore_or_initialize()

    try:
        if o.settle("manager restore", restore) and o.value is not None and changed is None:
            step = int(ckpt.step)
            o.check(1 <= step <= 5, f"manager restored step {step}")
            o.check(torch.equal(ckpt.w, torch.full((40, 30), float(step))), "manager: values")
        if holder:
            for step in (6, 7):
                ckpt.step.fill_(step)
                o.settle("manager save", holder[0].save)
    finally:
        for keeper in holder:
            with contextlib.suppress(Exception):
                keeper.close()
    o.cli("ls", root / "run")
    o.cli("verify", root / "run" / "ckpt-4")
    o.cli("gc", root / "run")


def read_hf(root: Path, o: Outcomes, changed: str | None) -> None:
    want = hf_state(0)
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    if o.settle("load_hf", lambda: distckpt.load_hf(got, root / "hf")):
        for k in want:
            o.check(same(got[k], want[k]), f"load_hf gave wrong values of {k}")
    if o.cli("import", root / "hf", root / "imported") == 0:
        back = {k: torch.zeros_like(v) for k, v in want.items()}
        if o.settle("load imported", lambda: distckpt.load(back, root / "imported")):
            for k in want:
                o.check(same(back[k], want[k]), f"import wrote wrong values of {k}")


def read_race(root: Path, o: Outcomes, racer: Racer) -> None:
    want = ck_state(0)
    racer.start()
    try:
        for i in range(6):
            got = {k: torch.zeros_like(want[k]) for k in ("w", "zb")}
            if o.settle(f"load {i}", lambda g=got: distckpt.load(g, root / "ck", strict=False)):
                for k in got:
                    o.check(same(got[k], want[k]), f"load {i} under {racer.kind}: wrong {k}")
        read_run(root, o, None)
    finally:
        racer.stop.set()
        racer.join()


DAMAGE = {
    "frame": damage_frame,
    "boxes": damage_boxes,
    "index": damage_index,
    "safetensors": damage_safetensors,
    "values": damage_values,
    "grids": damage_grids,
    "typed": damage_typed,
}
READERS = {"ck": read_ck, "golden": read_golden, "run": read_run, "hf": read_hf,
           "grids": read_grids, "typed": read_typed}  # fmt: skip


def example(pristine: Path, work: Path, seed: int, index: int, family: str) -> dict[str, Any]:
    """Run one example in this process; returns its record (``violations`` empty: held)."""
    rng = random.Random(f"{seed}:{index}:{family}")
    root = work / f"ex{index}"
    shutil.copytree(pristine, root, symlinks=True)
    outside = fingerprint(root / "outside")
    o = Outcomes()
    record: dict[str, Any] = {"index": index, "family": family}
    if family == "race":
        racer = Racer(root, rng)
        record["damage"] = racer.describe()
        read_race(root, o, racer)
        record["swaps"] = racer.swaps
    else:
        try:
            made = DAMAGE[family](rng, root)
        except (OSError, ValueError, KeyError, IndexError, RecursionError) as exc:
            made = {"damage": f"not applicable ({type(exc).__name__})", "readers": None}
        record["damage"] = made["damage"]
        if made["readers"]:
            READERS[made["readers"]](root, o, made.get("changed"))
    o.check(fingerprint(root / "outside") == outside, "something outside the run changed")
    record["outcomes"] = o.done
    record["violations"] = o.violations
    return record


# ---------------------------------------------------------------- the driver


def _build_in_child(pristine: Path) -> None:
    """Build the pristine tree in a child, so that the driver itself never starts an I/O
    thread before it forks."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            build(pristine)
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError("building the pristine tree failed")


def _run_forked(pristine: Path, work: Path, seed: int, index: int, family: str) -> dict[str, Any]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the example's child
        os.close(read)
        code = 0
        logging.disable(logging.CRITICAL)  # what readers log of the damage is not asked
        warnings.simplefilter("ignore")
        try:
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            limit = _vm_bytes() + MEMORY_BOUND
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
            record = example(pristine, work, seed, index, family)
            code = 1 if record["violations"] else 0
        except BaseException as exc:  # noqa: BLE001
            record = {"index": index, "family": family,
                      "violations": [f"the example itself failed: {exc!r}\n"
                                     + traceback.format_exc()[-2000:]]}  # fmt: skip
            code = 1
        with os.fdopen(write, "w") as f:
            f.write(json.dumps(record, default=str))
        os._exit(code)
    os.close(write)
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], EXAMPLE_BOUND)
        if not ready:
            os.kill(pid, signal.SIGKILL)
    finally:
        os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        text = f.read()
    record = json.loads(text) if text else {"index": index, "family": family, "violations": []}
    code = os.waitstatus_to_exitcode(status)
    record["exit"] = code
    if code < 0:
        name = signal.Signals(-code).name
        why = "killed: no end within the deadline" if not text and code == -9 else f"died by {name}"
        record["violations"] = [*record.get("violations", []), why]
    shutil.rmtree(work / f"ex{index}", ignore_errors=True)
    return record


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def campaign(
    work: Path, seed: int, examples: int, families: tuple[str, ...] = FAMILIES
) -> list[dict[str, Any]]:
    """Run ``examples`` examples (families in turn), each in a forked child; returns every
    record (an empty ``violations``: the property held)."""
    pristine = work / "pristine"
    _build_in_child(pristine)
    if "typed" in families:
        preload_typed()  # imported once here, not in every example's child
    records = []
    for index in range(examples):
        records.append(_run_forked(pristine, work, seed, index, families[index % len(families)]))
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=600)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--family", action="append", choices=FAMILIES)
    parser.add_argument("--work", default=None, help="scratch directory (default: a temp one)")
    parser.add_argument("--json", default=None, help="write every record to this file")
    args = parser.parse_args()
    import tempfile

    if args.work:
        os.makedirs(args.work, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        began = time.monotonic()
        records = campaign(Path(tmp), args.seed, args.examples, tuple(args.family or FAMILIES))
        bad = [r for r in records if r["violations"]]
        if args.json:
            Path(args.json).write_text(json.dumps(records, default=str))
        for r in bad:
            print(json.dumps(r, indent=1, default=str))
        per_family = {f: sum(r["family"] == f for r in records) for f in FAMILIES}
        print(f"seed {args.seed}: {len(records)} examples {per_family} in "
              f"{time.monotonic() - began:.0f} s; {len(bad)} broke the property")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
