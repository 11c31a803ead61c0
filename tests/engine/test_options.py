"""One options value (:class:`distckpt.CheckpointOptions`) through every entry point:
keywords win over the value's fields, a field an entry point does not use is refused,
bad values are refused before anything is written, and the value reaches the engine
whole from ``Checkpoint``, the manager and the local tier (seen in what is stored)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import distckpt
from distckpt.comm import SingleComm
from distckpt.pipeline.options import CheckpointOptions, merge
from tests.engine.test_single_process import index_of
from tests.support.make_golden import assert_same_bits

pytestmark = pytest.mark.timeout(120)
COMM = SingleComm()


def codecs_of(ckpt: Path) -> dict[str, set[str | None]]:
    return {
        n: {p.get("codec", {}).get("name") for p in v["pieces"]}
        for n, v in index_of(ckpt)["variables"].items()
        if v["kind"] == "tensor"
    }


def state() -> dict[str, torch.Tensor]:
    return {"w": (torch.arange(64 * 1024) % 7).float().reshape(256, 256)}


def test_keywords_win_and_unknown_fields_are_refused() -> None:
    base = CheckpointOptions(compression="zstd", io_workers=3)
    merged = merge(base, {"io_workers": 5}, frozenset({"io_workers"}), "f")
    assert (merged.compression, merged.io_workers) == ("zstd", 5)
    assert base.io_workers == 3  # frozen: the value given is never changed
    with pytest.raises(TypeError, match=r"f\(\) got an unexpected keyword argument 'strict'"):
        merge(base, {"strict": False}, frozenset({"io_workers"}), "f")
    with pytest.raises(TypeError, match="must be a distckpt.CheckpointOptions"):
        merge({"io_workers": 3}, {}, frozenset(), "f")  # type: ignore[arg-type]
    for bad in ({"compression": "lzma"}, {"io_workers": 0}, {"small_bytes": -1}):
        with pytest.raises(ValueError):
            CheckpointOptions(**bad)  # type: ignore[arg-type]
    choices = {"a/*": "zstd"}
    copied = CheckpointOptions(compression=choices)
    choices["b"] = "zstd"  # a later edit of the caller's mapping is not the options'
    assert copied.compression == {"a/*": "zstd"}
    assert copied.compression_key() == (("a/*", "zstd"),)


def test_save_and_load_take_the_value_and_keywords(tmp_path: Path) -> None:
    opts = CheckpointOptions(compression="zstd", small_bytes=0)
    distckpt.save(state(), tmp_path / "a", COMM, options=opts)
    assert codecs_of(tmp_path / "a") == {"w": {"zstd"}}
    distckpt.save(state(), tmp_path / "b", COMM, options=opts, compression=None)
    assert codecs_of(tmp_path / "b") == {"w": {None}}
    # overwrite=True in the value replaces, as the keyword does
    distckpt.save(state(), tmp_path / "a", COMM, options=opts.replace(overwrite=True))
    with pytest.raises(distckpt.CheckpointExists):
        distckpt.save(state(), tmp_path / "a", COMM, options=opts)
    with pytest.raises(TypeError, match="unexpected keyword argument 'strict'"):
        distckpt.save(state(), tmp_path / "c", COMM, strict=True)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="unknown compression"):
        distckpt.save(state(), tmp_path / "c", COMM, compression="lzma")  # type: ignore[arg-type]
    assert not (tmp_path / "c").exists()
    target = {"w": torch.zeros(256, 256), "extra": torch.zeros(1)}
    with pytest.raises(distckpt.MissingVariablesError):
        distckpt.load(target, tmp_path / "a", COMM)
    result = distckpt.load(target, tmp_path / "a", COMM, options=CheckpointOptions(strict=False))
    assert result.missing == ["extra"]
    assert_same_bits(target["w"], state()["w"], "w")
    with pytest.raises(TypeError, match="unexpected keyword argument 'compression'"):
        distckpt.load(target, tmp_path / "a", COMM, compression="zstd")  # type: ignore[call-arg]


def test_checkpoint_and_manager_pass_the_value_on(tmp_path: Path) -> None:
    opts = CheckpointOptions(compression="zstd", small_bytes=0)
    w = state()["w"].clone()
    ckpt = distckpt.Checkpoint(w=w)
    assert ckpt.save(tmp_path / "one" / "ckpt", COMM, options=opts).endswith("ckpt-1")
    assert codecs_of(tmp_path / "one" / "ckpt-1") == {"w": {"zstd"}}
    with pytest.raises(TypeError, match="unexpected keyword argument 'overwrite'"):
        ckpt.save(tmp_path / "one" / "ckpt", COMM, overwrite=True)  # type: ignore[call-arg]
    with distckpt.CheckpointManager(
        ckpt, tmp_path / "run", comm=COMM, options=opts, compression="blosc-lz4"
    ) as manager:
        assert manager.options.compression == "blosc-lz4"
        path = manager.save()
        assert codecs_of(Path(path)) == {"w": {"blosc"}}
        w.zero_()
        assert manager.restore_or_initialize() == path
    assert_same_bits(w, state()["w"], "w")
    with pytest.raises(TypeError, match="unexpected keyword argument 'strict'"):
        distckpt.CheckpointManager(ckpt, tmp_path / "run2", comm=COMM, strict=False)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="unknown compression"):
        distckpt.CheckpointManager(ckpt, tmp_path / "run2", comm=COMM, compression="x")  # type: ignore[arg-type]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))


def test_hugging_face_functions_take_the_value_and_keywords(tmp_path: Path) -> None:
    want = {"w": (torch.arange(24) % 5).float().reshape(4, 6)}
    distckpt.save_hf(want, tmp_path / "hf", COMM)
    with pytest.raises(distckpt.CheckpointExists):
        distckpt.save_hf(want, tmp_path / "hf", COMM, options=CheckpointOptions(io_workers=2))
    distckpt.save_hf(want, tmp_path / "hf", COMM, options=CheckpointOptions(overwrite=True))
    with pytest.raises(TypeError, match=r"save_hf\(\) got an unexpected keyword argument 'strict'"):
        distckpt.save_hf(want, tmp_path / "hf2", COMM, strict=True)  # type: ignore[call-arg]
    assert not (tmp_path / "hf2").exists()
    distckpt.save(want, tmp_path / "ckpt", COMM)
    distckpt.export_hf(tmp_path / "ckpt", tmp_path / "hf", COMM, overwrite=True, io_workers=1)
    target = {"w": torch.zeros(4, 6), "extra": torch.zeros(1)}
    with pytest.raises(distckpt.MissingVariablesError):
        distckpt.load_hf(target, tmp_path / "hf", COMM)
    result = distckpt.load_hf(
        target, tmp_path / "hf", COMM, options=CheckpointOptions(strict=False)
    )
    assert result.missing == ["extra"]
    assert_same_bits(target["w"], want["w"], "w")
    with pytest.raises(TypeError, match="unexpected keyword argument 'allow_pickle'"):
        distckpt.load_hf(target, tmp_path / "hf", COMM, allow_pickle=True)  # type: ignore[call-arg]
