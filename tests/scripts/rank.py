"""What the rank scripts share: reporting, the case runner, starting and ending a job,
and the small training jobs.

A rank script prints what its test checks, one whole line at a time (:func:`say`):
``CASE {json}`` records (:func:`record`), ``FAIL <case> <rank>: <why>`` for a failed
check, and ``OK <rank>`` as its last line when every check passed (:meth:`Runner.finish`,
:func:`finish_job`); ``tests.support.launch_util`` reads them back (``cases``,
``assert_all_ok``).

Importing this module imports no more than the standard library (the stub trainer, which
runs without torch, uses it too): torch and distckpt are imported by what needs them.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    import distckpt
    from distckpt.comm import Communicator


# --------------------------------------------------------------------------- reporting


def say(line: str) -> None:
    """Print ``line`` with one write(2): the ranks share the pipe, and print() writes the
    text and the newline apart (another rank's line could land between them, breaking
    ``^OK <rank>$``)."""
    os.write(1, f"{line}\n".encode())


def record(case: str, rank: int, **fields: Any) -> None:
    """This rank's ``CASE`` record of ``case``, for the test to compare between ranks."""
    say("CASE " + json.dumps({"case": case, "rank": rank, **fields}))


class Runner:
    """Runs a script's cases one after the other on every rank of ``comm`` and counts the
    failed checks: each is a ``FAIL <case> <rank>: <why>`` line, and the next case still
    runs. :meth:`finish` prints ``OK <rank>`` when none failed."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.rank = comm.rank
        self.failed = 0

    def fail(self, case: str, why: str) -> None:
        self.failed += 1
        say(f"FAIL {case} {self.rank}: {why}")

    def check(self, case: str, ok: bool, why: str) -> None:
        """A failed check of ``case`` unless ``ok``."""
        if not ok:
            self.fail(case, why)

    def attempt(self, case: str, fn: Callable[[], Any]) -> Any:
        """``fn()``; if it raises, a failed check of ``case`` with the traceback (and
        None)."""
        try:
            return fn()
        except Exception:  # noqa: BLE001 - reported; the next case still runs on every rank
            self.fail(case, "raised\n" + traceback.format_exc())
            return None

    def measure(self, case: str, fn: Callable[[], dict[str, Any]]) -> None:
        """Record what ``fn`` returns as this rank's ``CASE`` record of ``case``."""
        found = self.attempt(case, fn)
        if found is not None:
            record(case, self.rank, **found)

    def case(
        self,
        case: str,
        fn: Callable[[], Any],
        expect: type[BaseException] | None = None,
        err_rank: int | None = None,
        words: tuple[str, ...] = (),
        check: Callable[[BaseException | None], list[str]] | None = None,
        after: Callable[[], list[str]] | None = None,
    ) -> None:
        """Run ``fn`` on this rank and record how it ended: the ``CASE`` record holds the
        type of what it raised (None), that error's ``rank`` and its message.

        The checks: ``fn`` raised nothing (``expect`` None) or exactly an ``expect``;
        then the error names ``err_rank`` as the failed rank (when given: on the other
        ranks also in a note), and its message holds each of ``words``. A list that
        ``fn`` returns is the problems it found; ``check(error)`` and ``after()`` return
        more. Every rank runs the case: they wait for each other before ``after`` (the
        coordinator's clean-up done) and after it.
        """
        err: BaseException | None = None
        found: Any = None
        try:
            found = fn()
        except Exception as exc:  # noqa: BLE001 - reported below
            err = exc
        msg = "" if err is None else str(err)
        record(
            case,
            self.rank,
            type=type(err).__name__ if err else None,
            err_rank=getattr(err, "rank", None),
            msg=msg[:400],
        )
        problems: list[str] = list(found) if isinstance(found, list) else []
        if expect is None:
            if err is not None:
                problems.append("raised " + "".join(traceback.format_exception(err)))
        elif type(err) is not expect:
            problems.append(f"raised {type(err).__name__}: {msg!r}, expected {expect.__name__}")
        else:
            if err_rank is not None:
                if getattr(err, "rank", None) != err_rank:
                    problems.append(
                        f"err.rank is {getattr(err, 'rank', None)}, expected {err_rank}"
                    )
                if err_rank != self.rank:
                    notes = "".join(getattr(err, "__notes__", []))
                    if f"raised on rank {err_rank}" not in notes:
                        problems.append(f"no note naming rank {err_rank}: {notes!r}")
            problems += [f"message lacks {w!r}: {msg}" for w in words if w not in msg]
        if check is not None:
            problems += check(err)
        self.comm.barrier()
        if after is not None:
            problems += after()
        self.comm.barrier()
        for p in problems:
            self.fail(case, p)

    def finish(self) -> int:
        """``OK <rank>`` if no check failed; the exit status."""
        if self.failed == 0:
            say(f"OK {self.rank}")
            return 0
        return 1


# --------------------------------------------------------------------------- the job


def start_job() -> tuple[int, int]:
    """Start torch.distributed (gloo) from the launcher's variables, torn down at exit
    (see :func:`communicator`): (rank, world size)."""
    import torch.distributed as dist

    import distckpt
    from distckpt.comm.auto import launched_by_mpi
    from distckpt.comm.torch_dist import tear_down_at_exit

    if launched_by_mpi():
        distckpt.comm.init_torch_from_mpi()  # torn down at exit by distckpt
    else:
        dist.init_process_group("gloo")
        tear_down_at_exit()
    return dist.get_rank(), dist.get_world_size()


def communicator() -> Communicator:
    """The job's communicator, from ``auto()``: under torchrun over the default process
    group (started here, over gloo, and torn down at exit as ``auto()`` tears down its
    own: a gloo group left to the interpreter's teardown can abort a rank after its
    work), under mpiexec MPI's."""
    from distckpt.comm import auto
    from distckpt.comm.auto import launched_by_torchrun

    if launched_by_torchrun():
        import torch.distributed as dist

        from distckpt.comm.torch_dist import tear_down_at_exit

        dist.init_process_group("gloo")
        tear_down_at_exit()
    return auto()


def finish_job(rank: int) -> None:
    """Once every rank is done: print ``OK <rank>``."""
    import torch.distributed as dist

    dist.barrier()
    say(f"OK {rank}")
    dist.destroy_process_group()


# --------------------------------------------------------------------------- comparing


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same dtype, shape and bytes (NaNs compare by their bits, -0.0 is not 0.0)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)
    )


def assert_same(a: Any, b: Any, where: str = "checkpoint") -> None:
    """``a`` and ``b`` hold the same containers (types, keys in order, key types) and the
    same tensors bit for bit (dtype, shape and bytes: NaNs compare by their bits)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{where}: {a!r} {b!r}"
        sides = f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {sides}"
        bits_a = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        bits_b = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(bits_a, bits_b), f"{where}: tensors differ"
        return
    if isinstance(a, dict):
        assert isinstance(b, dict), f"{where}: dict vs {type(b).__name__}"
        keys_a, keys_b = [(type(k), k) for k in a], [(type(k), k) for k in b]
        assert keys_a == keys_b, f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r:.200} vs {b!r:.200}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
        return
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    assert a == b or (a != a and b != b), f"{where}: {a!r:.200} vs {b!r:.200}"


# --------------------------------------------------------------------------- training jobs


def fsdp_mlp(seed: int, widths: tuple[int, ...], mesh: Any, device: str | None = None) -> Any:
    """``nn.Sequential`` of Linear layers of ``widths`` with a ReLU between two, made from
    ``seed`` (on ``device``), every Linear and then the whole sharded with FSDP2."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(n_in, n_out))
    model = nn.Sequential(*layers)
    if device is not None:
        model = model.to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def rows(length: int, parts: int, index: int) -> tuple[int, int]:
    """The rows [lo, hi) part ``index`` of ``parts`` holds (torch.chunk's split)."""
    from distckpt.slices import chunk_bounds

    first, size = chunk_bounds(length, parts, index)
    return first, first + size


class RowsJob:
    """The training job of the node-local tier's tests (scripts/local_tier.py,
    scripts/two_nodes.py): ``w`` (float32, ``w_shape``) and ``e`` (float64, 10 x 3)
    sharded by rows, a replicated bfloat16 ``bias``, the ``step``, a per-rank ``counter``
    and a value ``meta``.

    Each step changes the state elementwise from the step and each element's global index
    (exactly: no rounding depends on the order), so a run resumed on any world size ends
    bit for bit where an uninterrupted one does (:meth:`checks`).
    """

    E_SHAPE = (10, 3)

    def __init__(self, rank: int, size: int, w_shape: tuple[int, int]) -> None:
        import torch

        import distckpt

        self.rank, self.w_shape = rank, w_shape
        self.w_rows = rows(w_shape[0], size, rank)
        self.e_rows = rows(self.E_SHAPE[0], size, rank)
        self.w, self.e = self.initial()
        self.bias = torch.zeros(5, dtype=torch.bfloat16)
        self.step = torch.tensor(0)
        self.counter = torch.zeros(1, dtype=torch.int64)
        self.ckpt = distckpt.Checkpoint(
            step=self.step,
            w=distckpt.Shard(self.w, w_shape, (self.w_rows[0], 0)),
            e=distckpt.Shard(self.e, self.E_SHAPE, (self.e_rows[0], 0)),
            bias=self.bias,
            counter=distckpt.PerRank(self.counter),
            meta={"lr": 0.0},
        )

    def initial(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of ``w`` and ``e`` before the first step."""
        import torch

        def full(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            n = int(torch.tensor(shape).prod())
            return (torch.arange(n, dtype=dtype) % 1000).reshape(shape) / 7

        (w0, w1), (e0, e1) = self.w_rows, self.e_rows
        w = full(self.w_shape, torch.float32)[w0:w1].clone()
        e = full(self.E_SHAPE, torch.float64)[e0:e1].clone()
        return w, e

    @staticmethod
    def update(t: torch.Tensor, step: int, rows: tuple[int, int]) -> None:
        """One training step on rows ``rows`` of a global tensor: elementwise, exact."""
        import torch

        index = torch.arange(rows[0], rows[1], dtype=t.dtype).reshape(-1, *([1] * (t.dim() - 1)))
        t.mul_(0.75).add_(index * 0.125 + step / 64)

    def manager(
        self, run: str, tier: str, persistent_every: int, comm: Communicator
    ) -> distckpt.CheckpointManager:
        """The job's manager: persistent saves every ``persistent_every`` steps to
        ``run``, node-local ones (one replica, on another node) to ``tier``
        (:attr:`tier`)."""
        import distckpt

        self.tier = distckpt.LocalTier(tier, replicas=1, max_to_keep=2)
        return distckpt.CheckpointManager(
            self.ckpt,
            run,
            max_to_keep=2,
            checkpoint_interval=persistent_every,
            step_counter=self.step,
            comm=comm,
            local=self.tier,
        )

    def restore(self, manager: distckpt.CheckpointManager, size: int) -> None:
        """Restore the newest step (or start afresh); rank 0 prints ``RESTORED {json}``:
        the tier, number and reason of what was restored, and the world size."""
        manager.restore_or_initialize()
        self.counter = self.ckpt.counter.value  # a restore replaces the value a PerRank holds
        restored = manager.restored
        if self.rank == 0:
            found = (
                {"tier": None}
                if restored is None
                else {"tier": restored.tier, "number": restored.number, "reason": restored.reason}
            )
            say("RESTORED " + json.dumps({**found, "world": size}))

    def before_replicate(self, hook: Callable[[int], None]) -> None:
        """Call ``hook(step)`` in every node-local save, right before its replicas are
        sent (the rank's own data is written)."""
        from distckpt.local import save as local_save

        replicate = local_save._replicate

        def hooked(*a: Any, **k: Any) -> Any:
            hook(int(self.step))
            return replicate(*a, **k)

        local_save._replicate = hooked

    def train_step(self) -> int:
        """One step: the step counter, every tensor and the value; the new step."""
        self.step.add_(1)
        s = int(self.step)
        self.update(self.w, s, self.w_rows)
        self.update(self.e, s, self.e_rows)
        self.bias.add_(1)
        self.counter.add_(self.rank + 1)
        self.ckpt.meta = {"lr": s / 100}
        return s

    def replay(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of ``w`` and ``e`` after ``steps`` uninterrupted steps."""
        w, e = self.initial()
        for s in range(1, steps + 1):
            self.update(w, s, self.w_rows)
            self.update(e, s, self.e_rows)
        return w, e

    def checks(self, steps: int) -> dict[str, bool]:
        """Whether each part of the state is, bit for bit, what ``steps`` uninterrupted
        steps make."""
        import torch

        w_ref, e_ref = self.replay(steps)
        return {
            "w": same_bits(self.w, w_ref),
            "e": same_bits(self.e, e_ref),
            "bias": same_bits(self.bias, torch.full((5,), float(steps), dtype=torch.bfloat16)),
            "step": int(self.step) == steps,
            "counter": int(self.counter[0]) == steps * (self.rank + 1),
            "meta": self.ckpt.meta == {"lr": steps / 100},
        }
