#!/usr/bin/env python
"""Node-local tier benchmark: saves to a node-local RAM disk (each rank's partitions also
copied to a peer on another node) vs persistent saves to the shared directory, and
recovery from each.

The driver (``python benchmarks/bench_local.py ...``) launches torchrun workers (this same
file, ``--worker SPEC``) with gloo, ``OMP_NUM_THREADS=1`` and ``GLOO_SOCKET_IFNAME=lo``,
collects what rank 0 of each launch reports and prints a table and ratios (see
benchmarks/README.md). The ranks play several nodes of one machine: each worker sets
``DISTCKPT_NODE=n{rank // ranks_per_node}`` (default 2 ranks per node) before it builds a
manager, so the local tier directory ``<local-dir>/{node}`` is one per simulated node.

State: case A of bench_engine.py (16 float32 tensors of (4096 * gib) x 4096, ``Shard(0)``
DTensors on a 1-D CPU mesh of 4 ranks, the same closed-form values), in a
``distckpt.Checkpoint(state=..., step=...)``. Contenders, on the same tensors:

* ``local``: a ``CheckpointManager`` on its own shared directory with
  ``local=LocalTier(<local-dir>, replicas=1)`` and a persistent ``checkpoint_interval``
  never reached: its first ``save()`` (untimed, at setup) is persistent, as every
  manager's first save is; every later ``save()`` goes to the local tier;
* ``persistent``: a ``CheckpointManager`` on another shared directory, no local tier,
  ``save(check_interval=False)``: always a persistent checkpoint.

Three launches:

1. **Saves** (4 ranks): an untimed warm-up save of every contender and kind, then rounds
   of ``local-sync``, ``persistent-sync`` (``manager.save()``: blocking, so block time =
   time to durable), ``local-async``, ``persistent-async`` (``manager.save(async_save=
   True)``: block = until it returns, durable = until ``handle.wait()`` returns), order
   rotated every round. Retention (``max_to_keep`` of each tier) runs inside the saves,
   as in training: it is part of the time, and keeps the disk and the RAM disk from
   filling.
2. **Recovery** (4 ranks): a fresh manager per restore (untimed: it reads the pointer),
   the targets filled with -1, every shared-directory file evicted from the page cache
   (``--cache cold``), then a timed ``restore_or_initialize()``: from the local tier
   (the newest local step is newer than the shared directory's only checkpoint) vs from
   the shared store. Verified warm-up restores first, then rounds, order rotated.
3. **Recovery after a lost node** (``--lost-world``, default 2 ranks): the driver deletes
   node ``n1``'s local directory, then the same restores on 2 ranks (both on node
   ``n0``, which holds its own partitions and ``n1``'s replicas): resharded 4 -> 2.

Timing: :func:`harness.timed` (a barrier, every rank notes its start, ..., max(end) -
min(start) over the ranks). Correctness: after every restore the tier and number that
``manager.restored`` reports are checked, then the values with bench_engine's
``verify`` (first and last local row of every tensor and one whole tensor, rotating,
bit for bit); any mismatch aborts the run (``VERIFY FAILED``).
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Any

import bench_engine as be
import harness as h

TIERS = ("local", "persistent")
SAVES = ("local-sync", "persistent-sync", "local-async", "persistent-async")
NEVER = 1 << 40  # a persistent checkpoint_interval the step counter never reaches

# --------------------------------------------------------------------------- worker


class Worker(h.RankWorker):
    """A save launch or a restore launch, by spec mode."""

    def run(self) -> None:
        spec = self.spec
        # before any manager exists: the local tier reads it at its first collective
        os.environ[self.distckpt.local.NODE_ENV] = f"n{self.rank // spec['ranks_per_node']}"
        {"save": self.run_save, "restore": self.run_restore}[spec["mode"]]()

    def manager(self, tier: str, state: dict[str, Any], step: Any) -> Any:
        """A contender's manager over ``state`` (see the module doc)."""
        spec, dc = self.spec, self.distckpt
        ckpt = dc.Checkpoint(state=state, step=step)
        if tier == "persistent":
            return dc.CheckpointManager(
                ckpt,
                spec["shared"]["persistent"],
                max_to_keep=spec["persistent_keep"],
                comm=self.comm,
            )
        local = dc.LocalTier(
            spec["local_dir"], replicas=spec["replicas"], max_to_keep=spec["local_keep"]
        )
        return dc.CheckpointManager(
            ckpt,
            spec["shared"]["local"],
            max_to_keep=1,
            checkpoint_interval=NEVER,
            step_counter=step,
            comm=self.comm,
            local=local,
        )

    def wrong_tier(self, tier: str, path: Any) -> str | None:
        """None if the save of ``path`` went where contender ``tier`` must save."""
        want = (
            self.distckpt.LocalTier(self.spec["local_dir"]).path()
            if tier == "local"
            else self.spec["shared"]["persistent"]
        )
        return None if str(path).startswith(want) else f"saved {path}, not under {want}"

    def start(self, who: str, mgr: Any) -> Any:
        """The call of ``who``'s save (tier-kind): a path, or an async handle."""
        tier, kind = who.split("-")
        return mgr.save(check_interval=tier == "local", async_save=kind == "async")

    def save(self, who: str, mgr: Any) -> Any:
        """One untimed save of ``who``, waited for; its path."""
        out = self.start(who, mgr)
        if who.endswith("async"):
            out.wait()
            return out.path
        return out

    def timed_save(self, who: str, mgr: Any) -> dict[str, Any]:
        """One timed save: ``block`` until the call returns, ``durable`` until the save is
        durable (the same for a blocking save)."""
        tier, kind = who.split("-")
        steps: list[Any] = [lambda: self.start(who, mgr)]
        if kind == "async":
            steps.append(lambda handle: handle.wait())
        sec = h.timed(self, *steps)
        path = sec.results[0].path if kind == "async" else sec.results[0]
        self.check(self.wrong_tier(tier, path), f"{who} save")
        ev = {"op": f"save {kind}", "who": tier, "world": self.world}
        ev.update(block=sec.marks[0], durable=sec.marks[-1], **sec.fields())
        if kind == "async":
            ev["timings_max"] = self.allmax(dict(sec.results[1].timings))
        return ev

    def run_save(self) -> None:
        spec = self.spec
        src = be.make_state(spec, self.mesh, fill=True)
        step = self.torch.zeros((), dtype=self.torch.int64)
        mgrs = {t: self.manager(t, src, step) for t in TIERS}
        # the local contender's first save is persistent (every manager's first save is)
        first = mgrs["local"].save()
        self.check(None if first.startswith(spec["shared"]["local"]) else first, "first save")
        for who in SAVES:  # warm-up: the pool of host buffers, the background group, pages
            path = self.save(who, mgrs[who.split("-")[0]])
            self.check(self.wrong_tier(who.split("-")[0], path), f"{who} warm-up save")
        for rnd, order in enumerate(spec["orders"]):
            for who in order:
                step.add_(1)
                ev = self.timed_save(who, mgrs[who.split("-")[0]])
                self.out["events"].append({**ev, "round": rnd})
        latest = mgrs["persistent"].latest_checkpoint
        self.out["newest"] = {
            "local": mgrs["local"].checkpoint.save_counter,  # local steps: the save counter
            "persistent": int(Path(latest).name.rsplit("-", 1)[1]),
        }
        for m in mgrs.values():
            m.close()

    def restore(self, who: str, state: dict[str, Any], salt: int) -> dict[str, Any]:
        """One timed ``restore_or_initialize()`` of contender ``who``, checked."""
        spec = self.spec
        for dt in state.values():
            dt.to_local().fill_(-1.0)
        step = self.torch.full((), -1, dtype=self.torch.int64)
        mgr = self.manager(who, state, step)  # untimed: a restarted job builds it first
        if spec["cold"]:
            self.barrier()
            if self.rank == 0:
                h.evict([Path(p) for p in spec["shared"].values()])
        sec = h.timed(self, mgr.restore_or_initialize)
        got = mgr.restored
        mgr.close()
        want = spec["newest"][who]
        err = None
        if got is None or (got.tier, got.number) != (who, want):
            err = f"restored {got}, expected the {who} tier's number {want}"
        self.check(err or be.verify(spec, state, self.rank, self.world, salt), f"{who} restore")
        ev = {"op": spec["op"], "who": who, "world": self.world, "block": sec.marks[0]}
        ev.update(durable=sec.marks[0], reason=got.reason if got else None, **sec.fields())
        return ev

    def run_restore(self) -> None:
        state = be.make_state(self.spec, self.mesh, fill=False)
        for who in TIERS:  # warm-up, verified too
            self.restore(who, state, salt=101)
        for rnd, order in enumerate(self.spec["orders"]):
            for who in order:
                self.out["events"].append({**self.restore(who, state, salt=rnd), "round": rnd})


# --------------------------------------------------------------------------- driver


def split_template(template: str) -> tuple[Path, str]:
    """(the directory above the first ``{node}`` component, the rest of the template)."""
    parts = Path(template).parts
    at = next((i for i, p in enumerate(parts) if "{node}" in p), None)
    if at is None or at == 0:
        raise SystemExit(f"--local-dir {template!r} needs a {{node}} component (one per node)")
    return Path(*parts[:at]), str(Path(*parts[at:]))


class Driver(h.Driver):
    """A save launch, a restore launch, and a restore launch after a node is lost."""

    name = "bench_local"

    def describe(self) -> str:
        a = self.args
        return (
            f"{a.tensors} x {a.rows}x{a.cols} f32 ({a.gib:g} GiB) on {a.world} ranks as "
            f"{-(-a.world // a.ranks_per_node)} nodes, {a.replicas} replica(s), local "
            f"{a.local_dir}, shared {a.shared_dir}, {a.rounds} save rounds, "
            f"{a.restore_rounds} restore rounds"
        )

    def env(self) -> dict[str, Any]:
        a = self.args
        return {
            "shared_fs": h.fs_type(Path(a.shared_dir)),
            "local_fs": h.fs_type(split_template(a.local_dir)[0]),
        }

    def launch(self, nproc: int, spec: dict[str, Any], label: str) -> dict[str, Any]:
        busy = self.wait_idle()
        out, wall, m = self.launch_worker(h.torchrun(nproc), __file__, spec, label, h.TORCHRUN_ENV)
        print(
            f"  {label}: {wall:.1f}s launch; other CPU before {busy:.0%}; avail "
            f"{m['MemAvailable']:.1f} GiB, shmem {m['Shmem']:.1f} GiB",
            flush=True,
        )
        for e in out["events"]:
            e["busy_before_launch"] = busy
            self.events.append(e)
            durable = f" durable {e['durable']:.3f}s" if e["op"] == "save async" else ""
            print(
                f"   r{e['round']} {e['op']:12} {e['who']:10} block {e['block']:.3f}s"
                f"{durable} oth {e['foreign_cpu']:.0%}",
                flush=True,
            )
        return out

    def run(self) -> None:
        a = self.args
        local_parent, rest = split_template(a.local_dir)
        with h.run_dir(a.shared_dir) as d, h.run_dir(local_parent) as ld:
            shared_fs, local_fs = h.fs_type(d), h.fs_type(ld)
            if shared_fs == "tmpfs":
                raise SystemExit(
                    f"--shared-dir {a.shared_dir} is tmpfs: the shared store must be a disk"
                )
            local = str(ld / rest)
            need = (a.local_keep + 1) * (1 + a.replicas) * a.gib
            for where, gib in ((ld, need), (d, 3 * a.gib)):
                free = shutil.disk_usage(where).free / h.GiB
                if free < gib + 1:
                    raise SystemExit(f"{where}: {free:.1f} GiB free, the run needs ~{gib:.1f} GiB")
            print(
                f"== shared {d} ({shared_fs}), local tier {local} ({local_fs}); the local tier "
                f"holds up to {need:.1f} GiB during a save",
                flush=True,
            )
            shared = {t: str(d / f"shared-{t}") for t in TIERS}
            spec0 = {
                "ntensors": a.tensors,
                "rows": a.rows,
                "cols": a.cols,
                "shared": shared,
                "local_dir": local,
                "ranks_per_node": a.ranks_per_node,
                "replicas": a.replicas,
                "local_keep": a.local_keep,
                "persistent_keep": a.persistent_keep,
                "cold": a.cache == "cold",
            }
            print(f" saves: {a.world} ranks, {a.rounds} rounds", flush=True)
            spec = {**spec0, "mode": "save", "orders": h.rotations(SAVES, a.rounds)}
            newest = self.launch(a.world, spec, "save")["newest"]
            spec = {**spec0, "mode": "restore", "newest": newest}
            spec["orders"] = h.rotations(TIERS, a.restore_rounds)
            op = f"restore {a.world}->{a.world}"
            print(f" {op}: newest {newest}, {a.restore_rounds} rounds", flush=True)
            self.launch(a.world, {**spec, "op": op}, "restore")
            if a.lost_world:
                lost = local.replace("{node}", a.lose_node)
                shutil.rmtree(lost)  # the node is lost: its directory with it
                op = f"restore {a.world}->{a.lost_world} ({a.lose_node} lost)"
                print(f" {op}: removed {lost}", flush=True)
                self.launch(a.lost_world, {**spec, "op": op}, f"restore-{a.lost_world}")


# --------------------------------------------------------------------------- report


def summarize(args: argparse.Namespace, events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (op, tier): the spread of the times; paired ratios local/persistent."""
    nbytes = args.tensors * args.rows * args.cols * 4
    ops = list(dict.fromkeys(e["op"] for e in events))
    rows, ratios = [], []
    for op in ops:
        for who in TIERS:
            es = [e for e in events if e["op"] == op and e["who"] == who]
            if not es:
                continue
            block, durable = [e["block"] for e in es], [e["durable"] for e in es]
            row = {"op": op, "who": who, "world": es[0]["world"], "n": len(es)}
            row.update({f"block_{k}": v for k, v in h.spread(block).items() if k != "n"})
            row.update(durable_median_s=h.med(durable), durable_min_s=min(durable))
            row.update(GiBps=nbytes / h.GiB / h.med(durable), bytes=nbytes)
            row["other_cpu_median"] = h.med([e["foreign_cpu"] for e in es])
            tm = [e["timings_max"] for e in es if "timings_max" in e]
            if tm:
                keys = [k for k in tm[0] if all(k in t for t in tm)]
                row["phases_median_max_over_ranks"] = {k: h.med([t[k] for t in tm]) for k in keys}
            reasons = sorted({e["reason"] for e in es if e.get("reason")})
            if reasons:
                row["reasons"] = reasons
            rows.append(row)
        keys = ("block", "durable") if op == "save async" else ("block",)
        for key in keys:
            per_round = [
                {e["round"]: e[key] for e in events if e["op"] == op and e["who"] == who}
                for who in TIERS
            ]
            q = h.ratio(*per_round)
            if q is None:
                continue
            what = "time" if op.startswith("restore") else key
            goal = ("<", 0.5) if op == "save sync" else None
            label = f"{op} {what} local/persistent"
            ratios.append({"label": label, "op": op, **q, **h.target(q["value"], goal)})
    return {"rows": rows, "ratios": ratios}


def print_report(s: dict[str, Any]) -> None:
    print(
        "\nblock: until save() / restore_or_initialize() returns (barrier to the slowest "
        "rank); durable: until the save is durable (async: handle.wait())"
    )
    print(
        f"{'op':26} {'who':10} {'world':>5} {'n':>2} {'block med s':>11} {'min s':>7} "
        f"{'max s':>7} {'durable med s':>13} {'GiB/s':>6} {'oth%':>5}"
    )
    for r in s["rows"]:
        print(
            f"{r['op']:26} {r['who']:10} {r['world']:>5} {r['n']:>2} "
            f"{r['block_median_s']:11.3f} {r['block_min_s']:7.3f} {r['block_max_s']:7.3f} "
            f"{r['durable_median_s']:13.3f} {r['GiBps']:6.2f} {100 * r['other_cpu_median']:5.0f}"
        )
    print(
        f"\n{'time ratio (< 1: local faster)':48} {'of medians':>10} {'of mins':>8} "
        f"{'paired med [min..max]':>24} {'target':>7} ok"
    )
    for q in s["ratios"]:
        print(
            f"{q['label']:48} {q['value']:10.3f} {q['of_mins']:8.3f} {h.paired_text(q)} "
            f"{q['target']:>7} {h.ok_text(q)}"
        )
    phases = [r for r in s["rows"] if "phases_median_max_over_ranks" in r]
    if phases:
        print("\nasync save phases (median over rounds of the max over ranks, s):")
        for r in phases:
            ph = r["phases_median_max_over_ranks"]
            print(f"  {r['who']:10}: " + "  ".join(f"{k} {v:.3f}" for k, v in ph.items()))
    reasons = [r for r in s["rows"] if r.get("reasons")]
    if reasons:
        print("\nwhy each restore took its tier (manager.restored.reason):")
        for r in reasons:
            print(f"  {r['op']} {r['who']}: " + " | ".join(r["reasons"]))


# --------------------------------------------------------------------------- main


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    h.common_args(p)
    p.add_argument(
        "--shared-dir",
        default="/tmp/distckpt-bench",
        help="parent of the shared (persistent) directories, on a disk, not tmpfs (a fresh "
        "run-PID-* directory inside it is used and removed)",
    )
    p.add_argument(
        "--local-dir",
        default="/dev/shm/distckpt-bench-local/{node}",
        help="the local tier's directory, {node} replaced by each node's name (a fresh "
        "run-PID-* directory is put in place of the parent of the {node} component)",
    )
    p.add_argument("--gib", type=float, default=1.0, help="16 tensors of (4096*gib) x 4096 f32")
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--world", type=int, default=4, help="ranks of the saves and the first restore")
    p.add_argument("--ranks-per-node", type=int, default=2, help="DISTCKPT_NODE=n{rank//this}")
    p.add_argument("--replicas", type=int, default=1, help="LocalTier replicas")
    p.add_argument("--local-keep", type=int, default=2, help="LocalTier max_to_keep")
    p.add_argument("--persistent-keep", type=int, default=1, help="the persistent max_to_keep")
    p.add_argument("--rounds", type=int, default=8, help="save rounds (4 contenders each)")
    p.add_argument("--restore-rounds", type=int, default=6)
    p.add_argument(
        "--lost-world",
        type=int,
        default=2,
        help="ranks of the restore after --lose-node's local directory is deleted (0: skip)",
    )
    p.add_argument("--lose-node", default="n1")
    p.add_argument(
        "--cache",
        choices=["cold", "warm"],
        default="cold",
        help="evict the shared directories' files from the page cache before each timed "
        "restore (cold, default)",
    )
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 64 MiB, 4 save and 2 restore rounds"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.gib = 0.0625
        args.rounds = min(args.rounds, 4)
        args.restore_rounds = min(args.restore_rounds, 2)
        args.wait_idle = min(args.wait_idle, 5)
    args.rows = max(1, round(4096 * args.gib * 4096 / args.cols * 16 / args.tensors))
    return args


if __name__ == "__main__":
    h.main(parse(), Driver, summarize, print_report, Worker.main)
