"""``dcp.save`` through distckpt on DCP's own terms, on 3 ranks (torchrun, gloo):

* ``groups``: ranks 0 and 2 save with ``process_group`` = a group of the two, rank 1 with
  a group of itself, each to its own path, with values that differ between the two saves;
  then every rank saves alone through a one-rank group (torchft's one save per replica
  group). Each path holds what its own group saved.
* ``no_dist``: rank 0 alone saves with ``no_dist=True`` while the others wait at a barrier.
* ``no_collectives``: every rank saves its own value with ``use_collectives=False`` to one
  path, and ``dcp.load`` gives each rank its own back (DCP's per-rank fallback).
* ``async``: ``dcp.async_save`` in thread mode; the state changed once staging is over is
  not what was saved.
* ``sharded_tensor``: a legacy ``ShardedTensor`` saved and loaded, bit for bit, with one
  shard per rank, and with several on one rank (regrouped into one box per rank).
* ``differing``: a value that differs between ranks is refused, naming both values.

Usage: ``dcp_groups.py DIR``; each rank prints ``OK <rank>`` last.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from rank import finish_job, say, start_job
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import distckpt
from distckpt.comm import SingleComm
from distckpt.integrations.dcp import DistckptReader, DistckptWriter


def state_of(value: int) -> dict[str, Any]:
    return {"w": torch.arange(5.0) * value, "meta": {"by": value, "blob": bytes([value])}}


def check(got: dict[str, Any], value: int, where: str) -> None:
    want = state_of(value)
    assert torch.equal(got["w"], want["w"]), (where, got["w"], want["w"])
    assert got["meta"] == want["meta"], (where, got["meta"], want["meta"])


def load(path: Path, group: Any = None) -> dict[str, Any]:
    got = {"w": torch.zeros(5), "meta": {"by": -1, "blob": b""}}
    dcp.load(got, storage_reader=DistckptReader(path), process_group=group)
    return got


def groups(directory: Path, rank: int) -> None:
    pair = dist.new_group([0, 2])
    alone = [dist.new_group([r]) for r in range(3)]
    mine, value = (pair, 10) if rank in (0, 2) else (alone[1], 11)
    path = directory / ("pair" if rank in (0, 2) else "solo")
    dcp.save(state_of(value), storage_writer=DistckptWriter(path), process_group=mine)
    check(load(path, mine), value, "a group's own save")
    own = directory / f"replica-{rank}"
    dcp.save(state_of(20 + rank), storage_writer=DistckptWriter(own), process_group=alone[rank])
    dist.barrier()
    for r in range(3):  # every replica group's checkpoint, each with its own values
        check(load(directory / f"replica-{r}", alone[rank]), 20 + r, f"replica {r}")


def no_dist(directory: Path, rank: int) -> None:
    if rank == 0:
        dcp.save(state_of(30), storage_writer=DistckptWriter(directory / "nodist"), no_dist=True)
    dist.barrier()
    check(load(directory / "nodist"), 30, "saved by rank 0 alone")


def no_collectives(directory: Path, rank: int) -> None:
    path = directory / "percoll"
    dcp.save(state_of(40 + rank), storage_writer=DistckptWriter(path), use_collectives=False)
    dist.barrier()
    with warnings.catch_warnings():  # DCP warns that it falls back to per-rank metadata
        warnings.simplefilter("ignore")
        check(load(path), 40 + rank, "each rank's own save")


def async_thread(directory: Path, rank: int) -> None:
    state = state_of(50)
    path = directory / "async"
    future = dcp.async_save(
        state,
        storage_writer=DistckptWriter(path),
        async_checkpointer_type=AsyncCheckpointerType.THREAD,
    )
    state["w"].add_(1000)  # training goes on once the state is staged
    future.result()
    check(load(path), 50, "async_save (thread)")


def async_process(directory: Path, rank: int) -> None:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    state = state_of(60)
    path = directory / "async-process"
    stager = DefaultStager(StagingOptions(False, True, True, False))
    response = dcp.async_save(
        state,
        storage_writer=DistckptWriter(path),
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        async_stager=stager,
    )
    response.staging_completion.result()
    state["w"].add_(1000)
    response.upload_completion.result()
    stager.close()
    check(load(path), 60, "async_save (process, shared-memory staging)")


def sharded_tensor(directory: Path, rank: int) -> None:
    from torch.distributed._shard import sharded_tensor as st
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(3)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ShardedTensor is deprecated
        saved = st.empty(spec, 7, 3)
        local = saved.local_shards()[0].tensor
        offset = saved.local_shards()[0].metadata.shard_offsets[0]
        local.copy_(torch.arange(21.0).reshape(7, 3)[offset : offset + local.shape[0]])
        dcp.save({"st": saved}, storage_writer=DistckptWriter(directory / "st"))
        got = st.empty(spec, 7, 3)
        dcp.load({"st": got}, storage_reader=DistckptReader(directory / "st"))
        assert torch.equal(got.local_shards()[0].tensor, local), got.local_shards()[0].tensor
        # Several shards on one rank (5 over 3 ranks): regrouped into one box per rank,
        # then loaded into one shard per rank, and whole by distckpt.load.
        full = torch.arange(60.0).reshape(10, 6)
        five = ChunkShardingSpec(dim=0, placements=[f"rank:{r % 3}/cpu" for r in range(5)])
        several = st.empty(five, 10, 6)
        for shard in several.local_shards():
            start, rows = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
            shard.tensor.copy_(full[start : start + rows])
        assert rank > 1 or len(several.local_shards()) == 2
        dcp.save({"several": several}, storage_writer=DistckptWriter(directory / "several"))
        back = st.empty(spec, 10, 6)
        dcp.load({"several": back}, storage_reader=DistckptReader(directory / "several"))
    (shard,) = back.local_shards()
    start, rows = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
    assert torch.equal(shard.tensor, full[start : start + rows]), shard.tensor
    whole = {"several": torch.zeros(10, 6)}
    distckpt.load(whole, directory / "several", SingleComm())
    assert torch.equal(whole["several"], full)


def differing(directory: Path, rank: int) -> None:
    try:
        dcp.save({"rank": rank}, storage_writer=DistckptWriter(directory / "differ"))
    except BaseException as exc:  # DCP raises a CheckpointException (a BaseException)
        text = " ".join(map(str, getattr(exc, "failures", {0: exc}).values()))
        assert "differs between rank 0 (0) and rank 1 (1)" in text, text
    else:
        raise AssertionError("values that differ between ranks were saved")


def main() -> None:
    directory = Path(sys.argv[1])
    rank, world = start_job()
    assert world == 3, world
    for case in (
        groups,
        no_dist,
        no_collectives,
        async_thread,
        async_process,
        sharded_tensor,
        differing,
    ):
        case(directory, rank)
        say(f"CASE {case.__name__} {rank}")
    finish_job(rank)


if __name__ == "__main__":
    main()
