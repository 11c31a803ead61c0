"""Hostile Hugging Face weights: a safetensors header or a weights index crafted to hang
the reader, blow up its memory, or crash it is one ``CorruptCheckpointError`` from
``load_hf`` and from ``distckpt import``, within a small time and memory bound (each
measured in a process of its own: its peak resident memory after the call, less before).
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import distckpt
from distckpt import CorruptCheckpointError
from distckpt.comm import SingleComm
from distckpt.hf import directory
from distckpt.hf.directory import INDEX

pytestmark = pytest.mark.timeout(300)

BOUND = 60  # seconds a hostile file may cost a child process, start-up included
GROWTH = 200  # MiB of peak memory a hostile file may add, over its own bytes read whole

#: The child: for each file or directory in argv, load_hf, then distckpt import; prints
#: a line for each: how each ended, the seconds, and the growth of the process's peak
#: resident memory so far (VmHWM) over what it was before the first.
CHILD = """
import json, sys, time
import torch  # in the baseline: the commands need it (import distckpt alone does not)
import distckpt
from distckpt.cli import main
from distckpt.comm import SingleComm

def peak():  # MiB. Not ru_maxrss: exec keeps the parent's, which made the files.
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 1024

base = peak()
for k, source in enumerate(sys.argv[1:]):
    out = {}
    began = time.monotonic()
    try:
        distckpt.load_hf({}, source, SingleComm(), strict=False)
        out["load_hf"] = "ok"
    except Exception as exc:
        out["load_hf"] = type(exc).__name__ + ": " + str(exc)[:300]
    print(f"case {k}:", file=sys.stderr, flush=True)
    out["code"] = main(["import", source, source + ".imported"])
    out["seconds"] = time.monotonic() - began
    out["growth"] = peak() - base
    print("result:", json.dumps(out), flush=True)
"""


def header_file(path: Path, text: bytes, data: bytes = b"") -> Path:
    """A safetensors file with the header ``text`` (padded as safetensors pads it)."""
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def in_a_child(*sources: Path) -> list[dict[str, Any]]:
    """How :data:`CHILD` ended for each of ``sources``, its stderr split by case."""
    run = subprocess.run(
        [sys.executable, "-c", CHILD, *map(str, sources)],
        capture_output=True,
        text=True,
        timeout=BOUND * len(sources),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = [
        json.loads(line.removeprefix("result:"))
        for line in run.stdout.splitlines()
        if line.startswith("result:")
    ]
    errors = run.stderr.split("case ")[1:]
    for result, err in zip(results, errors, strict=True):
        result["stderr"] = err
    return results


def entry(offsets: tuple[int, int] = (0, 0), shape: bytes = b"[0]") -> bytes:
    return b'{"dtype":"F32","shape":%s,"data_offsets":[%d,%d]}' % (shape, *offsets)


def two_million_dimensions(tmp_path: Path) -> Path:
    # math.prod of 2 ** 2,000,000 before any bound: it never ended.
    return header_file(
        tmp_path / "dims.safetensors",
        b'{"w":' + entry(shape=b"[" + b"2," * 2_000_000 + b"0]") + b"}",
    )


def empty_tensors_in_99_mb(tmp_path: Path) -> Path:
    # 1.65 million entries, each a few dicts and lists once parsed: gigabytes.
    parts = [b'"t%d":' % i + entry() for i in range(1_650_000)]
    return header_file(tmp_path / "many.safetensors", b"{" + b",".join(parts) + b"}")


def a_99_mb_name(tmp_path: Path) -> Path:
    # One emoji makes a string of 99 million characters take four bytes each.
    name = b"\xf0\x9f\x98\x80" + b"a" * 98_000_000
    return header_file(tmp_path / "name.safetensors", b'{"' + name + b'":' + entry() + b"}")


def arrays_nested_deep(tmp_path: Path) -> Path:
    # In a field safetensors ignores: skipped without recursion, to a bounded depth.
    deep = b"[" * 5_000_000 + b"]" * 5_000_000
    text = b'{"w":{"dtype":"F32","shape":[0],"data_offsets":[0,0],"note":' + deep + b"}}"
    return header_file(tmp_path / "deep.safetensors", text)


def strides_that_overflow(tmp_path: Path) -> Path:
    # No element, but torch multiplies the other dimensions into strides: it raised a
    # RuntimeError (a traceback from the command line).
    shape = b"[0,%d,%d]" % (2**40, 2**40)
    return header_file(tmp_path / "strides.safetensors", b'{"w":' + entry(shape=shape) + b"}")


HEADERS = {
    "two million dimensions": (two_million_dimensions, "more than 64 dimensions"),
    "1.65 million empty tensors in 99 MB": (empty_tensors_in_99_mb, "more than 131072 tensors"),
    "a name of 98 MB": (a_99_mb_name, "longer than 65536 bytes"),
    "arrays nested 5 million deep": (arrays_nested_deep, "nests deeper than 64"),
    "strides that overflow": (strides_that_overflow, "impossibly large"),
}


def test_hostile_headers_are_refused_within_bounds(tmp_path: Path) -> None:
    """One process reads every file in turn (so its peak memory after each is the most
    any of them took so far)."""
    sources = [make(tmp_path) for make, _ in HEADERS.values()]
    for (case, (_, words)), source, result in zip(
        HEADERS.items(), sources, in_a_child(*sources), strict=True
    ):
        assert result["load_hf"].startswith("CorruptCheckpointError: "), (case, result)
        assert words in result["load_hf"], (case, result)
        assert result["code"] == 2 and words in result["stderr"], (case, result)
        assert "Traceback" not in result["stderr"], (case, result["stderr"][-2000:])
        assert result["growth"] < GROWTH, (case, result)
        assert result["seconds"] < BOUND / 2, (case, result)
        assert not Path(f"{source}.imported").exists()


def test_headers_written_in_any_json_form_read_the_same(tmp_path: Path) -> None:
    """Escapes, another field order, other whitespace and unknown fields take the
    step-by-step path, and read what safetensors' own form reads."""
    tensors = {"a.weight": torch.arange(6.0).reshape(2, 3), 'q"u\\ote': torch.ones(2)}
    plain = tmp_path / "plain.safetensors"
    save_file(tensors, str(plain), metadata={"format": "pt"})
    length = int.from_bytes(plain.read_bytes()[:8], "little")
    doc = json.loads(plain.read_bytes()[8 : 8 + length])
    data = plain.read_bytes()[8 + length :]
    odd = {
        name: {"note": [1, {"x": None}], **dict(reversed(list(spec.items())))}
        if isinstance(spec, dict) and "dtype" in spec
        else spec
        for name, spec in doc.items()
    }
    text = json.dumps(odd, indent="\t", ensure_ascii=True).encode()
    text = text.replace(b'"dtype"', b'"d\\u0074ype"')
    other = header_file(tmp_path / "other.safetensors", text, data)
    for source in (plain, other):
        state = {name: torch.zeros_like(t) for name, t in tensors.items()}
        distckpt.load_hf(state, source, SingleComm())
        for name, tensor in tensors.items():
            assert torch.equal(state[name], tensor), (source, name)


# ------------------------------------------------------------------- weights indexes


def weights_dir(tmp_path: Path, weight_map: bytes) -> Path:
    root = tmp_path / "weights"
    root.mkdir()
    save_file({"w": torch.ones(2)}, str(root / "a.safetensors"))
    save_file({"w": torch.full((2,), 7.0)}, str(root / "b.safetensors"))
    (root / INDEX).write_bytes(
        b'{"metadata": {"total_size": 8}, "weight_map": ' + weight_map + b"}"
    )
    return root


def test_an_index_naming_one_tensor_in_two_files_is_refused(tmp_path: Path) -> None:
    """JSON keeps the last of two equal keys: the index said 'w' is in both files, and
    the load read b's without a word."""
    root = weights_dir(tmp_path, b'{"w": "a.safetensors", "w": "b.safetensors"}')
    with pytest.raises(CorruptCheckpointError, match="'w' appears twice in weight_map") as info:
        distckpt.load_hf({"w": torch.zeros(2)}, root, SingleComm())
    assert INDEX in str(info.value)


def test_an_index_of_too_many_names_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(directory, "MAX_TENSORS", 1000)
    names = b",".join(b'"t%d":"a.safetensors"' % i for i in range(1001))
    root = weights_dir(tmp_path, b"{" + names + b"}")
    with pytest.raises(CorruptCheckpointError, match="weight_map names more than 1000 tensors"):
        distckpt.load_hf({}, root, SingleComm(), strict=False)


def test_a_directory_of_too_many_tensors_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(directory, "MAX_TENSORS", 3)
    for k in range(2):
        save_file(
            {f"t{k}.{i}": torch.ones(1) for i in range(2)}, str(tmp_path / f"{k}.safetensors")
        )
    with pytest.raises(CorruptCheckpointError, match="more than 3 tensors in its files"):
        distckpt.load_hf({}, tmp_path, SingleComm(), strict=False)


def test_an_index_read_only_to_its_bound(tmp_path: Path) -> None:
    root = weights_dir(tmp_path, b'{"w": "a.safetensors"}')
    with open(root / INDEX, "ab") as f:
        f.truncate(65 << 20)  # sparse: 65 MiB of NULs after the document
    with pytest.raises(CorruptCheckpointError, match="a weights index of more than"):
        distckpt.load_hf({"w": torch.zeros(2)}, root, SingleComm())
