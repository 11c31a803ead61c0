"""One rank of saves and loads of one Megatron tensor under different stackings, through
the distckpt strategies (CPU, gloo).

    torchrun --standalone --nproc-per-node N megatron_stacking.py save|load DIR

The tensor ``B`` of global shape (6, 5, 12) holds ``arange`` values. ``save`` writes it on
every rank's share under four stackings, one checkpoint each (``DIR/<stacking>``):
``plain`` (no prepended axis, columns split over the ranks), ``stacked`` (6 layers of
(5, 12), one prepended axis, a band of layers per rank), ``interleaved`` (layer ``l`` on
rank ``l % N``: boxes that make no one box on a rank) and ``old`` (the per-layer layout
``tensors/B/<layer>`` that saves before the whole layout wrote). ``load`` reads each
checkpoint as ``plain``, ``stacked`` and ``stacked2`` (two prepended axes: 30 rows of
(12,)), every value compared bit for bit.
"""

from __future__ import annotations

import os
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

mode, root = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402

import distckpt  # noqa: E402
from distckpt.integrations.megatron import (  # noqa: E402
    DistckptLoadStrategy,
    DistckptSaveStrategy,
    checkpoint_path,
)

SHAPE = (6, 5, 12)
WHOLE = torch.arange(360, dtype=torch.float64).reshape(SHAPE)


def band(n: int) -> range:
    """This rank's band of ``n`` items."""
    return range(rank * n // world, (rank + 1) * n // world)


def leaves(stacking: str, data: torch.Tensor) -> list[ShardedTensor]:
    """This rank's leaves of ``B`` under ``stacking``, holding the values of ``data``."""
    if stacking == "plain":
        cols = band(SHAPE[2])
        part = data[:, :, cols.start : cols.stop].clone()
        return [ShardedTensor.from_rank_offsets("B", part, (2, rank, world))]
    layers = band(6) if stacking != "interleaved" else range(rank, 6, world)
    if stacking == "stacked2":
        return [
            ShardedTensor.from_rank_offsets(
                "B", data[i, j].clone(), (0, i, 6), (1, j, 5), prepend_axis_num=2
            )
            for i in layers
            for j in range(5)
        ]
    return [
        ShardedTensor.from_rank_offsets("B", data[i].clone(), (0, i, 6), prepend_axis_num=1)
        for i in layers
    ]


def save_old(path: str) -> None:
    """The per-layer layout of earlier saves: ``tensors/B/<layer>``, each (5, 12)."""
    mine = {str(i): distckpt.Shard(WHOLE[i].clone(), SHAPE[1:], (0, 0)) for i in band(6)}
    distckpt.save({"tensors": {"B": mine}}, checkpoint_path(path))


if mode == "save":
    for stacking in ("plain", "stacked", "interleaved"):
        path = os.path.join(root, stacking)
        os.makedirs(path, exist_ok=True)
        DistckptSaveStrategy().save({"B": leaves(stacking, WHOLE)}, path)
    save_old(os.path.join(root, "old"))
    names = [
        v.name for v in distckpt.list_variables(checkpoint_path(os.path.join(root, "stacked")))
    ]
    assert names == ["tensors/B"], names
else:
    for saved in ("plain", "stacked", "interleaved", "old"):
        for stacking in ("plain", "stacked", "stacked2"):
            wanted = leaves(stacking, torch.full(SHAPE, float("nan"), dtype=torch.float64))
            loaded = DistckptLoadStrategy().load({"B": wanted}, os.path.join(root, saved))["B"]
            expected = leaves(stacking, WHOLE)
            for got, want in zip(loaded, expected, strict=True):
                assert torch.equal(got.view(torch.int64), want.data.view(torch.int64)), (
                    saved,
                    stacking,
                )
    os.write(1, f"rank {rank}: LOADED every stacking bit for bit\n".encode())

dist.destroy_process_group()
os.write(1, f"OK {rank}\n".encode())
