"""Failure handling of save and load on several ranks (under mpiexec or torchrun).

Usage: failures.py MODE DIR [--golden PATH] [--overwrite] [--exit]

``errors``: many cases in one launch, in the same order on every rank. Before them a
good checkpoint ``DIR/prev`` (version 1) is saved. Then:

* validation errors (inconsistent global shapes, dtypes, partially overlapping boxes, a
  gap, a replicated tensor or a value that differs between ranks, a name that is a tensor
  on one rank and a value on another, two problems at once), a value one rank cannot
  store, an unsupported dtype on one rank, and a save onto ``prev`` without overwrite:
  every rank must raise the same error, no rank may write a byte, no staging directory
  may be created;
* errors in the write phase on one rank (a custom exception, ENOSPC from ``os.pwritev``,
  on rank 1, on the last rank, on the coordinator), replacing ``prev`` or writing a new
  checkpoint: every rank raises it with ``.rank`` the failing rank, ``prev`` still holds
  version 1, nothing else is left behind;
* load errors on every rank or on one rank only (missing names, a wrong shape, a
  corrupted piece that only one rank reads): every rank raises the same error type;
* with ``--golden``, the 2-rank golden checkpoint restored on this world size.

Each case prints ``CASE {json}`` per rank (case, rank, type, err_rank, msg), every failed
check prints ``FAIL <case> <rank>: <why>``, and a rank whose checks all passed ends with
``OK <rank>``.

``kill``: saves ``DIR/prev`` (version 1) and ``DIR/other`` (version 2), then saves
version 3 to ``DIR/target`` (or over ``DIR/prev`` with ``--overwrite``) while the last
rank SIGKILLs itself in its first shard write (``KILLING <rank> <file>``; with ``--exit``
it ends with ``os._exit(9)`` instead: no clean-up, no MPI_Finalize, but no signal
either, since MPICH's hydra SIGKILLs every rank once it reaps one that a signal killed,
even under ``-disable-auto-cleanup``), once every other rank has written, synced and
closed its own shard (each prints ``WROTE <rank> <file>`` and leaves
``DIR/markers/wrote-<rank>`` then). A survivor whose save fails prints ``SURVIVOR <rank>
<type> <seconds>`` and leaves the line in ``DIR/markers/survivor-<rank>`` too (a
launcher may lose output when it ends a job), waits for the other survivors to do the
same (the first process to exit makes a launcher end the job), and exits 3. Survivors
note the launcher's SIGTERM (torchrun's teardown) and SIGUSR1 (hydra's notice of a dead
rank under ``mpiexec -disable-auto-cleanup``) with ``SIGNAL <rank> <name>`` and carry on,
so that what is seen is how the save itself gives up. A save that returns prints
``COMMITTED <rank>`` (a bug).
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rank import Runner, say

import distckpt
from distckpt.comm import Communicator, auto
from distckpt.commit import staging as staging_mod
from distckpt.commit.staging import leftovers
from distckpt.errors import (
    CheckpointExists,
    CorruptCheckpointError,
    MissingVariablesError,
    ShapeMismatchError,
    UnsupportedValueError,
    ValidationError,
)
from distckpt.storage.posix import PosixStore, PosixWriter

# w: 4 inner chunks of 2 rows per shard
KW: dict[str, Any] = {"small_bytes": 256, "inner_bytes": 128}
# Check every replicated tensor at every save: the cases reuse one another's plans, and a
# reused plan checks a rotating share of them by default.
os.environ["DISTCKPT_REPLICA_CHECK"] = "1"
ROWS = 8  # rows of w per rank


class DiskOnFire(Exception):
    """An error raised on purpose in the write phase of one rank."""


# --------------------------------------------------------------------------- states


def full_w(version: int, world: int) -> torch.Tensor:
    return (
        torch.arange(ROWS * world * 16, dtype=torch.float32).reshape(ROWS * world, 16)
        * (version + 1)
        / 3
    )


def full_b(version: int) -> torch.Tensor:
    return torch.linspace(-1, 1, 20) * version


def rng(rank: int, version: int) -> torch.Tensor:
    return torch.arange(4) + 100 * rank + version


def good_state(rank: int, world: int, version: int) -> dict[str, Any]:
    """Rank ``rank``'s part of checkpoint ``version``: a row-partitioned w (a regular
    sharded array), a replicated b, a per-rank tensor and a value."""
    w = full_w(version, world)[ROWS * rank : ROWS * (rank + 1)].clone()
    return {
        "w": distckpt.Shard(w, (ROWS * world, 16), (ROWS * rank, 0)),
        "b": full_b(version),
        "rng": distckpt.PerRank(rng(rank, version)),
        "step": version,
    }


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def verify(comm: Communicator, path: Path, version: int) -> list[str]:
    """Load ``path`` on every rank (w whole) and compare with ``version``; problems found."""
    rank, world = comm.rank, comm.size
    state: dict[str, Any] = {
        "w": torch.zeros(ROWS * world, 16),
        "b": torch.zeros(20),
        "rng": distckpt.PerRank(None),
        "step": None,
    }
    distckpt.load(state, path, comm)
    problems = []
    if bits(state["w"]) != bits(full_w(version, world)):
        problems.append(f"{path}: w is not version {version}")
    if bits(state["b"]) != bits(full_b(version)):
        problems.append(f"{path}: b is not version {version}")
    if bits(state["rng"].value) != bits(rng(rank, version)):
        problems.append(f"{path}: rng is not rank {rank}'s of version {version}")
    if state["step"] != version:
        problems.append(f"{path}: step {state['step']!r} != {version}")
    return problems


# --------------------------------------------------------------------------- spies


class Spy:
    """Counts every file write and staging directory creation of this rank."""

    def __init__(self) -> None:
        self.writes: list[str] = []
        self.stagings = 0
        real_create, real_write = PosixStore.create, PosixStore.write
        real_staging = staging_mod.Staging
        spy = self

        def create(store: PosixStore, key: str, size_hint: int | None = None) -> Any:
            spy.writes.append(store.where(key))
            return real_create(store, key, size_hint)

        def write(store: PosixStore, key: str, data: Any) -> None:
            spy.writes.append(store.where(key))
            real_write(store, key, data)

        class CountingStaging(real_staging):  # type: ignore[misc,valid-type]
            def __init__(self, *a: Any, **kw: Any) -> None:
                spy.stagings += 1
                super().__init__(*a, **kw)

        PosixStore.create = create  # type: ignore[method-assign]
        PosixStore.write = write  # type: ignore[method-assign]
        staging_mod.Staging = CountingStaging  # type: ignore[misc]

    def reset(self) -> None:
        self.writes.clear()
        self.stagings = 0


class Patch:
    """Temporarily replace ``obj.name`` on this rank."""

    def __init__(self, obj: Any, name: str, value: Any, active: bool = True) -> None:
        self.obj, self.name, self.value, self.active = obj, name, value, active

    def __enter__(self) -> None:
        if self.active:
            self.saved = getattr(self.obj, self.name)
            setattr(self.obj, self.name, self.value)

    def __exit__(self, *exc: Any) -> None:
        if self.active:
            setattr(self.obj, self.name, self.saved)


def raise_on_fire(*_a: Any, **_kw: Any) -> Any:
    raise DiskOnFire("this rank's disk is on fire")


def raise_enospc(*_a: Any, **_kw: Any) -> Any:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# --------------------------------------------------------------------------- errors mode


def errors_mode(comm: Communicator, directory: Path, golden: Path | None) -> int:
    rank, world = comm.rank, comm.size
    last = world - 1
    run = Runner(comm)
    prev, bad, fresh = directory / "prev", directory / "bad", directory / "fresh"

    run.case(
        "save-prev",
        lambda: distckpt.save(good_state(rank, world, 1), prev, comm, **KW),
        None,
        after=lambda: verify(comm, prev, 1),
    )
    spy = Spy()

    def nothing_written(path: Path) -> Callable[[], list[str]]:
        def after() -> list[str]:
            problems = []
            if spy.writes:
                problems.append(f"wrote {spy.writes}")
            if spy.stagings:
                problems.append(f"created {spy.stagings} staging directories")
            if path.exists():
                problems.append(f"{path} exists")
            if leftovers(directory):
                problems.append(f"leftovers {leftovers(directory)}")
            spy.reset()
            return problems

        return after

    def saving(
        edit: Callable[[dict[str, Any]], None], path: Path = bad, **kw: Any
    ) -> Callable[[], Any]:
        def fn() -> Any:
            state = good_state(rank, world, 5)
            edit(state)
            return distckpt.save(state, path, comm, **{**KW, **kw})

        return fn

    gw = ROWS * world
    full5 = full_w(5, world)

    def shape(s: dict[str, Any]) -> None:
        if rank == last:
            s["w"] = distckpt.Shard(s["w"].tensor, (gw, 17), (ROWS * rank, 0))

    def dtype(s: dict[str, Any]) -> None:
        if rank == last:
            s["w"] = distckpt.Shard(s["w"].tensor.double(), (gw, 16), (ROWS * rank, 0))

    def overlap(s: dict[str, Any]) -> None:
        if rank == 0:
            s["w"] = distckpt.Shard(full5[: ROWS + 1].clone(), (gw, 16), (0, 0))

    def gap(s: dict[str, Any]) -> None:
        if rank == 0:
            s["w"] = distckpt.Shard(full5[: ROWS - 1].clone(), (gw, 16), (0, 0))

    def replica(s: dict[str, Any]) -> None:
        if rank == last:
            s["b"] = s["b"] + 1

    def value(s: dict[str, Any]) -> None:
        if rank == 1:
            s["step"] = 6

    def kind(s: dict[str, Any]) -> None:
        if rank == 1:
            s["step"] = torch.zeros(1)

    def two(s: dict[str, Any]) -> None:
        shape(s)
        value(s)

    def unsupported(s: dict[str, Any]) -> None:
        s["cfg"] = {1, 2} if rank == 1 else [1, 2]

    def bad_dtype(s: dict[str, Any]) -> None:
        s["u"] = torch.zeros(2, dtype=torch.uint16 if rank == last else torch.int16)

    validation = [
        (
            "shape",
            shape,
            ("'w'", f"global shape [{gw}, 16] on rank 0", f"[{gw}, 17] on rank {last}"),
        ),
        ("dtype", dtype, ("'w'", "dtype float32 on rank 0", f"float64 on rank {last}")),
        (
            "overlap",
            overlap,
            (
                "'w'",
                f"[0:{ROWS + 1}, 0:16] (rank 0)",
                f"[{ROWS}:{2 * ROWS}, 0:16] (rank 1)",
                "overlap partially",
            ),
        ),
        (
            "gap",
            gap,
            ("'w'", f"cover {(gw - 1) * 16} of the {gw * 16} elements", f"global shape [{gw}, 16]"),
        ),
        ("replica", replica, ("'b'", "replicated", f"differs between rank 0 and rank {last}")),
        (
            "value",
            value,
            ("'step'", "the value differs between rank 0 (5) and rank 1 (6)", "PerRank"),
        ),
        ("kind", kind, ("'step' is a value on rank 0 but a tensor on rank 1",)),
        ("two", two, ("'w'", "'step'", f"on rank {last}", "rank 1 (6)")),
    ]
    for name, edit, words in validation:
        run.case(name, saving(edit), ValidationError, 0, words, after=nothing_written(bad))
    run.case(
        "unsupported",
        saving(unsupported),
        UnsupportedValueError,
        1,
        ("'cfg'", "builtins.set"),
        after=nothing_written(bad),
    )
    run.case(
        "unsupported-dtype",
        saving(bad_dtype),
        UnsupportedValueError,
        last,
        ("'u'", "uint16"),
        after=nothing_written(bad),
    )
    run.case(
        "exists",
        saving(lambda s: None, prev),
        CheckpointExists,
        0,
        (str(prev), "overwrite=True"),
        after=nothing_written(bad),
    )

    # ---- errors in the write phase
    def clean_and_prev_intact() -> list[str]:
        problems = [] if not leftovers(directory) else [f"leftovers {leftovers(directory)}"]
        if fresh.exists():
            problems.append(f"{fresh} exists")
        return problems + verify(comm, prev, 1)

    def enospc(err: BaseException | None) -> list[str]:
        return (
            []
            if getattr(err, "errno", None) == errno.ENOSPC
            else [f"errno of {err!r} is not ENOSPC"]
        )

    def failing_write(
        who: int, obj: Any, name: str, value: Any, path: Path, overwrite: bool
    ) -> Callable[[], Any]:
        def fn() -> Any:
            with Patch(obj, name, value, active=rank == who):
                return distckpt.save(
                    good_state(rank, world, 7), path, comm, overwrite=overwrite, **KW
                )

        return fn

    run.case(
        "write-raise-rank1",
        failing_write(1, PosixStore, "create", raise_on_fire, prev, True),
        DiskOnFire,
        1,
        ("on fire",),
        after=clean_and_prev_intact,
    )
    run.case(
        "write-enospc-last",
        failing_write(last, os, "pwritev", raise_enospc, prev, True),
        OSError,
        last,
        ("No space left",),
        check=enospc,
        after=clean_and_prev_intact,
    )
    run.case(
        "write-raise-rank0",
        failing_write(0, PosixStore, "create", raise_on_fire, prev, True),
        DiskOnFire,
        0,
        ("on fire",),
        after=clean_and_prev_intact,
    )
    run.case(
        "write-fresh-rank1",
        failing_write(1, PosixStore, "create", raise_on_fire, fresh, False),
        DiskOnFire,
        1,
        ("on fire",),
        after=clean_and_prev_intact,
    )

    # ---- errors in load
    def loading(edit: Callable[[dict[str, Any]], None], path: Path = prev) -> Callable[[], Any]:
        def fn() -> Any:
            state = good_state(rank, world, 0)
            edit(state)
            return distckpt.load(state, path, comm)

        return fn

    def names(
        missing: list[str], unexpected: list[str]
    ) -> Callable[[BaseException | None], list[str]]:
        def check(err: BaseException | None) -> list[str]:
            if (
                getattr(err, "missing", None) != missing
                or getattr(err, "unexpected", None) != unexpected
            ):
                return [f"missing/unexpected of {err!r} are not {missing}/{unexpected}"]
            return []

        return check

    def extra_everywhere(s: dict[str, Any]) -> None:
        s["extra"] = torch.zeros(1)

    def extra_on_last(s: dict[str, Any]) -> None:
        if rank == last:
            s["extra"] = torch.zeros(1)
            del s["step"]

    def wrong_shape_on_1(s: dict[str, Any]) -> None:
        if rank == 1:
            s["b"] = torch.zeros(21)

    run.case(
        "load-missing-all",
        loading(extra_everywhere),
        MissingVariablesError,
        0,
        ("missing from the checkpoint: extra",),
        check=names(["extra"], []),
    )
    run.case(
        "load-missing-one",
        loading(extra_on_last),
        MissingVariablesError,
        last,
        ("missing from the checkpoint: extra",),  # step: other ranks restore it
        check=names(["extra"], []),
    )
    run.case(
        "load-shape-one",
        loading(wrong_shape_on_1),
        ShapeMismatchError,
        1,
        ("'b'", "shape in the state [21]", "checkpoint: [20]"),
    )

    corrupt = directory / "corrupt"
    if rank == 0:
        shutil.copytree(prev, corrupt)
        data = bytearray((corrupt / "w" / f"c.{last}.0").read_bytes())
        meta = json.loads((corrupt / "w" / "zarr.json").read_text())
        block = meta["chunk_grid"]["configuration"]["chunk_shape"]
        inner = meta["codecs"][0]["configuration"]["chunk_shape"]
        table = 4 * math.prod(b // i for b, i in zip(block, inner))  # checksum table first
        data[table + 10] ^= 0xFF  # inside the first inner chunk of the last rank's shard
        (corrupt / "w" / f"c.{last}.0").write_bytes(bytes(data))
    comm.barrier()
    mine = torch.full((ROWS, 16), -1.0)

    def load_own_rows() -> Any:
        return distckpt.load(
            {"w": distckpt.Shard(mine, (gw, 16), (ROWS * rank, 0))}, corrupt, comm, strict=False
        )

    def own_rows_read(err: BaseException | None) -> list[str]:
        if rank != last and bits(mine) != bits(full_w(1, world)[ROWS * rank : ROWS * (rank + 1)]):
            return ["the undamaged rows of this rank were not restored"]
        return []

    run.case(
        "load-corrupt-one",
        load_own_rows,
        CorruptCheckpointError,
        last,
        ("variable 'w'", str(corrupt / "w" / f"c.{last}.0"), "inner chunk (0, 0)"),
        check=own_rows_read,
    )

    if golden is not None:
        run.case("golden", lambda: check_golden(comm, golden), None)

    run.case("final", lambda: None, None, after=lambda: verify(comm, prev, 1))
    return run.finish()


def check_golden(comm: Communicator, golden: Path) -> None:
    """Restore the 2-rank golden checkpoint on this world size (resharded), compare."""
    from tests.support import make_golden as g

    rank, world = comm.rank, comm.size

    def chunk(n: int) -> tuple[int, int]:
        return g.rows(rank, n, world)

    w0, wn = chunk(5)
    e0, en = chunk(8)
    f0, fn = chunk(6)
    state = g.target(
        distckpt.Shard(torch.zeros(wn, 8), (5, 8), (w0, 0)),
        distckpt.Shard(torch.zeros(6, en, dtype=torch.bfloat16), (6, 8), (0, e0)),
        distckpt.Shard(torch.zeros(fn, 4, dtype=torch.int32), (6, 4), (f0, 0)),
    )
    distckpt.load(state, golden, comm)
    got_want = [
        (state["model"]["l1.weight"].tensor, g.weight()[w0 : w0 + wn]),
        (state["model"]["emb"].tensor, g.emb()[:, e0 : e0 + en]),
        (state["opt"]["flat"].tensor, g.flat()[f0 : f0 + fn]),
        (state["bias"], g.small()),
        (state["__scalar"], g.scalar()),
        (state["odd"]["a/b"], g.slashed()),
        (state["rng"].value, g.rng(rank % 2)),
    ]
    for i, (got, want) in enumerate(got_want):
        g.assert_same_bits(got, want.contiguous(), f"golden item {i}")
    g.assert_same_value(state["loader"].value, g.loader(rank % 2), "loader")
    g.assert_same_value(state["step"], g.values()["step"], "step")
    g.assert_same_value(state["cfg"], g.values()["cfg"], "cfg")


# --------------------------------------------------------------------------- kill mode


def _shard(path: str) -> bool:
    """Whether ``path`` is a shard of the big tensor (not its ``zarr.json``)."""
    return "/w/" in path and not path.endswith("/zarr.json")


def kill_mode(comm: Communicator, directory: Path, overwrite: bool, exit_: bool) -> int:
    rank, world = comm.rank, comm.size
    last = world - 1
    distckpt.save(good_state(rank, world, 1), directory / "prev", comm, **KW)
    distckpt.save(good_state(rank, world, 2), directory / "other", comm, **KW)
    markers = directory / "markers"
    markers.mkdir(exist_ok=True)
    comm.barrier()
    real, real_finish = PosixStore.create, PosixWriter.finish

    def wrote(writer: PosixWriter, durable: bool = True) -> None:
        real_finish(writer, durable)
        path = str(writer.path)
        if _shard(path):  # only the shards of the big tensor count
            # The shard is whole (written, synced, closed): the last rank may die now. The
            # line goes out first: once the marker exists the job may be ended any time.
            say(f"WROTE {rank} {path}")
            (markers / f"wrote-{rank}").write_text(path)

    def killer(store: PosixStore, key: str, size_hint: int | None = None) -> Any:
        path = store.where(key)
        if not _shard(path):
            return real(store, key, size_hint)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all((markers / f"wrote-{r}").exists() for r in range(last)):
                break
            time.sleep(0.02)
        (markers / f"killing-{rank}").write_text(path)
        say(f"KILLING {rank} {path}")
        if exit_:
            os._exit(9)
        os.kill(os.getpid(), signal.SIGKILL)

    def noted(signum: int, _frame: Any) -> None:
        say(f"SIGNAL {rank} {signal.Signals(signum).name}")

    if rank == last:
        PosixStore.create = killer  # type: ignore[method-assign]
    else:
        PosixWriter.finish = wrote  # type: ignore[method-assign]
        signal.signal(signal.SIGTERM, noted)
        signal.signal(signal.SIGUSR1, noted)
    target = directory / "prev" if overwrite else directory / "target"
    start = time.monotonic()
    try:
        distckpt.save(good_state(rank, world, 3), target, comm, overwrite=overwrite, **KW)
    except BaseException as exc:  # noqa: BLE001
        line = f"SURVIVOR {rank} {type(exc).__name__} {time.monotonic() - start:.1f}"
        say(line)
        (markers / f"survivor-{rank}").write_text(line)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all((markers / f"survivor-{r}").exists() for r in range(last)):
                break
            time.sleep(0.02)
        os._exit(3)  # as a job that lost a rank would end, without MPI_Finalize
    say(f"COMMITTED {rank}")
    return 4


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["errors", "kill"])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--golden", type=Path)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--exit", action="store_true")
    args = parser.parse_args()
    comm = auto()
    assert comm.size >= 2, "run under a launcher with at least 2 ranks"
    np.seterr(all="ignore")
    if args.mode == "errors":
        return errors_mode(comm, args.dir, args.golden)
    return kill_mode(comm, args.dir, args.overwrite, args.exit)


if __name__ == "__main__":
    sys.exit(main())
