"""Hugging Face weights on every store (``backend``: a directory, S3, Azure): written by
``save_hf``, read by ``load_hf`` and ``distckpt import`` from the store's location."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import distckpt
from distckpt.comm import SingleComm
from distckpt.storage.registry import open_store
from tests.support.backends import Backend

COMM = SingleComm()


def _hf_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "embed.weight": torch.randn(300, 64, generator=g).to(torch.bfloat16),
        "layers.0.w": torch.randn(64, 640, generator=g),
        "layers.1.w": torch.randn(64, 640, generator=g),
        "norm.bias": torch.randn(64, generator=g).to(torch.float16),
    }


def test_load_hf_from_store(backend: Backend, tmp_path: Path) -> None:
    """Hugging Face weights written to a store by save_hf (an index and three files)
    are the files it writes to a directory, byte for byte; they load from its URL bit for
    bit, resharded boxes included; existing weights are refused, or replaced with
    ``overwrite=True`` (the old files the new save does not name removed); a hostile index
    or header in the store is refused with a message naming it."""
    want = _hf_state()
    local = tmp_path / "hf"
    distckpt.save_hf(want, local, COMM, max_shard_size=200_000)
    files = sorted(p.name for p in local.iterdir())
    assert "model.safetensors.index.json" in files and len(files) >= 4
    store = open_store(f"{backend.url}/hf")
    distckpt.save_hf(want, store.url, COMM, max_shard_size=200_000)
    assert store.list() == files
    for name in files:
        assert store.read(name) == (local / name).read_bytes(), name
    with pytest.raises(distckpt.CheckpointExists, match="already holds weights"):
        distckpt.save_hf(want, store.url, COMM)
    again = open_store(f"{backend.url}/again")
    distckpt.save_hf(want, again.url, COMM, max_shard_size=200_000)
    distckpt.save_hf(want, again.url, COMM, options=distckpt.CheckpointOptions(overwrite=True))
    distckpt.save_hf(want, tmp_path / "whole", COMM)
    assert again.list() == ["model.safetensors"]
    assert again.read("model.safetensors") == (tmp_path / "whole/model.safetensors").read_bytes()

    got: dict[str, Any] = {k: torch.zeros_like(v) for k, v in want.items()}
    result = distckpt.load_hf(got, f"{backend.url}/hf", COMM)
    assert sorted(result.loaded) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
    # A box of a tensor (as a rank of a sharded job reads it): only its bytes.
    box = distckpt.Shard(torch.zeros(64, 100), global_shape=(64, 640), offsets=(0, 300))
    distckpt.load_hf({"layers.1.w": box}, f"{backend.url}/hf", COMM, strict=False)
    assert torch.equal(box.tensor, want["layers.1.w"][:, 300:400])
    # `distckpt import` from the bucket: a checkpoint of the same tensors.
    proc = subprocess.run(
        [sys.executable, "-m", "distckpt", "import", f"{backend.url}/hf", str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    back: dict[str, Any] = {k: torch.zeros_like(v) for k, v in want.items()}
    distckpt.load(back, tmp_path / "ck", COMM)
    for k, v in want.items():
        assert torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)), k
    # One object named directly.
    single = open_store(f"{backend.url}/one")
    distckpt.save_hf({"x": want["norm.bias"]}, tmp_path / "one", COMM)
    single.write("model.safetensors", (tmp_path / "one" / "model.safetensors").read_bytes())
    x = {"x": torch.zeros(64, dtype=torch.float16)}
    distckpt.load_hf(x, f"{backend.url}/one/model.safetensors", COMM)
    assert torch.equal(x["x"], want["norm.bias"])

    hostile = open_store(f"{backend.url}/hostile")
    hostile.write(
        "model.safetensors.index.json",
        json.dumps({"weight_map": {"a": "../hf/model-00001-of-00003.safetensors"}}).encode(),
    )
    with pytest.raises(distckpt.CorruptCheckpointError, match="names the file"):
        distckpt.load_hf({"a": torch.zeros(1)}, hostile.url, COMM)
    huge = open_store(f"{backend.url}/huge")
    huge.write("model.safetensors", (1 << 60).to_bytes(8, "little") + b"{}")
    with pytest.raises(distckpt.CorruptCheckpointError, match="header length"):
        distckpt.load_hf({"a": torch.zeros(1)}, huge.url, COMM)
