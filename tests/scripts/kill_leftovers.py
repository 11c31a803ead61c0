"""A save of ``DIR/ckpt`` that one rank's SIGKILL ends at a chosen point, under torchrun
with 3 ranks (``kill_leftovers.py POINT DIR``); the test then saves into ``DIR`` again and
checks that nothing of this save is left.

Every point is reached by a hook on the save's own code path, and the ranks wait on
marker files in ``DIR/markers``, never on a clock:

* ``coordinator-writing``: rank 0 SIGKILLs itself as it creates its first shard (its
  staging directory holds its owner file, naming a process that is gone); torchrun's
  SIGTERM ends the others.
* ``writer-late``: rank 1 SIGKILLs itself as it creates its first shard; rank 0 gives up
  (the dead rank's connection closed) and removes its staging directory; rank 2, held before it
  prepares its directories until rank 0 has done so, then writes its shards there: a
  writer of a dead save that came late.
* ``coordinator-aborting``: rank 1 SIGKILLs itself as it creates its first shard; rank 0,
  removing its staging directory after the time-out, is SIGKILLed half way (it has
  removed the owner file), as torchrun's teardown may do.
* ``coordinator-committing``: rank 0 SIGKILLs itself in the commit, as it renames the
  complete staging directory (index written, owner file gone) into place; torchrun's
  SIGTERM ends the others. The next save follows at once, as a job restarted at once
  would.

The survivors note torchrun's SIGTERM and carry on (``SIGNAL <rank> SIGTERM``), so that
what is seen is how the save itself ends; a survivor whose save fails prints ``SURVIVOR
<rank> <type>`` and exits 3. The killed rank prints ``KILLING <rank>`` first.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rank import say

import distckpt
from distckpt.comm import auto
from distckpt.commit import staging as staging_mod
from distckpt.storage.posix import PosixStore

POINTS = ("coordinator-writing", "writer-late", "coordinator-aborting", "coordinator-committing")
ROWS = 8  # rows of w per rank
KW: dict[str, Any] = {"small_bytes": 256, "inner_bytes": 128}
WAIT_SECONDS = 60  # a marker that never comes: the job ends, the test reports it


def full_w(version: int, world: int) -> torch.Tensor:
    """Version ``version`` of the whole w: distinct bits in every element."""
    return torch.arange(ROWS * world * 16, dtype=torch.float32).reshape(-1, 16) * (version + 1) / 3


def state(rank: int, world: int, version: int) -> dict[str, Any]:
    w = full_w(version, world)[ROWS * rank : ROWS * (rank + 1)].clone()
    return {"w": distckpt.Shard(w, (ROWS * world, 16), (ROWS * rank, 0)), "step": version}


def _staging(path: str) -> bool:
    return ".ckpt.staging-" in path or ".ckpt.trash-" in path


def _shard(path: str) -> bool:
    return _staging(path) and "/w/" in path and not path.endswith("zarr.json")


def _wait_for(marker: Path) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def _die(rank: int) -> None:
    say(f"KILLING {rank}")
    os.kill(os.getpid(), signal.SIGKILL)


def _hook(cls: Any, name: str, before: Callable[[Any, str], None]) -> None:
    """Run ``before(store, key)`` ahead of ``cls.name(store, key, ...)``."""
    real = getattr(cls, name)

    def hooked(store: Any, key: Any = "", *args: Any, **kwargs: Any) -> Any:
        before(store, key)
        return real(store, key, *args, **kwargs)

    setattr(cls, name, hooked)


def arm(point: str, rank: int, markers: Path) -> None:
    """Install this rank's hooks for ``point``."""

    def kill_at_first_shard(store: PosixStore, key: str) -> None:
        if _shard(store.where(key)):
            _die(rank)

    def kill_at_rename(store: PosixStore, key: str) -> None:
        if ".ckpt.staging-" in key:
            _die(rank)

    if point == "coordinator-committing":
        if rank == 0:
            _hook(PosixStore, "rename", kill_at_rename)
            _hook(PosixStore, "exchange", kill_at_rename)
        return  # torchrun's SIGTERM ends the others
    killed = 0 if point == "coordinator-writing" else 1
    if rank == killed:
        _hook(PosixStore, "create", kill_at_first_shard)
        return
    if point == "coordinator-writing":
        return  # torchrun's SIGTERM ends the others
    signal.signal(signal.SIGTERM, lambda signum, _: say(f"SIGNAL {rank} SIGTERM"))
    if rank == 0:
        real_abort = staging_mod.Staging.abort

        def abort(self: staging_mod.Staging) -> None:
            real_abort(self)
            (markers / "aborted").write_text("")

        staging_mod.Staging.abort = abort  # type: ignore[method-assign]
    if rank == 0 and point == "coordinator-aborting":

        def half_removed(store: PosixStore, key: str) -> None:
            where = Path(store.where(key))
            if _staging(str(where)):
                (where / staging_mod.OWNER_FILE).unlink(missing_ok=True)
                _die(rank)

        _hook(PosixStore, "delete_tree", half_removed)
    if rank == 2 and point == "writer-late":

        def late(store: PosixStore, keys: Any) -> None:
            if _staging(store.url):
                _wait_for(markers / "aborted")

        _hook(PosixStore, "prepare", late)


def main() -> int:
    point, directory = sys.argv[1], Path(sys.argv[2])
    assert point in POINTS, point
    comm = auto()
    rank, world = comm.rank, comm.size
    markers = directory / "markers"
    markers.mkdir(parents=True, exist_ok=True)
    comm.barrier()
    arm(point, rank, markers)
    try:
        distckpt.save(state(rank, world, 1), directory / "ckpt", comm, overwrite=True, **KW)
    except BaseException as exc:  # noqa: BLE001
        say(f"SURVIVOR {rank} {type(exc).__name__}")
        os._exit(3)  # as a job that lost a rank would end
    say(f"COMMITTED {rank}")  # a bug: a rank died
    return 4


if __name__ == "__main__":
    sys.exit(main())
