"""A save whose object store stops answering, on every rank (run by
tests/storage/test_s3_deadlines.py under torchrun).

Usage::

    s3_silent.py RUN      # AWS_ENDPOINT_URL: the test's proxy; MOTO_PID: the server

Saves RUN/ckpt-1 (each rank its rows, then the ``latest`` pointer); then RUN/ckpt-2,
during which the test stops the server (SIGSTOP) as the first data object of the save
reaches it: every rank must raise. Rank 0 then continues the server (SIGCONT); each rank
waits until the service answers it again, checks that ckpt-1 and the pointer are as they
were, and saves RUN/ckpt-3. Prints ``CASE {json}`` for the failed save (the error's type
and message, and how long it took), ``FAIL <case> <rank>: <why>`` for a failed check,
and ``OK <rank>`` at the end.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from rank import Runner, record

import distckpt
from distckpt.comm import auto
from distckpt.storage import s3
from distckpt.training.pointer import advance_pointer

ROWS, COLS = 512, 256  # 512 KiB of float32: each rank writes its half


def rows(step: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(step))


def main(run: str) -> int:
    dist.init_process_group("gloo")
    comm = auto()
    rank, half = comm.rank, ROWS // comm.size
    runner = Runner(comm)

    def save(step: int) -> None:
        path = f"{run}/ckpt-{step}"
        local = rows(step)[rank * half : (rank + 1) * half].clone()
        state = {"w": distckpt.Shard(local, (ROWS, COLS), (rank * half, 0)), "step": step}

        def after_commit() -> None:
            advance_pointer(path)

        distckpt.save(state, path, comm, after_commit=after_commit)

    save(1)
    comm.barrier()
    t0 = time.monotonic()
    error: BaseException | None = None
    try:
        save(2)
    except Exception as exc:  # noqa: BLE001 - reported
        error = exc
    took = time.monotonic() - t0
    record("silent-save", rank, type=type(error).__name__, message=str(error), took=took)

    comm.barrier()  # every rank has failed: the server may answer again
    if rank == 0:
        os.kill(int(os.environ["MOTO_PID"]), signal.SIGCONT)
    runner.check("answering", s3.answering(60), "the service did not answer again")
    runner.check("pointer", distckpt.latest_checkpoint(run) == f"{run}/ckpt-1", "the pointer moved")
    got: dict[str, Any] = {"w": torch.zeros(ROWS, COLS), "step": None}
    distckpt.load(got, f"{run}/ckpt-1", comm)
    runner.check("ckpt-1", torch.equal(got["w"], rows(1)) and got["step"] == 1, "ckpt-1 changed")
    comm.barrier()
    save(3)
    latest = distckpt.latest_checkpoint(run)
    runner.check("ckpt-3", latest == f"{run}/ckpt-3", f"latest is {latest}")
    comm.barrier()
    status = runner.finish()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
