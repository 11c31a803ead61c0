"""distckpt.remove: one committed checkpoint deleted whole, nothing else touched."""

from __future__ import annotations

import os

import pytest
import torch

import distckpt


def test_remove_deletes_a_committed_checkpoint(tmp_path):
    distckpt.save({"w": torch.arange(4.0)}, tmp_path / "ckpt-1")
    distckpt.save({"w": torch.arange(4.0)}, tmp_path / "ckpt-2")
    distckpt.remove(tmp_path / "ckpt-1")
    assert os.listdir(tmp_path) == ["ckpt-2"]
    state = {"w": torch.zeros(4)}
    distckpt.load(state, tmp_path / "ckpt-2")
    assert torch.equal(state["w"], torch.arange(4.0))


def test_remove_leaves_what_distckpt_did_not_write(tmp_path):
    (tmp_path / "model.ckpt").write_bytes(b"not ours")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "f").write_bytes(b"x")
    for name in ("model.ckpt", "dir"):
        with pytest.raises(distckpt.CheckpointNotFoundError, match="left alone"):
            distckpt.remove(tmp_path / name, missing_ok=True)
    assert (tmp_path / "model.ckpt").read_bytes() == b"not ours"
    assert (tmp_path / "dir" / "f").read_bytes() == b"x"


def test_remove_missing(tmp_path):
    distckpt.remove(tmp_path / "absent", missing_ok=True)
    with pytest.raises(distckpt.CheckpointNotFoundError):
        distckpt.remove(tmp_path / "absent")
