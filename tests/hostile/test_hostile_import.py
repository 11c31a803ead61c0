"""Hostile sources for ``distckpt import``: a ``.pt`` file crafted to run code, to stop
the process (a traceback, a hang, the stack), or to make it write far more than the file
holds; a FIFO or a socket in place of the file. Each import ends in exit 0 with the
values as stored, or exit 2 with one line naming what is wrong; no code from the file
runs (``torch.load(weights_only=True)``, unless ``--allow-pickle``) and nothing is
created. Safetensors sources are attacked in ``tests/hostile/test_hostile_hf.py``.
"""

from __future__ import annotations

import io
import os
import socket
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import distckpt
from tests.support.hostile_util import cli

#: Where a pickle that runs code leaves its mark.
PWNED = "pwned"


class RunsCode:
    """Pickled as a call of ``os.system``: unpickling it runs a shell command."""

    def __init__(self, mark: Path) -> None:
        self.mark = mark

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.mark}",))


def deep_pickle(path: Path, depth: int) -> None:
    """A torch.save archive whose pickle is ``{"d": [[[...]]]}``, ``depth`` lists deep
    (torch.save itself recurses, so the pickle is written by hand)."""
    buf = io.BytesIO()
    torch.save({"d": 1}, buf)
    archive = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    pickled = b"\x80\x02}X\x01\x00\x00\x00d" + b"]" * depth + b"a" * (depth - 1) + b"s."
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for info in archive.infolist():
            data = pickled if info.filename.endswith("data.pkl") else archive.read(info)
            out.writestr(info.filename, data)


def saved(state: Any, **kwargs: Any) -> Callable[[Path], None]:
    return lambda path: torch.save(state, path, **kwargs)


def damaged(legacy: bool, at: int, cut: bool) -> Callable[[Path], None]:
    """A small state's torch.save file cut short at byte ``at``, or with it flipped:
    torch.load then raised IndexError, KeyError and struct.error, not only its own."""

    def craft(path: Path) -> None:
        state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3, dtype=torch.int64)}
        buf = io.BytesIO()
        torch.save({**state, "v": {"lr": 0.1, "n": [1, 2]}}, buf, **_format(legacy))
        raw = buf.getvalue()
        path.write_bytes(raw[:at] if cut else raw[:at] + bytes([raw[at] ^ 0xFF]) + raw[at + 1 :])

    return craft


def _format(legacy: bool) -> dict[str, Any]:
    return {"_use_new_zipfile_serialization": False} if legacy else {}


def fifo(path: Path) -> None:
    os.mkfifo(path)


def bound_socket(path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))  # left bound until the test's process ends


def torchscript(path: Path) -> None:
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), path)


#: attack -> (the craft, given the mark of code run; words of the one error line)
SOURCES: dict[str, tuple[Callable[[Path], Callable[[Path], None]], str]] = {
    # held: no code runs
    "pickle-runs-code": (lambda mark: saved({"a": RunsCode(mark)}), "weights_only=True"),
    "pickle-runs-code-legacy": (
        lambda mark: saved({"a": RunsCode(mark)}, **_format(True)),
        "weights_only=True",
    ),
    "torchscript": (lambda mark: torchscript, "not a readable torch.save file"),
    # broke: a traceback
    "sparse": (lambda mark: saved({"s": torch.eye(3).to_sparse()}), "sparse"),
    "sparse-csr": (lambda mark: saved({"s": torch.eye(3).to_sparse_csr()}), "sparse"),
    "nested": (
        lambda mark: saved({"n": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}),
        "nested",
    ),
    "key-lone-surrogate": (lambda mark: saved({"\ud800": torch.ones(2)}), "lone surrogate"),
    "legacy-cut-1": (lambda mark: damaged(True, 1, True), "not a readable torch.save file"),
    "legacy-cut-18": (lambda mark: damaged(True, 18, True), "not a readable torch.save file"),
    "zip-flip-26": (lambda mark: damaged(False, 26, False), "not a readable torch.save file"),
    "nested-100000-deep": (lambda mark: lambda p: deep_pickle(p, 100_000), "nests more than"),
    # broke: a hang, or writes of what no stored byte backs
    "fifo": (lambda mark: fifo, "FIFO"),
    "socket": (lambda mark: bound_socket, "socket"),
    "meta-4-TiB": (lambda mark: saved({"m": torch.empty(1 << 40, device="meta")}), "meta"),
    "stride-0-256-MiB-of-4-bytes": (
        lambda mark: saved({"e": torch.zeros(1).expand(1 << 26)}),
        "stride of 0",
    ),
    "64-views-of-one-storage": (
        lambda mark: saved(dict.fromkeys(map(str, range(64)), torch.zeros(1 << 18))),
        "at most 16 times",
    ),
}


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_a_hostile_pt_file_is_one_line_and_exit_2(tmp_path: Path, source: str) -> None:
    craft, words = SOURCES[source]
    mark = tmp_path / PWNED
    src, out = tmp_path / "src.pt", tmp_path / "out"
    craft(mark)(src)
    run = cli("import", src, out)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2, (run.returncode, run.stdout, run.stderr)
    assert len(lines) == 1 and lines[0].startswith("distckpt import: error: "), lines
    assert words in lines[0], lines[0]
    assert all(c.isprintable() for c in lines[0]), lines[0]
    assert not mark.exists(), "code from the file ran"
    assert not out.exists()


def test_a_pickle_runs_code_only_when_allowed(tmp_path: Path) -> None:
    mark = tmp_path / PWNED
    torch.save({"a": RunsCode(mark), "w": torch.ones(2)}, tmp_path / "src.pt")
    assert cli("import", tmp_path / "src.pt", tmp_path / "out").returncode == 2
    assert not mark.exists()
    run = cli("import", tmp_path / "src.pt", tmp_path / "out", "--allow-pickle")
    assert mark.exists(), run.stderr  # what --allow-pickle says it does


def test_views_a_real_model_has_are_imported(tmp_path: Path) -> None:
    """What the checks allow: tied weights (two tensors of one storage), a buffer
    expanded along a dimension of one (position ids), a transposed view."""
    emb = torch.arange(12.0).reshape(4, 3)
    state = {
        "emb": emb,
        "head": emb,
        "ids": torch.arange(5).expand((1, -1)),
        "t": torch.arange(6.0).reshape(2, 3).t(),
    }
    torch.save(state, tmp_path / "src.pt")
    run = cli("import", tmp_path / "src.pt", tmp_path / "out")
    assert run.returncode == 0, run.stderr
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    distckpt.load(back, tmp_path / "out")
    for name, value in state.items():
        assert torch.equal(back[name], value), name
