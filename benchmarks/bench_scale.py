#!/usr/bin/env python
"""Coordination at scale: planning for thousands of simulated ranks, plan reuse and
replicated loads with real ranks, against DCP.

Part ``sim`` (one process, no data written): the coordinator's planning driven with the
descriptions of N simulated ranks (``tests/support/simulated_job.py``: 1,000 FSDP-like sharded
weights, 100 small sharded norms, 3 replicated tensors, a per-rank tensor, 2 values), for
N in ``--sim-ranks`` (256, 1,024, 8,192). Per N, medians over ``--rounds``: the time of a
fresh plan (validation, layout, writers, every rank's share), its peak memory
(tracemalloc, a separate run), the time of a reused plan (the coordinator's check of N
fingerprints and the values), the index's bytes and build time, the bytes of one rank's
share and of the part every rank receives, and one rank's read plan for a resharded load
onto 3/4 of the ranks (8,192 -> 6,144). Each is also printed per rank x variable, which
stays flat when growth is linear. Targets: 8,192 ranks planned in <= 5 s and <= 2 GiB, a
reused plan <= 0.1 of a fresh one, one rank's read plan <= 50 ms.

Part ``ranks`` (one torchrun launch of ``--world`` ranks, gloo, 16 by default):

* ``B``: 1,000 tensors of 48 x 64 float32, DTensors ``Shard(0)`` over the ranks (3 rows
  each on 16 ranks). The first distckpt save of the process (the plan is made) is timed
  apart; then ``--rounds`` rounds alternate distckpt (the plan reused) and DCP
  (``dcp.save``, default planner), order rotated. Ratios: distckpt/DCP, first/later.
* ``R``: fully replicated state (1,000 plain 48 x 64 tensors and two of 4 MiB), saved once
  by each; then rounds of loads, order rotated: ``distckpt`` (each rank reads its share,
  the rest exchanged), ``distckpt-all`` (every rank reads everything: distckpt given a
  communicator without ``split``) and DCP. Bytes read from storage, summed over the ranks,
  are reported against the bytes stored (1.0: each byte read once).

Every load is checked bit for bit against the saved values.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import harness as h

SIM_TARGETS = {"plan_s": 5.0, "plan_peak_bytes": 2 * h.GiB, "reuse_ratio": 0.1, "read_plan_s": 0.05}
B_CONTENDERS = ("distckpt", "dcp")
R_CONTENDERS = ("distckpt", "distckpt-all", "dcp")


# --------------------------------------------------------------------------- sim


def run_sim(args: argparse.Namespace) -> list[dict[str, Any]]:
    sys.path.insert(0, str(h.ROOT))
    from tests.support import simulated_job as sim

    events = []
    for n in args.sim_ranks:
        rows = [sim.measure(n, args.sim_layers, peak=k == 0) for k in range(args.rounds)]
        row = {**rows[0]}
        for key in ("plan_s", "reuse_s", "index_s", "index_parse_s", "read_plan_s"):
            row[key] = statistics.median(r[key] for r in rows)
        row["reuse_ratio"] = row["reuse_s"] / row["plan_s"]
        print(
            f" sim {n:5d} ranks: plan {row['plan_s']:.3f}s, peak "
            f"{row['plan_peak_bytes'] / h.MiB:.0f} MiB, reuse {row['reuse_s'] * 1e3:.1f} ms, "
            f"index {row['index_bytes'] / h.MiB:.1f} MiB, read plan "
            f"{row['read_plan_s'] * 1e3:.1f} ms",
            flush=True,
        )
        events.append({"part": "sim", **row})
    return events


# --------------------------------------------------------------------------- ranks


class NoSplit:
    """A communicator without ``split``: distckpt then has every rank read what it
    restores (the ``distckpt-all`` contender)."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm
        self.rank, self.size, self.timeout = comm.rank, comm.size, comm.timeout

    def __getattr__(self, name: str) -> Any:
        if name in ("split", "broadcast_array"):
            raise AttributeError(name)
        return getattr(self._comm, name)


class Worker(h.RankWorker):
    def run(self) -> None:
        spec = self.spec
        self.case_b(Path(spec["dir"]))
        self.case_r(Path(spec["dir"]))

    def value(self, i: int, shape: tuple[int, ...], salt: int) -> Any:
        torch = self.torch
        n = 1
        for s in shape:
            n *= s
        base = torch.arange(n, dtype=torch.float64).reshape(shape)
        return ((base * 1.000001 + i * 7919 + salt * 104729) % 16777213).to(torch.float32)

    def case_b(self, d: Path) -> None:
        from torch.distributed.tensor import DTensor, Shard

        spec = self.spec
        torch = self.torch
        rows, cols = 48, 64
        size = -(-rows // self.world)
        lo, hi = min(rows, self.rank * size), min(rows, (self.rank + 1) * size)
        full = [self.value(i, (rows, cols), 1) for i in range(spec["tensors"])]

        def state(fill: bool) -> dict[str, Any]:
            return {
                f"t{i}": DTensor.from_local(
                    f[lo:hi].clone() if fill else torch.full((hi - lo, cols), -1.0),
                    self.mesh,
                    [Shard(0)],
                    run_check=False,
                    shape=(rows, cols),
                    stride=(cols, 1),
                )
                for i, f in enumerate(full)
            }

        src = state(True)

        def save(who: str, path: Path) -> dict[str, Any]:
            if who == "dcp":
                s = h.timed(self, lambda: self.dcp.save(src, checkpoint_id=str(path)))
                reused = None
            else:
                s = h.timed(self, lambda: self.distckpt.save(src, path, self.comm))
                reused = s.results[0].plan_reused
            return {
                "case": "B",
                "op": "save",
                "who": who,
                "span": s.marks[-1],
                "reused": reused,
                **s.fields(),
            }

        first = save("distckpt", d / "B-first")
        first["who"] = "distckpt-first"
        self.check(None if first["reused"] is False else "the first save reused a plan", "B")
        events = [first]
        dcp_first = save("dcp", d / "B-dcp-first")
        dcp_first["who"] = "dcp-first"
        events.append(dcp_first)
        self.rmtree(d / "B-first", d / "B-dcp-first")
        for rnd, order in enumerate(h.rotations(B_CONTENDERS, spec["rounds"])):
            paths = {who: d / f"B-{rnd}-{who}" for who in order}
            for who in order:
                events.append({**save(who, paths[who]), "round": rnd})
            dst = state(False)
            self.distckpt.load(dst, paths["distckpt"], self.comm)
            bad = next(
                (
                    n
                    for n, f in zip(dst, full, strict=True)
                    if not torch.equal(dst[n].to_local(), f[lo:hi])
                ),
                None,
            )
            self.check(bad and f"B: {bad} differs", "B")
            self.rmtree(*paths.values())
        self.out["events"] += events

    def case_r(self, d: Path) -> None:
        spec = self.spec
        torch = self.torch
        shapes = [(48, 64)] * spec["tensors"] + [(1024, 1024), (1024, 1024)]
        want = {f"r{i}": self.value(i, s, 2) for i, s in enumerate(shapes)}
        paths = {"distckpt": d / "R-distckpt", "dcp": d / "R-dcp"}
        self.distckpt.save(want, paths["distckpt"], self.comm)
        self.dcp.save(want, checkpoint_id=str(paths["dcp"]))
        from distckpt.format.index import read_index
        from distckpt.format.stored import Pieces

        index = read_index(paths["distckpt"])
        stored = sum(
            Pieces(e, n).stored_bytes
            for n, e in index["variables"].items()
            if e.get("kind") == "tensor"
        )
        plain = NoSplit(self.comm)
        events = []
        for rnd, order in enumerate(h.rotations(R_CONTENDERS, spec["rounds"])):
            for who in order:
                dst = {k: torch.full_like(v, -1.0) for k, v in want.items()}
                if who == "dcp":
                    s = h.timed(
                        self, lambda dst=dst: self.dcp.load(dst, checkpoint_id=str(paths["dcp"]))
                    )
                    read = exchanged = None
                else:
                    comm = self.comm if who == "distckpt" else plain
                    s = h.timed(
                        self,
                        lambda dst=dst, comm=comm: self.distckpt.load(dst, paths["distckpt"], comm),
                    )
                    got = self.gather((s.results[0].bytes_read, s.results[0].bytes_exchanged))
                    read = sum(g[0] for g in got)
                    exchanged = sum(g[1] for g in got)
                bad = next((k for k, v in want.items() if not torch.equal(dst[k], v)), None)
                self.check(bad and f"R {who}: {bad} differs", "R")
                events.append(
                    {
                        "case": "R",
                        "op": "load",
                        "who": who,
                        "round": rnd,
                        "span": s.marks[-1],
                        "read_ratio": None if read is None else read / stored,
                        "exchanged": exchanged,
                        "stored": stored,
                        **s.fields(),
                    }
                )
        self.rmtree(*paths.values())
        self.out["events"] += events


class Driver(h.Driver):
    name = "bench_scale"

    def describe(self) -> str:
        a = self.args
        return f"parts {a.part}, sim ranks {a.sim_ranks}, world {a.world}, {a.rounds} rounds"

    def env(self) -> dict[str, Any]:
        return {"fs": {self.args.dir: h.fs_type(Path(self.args.dir).parent)}}

    def run(self) -> None:
        a = self.args
        if "sim" in a.part:
            self.wait_idle()
            self.events += run_sim(a)
        if "ranks" in a.part:
            with h.run_dir(a.dir) as d:
                spec = {"dir": str(d), "rounds": a.rounds, "tensors": a.tensors}
                busy = self.wait_idle()
                out, wall, _ = self.launch_worker(
                    h.torchrun(a.world), __file__, spec, f"ranks-{a.world}", h.TORCHRUN_ENV
                )
                print(f" ranks: {a.world} ranks, {wall:.1f}s launch", flush=True)
                self.events += [{"part": "ranks", "busy_before": busy, **e} for e in out["events"]]


def summarize(args: argparse.Namespace, events: list[dict[str, Any]]) -> dict[str, Any]:
    sim_rows = [e for e in events if e.get("part") == "sim"]
    out: dict[str, Any] = {"sim": sim_rows, "ratios": []}

    def series(case: str, who: str) -> dict[Any, float]:
        return {
            e["round"]: e["span"]
            for e in events
            if e.get("case") == case and e["who"] == who and "round" in e
        }

    def once(case: str, who: str) -> float | None:
        return next((e["span"] for e in events if e.get("case") == case and e["who"] == who), None)

    def add(label: str, q: dict[str, float] | None, goal: tuple[str, float] | None) -> None:
        if q is not None:
            out["ratios"].append({"ratio": label, **q, **h.target(q["paired_median"], goal)})

    add(
        "B save time distckpt (reused plan) / DCP",
        h.ratio(series("B", "distckpt"), series("B", "dcp")),
        ("<=", 0.2),
    )
    first = once("B", "distckpt-first")
    later = series("B", "distckpt")
    if first and later:
        value = h.med(list(later.values())) / first
        out["ratios"].append(
            {
                "ratio": "B save time distckpt later / first",
                "value": value,
                "paired_median": value,
                "paired_min": min(later.values()) / first,
                "paired_max": max(later.values()) / first,
                **h.target(value, ("<", 1.0)),
            }
        )
    dcp_first = once("B", "dcp-first")
    if first and dcp_first:
        value = first / dcp_first
        out["ratios"].append(
            {
                "ratio": "B first save time distckpt / DCP",
                "value": value,
                "paired_median": value,
                "paired_min": value,
                "paired_max": value,
                **h.target(value, None),
            }
        )
    add("R load time distckpt / DCP", h.ratio(series("R", "distckpt"), series("R", "dcp")), None)
    add(
        "R load time distckpt / distckpt-all",
        h.ratio(series("R", "distckpt"), series("R", "distckpt-all")),
        None,
    )
    reads = {}
    for who in ("distckpt", "distckpt-all"):
        ratios = [e["read_ratio"] for e in events if e.get("case") == "R" and e["who"] == who]
        if ratios:
            reads[who] = h.med(ratios)
    out["read_ratio"] = reads
    return out


def print_report(summary: dict[str, Any]) -> None:
    rows = summary["sim"]
    if rows:
        print("\nsimulated planning (medians; per rank x variable in parentheses)")
        print(
            f"{'ranks':>6} {'pieces':>9} {'plan s':>8} {'peak MiB':>9} {'reuse/plan':>10} "
            f"{'index MiB':>10} {'share KiB':>10} {'max share KiB':>14} {'read plan ms':>13}"
        )
        for r in rows:
            rv = r["ranks"] * r["variables"]
            print(
                f"{r['ranks']:6d} {r['pieces']:9d} {r['plan_s']:8.3f} "
                f"{r.get('plan_peak_bytes', 0) / h.MiB:9.0f} {r['reuse_ratio']:10.4f} "
                f"{r['index_bytes'] / h.MiB:10.2f} {r['share_bytes_mean'] / 1024:10.1f} "
                f"{r['share_bytes_max'] / 1024:14.1f} {r['read_plan_s'] * 1e3:13.1f}"
            )
            print(
                f"{'':6} {'':9} ({r['plan_s'] / rv * 1e6:.2f} us, "
                f"{r.get('plan_peak_bytes', 0) / rv:.0f} B, index {r['index_bytes'] / rv:.1f} B)"
            )
        big = rows[-1]
        for key, limit in SIM_TARGETS.items():
            value = big.get(key)
            if value is None:
                continue
            ok = "yes" if value <= limit else "NO"
            print(f"  target {key} at {big['ranks']} ranks: {value:.4g} <= {limit:.4g}: {ok}")
    if summary["ratios"]:
        print(f"\n{'ratio (paired median [min..max])':52} {'value':>28} {'target':>8} {'ok':>4}")
        for q in summary["ratios"]:
            print(f"{q['ratio']:52} {h.paired_text(q):>28} {q['target']:>8} {h.ok_text(q):>4}")
    for who, value in summary.get("read_ratio", {}).items():
        print(f"R bytes read from storage / stored, {who}: {value:.4f}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.common_args(p)
    p.add_argument("--part", nargs="+", default=["sim", "ranks"], choices=["sim", "ranks"])
    p.add_argument("--sim-ranks", type=int, nargs="+", default=[256, 1024, 8192])
    p.add_argument("--sim-layers", type=int, default=1000)
    p.add_argument("--world", type=int, default=16)
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default="/dev/shm/distckpt-bench")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    h.main(args, Driver, summarize, print_report, Worker.main)
