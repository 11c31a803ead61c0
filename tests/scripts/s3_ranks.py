"""distckpt on an S3-compatible object store, with real processes (run by tests/storage/test_s3.py).

The store is the one ``AWS_ENDPOINT_URL`` names (the tests' moto server on 127.0.0.1).

Usage::

    s3_ranks.py save URL                # any world size N: saves URL/n{N}
    s3_ranks.py restore URL N           # world size M: restores URL/n{N}, resharded
    s3_ranks.py manager DIR LOCKED      # a CheckpointManager on DIR; LOCKED is held elsewhere
    s3_ranks.py kill URL MARKERS        # the last rank SIGKILLs itself mid-upload
    s3_ranks.py race URL WHO ROUNDS MARKERS   # one process: races another for URL/race-R

Every value is a pure function of the variable name (and of the rank, for PerRank
state): every rank generates the *global* tensor with a seeded generator and slices its
own box, so any process can compute what any box must hold.

Each case prints ``CASE {json}`` per rank; a failed check prints ``FAIL <case> <rank>:
<why>``; a rank whose checks all passed ends with ``OK <rank>``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch
from rank import Runner, communicator, say

import distckpt
from distckpt.training.lock import DirectoryLockedError

#: Compressed variables: the optimizer's.
COMPRESSION = {"opt/*": "zstd"}
ROWS, COLS = (64, 1280), (6, 10)  # rows: 320 KiB of float32 (regular); cols: int32
OPT = (128, 640)  # opt/m, opt/v: 320 KiB each (above small_bytes), several inner chunks
INNER_BYTES = 16 * 1024
VALUES: dict[str, Any] = {"step": 42, "cfg": {"lr": 0.125, "name": "run", "betas": [0.9, 0.95]}}


# --------------------------------------------------------------------------- values


def seed_of(*key: object) -> int:
    return zlib.crc32(repr(key).encode())


def generate(key: object, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The global tensor for ``key`` (seeded; finite, so ``torch.equal`` is bitwise)."""
    g = torch.Generator().manual_seed(seed_of(key))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    return torch.randint(-(2**30), 2**30, shape, generator=g, dtype=torch.int64).to(dtype)


GLOBAL: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "model/rows": (ROWS, torch.float32),  # row-sharded: a regular zarr array
    "model/cols": (COLS, torch.int32),  # column-sharded, irregular widths
    "model/rep": ((4, 6), torch.bfloat16),  # replicated
    "small": ((3,), torch.float64),
    "opt/m": (OPT, torch.float32),  # compressed, row-sharded
    "opt/v": (OPT, torch.float32),  # compressed, column-sharded
}


def full(name: str) -> torch.Tensor:
    shape, dtype = GLOBAL[name]
    return generate(name, shape, dtype)


def per_rank_tensor(rank: int) -> torch.Tensor:
    return generate(("rng", rank), (rank + 2,), torch.int64)


def per_rank_value(rank: int) -> Any:
    return {"epoch": rank, "offset": [rank * 10, None], "name": f"rank{rank}"}


def even(total: int, world: int, rank: int) -> tuple[int, int]:
    """torch.chunk-style rows: ceil(total / world) each, the last ones short or empty."""
    size = -(-total // world)
    return min(total, size * rank), min(total, size * (rank + 1))


def weighted(total: int, world: int, rank: int) -> tuple[int, int]:
    """An irregular partition of ``total``: weights 1, 2, .., world."""
    denom = world * (world + 1) // 2
    return total * rank * (rank + 1) // 2 // denom, total * (rank + 1) * (rank + 2) // 2 // denom


def row_shard(name: str, lo: int, hi: int, target: bool = False) -> distckpt.Shard:
    t = full(name)
    local = torch.zeros_like(t[lo:hi]) if target else t[lo:hi].clone()
    return distckpt.Shard(local, tuple(t.shape), (lo,) + (0,) * (t.dim() - 1))


def col_shard(name: str, lo: int, hi: int, target: bool = False) -> distckpt.Shard:
    t = full(name)
    local = torch.zeros_like(t[:, lo:hi]) if target else t[:, lo:hi].clone()
    return distckpt.Shard(local.contiguous(), tuple(t.shape), (0, lo))


def save_state(rank: int, world: int) -> dict[str, Any]:
    return {
        "model": {
            "rows": row_shard("model/rows", *even(ROWS[0], world, rank)),
            "cols": col_shard("model/cols", *weighted(COLS[1], world, rank)),
            "rep": full("model/rep"),
        },
        "small": full("small"),
        "opt": {
            "m": row_shard("opt/m", *even(OPT[0], world, rank)),
            "v": col_shard("opt/v", *weighted(OPT[1], world, rank)),
        },
        "rng": distckpt.PerRank(per_rank_tensor(rank)),
        "loader": distckpt.PerRank(per_rank_value(rank)),
        **VALUES,
    }


# --------------------------------------------------------------------------- checks


def same(where: str, got: Any, want: torch.Tensor) -> list[str]:
    if not isinstance(got, torch.Tensor):
        return [f"{where}: got {type(got).__name__}, not a tensor"]
    if got.dtype != want.dtype or got.shape != want.shape:
        return [f"{where}: {got.dtype} {list(got.shape)}, expected {want.dtype} {list(want.shape)}"]
    if not torch.equal(got, want):
        return [f"{where}: values differ"]
    return []


# --------------------------------------------------------------------------- save / restore


def save_mode(url: str) -> int:
    comm = communicator()
    run = Runner(comm)
    path = f"{url}/n{comm.size}"

    def save() -> list[str]:
        result = distckpt.save(
            save_state(comm.rank, comm.size),
            path,
            comm,
            compression=COMPRESSION,
            inner_bytes=INNER_BYTES,
        )
        return [] if result.path == path else [f"SaveResult.path {result.path!r}"]

    run.case("save", save)
    return run.finish()


def restore_mode(url: str, n_saved: int) -> int:
    comm = communicator()
    rank, world = comm.rank, comm.size
    run = Runner(comm)
    path = f"{url}/n{n_saved}"
    source = rank % n_saved

    def catalog() -> list[str]:
        got = {v.name: (v.shape, v.dtype) for v in distckpt.list_variables(path)}
        want: dict[str, Any] = {
            n: (tuple(s), str(d).removeprefix("torch.")) for n, (s, d) in GLOBAL.items()
        }
        want.update({n: (None, "value") for n in VALUES})
        want.update({"rng": (None, "per_rank"), "loader": (None, "per_rank")})
        return [] if got == want else [f"list_variables: {got}, expected {want}"]

    run.case("catalog", catalog)

    def resharded() -> list[str]:
        # Other partitions than saved: the rows irregular, the columns even.
        rows = weighted(ROWS[0], world, rank)
        cols = even(COLS[1], world, rank)
        m_rows = weighted(OPT[0], world, rank)
        v_cols = even(OPT[1], world, rank)
        rng_target = torch.zeros_like(per_rank_tensor(source))
        state: dict[str, Any] = {
            "model": {
                "rows": row_shard("model/rows", *rows, target=True),
                "cols": col_shard("model/cols", *cols, target=True),
                "rep": torch.zeros(4, 6, dtype=torch.bfloat16),
            },
            "small": torch.zeros(3, dtype=torch.float64),
            "opt": {
                "m": row_shard("opt/m", *m_rows, target=True),
                "v": col_shard("opt/v", *v_cols, target=True),
            },
            "rng": distckpt.PerRank(rng_target),
            "loader": distckpt.PerRank(None),
            "step": None,
            "cfg": None,
        }
        result = distckpt.load(state, path, comm)
        problems = [] if not result.missing and not result.unexpected else [f"{result}"]
        model, opt = state["model"], state["opt"]
        problems += same("model/rows", model["rows"].tensor, full("model/rows")[slice(*rows)])
        problems += same("model/cols", model["cols"].tensor, full("model/cols")[:, slice(*cols)])
        problems += same("model/rep", model["rep"], full("model/rep"))
        problems += same("small", state["small"], full("small"))
        problems += same("opt/m", opt["m"].tensor, full("opt/m")[slice(*m_rows)])
        problems += same("opt/v", opt["v"].tensor, full("opt/v")[:, slice(*v_cols)])
        problems += same("rng", state["rng"].value, per_rank_tensor(source))
        if state["rng"].value is not rng_target:
            problems.append("rng: the PerRank tensor was replaced, not filled in place")
        if state["loader"].value != per_rank_value(source):
            problems.append(f"loader: {state['loader'].value!r}")
        for name, value in VALUES.items():
            if state[name] != value:
                problems.append(f"{name}: {state[name]!r}, expected {value!r}")
        return problems

    run.case("resharded", resharded)

    def whole() -> list[str]:
        # Every sharded variable whole on every rank (strict=False: a subset).
        state: dict[str, Any] = {
            "model": {"rows": torch.zeros(ROWS), "cols": torch.zeros(COLS, dtype=torch.int32)},
            "opt": {"m": torch.zeros(OPT), "v": torch.zeros(OPT)},
        }
        distckpt.load(state, path, comm, strict=False)
        return (
            same("model/rows whole", state["model"]["rows"], full("model/rows"))
            + same("model/cols whole", state["model"]["cols"], full("model/cols"))
            + same("opt/m whole", state["opt"]["m"], full("opt/m"))
            + same("opt/v whole", state["opt"]["v"], full("opt/v"))
        )

    run.case("whole", whole)
    return run.finish()


# --------------------------------------------------------------------------- manager


def manager_values(i: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """What save number ``i`` of the manager job holds: step, w, the module's state."""
    net = torch.nn.Linear(8, 4)
    g = torch.Generator().manual_seed(seed_of("net", i))
    params = {
        "weight": torch.randn(4, 8, generator=g),
        "bias": torch.randn(4, generator=g),
    }
    net.load_state_dict(params)
    return torch.tensor(i), generate(("w", i), (16, 5), torch.float32), params


def manager_checkpoint() -> tuple[distckpt.Checkpoint, torch.nn.Linear]:
    net = torch.nn.Linear(8, 4)
    with torch.no_grad():
        net.weight.zero_()
        net.bias.zero_()
    ckpt = distckpt.Checkpoint(step=torch.tensor(0), w=torch.zeros(16, 5), net=net)
    return ckpt, net


def manager_mode(directory: str, locked: str) -> int:
    comm = communicator()
    run = Runner(comm)
    ckpt, net = manager_checkpoint()

    def fill(i: int) -> None:
        step, w, params = manager_values(i)
        ckpt.step.copy_(step)
        ckpt.w.copy_(w)
        with torch.no_grad():
            net.weight.copy_(params["weight"])
            net.bias.copy_(params["bias"])

    def saves() -> list[str]:
        problems = []
        with distckpt.CheckpointManager(ckpt, directory, max_to_keep=2, comm=comm) as manager:
            if manager.restore_or_initialize() is not None:
                problems.append("a fresh directory restored something")
            for i in range(1, 5):
                fill(i)
                if i < 4:
                    path = manager.save()
                else:  # the last one in the background
                    handle = manager.save(async_save=True)
                    path = handle.path
                    fill(99)  # training goes on: the snapshot was taken
                    manager.sync()
                if path != f"{directory}/ckpt-{i}":
                    problems.append(f"save {i} returned {path!r}")
            names = [p.rsplit("/", 1)[-1] for p in manager.checkpoints]
            if names != ["ckpt-3", "ckpt-4"]:
                problems.append(f"manager.checkpoints {names}")
            if manager.latest_checkpoint != f"{directory}/ckpt-4":
                problems.append(f"manager.latest_checkpoint {manager.latest_checkpoint}")
        latest = distckpt.latest_checkpoint(directory)
        if latest != f"{directory}/ckpt-4":
            problems.append(f"latest_checkpoint {latest}")
        return problems

    run.case("manager-saves", saves)

    def restore_latest() -> list[str]:
        fresh, fresh_net = manager_checkpoint()
        with distckpt.CheckpointManager(fresh, directory, max_to_keep=2, comm=comm) as manager:
            path = manager.restore_or_initialize()
        step, w, params = manager_values(4)
        problems = [] if path == f"{directory}/ckpt-4" else [f"restored {path}"]
        problems += same("step", fresh.step, step) + same("w", fresh.w, w)
        problems += same("net.weight", fresh_net.weight.detach(), params["weight"])
        problems += same("net.bias", fresh_net.bias.detach(), params["bias"])
        if fresh.save_counter != 4:
            problems.append(f"save_counter {fresh.save_counter}")
        return problems

    run.case("manager-restore", restore_latest)

    def locked_out() -> list[str]:
        other, _ = manager_checkpoint()
        distckpt.CheckpointManager(other, locked, comm=comm)
        return ["a second manager of a locked directory was created"]

    run.case("manager-locked", locked_out, expect=DirectoryLockedError)
    return run.finish()


# --------------------------------------------------------------------------- kill

KILL_ROWS = 2048  # rows of kill/w per rank: 2048 x 1024 float32 = 8 MiB, a multipart upload
KILL_COLS = 1024


def kill_state(rank: int, world: int, version: int) -> dict[str, Any]:
    lo, hi = KILL_ROWS * rank, KILL_ROWS * (rank + 1)
    w = kill_w(version, world)[lo:hi].clone()
    return {
        "w": distckpt.Shard(w, (KILL_ROWS * world, KILL_COLS), (lo, 0)),
        "b": generate(("b", version), (20,), torch.float32),
        "rng": distckpt.PerRank(generate(("rng", version, rank), (4,), torch.int64)),
        "step": version,
    }


def kill_w(version: int, world: int) -> torch.Tensor:
    return generate(("w", version), (KILL_ROWS * world, KILL_COLS), torch.float32)


def kill_mode(url: str, markers: Path) -> int:
    """Save ``URL/prev`` (version 1), then ``URL/target`` (version 3) while the last rank
    SIGKILLs itself in the middle of its multipart upload of ``w`` (after one part went
    up), once every other rank has finished its own shard of ``w``."""
    from distckpt.storage.object_io import ObjectWriter

    comm = communicator()
    rank, world = comm.rank, comm.size
    last = world - 1
    distckpt.save(kill_state(rank, world, 1), f"{url}/prev", comm)
    markers.mkdir(parents=True, exist_ok=True)
    comm.barrier()
    real_write, real_finish = ObjectWriter.write, ObjectWriter.finish

    def key_of(writer: ObjectWriter) -> str:
        return writer._where.removeprefix(f"{url}/target/")

    def finish(self: ObjectWriter, durable: bool = True) -> None:
        real_finish(self, durable)
        key = key_of(self)
        if key.startswith("w/"):
            (markers / f"wrote-{rank}").write_text(key)
            say(f"WROTE {rank} {key}")

    def write(self: ObjectWriter, buffers: Any, offset: int) -> int:
        n = real_write(self, buffers, offset)
        if key_of(self).startswith("w/") and self._sent:  # a part is uploaded
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if all((markers / f"wrote-{r}").exists() for r in range(last)):
                    break
                time.sleep(0.02)
            say(f"KILLING {rank} {key_of(self)}")
            os.kill(os.getpid(), signal.SIGKILL)
        return n

    ObjectWriter.finish = finish  # type: ignore[method-assign]
    if rank == last:
        ObjectWriter.write = write  # type: ignore[method-assign]
    start = time.monotonic()
    try:
        distckpt.save(kill_state(rank, world, 3), f"{url}/target", comm, inner_bytes=1 << 20)
    except BaseException as exc:  # noqa: BLE001
        say(f"SURVIVOR {rank} {type(exc).__name__} {time.monotonic() - start:.1f}")
        os._exit(3)  # as a job that lost a rank would end
    say(f"COMMITTED {rank}")
    return 4


# --------------------------------------------------------------------------- race


def race_state(who: int, round_: int) -> dict[str, Any]:
    return {
        "a": generate(("race-a", who, round_), (300, 50), torch.float32),
        "b": generate(("race-b", who, round_), (7,), torch.int64),
        "who": who,
    }


def race_mode(url: str, who: int, rounds: int, markers: Path) -> int:
    """One process (``SingleComm``); another runs the same with the other ``who``. Each
    round both wait for each other, then save their own state to ``URL/race-R`` (in
    rounds 1, 4, .. process 0 starts 30 ms late, in rounds 2, 5, .. process 1)."""
    from distckpt.comm import SingleComm

    comm = SingleComm()
    markers.mkdir(parents=True, exist_ok=True)
    distckpt.save(race_state(who, -1), f"{url}/warm-{who}", comm)  # imports, connections
    for r in range(rounds):
        (markers / f"ready-{r}-{who}").write_text("")
        deadline = time.monotonic() + 30
        while not (markers / f"ready-{r}-{1 - who}").exists():
            if time.monotonic() > deadline:
                say(f"RESULT {r} {who} timeout")
                return 1
            time.sleep(0.001)
        if r % 3 == who + 1:  # let the other one win this round (its name, its state)
            time.sleep(0.03)
        try:
            distckpt.save(race_state(who, r), f"{url}/race-{r}", comm)
            outcome = "committed"
        except distckpt.CheckpointExists:
            outcome = "exists"
        except Exception as exc:  # noqa: BLE001 - reported
            outcome = f"{type(exc).__name__}:{' '.join(str(exc).split())[:200]}"
        say(f"RESULT {r} {who} {outcome}")
    say(f"OK {who}")
    return 0


def main(argv: list[str]) -> int:
    mode = argv[0] if argv else ""
    if mode == "save" and len(argv) == 2:
        return save_mode(argv[1])
    if mode == "restore" and len(argv) == 3:
        return restore_mode(argv[1], int(argv[2]))
    if mode == "manager" and len(argv) == 3:
        return manager_mode(argv[1], argv[2])
    if mode == "kill" and len(argv) == 3:
        return kill_mode(argv[1], Path(argv[2]))
    if mode == "race" and len(argv) == 5:
        return race_mode(argv[1], int(argv[2]), int(argv[3]), Path(argv[4]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))
