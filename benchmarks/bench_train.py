#!/usr/bin/env python
"""Training steps during background saves: how much a save in flight slows training.

Each torchrun rank (gloo, one torch thread) trains: a step is a fixed amount of compute
(``--step-ms`` of 512 x 512 float32 matrix products, calibrated once on rank 0 and used
by every rank) followed by an all-reduce of 4 MiB (the gradients) over a group of the
training's own. Every ``--every`` steps the rank starts a background save of its state
(``--tensors`` float32 DTensors ``Shard(0)``, ``rows-per-rank x cols`` each; default
8 x 1024 x 4096 = 128 MiB per rank); a save still running when the next one is due is
waited for (``drain``). Contenders, alternated over the rounds (order rotated):

* ``none``: the same steps, no saves (the step alone);
* ``distckpt``: ``distckpt.save(state, path, comm, async_save=True)`` with its defaults:
  its threads run at niceness +10 and the lowest best-effort I/O priority once the
  snapshot is taken (:mod:`distckpt.transfer.priority`);
* ``distckpt-nice0``: the same with ``background_nice=0`` (threads at training's priority);
* ``distckpt-pinned``: the same with ``background_cpus`` = the last core (with
  ``--pin-cpu``, another core);
* ``dcp``: ``torch.distributed.checkpoint.async_save(state, checkpoint_id=path,
  async_stager=...)`` with one ``DefaultStager`` for the run (cached staging, CPU).

Reported per world size and contender: the median step time of the steps that started
while a save was in flight (the *save window*), over the median step of ``none``; the
median save call (blocking) and the median time from the call to committed. Step times
are rank 0's (the all-reduce makes every rank's step end together). After the rounds each
saving contender's last checkpoint is loaded and compared bit for bit with the state.

World 1 leaves a spare core on this 2-core machine (the target: a step in a save window at
most 1.25x the step alone); world 2 leaves none (the target: the least of all contenders).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import harness as h

CONTENDERS = ("none", "distckpt", "distckpt-nice0", "distckpt-pinned", "dcp")
GRAD_FLOATS = 1 << 20  # 4 MiB all-reduced per step


class TrainWorker(h.RankWorker):
    """One rank: calibrate the step, then the rounds, then the verification."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__(spec)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        torch = self.torch
        self.stager = DefaultStager(StagingOptions(False, False, False, False))
        self.train_group = self.dist.new_group(backend="gloo")  # DCP's thread uses the default
        self.grads = torch.zeros(GRAD_FLOATS)
        gen = torch.Generator().manual_seed(7)
        self.a = torch.rand(512, 512, generator=gen)
        self.b = torch.rand(512, 512, generator=gen)
        self.reps = self.calibrate(spec["step_ms"] / 1000)

    def close(self) -> None:
        self.stager.close()
        super().close()

    def calibrate(self, seconds: float) -> int:
        """Products per step so that rank 0's step takes ``seconds`` alone."""
        t = self.torch.tensor([0], dtype=self.torch.int64)
        if self.rank == 0:
            for _ in range(3):
                self.a @ self.b
            t0 = time.perf_counter()
            for _ in range(20):
                self.a @ self.b
            one = (time.perf_counter() - t0) / 20
            t[0] = max(1, round(seconds / one))
        self.dist.broadcast(t, 0)
        return int(t[0])

    def step(self) -> None:
        for _ in range(self.reps):
            self.a @ self.b
        self.dist.all_reduce(self.grads, group=self.train_group)

    def make_state(self) -> dict[str, Any]:
        torch = self.torch
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor import empty as dt_empty

        spec = self.spec
        rows, cols = spec["rows_per_rank"] * self.world, spec["cols"]
        gen = torch.Generator().manual_seed(self.rank)
        state = {}
        for i in range(spec["ntensors"]):
            dt = dt_empty((rows, cols), device_mesh=self.mesh, placements=[Shard(0)])
            dt.to_local().uniform_(-1.0, 1.0, generator=gen)
            state[f"w{i:02d}"] = dt
        return state

    def start(self, who: str, state: dict[str, Any], path: Path) -> Any:
        if who == "dcp":
            return self.dcp.async_save(state, checkpoint_id=str(path), async_stager=self.stager)
        extra: dict[str, Any] = {}
        if who == "distckpt-nice0":
            extra["background_nice"] = 0
        elif who == "distckpt-pinned":
            extra["background_cpus"] = [self.spec["pin_cpu"]]
        return self.distckpt.save(state, path, self.comm, async_save=True, overwrite=True, **extra)

    @staticmethod
    def done(who: str, handle: Any) -> bool:
        return bool(handle.done())

    @staticmethod
    def wait(who: str, handle: Any) -> None:
        if who == "dcp":
            handle.result()
        else:
            handle.wait()

    def round(self, who: str, state: dict[str, Any], path: Path) -> dict[str, Any]:
        """``steps`` steps, a save every ``every``; each step's time and whether a save
        was in flight when it started."""
        spec = self.spec
        steps, window, calls, totals, drains = [], [], [], [], []
        handle, started = None, 0.0
        self.barrier()
        for k in range(spec["steps"]):
            if who != "none" and k % spec["every"] == 0:
                if handle is not None:
                    t0 = time.perf_counter()
                    self.wait(who, handle)
                    drains.append(time.perf_counter() - t0)
                    totals.append(time.perf_counter() - started)
                started = time.perf_counter()
                handle = self.start(who, state, path)
                calls.append(time.perf_counter() - started)
            busy = handle is not None and not self.done(who, handle)
            if handle is not None and not busy and started:
                totals.append(time.perf_counter() - started)
                handle, started = None, 0.0
            t0 = time.perf_counter()
            self.step()
            steps.append(time.perf_counter() - t0)
            window.append(busy)
        if handle is not None:
            self.wait(who, handle)
            totals.append(time.perf_counter() - started)
        self.barrier()
        return {
            "who": who,
            "steps": steps,
            "window": window,
            "calls": calls,
            "totals": totals,
            "drains": drains,
        }

    def run(self) -> None:
        spec = self.spec
        base = Path(spec["dir"])
        state = self.make_state()
        paths = {c: base / f"w{self.world}-{c}" for c in spec["contenders"]}
        for who in spec["contenders"]:  # warm-up: buffers, stager cache, groups, tmpfs pages
            if who != "none":
                self.wait(who, self.start(who, state, paths[who]))
        for rnd, order in enumerate(spec["orders"]):
            for who in order:
                ev = self.round(who, state, paths[who])
                self.out["events"].append({**ev, "round": rnd, "reps": self.reps})
        self.verify(state, paths)
        self.rmtree(*paths.values())

    def verify(self, state: dict[str, Any], paths: dict[str, Path]) -> None:
        torch = self.torch
        results = {}
        for who in self.spec["contenders"]:
            if who == "none":
                continue
            target = {k: torch.zeros_like(v) for k, v in state.items()}
            if who == "dcp":
                self.dcp.load(target, checkpoint_id=str(paths[who]))
            else:
                self.distckpt.load(target, paths[who], self.comm)
            results[who] = all(
                torch.equal(target[k].to_local(), v.to_local()) for k, v in state.items()
            )
        got = self.gather(results)
        bad = [f"{c} on rank {r}" for r, g in enumerate(got) for c, ok in g.items() if not ok]
        if bad:
            raise SystemExit("VERIFY FAILED (restored != saved): " + ", ".join(bad))
        self.out["verified"] = sorted(results)


class Driver(h.Driver):
    name = "bench_train"

    def describe(self) -> str:
        a = self.args
        return (
            f"worlds {a.worlds}, a {a.step_ms} ms step, a save every {a.every} of {a.steps} "
            f"steps, {a.tensors * a.rows_per_rank * a.cols * 4 / h.MiB:.0f} MiB per rank, "
            f"{a.rounds} rounds"
        )

    def env(self) -> dict[str, Any]:
        return {"fs": h.fs_type(Path(self.args.dir).absolute().parent)}

    def run(self) -> None:
        a = self.args
        with h.run_dir(a.dir) as d:
            for world in a.worlds:
                spec = {
                    "dir": str(d),
                    "ntensors": a.tensors,
                    "rows_per_rank": a.rows_per_rank,
                    "cols": a.cols,
                    "step_ms": a.step_ms,
                    "steps": a.steps,
                    "every": a.every,
                    "pin_cpu": a.pin_cpu,
                    "contenders": a.contenders,
                    "orders": h.rotations(a.contenders, a.rounds),
                }
                busy = self.wait_idle()
                out, wall, _ = self.launch_worker(
                    h.torchrun(world), __file__, spec, f"train-w{world}", h.TORCHRUN_ENV
                )
                print(
                    f" world {world}: {wall:.1f}s, verified {out.get('verified')}, "
                    f"other CPU before {busy:.0%}",
                    flush=True,
                )
                for e in out["events"]:
                    e["world"] = world
                    self.events.append(e)
                    inside = [s for s, w in zip(e["steps"], e["window"], strict=True) if w]
                    print(
                        f"   r{e['round']} {e['who']:16} step med {h.med(e['steps']) * 1e3:6.1f} ms"
                        + (f", in saves {h.med(inside) * 1e3:6.1f} ms" if inside else ""),
                        flush=True,
                    )


def summarize(args: argparse.Namespace, events: list[dict[str, Any]]) -> dict[str, Any]:
    rows, ratios = [], []
    for world in sorted({e["world"] for e in events}):
        es = [e for e in events if e["world"] == world]
        alone = {e["round"]: h.med(e["steps"]) for e in es if e["who"] == "none"}
        per_round: dict[str, dict[int, float]] = {}
        for who in CONTENDERS:
            mine = [e for e in es if e["who"] == who]
            if not mine:
                continue
            steps = [s for e in mine for s in e["steps"]]
            inside = [s for e in mine for s, w in zip(e["steps"], e["window"], strict=True) if w]
            per_round[who] = {
                e["round"]: h.med([s for s, w in zip(e["steps"], e["window"], strict=True) if w])
                for e in mine
                if any(e["window"])
            }
            rows.append(
                {
                    "world": world,
                    "who": who,
                    "n": len(mine),
                    "step_median_ms": 1e3 * h.med(steps),
                    "in_saves_median_ms": 1e3 * h.med(inside) if inside else None,
                    "in_saves_share": len(inside) / len(steps),
                    "call_median_ms": 1e3 * h.med([c for e in mine for c in e["calls"]])
                    if who != "none"
                    else None,
                    "total_median_s": h.med([t for e in mine for t in e["totals"]])
                    if who != "none"
                    else None,
                }
            )
        for who in CONTENDERS[1:]:
            q = h.ratio(per_round.get(who, {}), alone)
            if q is not None:
                goal = ("<=", 1.25) if world == 1 else None
                label = f"step in saves {who}/none"
                ratios.append({"world": world, "label": label, **q, **h.target(q["value"], goal)})
    return {"rows": rows, "ratios": ratios}


def print_report(s: dict[str, Any]) -> None:
    print("\ntraining steps during background saves (rank 0)")
    print("in saves: the steps that started while a save was in flight")
    print(
        f"{'world':>5} {'who':16} {'n':>2} {'step med ms':>11} {'in saves ms':>11} "
        f"{'share':>5} {'call ms':>8} {'to commit s':>11}"
    )
    for r in s["rows"]:
        ins = "" if r["in_saves_median_ms"] is None else f"{r['in_saves_median_ms']:.1f}"
        call = "" if r["call_median_ms"] is None else f"{r['call_median_ms']:.1f}"
        tot = "" if r["total_median_s"] is None else f"{r['total_median_s']:.3f}"
        print(
            f"{r['world']:>5} {r['who']:16} {r['n']:>2} {r['step_median_ms']:11.1f} {ins:>11} "
            f"{r['in_saves_share']:5.2f} {call:>8} {tot:>11}"
        )
    print(f"\n{'world':>5} {'ratio':34} {'of medians':>10} {'paired med [min..max]':>24} target ok")
    for q in s["ratios"]:
        print(
            f"{q['world']:>5} {q['label']:34} {q['value']:10.3f} {h.paired_text(q)} "
            f"{q['target']:>7} {h.ok_text(q)}"
        )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    h.common_args(p)
    p.add_argument("--dir", default="/dev/shm/distckpt-bench", help="parent directory of the files")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--rows-per-rank", type=int, default=1024)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--pin-cpu", type=int, default=1, help="the core of distckpt-pinned")
    p.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    p.add_argument("--quick", action="store_true", help="smoke run: small sizes, 2 rounds")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.every = 2, 12, 4
        args.rows_per_rank, args.cols = 256, 2048
        args.wait_idle = min(args.wait_idle, 5)
    return args


def worker_main(spec_file: str) -> None:
    TrainWorker.main(spec_file)


if __name__ == "__main__":
    h.main(parse(), Driver, summarize, print_report, worker_main)
