"""Every thread distckpt starts is gone before the interpreter finalizes (torchrun, gloo).

Usage: clean_exit.py DIR

Saves (blocking, then in the background) and loads under ``torchrun``, on the program's
own gloo world group, which it never destroys (as Accelerate leaves it). An exit handler
registered before distckpt is imported runs after distckpt's own: the process must have
no more threads then than it had before its first distckpt call, and distckpt's
collectives must not have run on the program's group. A gloo group still alive while the
interpreter finalizes can abort the process ("terminate called without an active
exception") after its work is done; this checks the cause, which a run shows only by
chance. Prints ``CLEAN <rank>`` on success.
"""

from __future__ import annotations

import atexit
import os
import sys

_before: list[int] = []


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _check() -> None:
    left = _threads() - _before[0] if _before else 0
    rank = os.environ.get("RANK", "?")
    if left > 0:
        print(f"LEFT {left} thread(s) on rank {rank}", flush=True)
        os._exit(5)
    print(f"CLEAN {rank}", flush=True)


atexit.register(_check)  # first registered: runs last

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
_before.append(_threads())

import distckpt  # noqa: E402
from distckpt.comm import TorchComm  # noqa: E402

where = os.path.join(sys.argv[1], "ckpt")
rank = dist.get_rank()
comm = TorchComm()  # no time-out asked for: the world group's, on a side group of its own
assert comm._pg is not dist.group.WORLD
comm.barrier()
state = {"w": distckpt.PerRank(torch.arange(8.0) + rank), "step": 3}
distckpt.save(state, where)
pending = distckpt.save({**state, "step": 4}, where + "-bg", async_save=True)
pending.wait()
back = {"w": distckpt.PerRank(torch.zeros(8)), "step": None}
distckpt.load(back, where)
assert torch.equal(back["w"].value, torch.arange(8.0) + rank) and back["step"] == 3, back
