"""Pipeline-parallel states, where ranks hold different variables, for
tests/engine/test_pipeline.py.

Usage (4 ranks, under torchrun or mpiexec)::

    pipeline.py DIR

Three pipeline stages, each with a plain tensor ``stage{s}/w``, a tensor partitioned over
the stage's ranks ``stage{s}/p`` (a DTensor ``Shard(0)`` on the stage's sub-mesh where the
stage has two ranks, else a :class:`distckpt.Shard`), an optimizer-like state
``optim/stage{s}/exp_avg`` (a :class:`distckpt.Shard` split another way) and
``optim/stage{s}/step`` (a Python value), and beside them a tensor and a value every rank
holds. One launch of 4 ranks plays three jobs with sub-communicators:

* ``save3``: ranks 0-2 save, stage ``s`` on rank ``s``: :func:`distckpt.save`,
  :func:`distckpt.save_hf`, and a :class:`distckpt.Checkpoint` of per-stage modules and
  optimizers through a :class:`distckpt.CheckpointManager` (step 1 persistent, step 2 to
  its node-local tier);
* ``load2``: ranks 1 and 2 load as a job of 2, its rank 0 taking stages 0 and 1, its
  rank 1 stage 2;
* ``load4``: all 4 load, stage 1 split over ranks 1 and 2; ``save4``: they save that
  layout and load it back.

Every load is strict and checked bit for bit (``load``, ``load_hf``, a restore whose
status must be consumed, ``restore_or_initialize`` from the local tier, which must warn
of nothing unmatched); then a stored variable no rank restores (``unexpected4``) and one
a rank holds that is not stored (``missing4``), on 4 ranks. Each rank
prints ``CASE {json}`` records (what the test compares between ranks), ``FAIL <case>
<rank>: ...`` for every failed check and ``OK <rank>`` last when all passed.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import zlib
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rank import Runner, record, same_bits
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard as DShard

import distckpt
from distckpt.comm.auto import launched_by_mpi
from distckpt.errors import MissingVariablesError
from distckpt.local.nodes import NODE_ENV
from distckpt.slices import chunk_bounds

#: The ranks of each stage, by world size of the job.
MEMBERS = {
    3: {0: [0], 1: [1], 2: [2]},
    2: {0: [0], 1: [0], 2: [1]},
    4: {0: [0], 1: [1, 2], 2: [3]},
}
STEP = 42
Check = Callable[[bool, str], None]  # check(ok, what failed)


def TIER(root: Path) -> distckpt.LocalTier:  # noqa: N802 - a constant's factory
    """The node-local tier. Ranks 0 and 1 are node ``a``, ranks 2 and 3 node ``b``
    (``$DISTCKPT_NODE``, set in :func:`main`): a node's ranks hold different stages, so
    each plain tensor is written by the rank of the node that holds it."""
    return distckpt.LocalTier(root / "tier" / "{node}", replicas=1)


def generate(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, version: int = 0
) -> torch.Tensor:
    """The global value of ``name``: random bit patterns (NaNs and all)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}:{version}".encode()))
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * size,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


# ---------------------------------------------------------------------------------------
# The engine's state
# ---------------------------------------------------------------------------------------


def shapes(s: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {
        f"stage{s}/w": ((5 + s, 3), torch.float32),
        f"stage{s}/p": ((7, 4 + s), torch.bfloat16),
        f"optim/stage{s}/exp_avg": ((7, 4 + s), torch.float32),
    }


def put(state: dict[str, Any], name: str, value: Any) -> None:
    *path, key = name.split("/")
    for part in path:
        state = state.setdefault(part, {})
    state[key] = value


class Job:
    """One of the jobs this launch plays: its world size, this rank in it and its comm."""

    def __init__(self, world: int, rank: int, comm: Any, meshes: dict[tuple[int, ...], DeviceMesh]):
        self.world, self.rank, self.comm, self.meshes = world, rank, comm, meshes

    def stages(self) -> list[int]:
        return [s for s, members in MEMBERS[self.world].items() if self.rank in members]

    def state(self, filled: bool, skip: tuple[str, ...] = ()) -> dict[str, Any]:
        """This rank's state: the saved values (``filled``) or zeros to load into."""
        state: dict[str, Any] = {}
        for s in self.stages():
            members = MEMBERS[self.world][s]
            k, i = len(members), members.index(self.rank)
            for name, (shape, dtype) in shapes(s).items():
                full = generate(name, shape, dtype)
                if not filled:
                    full = torch.zeros_like(full)
                if name.endswith("/w"):
                    value: Any = full.clone()
                elif name.endswith("/p") and k > 1:
                    start, size = chunk_bounds(shape[0], k, i)
                    value = DTensor.from_local(
                        full[start : start + size].clone(),
                        self.meshes[tuple(members)],
                        [DShard(0)],
                        shape=full.shape,
                        stride=full.stride(),
                    )
                else:  # rows split 2 + 5 over two ranks: not torch.chunk's split
                    bounds = [0, 2, shape[0]] if k == 2 else [0, shape[0]]
                    lo, hi = bounds[i], bounds[i + 1]
                    value = distckpt.Shard(full[lo:hi].clone(), shape, (lo, 0))
                if name not in skip:
                    put(state, name, value)
            put(state, f"optim/stage{s}/step", 10 * s + 1 if filled else -1)
        emb = generate("shared/emb", (6, 2), torch.float64)
        put(state, "shared/emb", emb if filled else torch.zeros_like(emb))
        put(state, "step", STEP if filled else 0)
        return state


def weights(state: dict[str, Any]) -> dict[str, Any]:
    """The tensors of ``state`` as a flat dict named as Hugging Face weights are
    (``stage0.w``)."""
    return {k.replace("/", "."): v for k, v in leaves(state).items() if not isinstance(v, int)}


def leaves(state: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(leaves(value, name + "/"))
        else:
            out[name] = value
    return out


def local(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, distckpt.Shard):
        return value.tensor
    return value


def compare(check: Check, got: dict[str, Any], want: dict[str, Any]) -> None:
    got, want = leaves(got), leaves(want)
    check(sorted(got) == sorted(want), f"names {sorted(got)} != {sorted(want)}")
    for name in want:
        g, w = local(got.get(name)), local(want[name])
        if isinstance(w, torch.Tensor):
            check(isinstance(g, torch.Tensor) and same_bits(g, w), f"{name}: bits differ")
        else:
            check(g == w, f"{name}: {g!r} != {w!r}")


def untouched(state: dict[str, Any]) -> bool:
    """Whether every tensor and value of a zero-filled state is still as built."""
    for value in leaves(state).values():
        v = local(value)
        if isinstance(v, torch.Tensor) and bool(v.reshape(-1).view(torch.uint8).any()):
            return False
        if isinstance(v, int) and v not in (0, -1):
            return False
    return True


# ---------------------------------------------------------------------------------------
# The training state: Checkpoint, CheckpointManager
# ---------------------------------------------------------------------------------------


class Stage(torch.nn.Module):
    def __init__(self, s: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4 + s, 3))
        self.bias = torch.nn.Parameter(torch.zeros(4 + s))


def fill_stage(module: Stage, opt: torch.optim.Optimizer, s: int, version: int) -> None:
    """Parameters and Adam state as a training step ``version`` would leave them."""
    for name, p in module.named_parameters():
        with torch.no_grad():
            p.copy_(generate(f"stage{s}.{name}", tuple(p.shape), p.dtype, version))
        opt.state[p] = {
            "step": torch.tensor(float(version)),
            "exp_avg": generate(f"adam{s}.{name}.m", tuple(p.shape), p.dtype, version),
            "exp_avg_sq": generate(f"adam{s}.{name}.v", tuple(p.shape), p.dtype, version),
        }


def graph(job: Job, filled: int | None, skip: int | None = None) -> tuple[Any, dict[str, Any]]:
    """A Checkpoint of this rank's stages (but ``skip``), each with its own Adam, and a
    shared embedding every rank holds; filled as at step ``filled`` (None: zeros)."""
    objects: dict[str, Any] = {"counter": torch.zeros((), dtype=torch.int64)}
    shared = torch.nn.Embedding(6, 2)
    with torch.no_grad():
        shared.weight.copy_(generate("shared.emb", (6, 2), torch.float32, filled or 0))
        if filled is None:
            shared.weight.zero_()
    objects["shared"] = shared
    for s in job.stages():
        if s == skip:
            continue
        module = Stage(s)
        opt = torch.optim.Adam(module.parameters(), lr=0.5)
        if filled is not None:
            fill_stage(module, opt, s, filled)
        objects[f"stage{s}"], objects[f"opt{s}"] = module, opt
    if filled is not None:
        objects["counter"].fill_(filled)
    return distckpt.Checkpoint(**objects), objects


def compare_graph(check: Check, got: dict[str, Any], want: dict[str, Any]) -> None:
    check(sorted(got) == sorted(want), f"objects {sorted(got)} != {sorted(want)}")
    for key, w in want.items():
        g = got[key]
        if isinstance(w, torch.Tensor):
            check(same_bits(g, w), f"{key}: bits differ")
        elif isinstance(w, torch.nn.Module):
            for (name, a), (_, b) in zip(g.state_dict().items(), w.state_dict().items()):
                check(same_bits(a, b), f"{key}.{name}: bits differ")
        else:
            sg, sw = g.state_dict()["state"], w.state_dict()["state"]
            check(
                sorted(sg) == sorted(sw), f"{key}: optimizer state for {sorted(sg)} != {sorted(sw)}"
            )
            for i in sw:
                for slot in sw[i]:
                    check(same_bits(sg[i][slot], sw[i][slot]), f"{key} {i} {slot}: bits differ")


class Warnings(logging.Handler):
    """The warnings distckpt logs about checkpoint values nothing matched."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.unmatched: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "not matched to any object" in text:
            self.unmatched.append(text)


# ---------------------------------------------------------------------------------------
# The cases
# ---------------------------------------------------------------------------------------


Case = Callable[["Job", Check], None]  # a case: run on the ranks of a job


def play(run: Runner, name: str, job: Job | None, fn: Case) -> None:
    """Run ``fn`` on the ranks of ``job`` (None: this rank sits out), then wait for all."""
    if job is not None:
        run.attempt(name, lambda: fn(job, lambda ok, what: run.check(name, ok, what)))
    run.comm.barrier()


def managed(
    root: Path, job: Job, ckpt: distckpt.Checkpoint, objects: dict[str, Any]
) -> distckpt.CheckpointManager:
    """The job's manager of ``root/managed``: persistent every 10 steps, else local."""
    return distckpt.CheckpointManager(
        ckpt,
        root / "managed",
        comm=job.comm,
        step_counter=objects["counter"],
        checkpoint_interval=10,
        local=TIER(root),
    )


def save3(root: Path) -> Case:
    """The job of 3 saves every kind of checkpoint the other cases load."""

    def run(job: Job, check: Check) -> None:
        distckpt.save(job.state(filled=True), root / "engine", job.comm)
        distckpt.save_hf(weights(job.state(filled=True)), root / "hf", job.comm)
        ckpt, objects = graph(job, filled=1)
        manager = managed(root, job, ckpt, objects)
        check(manager.save() is not None, "the persistent save did not happen")
        fill_all = graph(job, filled=2)[1]
        for key, value in fill_all.items():  # step 2: saved to the local tier
            if isinstance(value, torch.Tensor):
                objects[key].copy_(value)
            elif isinstance(value, torch.nn.Module):
                objects[key].load_state_dict(value.state_dict())
            else:
                s = int(key[3:])
                fill_stage(objects[f"stage{s}"], objects[key], s, 2)
        check(manager.save() is not None, "the local save did not happen")
        check(manager.latest_checkpoint is not None, "no persistent checkpoint")
        manager.close()

    return run


def load(root: Path) -> Case:
    """Strict loads on this job's layout, each checked bit for bit."""

    def run(job: Job, check: Check) -> None:
        target = job.state(filled=False)
        result = distckpt.load(target, root / "engine", job.comm)
        compare(check, target, job.state(filled=True))
        check(result.unexpected == [] and result.missing == [], f"result {result}")

        tensors = weights(job.state(filled=False))
        distckpt.load_hf(tensors, root / "hf", job.comm)
        compare(check, tensors, weights(job.state(filled=True)))

        # a Checkpoint restored from the persistent checkpoint (step 1): consumed by the job
        ckpt, objects = graph(job, filled=None)
        status = ckpt.restore(distckpt.latest_checkpoint(root / "managed"), job.comm)
        compare_graph(check, objects, graph(job, filled=1)[1])
        status.assert_consumed()
        # ... and by the manager from the local tier (step 2), resharded
        handler = Warnings()
        logging.getLogger("distckpt").addHandler(handler)
        ckpt, objects = graph(job, filled=None)
        manager = managed(root, job, ckpt, objects)
        manager.restore_or_initialize()
        manager.close()
        restored = manager.restored
        check(restored is not None and restored.tier == "local", f"restored {restored}")
        compare_graph(check, objects, graph(job, filled=2)[1])
        ckpt.restore(None)  # logs what the last restore left unmatched, if anything
        logging.getLogger("distckpt").removeHandler(handler)
        check(handler.unmatched == [], f"warned: {handler.unmatched}")

    return run


def save4(root: Path) -> Case:
    """The job of 4 saves its layout (stage 1's plain tensor on two of the four ranks, its
    other tensors split over them) and loads it back strictly."""

    def run(job: Job, check: Check) -> None:
        distckpt.save(job.state(filled=True), root / "engine4", job.comm)
        target = job.state(filled=False)
        distckpt.load(target, root / "engine4", job.comm)
        compare(check, target, job.state(filled=True))

    return run


def unexpected4(root: Path) -> Case:
    """No rank holds ``stage2/w``: strict loads fail on every rank naming it, before
    reading anything; ``strict=False`` reports it; the restore status is not consumed."""

    def refused(check: Check, load: Any, target: Any, name: str, label: str) -> None:
        """A strict ``load`` of ``target`` fails naming ``name``, having filled nothing."""
        try:
            load(target)
            check(False, f"the strict {label} did not fail")
        except MissingVariablesError as exc:
            check(exc.unexpected == [name] and exc.missing == [], f"{exc}")
            check(untouched(target), f"a strict {label} that failed filled targets")
            record(
                f"unexpected4-{label}",
                dist.get_rank(),
                message=str(exc),
                error_rank=getattr(exc, "rank", None),
            )

    def run(job: Job, check: Check) -> None:
        target = job.state(filled=False, skip=("stage2/w",))
        refused(
            check, lambda t: distckpt.load(t, root / "engine", job.comm), target, "stage2/w", "load"
        )
        result = distckpt.load(target, root / "engine", job.comm, strict=False)
        check(result.unexpected == ["stage2/w"], f"unexpected {result.unexpected}")
        check(result.missing == [], f"missing {result.missing}")
        compare(check, target, job.state(filled=True, skip=("stage2/w",)))

        tensors = weights(job.state(filled=False, skip=("stage2/w",)))
        refused(
            check, lambda t: distckpt.load_hf(t, root / "hf", job.comm), tensors, "stage2.w", "hf"
        )
        result = distckpt.load_hf(tensors, root / "hf", job.comm, strict=False)
        check(result.unexpected == ["stage2.w"], f"hf unexpected {result.unexpected}")

        # the job has no stage 2 at all: its values are left unconsumed on every rank
        ckpt, _ = graph(job, filled=None, skip=2)
        status = ckpt.restore(distckpt.latest_checkpoint(root / "managed"), job.comm)
        status.assert_existing_objects_matched()
        try:
            status.assert_consumed()
            check(False, "assert_consumed passed")
        except AssertionError as exc:
            text = str(exc)
            check("stage2/weight" in text and "opt2/" in text, text)
            check("stage1/" not in text and "stage0/" not in text, text)
            record("unexpected4-status", dist.get_rank(), message=text)
        status.expect_partial()

    return run


def missing4(root: Path) -> Case:
    """Rank 3 holds ``stage2/extra``, which is not stored: every rank raises its error."""

    def run(job: Job, check: Check) -> None:
        target = job.state(filled=False)
        if job.rank == 3:
            target["stage2"]["extra"] = torch.zeros(2)
        try:
            distckpt.load(target, root / "engine", job.comm)
            check(False, "the strict load did not fail")
        except MissingVariablesError as exc:
            check(exc.missing == ["stage2/extra"] and exc.unexpected == [], f"{exc}")
            check(getattr(exc, "rank", None) == 3, f"rank {getattr(exc, 'rank', None)}")
            record("missing4", dist.get_rank(), message=str(exc))

    return run


# ---------------------------------------------------------------------------------------


def setup() -> tuple[int, dict[int, Any], dict[tuple[int, ...], DeviceMesh]]:
    """This rank, its communicator in the jobs of 3, 2 and 4 ranks (None: not a member)
    and the sub-mesh of the stage split over two ranks.

    The job of 3 is ranks 0-2, the job of 2 ranks 1 and 2 (its ranks 0 and 1), the job
    of 4 all. Ranks 1 and 2 belong to the same torch groups: the groups a load creates
    among them (``use_local_synchronization``) need members that created the same
    groups before."""
    timeout = float(os.environ.get("DISTCKPT_TIMEOUT", "60"))
    if launched_by_mpi():
        distckpt.comm.init_torch_from_mpi(timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    rank = dist.get_rank()
    assert dist.get_world_size() == 4, "run on 4 ranks"
    os.environ[NODE_ENV] = "a" if rank < 2 else "b"
    jobs = {3: [0, 1, 2], 2: [1, 2]}
    groups = {
        n: dist.new_group(ranks, timeout=timedelta(seconds=timeout)) for n, ranks in jobs.items()
    }
    meshes: dict[tuple[int, ...], DeviceMesh] = {}
    if rank in jobs[2]:
        meshes[(1, 2)] = DeviceMesh.from_group(groups[2], "cpu")
    comms: dict[int, Any] = {}
    if launched_by_mpi():
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        comms[4] = distckpt.comm.MPIComm(timeout=timeout)
        for n, ranks in jobs.items():
            sub = world.Split(0 if rank in ranks else MPI.UNDEFINED, rank)
            if rank in ranks:
                comms[n] = distckpt.comm.MPIComm(sub, timeout=timeout)
    else:
        comms[4] = distckpt.comm.TorchComm(timeout=timeout)
        for n, ranks in jobs.items():
            if rank in ranks:
                comms[n] = distckpt.comm.TorchComm(groups[n])
    return rank, comms, meshes


def main() -> None:
    root = Path(sys.argv[1])
    _, comms, meshes = setup()
    run = Runner(comms[4])

    def job(n: int) -> Job | None:
        return Job(n, comms[n].rank, comms[n], meshes) if n in comms else None

    play(run, "save3", job(3), save3(root))
    play(run, "load2", job(2), load(root))
    play(run, "load4", job(4), load(root))
    play(run, "save4", job(4), save4(root))
    play(run, "unexpected4", job(4), unexpected4(root))
    play(run, "missing4", job(4), missing4(root))
    status = run.finish()
    dist.destroy_process_group()
    sys.exit(status)


if __name__ == "__main__":
    main()
