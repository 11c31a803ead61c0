#!/usr/bin/env python
"""Background saves: how long a save blocks training, distckpt vs DCP vs a plain copy.

Two parts (see benchmarks/README.md):

* ``multi``: the blocking time of an async save on 2 and 4 ranks. The driver launches
  torchrun workers (this file, ``--worker SPEC``) with gloo, ``OMP_NUM_THREADS=1`` and
  ``GLOO_SOCKET_IFNAME=lo``. Each rank holds float32 DTensors sharded on dim 0. Contenders,
  alternated over the rounds after an untimed warm-up of each:

  - ``copy``: the limit. Each rank ``copy_``s its local shards into host buffers allocated
    (and touched) beforehand;
  - ``distckpt``: ``distckpt.save(state, path, comm, async_save=True)`` until it returns;
  - ``dcp``: ``torch.distributed.checkpoint.async_save(state, checkpoint_id=path)`` until
    it returns, with torch's defaults (a new ``DefaultStager`` per call, no pinned or
    shared memory, staging on the calling thread);
  - ``dcp-cached``: the same with one ``DefaultStager`` kept for the whole run (passed as
    ``async_stager``), whose staging buffers are reused from one save to the next.

  Timing: a barrier, every rank notes its start, calls the save, notes when it returns
  (blocking), waits for the save to finish (committed) and notes that; the reported
  times are ``max(end) - min(start)`` over the ranks. No collective of the benchmark runs
  while a save is in the background (DCP's background thread uses the default group).

* ``lazy``: one process trains an MLP (AdamW, random data) and saves every K steps through
  ``distckpt.CheckpointManager(max_to_keep=2)``: modes ``none``, ``sync``, ``async``,
  ``lazy``, alternated over the rounds. Reported: wall time of N steps (including the
  final wait for the last save to commit) and the time of each ``manager.save()`` call.

Correctness: ``multi`` restores one checkpoint per contender (saved, then the source
overwritten before waiting for the background write) and compares it bit-exactly with
the values at the time of the save; ``lazy`` restores a checkpoint of every saving mode into
a fresh model and optimizer and compares them with clones taken when the save was called.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import harness as h

MULTI = ("copy", "distckpt", "dcp", "dcp-cached")
MODES = ("none", "sync", "async", "lazy")

# --------------------------------------------------------------------------- multi-rank


class MultiWorker(h.RankWorker):
    """One rank of a ``multi`` launch: warm-up, timed rounds, then the verification."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__(spec)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # torch's defaults for async_save on CPU, but one stager for the whole run
        self.stager = DefaultStager(StagingOptions(False, False, False, False))

    def close(self) -> None:
        self.stager.close()
        super().close()

    def make_state(self, seed: int) -> dict[str, Any]:
        """Float32 DTensors Shard(0), uniform in [-1, 1) from a per-rank seed."""
        torch = self.torch
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor import empty as dt_empty

        rows, cols = self.spec["rows_per_rank"] * self.world, self.spec["cols"]
        gen = torch.Generator().manual_seed(seed * 1000 + self.rank)
        state = {}
        for i in range(self.spec["ntensors"]):
            dt = dt_empty(
                (rows, cols), dtype=torch.float32, device_mesh=self.mesh, placements=[Shard(0)]
            )
            dt.to_local().uniform_(-1.0, 1.0, generator=gen)
            state[f"w{i:02d}"] = dt
        return state

    def start(self, who: str, state: dict[str, Any], bufs: list[Any], path: Path) -> Any:
        """The blocking part of ``who``'s save; returns its handle."""
        if who == "copy":
            for b, dt in zip(bufs, state.values(), strict=True):
                b.copy_(dt.to_local())
            return None
        if who == "distckpt":
            return self.distckpt.save(state, path, self.comm, async_save=True)
        if who == "dcp":
            return self.dcp.async_save(state, checkpoint_id=str(path))
        return self.dcp.async_save(state, checkpoint_id=str(path), async_stager=self.stager)

    def finish(self, who: str, handle: Any) -> dict[str, float] | None:
        """Wait until the save is committed; distckpt's per-phase timings."""
        if who == "distckpt":
            return dict(handle.wait().timings)
        if who.startswith("dcp"):
            handle.result()
        return None

    def timed(self, who: str, state, bufs, path: Path) -> dict[str, Any]:
        """One timed save: ``block`` until the call returns, ``total`` until committed. No
        collective of ours runs before the save is finished: DCP's thread uses the group."""
        sec = h.timed(
            self,
            lambda: self.start(who, state, bufs, path),
            lambda handle: self.finish(who, handle),
        )
        ev = {"who": who, "world": self.world, "block": sec.marks[0], "total": sec.marks[1]}
        ev.update(block_own=sec.own, foreign_cpu=sec.foreign_cpu, steal=sec.steal)
        timings = sec.results[1]
        if timings is not None:
            ev["timings_max"] = self.allmax(timings)
        return ev

    def run(self) -> None:
        torch, spec = self.torch, self.spec
        base = Path(spec["dir"])
        state = self.make_state(seed=1)
        bufs = [torch.empty_like(dt.to_local()) for dt in state.values()]
        for b in bufs:
            b.fill_(0.0)  # touched: the limit copies into memory that exists already
        contenders = spec["contenders"]
        paths = {c: base / f"w{self.world}-{c}" for c in contenders}
        # warm-up (untimed): first touch of distckpt's pool, DCP's stager cache, the page
        # cache of tmpfs, the background gloo group
        for who in contenders:
            self.finish(who, self.start(who, state, bufs, paths[who]))
            self.barrier()
        for rnd, order in enumerate(spec["orders"]):
            for who in order:
                self.rmtree(paths[who])  # just before its save: recycled memory for all
                self.out["events"].append(
                    {**self.timed(who, state, bufs, paths[who]), "round": rnd}
                )
        self.rmtree(*paths.values())
        self.verify(state, bufs, paths)

    def verify(self, state, bufs, paths: dict[str, Path]) -> None:
        """Save once more per contender, overwrite the source as soon as the call returns,
        wait, restore into fresh tensors: they must equal the values at the call."""
        torch = self.torch
        for b, dt in zip(bufs, state.values(), strict=True):
            b.copy_(dt.to_local())  # the reference
        results = {}
        for who in self.spec["contenders"]:
            if who == "copy":
                results[who] = all(
                    torch.equal(b, dt.to_local())
                    for b, dt in zip(bufs, state.values(), strict=True)
                )
                continue
            handle = self.start(who, state, bufs, paths[who])
            for dt in state.values():
                dt.to_local().fill_(-7.0)  # the save must not see this
            self.finish(who, handle)
            self.barrier()
            target = self.make_state(seed=2)
            if who == "distckpt":
                self.distckpt.load(target, paths[who], self.comm)
            else:
                self.dcp.load(target, checkpoint_id=str(paths[who]))
            results[who] = all(
                torch.equal(b, dt.to_local()) for b, dt in zip(bufs, target.values(), strict=True)
            )
            for b, dt in zip(bufs, state.values(), strict=True):
                dt.to_local().copy_(b)
            del target
            self.rmtree(paths[who])
        got = self.gather(results)
        bad = [f"{c} on rank {r}" for r, g in enumerate(got) for c, ok in g.items() if not ok]
        if bad:
            raise SystemExit("VERIFY FAILED (restored != saved): " + ", ".join(bad))
        self.out["verified"] = sorted(results)


# --------------------------------------------------------------------------- lazy, one process


class LazyWorker:
    """The ``lazy`` part: one process trains and saves in every mode, then verifies."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch

        if spec["threads"]:
            torch.set_num_threads(spec["threads"])
        import distckpt

        self.torch, self.distckpt, self.spec = torch, distckpt, spec
        self.out: dict[str, Any] = {
            "events": [],
            "threads": torch.get_num_threads(),
            "distckpt_file": distckpt.__file__,
        }

    def model(self, seed: int):
        torch, spec = self.torch, self.spec
        nn = torch.nn
        torch.manual_seed(seed)
        w = spec["width"]
        layers: list[Any] = []
        for i in range(spec["layers"]):
            layers.append(nn.Linear(w, w))
            if i + 1 < spec["layers"]:
                layers.append(nn.ReLU())
        net = nn.Sequential(*layers)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        return net, opt

    def batches(self, n: int, seed: int) -> list[tuple[Any, Any]]:
        torch, spec = self.torch, self.spec
        gen = torch.Generator().manual_seed(seed)
        w, b = spec["width"], spec["batch"]
        return [
            (torch.randn(b, w, generator=gen), torch.randn(b, w, generator=gen)) for _ in range(n)
        ]

    def run_mode(self, mode: str, directory: Path, data, on_save=None) -> dict[str, Any]:
        """N steps in ``mode``; a save after every K-th step except the last (so each save
        has K steps to finish in the background); the time includes the final sync."""
        torch, spec = self.torch, self.spec
        net, opt = self.model(seed=3)
        step = torch.zeros((), dtype=torch.int64)
        manager = None
        if mode != "none":
            directory.mkdir(parents=True, exist_ok=True)
            ckpt = self.distckpt.Checkpoint(net=net, optimizer=opt, step=step)
            manager = self.distckpt.CheckpointManager(ckpt, directory, max_to_keep=2)
        loss_fn = torch.nn.functional.mse_loss
        n, k = spec["steps"], spec["every"]
        save_s: list[float] = []
        after_save_step_s: list[float] = []
        c0, m0 = h.own_cpu(), h.cpu_times()
        t0 = time.perf_counter()
        saved = False
        for i in range(1, n + 1):
            x, y = data[i - 1]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(net(x), y)
            loss.backward()
            s0 = time.perf_counter()
            opt.step()  # after a lazy save, waits here for the copies still running
            if saved:
                after_save_step_s.append(time.perf_counter() - s0)
            saved = False
            step.add_(1)
            if i % k == 0 and i < n:
                if on_save is not None:
                    on_save(net, opt, i)
                if manager is not None:
                    s0 = time.perf_counter()
                    manager.save(async_save=mode == "async", lazy=mode == "lazy")
                    save_s.append(time.perf_counter() - s0)
                saved = True
        t_steps = time.perf_counter() - t0
        if manager is not None:
            manager.sync()
        t1 = time.perf_counter()
        c1, m1 = h.own_cpu(), h.cpu_times()
        ev = {
            "mode": mode,
            "wall": t1 - t0,
            "drain": t1 - t0 - t_steps,
            "save_s": save_s,
            "step_after_save_s": after_save_step_s,
            "loss": float(loss),
            "foreign_cpu": h.cpu_share(m1[0] - m0[0] - (c1 - c0), t1 - t0),
        }
        if manager is not None:
            ev["checkpoints"] = list(manager.checkpoints)
            manager.close()
        return ev

    def run(self) -> None:
        spec = self.spec
        base = Path(spec["dir"])
        data = self.batches(spec["steps"], seed=4)
        for rnd, order in enumerate([list(MODES), *spec["orders"]]):  # warm-up round first
            for mode in order:
                d = base / f"lazy-{mode}"
                shutil.rmtree(d, ignore_errors=True)
                ev = self.run_mode(mode, d, data)
                shutil.rmtree(d, ignore_errors=True)
                if rnd > 0:
                    ev["round"] = rnd - 1
                    self.out["events"].append(ev)
        self.verify(base, data)

    def verify(self, base: Path, data) -> None:
        """Per saving mode: clone the state when the last save is called, train on, restore
        that checkpoint into a fresh model and optimizer, compare bit-exactly."""
        torch = self.torch
        results = {}
        for mode in ("sync", "async", "lazy"):
            ref: dict[str, Any] = {}

            def grab(net, opt, i, ref=ref):
                ref["net"] = {k: v.detach().clone() for k, v in net.state_dict().items()}
                ref["opt"] = {
                    p: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                    for p, s in opt.state_dict()["state"].items()
                }
                ref["step"] = i

            d = base / f"verify-{mode}"
            shutil.rmtree(d, ignore_errors=True)
            self.run_mode(mode, d, data, on_save=grab)
            net, opt = self.model(seed=5)
            step = torch.zeros((), dtype=torch.int64)
            ckpt = self.distckpt.Checkpoint(net=net, optimizer=opt, step=step)
            path = self.distckpt.latest_checkpoint(d)
            ckpt.restore(path).assert_consumed()
            ok = int(step) == ref["step"]
            ok = ok and all(torch.equal(v, ref["net"][k]) for k, v in net.state_dict().items())
            got = opt.state_dict()["state"]
            ok = ok and set(got) == set(ref["opt"])
            for p, s in got.items():
                for key, v in s.items():
                    want = ref["opt"][p][key]
                    same = torch.equal(v, want) if torch.is_tensor(v) else v == want
                    ok = ok and bool(same)
            results[mode] = ok
            shutil.rmtree(d, ignore_errors=True)
        bad = [m for m, ok in results.items() if not ok]
        if bad:
            raise SystemExit("VERIFY FAILED (restored != state at save): " + ", ".join(bad))
        self.out["verified"] = sorted(results)

    @staticmethod
    def main(spec_file: str) -> None:
        spec = json.loads(Path(spec_file).read_text())
        w = LazyWorker(spec)
        w.run()
        Path(spec["result"]).write_text(json.dumps(w.out))


# --------------------------------------------------------------------------- driver


class Driver(h.Driver):
    """``multi``: one torchrun launch per world size; ``lazy``: one launch of one process per
    (threads, width)."""

    name = "bench_async"

    def describe(self) -> str:
        return f"parts {self.args.part}"

    def env(self) -> dict[str, Any]:
        return {"fs": h.fs_type(Path(self.args.dir).absolute().parent)}

    def launch(self, cmd_head: list[str], spec: dict[str, Any], label: str, env_extra) -> Any:
        busy = self.wait_idle()
        out, wall, m = self.launch_worker(cmd_head, __file__, spec, label, env_extra)
        print(
            f"  {label}: {wall:.1f}s; verified {out.get('verified')}; other CPU before {busy:.0%}; "
            f"avail {m['MemAvailable']:.1f} GiB",
            flush=True,
        )
        return out

    def multi(self, d: Path) -> None:
        a = self.args
        per_rank = a.tensors * a.rows_per_rank * a.cols * 4
        for world in a.worlds:
            spec = {
                "mode": "multi",
                "dir": str(d),
                "ntensors": a.tensors,
                "rows_per_rank": a.rows_per_rank,
                "cols": a.cols,
                "contenders": a.contenders,
                "orders": h.rotations(a.contenders, a.rounds),
            }
            print(
                f" multi: {world} ranks x {per_rank / h.MiB:.0f} MiB, {a.rounds} rounds", flush=True
            )
            out = self.launch(h.torchrun(world), spec, f"multi-w{world}", h.TORCHRUN_ENV)
            for e in out["events"]:
                e.update(part="multi", per_rank_bytes=per_rank)
                self.events.append(e)
                print(
                    f"   r{e['round']} {e['who']:10} block {e['block']:.4f}s "
                    f"total {e['total']:.3f}s oth {e['foreign_cpu']:.0%}",
                    flush=True,
                )

    def lazy(self, d: Path) -> None:
        a = self.args
        for threads in a.threads:
            for width in a.widths:
                spec = {
                    "mode": "lazy",
                    "dir": str(d),
                    "width": width,
                    "layers": a.layers,
                    "batch": a.batch,
                    "steps": a.steps,
                    "every": a.every,
                    "threads": threads,
                    "orders": h.rotations(MODES, a.lazy_rounds),
                }
                label = f"lazy-w{width}-t{threads or 'default'}"
                print(
                    f" {label}: {a.layers} x {width}^2 + AdamW, {a.steps} steps, "
                    f"a save every {a.every}"
                )
                env = {} if threads else {"OMP_NUM_THREADS": None}  # torch's own default
                out = self.launch([sys.executable], spec, label, env)
                for e in out["events"]:
                    e.update(part="lazy", width=width, threads=out["threads"], threads_arg=threads)
                    self.events.append(e)
                    saves = ", ".join(f"{s * 1000:.1f}" for s in e["save_s"])
                    print(
                        f"   r{e['round']} {e['mode']:5} {e['wall']:.3f}s "
                        f"(drain {e['drain']:.3f}s) save() ms [{saves}] "
                        f"oth {e['foreign_cpu']:.0%}",
                        flush=True,
                    )

    def run(self) -> None:
        with h.run_dir(self.args.dir) as d:
            print(f"== {d} ({h.fs_type(d)})", flush=True)
            if "multi" in self.args.part:
                self.multi(d)
            if "lazy" in self.args.part:
                self.lazy(d)


# --------------------------------------------------------------------------- report


def compare(es: list[dict[str, Any]], who: str, key: str, num: str, den: str) -> Any:
    """:func:`harness.ratio` of the per-round ``key`` of contender ``num`` over ``den``."""
    return h.ratio(*({e["round"]: e[key] for e in es if e[who] == c} for c in (num, den)))


def summarize(args: argparse.Namespace, events: list[dict[str, Any]]) -> dict[str, Any]:
    """Rows per (world, contender) and (threads, width, mode); ratios and targets."""
    multi_rows, multi_ratios, lazy_rows, lazy_ratios = [], [], [], []
    for world in sorted({e["world"] for e in events if e["part"] == "multi"}):
        es = [e for e in events if e["part"] == "multi" and e["world"] == world]
        for who in MULTI:
            mine = [e for e in es if e["who"] == who]
            if not mine:
                continue
            blocks = [e["block"] for e in mine]
            row = {
                "world": world,
                "who": who,
                "n": len(mine),
                "per_rank_MiB": mine[0]["per_rank_bytes"] / h.MiB,
                "block_median_s": h.med(blocks),
                "block_min_s": min(blocks),
                "block_max_s": max(blocks),
                "total_median_s": h.med([e["total"] for e in mine]),
                "other_cpu_median": h.med([e["foreign_cpu"] for e in mine]),
            }
            row["block_GiBps_per_rank"] = mine[0]["per_rank_bytes"] / h.GiB / row["block_median_s"]
            tm = [e["timings_max"] for e in mine if "timings_max" in e]
            if tm:
                row["phases_median_max_over_ranks"] = {k: h.med([t[k] for t in tm]) for k in tm[0]}
            multi_rows.append(row)
        for label, goal in (
            ("block distckpt/copy", ("<=", 1.2)),
            ("block distckpt/dcp", ("<", 1.0)),
            ("block distckpt/dcp-cached", None),
            ("block dcp-cached/copy", None),
            ("total distckpt/dcp", None),
            ("total distckpt/dcp-cached", None),
        ):
            key, pair = label.split()
            q = compare(es, "who", key, *pair.split("/"))
            if q is not None:
                multi_ratios.append(
                    {"world": world, "label": label, **q, **h.target(q["value"], goal)}
                )

    for threads, width in sorted(
        {(e["threads"], e["width"]) for e in events if e["part"] == "lazy"}
    ):
        es = [
            e
            for e in events
            if e["part"] == "lazy" and (e["threads"], e["width"]) == (threads, width)
        ]
        for mode in MODES:
            mine = [e for e in es if e["mode"] == mode]
            if not mine:
                continue
            saves = [s for e in mine for s in e["save_s"]]
            after = [s for e in mine for s in e["step_after_save_s"]]
            walls = [e["wall"] for e in mine]
            lazy_rows.append(
                {
                    "threads": threads,
                    "width": width,
                    "mode": mode,
                    "n": len(mine),
                    "wall_median_s": h.med(walls),
                    "wall_min_s": min(walls),
                    "wall_max_s": max(walls),
                    "drain_median_s": h.med([e["drain"] for e in mine]),
                    "save_median_ms": 1000 * h.med(saves) if saves else None,
                    "save_max_ms": 1000 * max(saves) if saves else None,
                    "step_after_save_median_ms": 1000 * h.med(after),
                    "step_after_save_max_ms": 1000 * max(after) if after else None,
                    "other_cpu_median": h.med([e["foreign_cpu"] for e in mine]),
                }
            )
        for num, den in (
            ("lazy", "async"),
            ("lazy", "sync"),
            ("async", "sync"),
            ("async", "none"),
            ("lazy", "none"),
            ("sync", "none"),
        ):
            q = compare(es, "mode", "wall", num, den)
            if q is not None:
                label = f"wall {num}/{den}"
                lazy_ratios.append({"threads": threads, "width": width, "label": label, **q})
    return {
        "multi_rows": multi_rows,
        "multi_ratios": multi_ratios,
        "lazy_rows": lazy_rows,
        "lazy_ratios": lazy_ratios,
    }


def print_report(s: dict[str, Any]) -> None:
    if s["multi_rows"]:
        print(
            "\nasync save: blocking time (barrier to the slowest rank's return) "
            "and total (to committed)"
        )
        print(
            f"{'world':>5} {'who':10} {'MiB/rank':>8} {'n':>2} {'block med s':>11} {'min s':>7} "
            f"{'max s':>7} {'GiB/s/rank':>10} {'total med s':>11} {'oth%':>5}"
        )
        for r in s["multi_rows"]:
            print(
                f"{r['world']:>5} {r['who']:10} {r['per_rank_MiB']:8.0f} {r['n']:>2} "
                f"{r['block_median_s']:11.4f} {r['block_min_s']:7.4f} {r['block_max_s']:7.4f} "
                f"{r['block_GiBps_per_rank']:10.2f} {r['total_median_s']:11.3f} "
                f"{100 * r['other_cpu_median']:5.0f}"
            )
        print(
            f"\n{'world':>5} {'ratio':28} {'of medians':>10} {'paired med [min..max]':>24} "
            f"{'target':>7} ok"
        )
        for q in s["multi_ratios"]:
            print(
                f"{q['world']:>5} {q['label']:28} {q['value']:10.3f} {h.paired_text(q)} "
                f"{q['target']:>7} {h.ok_text(q)}"
            )
        h.print_phases(
            s["multi_rows"],
            lambda r: f"world {r['world']}:",
            "phases_median_max_over_ranks",
            digits=4,
        )
    if s["lazy_rows"]:
        print(
            "\nlazy saves, one process: wall time of the steps (+ final sync), manager.save() call"
        )
        print(
            f"{'thr':>3} {'width':>5} {'mode':5} {'n':>2} {'wall med s':>10} {'min s':>7} "
            f"{'max s':>7} {'drain s':>7} {'save() med ms':>13} {'max ms':>8} "
            f"{'step after save med/max ms':>26} {'oth%':>5}"
        )
        for r in s["lazy_rows"]:
            sm = "" if r["save_median_ms"] is None else f"{r['save_median_ms']:.2f}"
            sx = "" if r["save_max_ms"] is None else f"{r['save_max_ms']:.2f}"
            am = f"{r['step_after_save_median_ms']:.1f}/{r['step_after_save_max_ms']:.1f}"
            print(
                f"{r['threads']:>3} {r['width']:>5} {r['mode']:5} {r['n']:>2} "
                f"{r['wall_median_s']:10.3f} {r['wall_min_s']:7.3f} {r['wall_max_s']:7.3f} "
                f"{r['drain_median_s']:7.3f} {sm:>13} {sx:>8} {am:>26} "
                f"{100 * r['other_cpu_median']:5.0f}"
            )
        print(
            f"\n{'thr':>3} {'width':>5} {'ratio':16} {'of medians':>10} "
            f"{'paired med [min..max]':>24}"
        )
        for q in s["lazy_ratios"]:
            print(
                f"{q['threads']:>3} {q['width']:>5} {q['label']:16} {q['value']:10.3f} "
                f"{h.paired_text(q)}"
            )


# --------------------------------------------------------------------------- main


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    h.common_args(p)
    p.add_argument("--part", nargs="+", choices=["multi", "lazy"], default=["multi", "lazy"])
    p.add_argument("--dir", default="/dev/shm/distckpt-bench", help="parent directory of the files")
    p.add_argument("--quick", action="store_true", help="smoke run (~1 min): small sizes, 2 rounds")
    g = p.add_argument_group("multi (torchrun)")
    g.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    g.add_argument("--rounds", type=int, default=8)
    g.add_argument("--tensors", type=int, default=8)
    g.add_argument("--rows-per-rank", type=int, default=1024)
    g.add_argument("--cols", type=int, default=4096, help="default: 8 x 1024 x 4096 = 128 MiB/rank")
    g.add_argument("--contenders", nargs="+", choices=MULTI, default=list(MULTI))
    g = p.add_argument_group("lazy (one process)")
    g.add_argument("--widths", type=int, nargs="+", default=[1024, 2048])
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--batch", type=int, default=64)
    g.add_argument("--steps", type=int, default=20, help="N steps per round")
    g.add_argument("--every", type=int, default=5, help="K: a save after every K-th step")
    g.add_argument("--lazy-rounds", type=int, default=5)
    g.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[1],
        help="torch threads of the training process (0: torch's default)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.worlds = [2]
        args.rounds = min(args.rounds, 2)
        args.rows_per_rank, args.cols = 256, 2048  # 16 MiB per rank
        args.widths = [256, 512]
        args.lazy_rounds = min(args.lazy_rounds, 2)
        args.steps, args.every = 10, 3
        args.wait_idle = min(args.wait_idle, 5)
    return args


def worker_main(spec_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    (MultiWorker if spec["mode"] == "multi" else LazyWorker).main(spec_file)


if __name__ == "__main__":
    h.main(parse(), Driver, summarize, print_report, worker_main)
