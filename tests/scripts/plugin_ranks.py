"""Saves, loads and a manager through a store added by a plug-in (run by
tests/storage/test_store_plugin.py, which installs the ``files://`` store's package on
``PYTHONPATH``: the scheme is found through its entry point, nothing is imported here).

Usage::

    plugin_ranks.py save RUN    # any world size: RUN/plain, then a manager keeping 1 of 2
    plugin_ranks.py load RUN    # any other world size: both restored, resharded

Hugging Face weights through the plug-in (an object store to distckpt: each file has one
writer, which receives the rows it does not hold from the ranks that do): ``save``
writes them (``save_hf``: RUN/hf; ``export_hf`` of RUN/plain: RUN/exported), and a save
to a ``flaky://`` store (the plug-in's store whose writes of one file fail) must fail on
every rank with that error and leave nothing; ``load`` reads them back resharded.

Every value is a pure function of its name and step, so any rank of any world size knows
what its box must hold; the loads compare bit for bit. A rank whose checks passed prints
``OK <rank>``; a failed check raises, and the job fails.
"""

from __future__ import annotations

import os
import sys
import zlib
from typing import Any

import torch
from rank import say

import distckpt
from distckpt.comm import auto
from distckpt.storage.registry import open_store, register_store

SHAPE = (10, 6)  # rows split over the ranks, unevenly on 3 or 4


def full(name: str, step: int) -> torch.Tensor:
    """The global value of variable ``name`` at ``step``."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}".encode()))
    if name == "w":
        return torch.randn(SHAPE, generator=g)
    if name == "h":
        return torch.randn(7, generator=g).to(torch.bfloat16)
    return torch.randint(-(2**62), 2**62, (5,), generator=g)


def rows(rank: int, world: int) -> tuple[int, int]:
    per = -(-SHAPE[0] // world)
    start = min(rank * per, SHAPE[0])
    return start, min(start + per, SHAPE[0])


def model(step: int, rank: int, world: int, *, blank: bool = False) -> dict[str, Any]:
    """This rank's part of the model at ``step`` (zeros with ``blank``)."""
    a, b = rows(rank, world)
    values = {name: full(name, step) for name in ("w", "h", "ids")}
    if blank:
        values = {name: torch.zeros_like(v) for name, v in values.items()}
    return {
        "w": distckpt.Shard(values["w"][a:b].clone(), SHAPE, (a, 0)),
        "h": values["h"],
        "ids": values["ids"],
    }


def check(got: dict[str, Any], step: int, rank: int, world: int, where: str) -> None:
    want = model(step, rank, world)
    for name in want:
        g, w = got[name], want[name]
        g, w = (g.tensor, w.tensor) if isinstance(g, distckpt.Shard) else (g, w)
        same = g.dtype == w.dtype and g.shape == w.shape
        if not same or not torch.equal(g.view(torch.uint8), w.view(torch.uint8)):
            raise AssertionError(f"rank {rank}: {where}: {name} is not step {step}'s, bit for bit")


HF_FILE = 200  # bytes: "w" (240) gets a file of its own, "h" and "ids" share one


def weights(step: int, rank: int, world: int, *, blank: bool = False) -> dict[str, Any]:
    """The model as Hugging Face names it."""
    return {f"model.{k}": v for k, v in model(step, rank, world, blank=blank).items()}


def save_weights(url: str, comm: Any) -> None:
    rank, world = comm.rank, comm.size
    result = distckpt.save_hf(weights(1, rank, world), f"{url}/hf", comm, max_shard_size=HF_FILE)
    assert result.bytes_written > 0, result
    distckpt.export_hf(f"{url}/plain", f"{url}/exported", comm, prefix="model/")
    store = open_store(url)

    class FlakyWriter:
        """Fails every write past the header of the file of ``w``."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def write(self, buffers: Any, offset: int) -> int:
            if offset > 0:
                raise distckpt.StorageError("flaky: the service dropped the connection")
            return int(self.inner.write(buffers, offset))

        def finish(self, durable: bool = True) -> None:
            self.inner.finish(durable)

        def abort(self) -> None:
            self.inner.abort()

    class FlakyStore(type(store)):  # type: ignore[misc]
        def create(self, key: str, size_hint: int | None = None) -> Any:
            handle = super().create(key, size_hint)
            return FlakyWriter(handle) if key.endswith("00001-of-00002.safetensors") else handle

    register_store("flaky", lambda u: FlakyStore(u.removeprefix("flaky://")))
    flaky = f"flaky://{url.removeprefix('files://')}/failed"
    try:
        distckpt.save_hf(weights(1, rank, world), flaky, comm, max_shard_size=HF_FILE)
    except distckpt.StorageError as exc:
        assert "flaky: the service dropped" in str(exc), exc
    else:
        raise AssertionError(f"rank {rank}: a failed write of weights went unnoticed")
    left = open_store(f"{url}/failed").list()
    assert not [n for n in left if n.endswith(".safetensors") or n.endswith(".json")], left


def load_weights(url: str, comm: Any) -> None:
    rank, world = comm.rank, comm.size
    got = weights(0, rank, world, blank=True)
    distckpt.load_hf(got, f"{url}/hf", comm)
    check({k.removeprefix("model."): v for k, v in got.items()}, 1, rank, world, "hf")
    plain = model(0, rank, world, blank=True)
    distckpt.load_hf(plain, f"{url}/exported", comm)
    check(plain, 1, rank, world, "exported")


def main() -> None:
    mode, run = sys.argv[1], sys.argv[2]
    comm = auto()
    rank, world = comm.rank, comm.size
    url = f"files://{os.path.abspath(run)}"
    assert type(open_store(url)).__module__ == "files_store", open_store(url)
    if mode == "save":
        distckpt.save({"model": model(1, rank, world), "step": 1}, f"{url}/plain", comm)
        ckpt = distckpt.Checkpoint(model=model(2, rank, world), step=2)
        with distckpt.CheckpointManager(ckpt, url, max_to_keep=1, comm=comm) as manager:
            manager.save()
            ckpt.model, ckpt.step = model(3, rank, world), 3
            manager.save()
            assert manager.checkpoints == [f"{url}/ckpt-2"], manager.checkpoints
        save_weights(url, comm)
    else:
        got: dict[str, Any] = {"model": model(0, rank, world, blank=True), "step": None}
        distckpt.load(got, f"{url}/plain", comm)
        check(got["model"], 1, rank, world, "plain")
        assert got["step"] == 1, got["step"]
        ckpt = distckpt.Checkpoint(model=model(0, rank, world, blank=True), step=0)
        with distckpt.CheckpointManager(ckpt, url, max_to_keep=1, comm=comm) as manager:
            assert manager.restore_or_initialize() == f"{url}/ckpt-2"
        check(ckpt.model, 3, rank, world, "ckpt-2")
        assert ckpt.step == 3, ckpt.step
        load_weights(url, comm)
    say(f"LATEST {distckpt.latest_checkpoint(url)}")
    say(f"OK {rank}")


if __name__ == "__main__":
    main()
