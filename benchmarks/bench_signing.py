#!/usr/bin/env python
"""Signed checkpoints: what signing costs a save, and verifying a load, in one process.

One process (no torchrun: distckpt's single-process communicator) holds N GiB in 16 equal
tensors (``--gib``, ``--tensors``; GPU tensors when CUDA is available, bfloat16 there,
float32 on CPU), as ``bench_rank.py`` does, and measures with T I/O workers: the
library's default count first, then each ``--workers`` value. Three parts (``--parts``),
each alternating its contenders over the rounds (order rotated each round, reversed
every other cycle, after an untimed warm-up):

* ``hash``: the raw speed of each hash on the same bytes (the tensors' host bytes, a
  1 MiB inner chunk at a time, each chunk's hash then its 4-byte crc32c, as
  ``ShardFile`` does) in T threads: ``blake3``, ``sha256`` and, for scale, ``crc32c``
  (what every save computes). GB/s of the wall time, GB/s of each thread's CPU time
  (one core's speed) and their ratio (the cores used at once: about T when the hash
  runs off the GIL);
* ``sign``: saves ``unsigned`` (``distckpt.save(state, path, io_workers=T)``),
  ``blake3`` and ``sha256`` (the same with ``signing_key=<private PEM>`` and
  ``DISTCKPT_SIGNING_HASH`` set to the algorithm); then loads, ``unsigned`` (of the
  unsigned checkpoint), ``ALG-plain`` (of the signed one, no keys: nothing verified) and
  ``ALG-verified`` (``trusted_keys=<public PEM>``: the signature, the files the index
  lists and every byte read checked against its hash);
* ``baseline``: ordinary (unsigned) saves and loads, ``current`` (this checkout's
  library, frozen as every driver does) against ``baseline`` (``--baseline``: a source
  tree, or a git revision copied with ``git archive``; by default ``f32e27f``, the
  library before signed checkpoints), each in a worker process of its own that holds its
  own tensors and serves requests (:meth:`harness.Driver.start_peer`; a fresh pair every
  ``--peer-rounds`` rounds), at the default T. Each worker times its whole operation
  (``harness.timed``); the driver alternates the two every round. Each saves its own
  checkpoint; both then load the same one (saved by each version in turn).

Timing: :func:`harness.timed` (``oth%``: CPU used by other processes meanwhile), and the
CPU time of the process (``getrusage``: user + system, all threads) for every operation,
which other processes disturb less than the wall time. On a disk (not tmpfs) the files
are evicted from the page cache before each timed load (``--cache warm`` keeps them).

Correctness: element k of tensor i holds the low bits of a hash of (i, k), as in
``bench_rank.py``. Targets are filled with all-ones bits before every load, and after it
every byte of every tensor is compared with the source tensors, and the first and last
rows with the formula. The warm-up also checks that each signed checkpoint's index
names its algorithm and that a verified load refuses the unsigned checkpoint, and the
signed ones when it trusts only another key. A mismatch aborts the run (``VERIFY FAILED``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import harness as h
from bench_rank import io_workers_api

ALGORITHMS = ("blake3", "sha256")
SAVERS = ("unsigned", *ALGORITHMS)
LOADERS = ("unsigned", *(f"{a}-{how}" for a in ALGORITHMS for how in ("plain", "verified")))
HASHES = (*ALGORITHMS, "crc32c")
VERSIONS = ("current", "baseline")
#: Bytes hashed at a time by the hash part: distckpt's default inner chunk.
PIECE = 1 << 20
#: Environment variables that would sign or verify an ordinary save or load.
SIGNING_ENV = ("DISTCKPT_SIGNING_KEY", "DISTCKPT_TRUSTED_KEYS", "DISTCKPT_SIGNING_HASH")
HASH_ENV = "DISTCKPT_SIGNING_HASH"
#: Goals: a signed save at the default T; ordinary operations against the baseline.
SIGNED_GOAL = ("<=", 1.2)
BASELINE_GOAL = ("<=", 1.03)

# --------------------------------------------------------------------------- the tensors


class State(h.PatternTensors):
    """The source tensors (filled with the pattern), the targets of loads, and checks."""

    def verify(self, what: str) -> None:
        """Every byte of every target against its source, and the first and last rows of
        both against the formula."""
        torch = self.torch
        for i, name in enumerate(self.names):
            got, want = self.dst[name], self.src[name]
            if got.dtype != self.dtype or got.shape != want.shape or got.device != self.device:
                raise SystemExit(f"VERIFY FAILED ({what}): {name} is {got.dtype} {got.shape}")
            a, b = got.view(self.int_dtype), want.view(self.int_dtype)
            if not torch.equal(a, b):
                bad = int((a != b).sum())
                raise SystemExit(f"VERIFY FAILED ({what}): {name}, {bad} elements differ")
            for r in (0, self.rows - 1):
                ref = self.pattern(i, r * self.cols, self.cols)
                if not (torch.equal(a[r], ref) and torch.equal(b[r], ref)):
                    raise SystemExit(f"VERIFY FAILED ({what}): {name} row {r} vs the formula")

    def host_pieces(self) -> list[memoryview]:
        """The sources' bytes in host memory (a copy from the GPU), :data:`PIECE` at a
        time."""
        pieces = []
        for t in self.src.values():
            host = t.cpu() if self.cuda else t
            flat = memoryview(host.reshape(-1).view(self.torch.uint8).numpy())
            pieces += [flat[o : o + PIECE] for o in range(0, len(flat), PIECE)]
        return pieces


def timed_op(fn: Callable[[], Any]) -> tuple[dict[str, Any], Any]:
    """Time ``fn`` in this process (:func:`harness.timed`) with the process's CPU time;
    (the event's fields, what ``fn`` returned)."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    sec = h.timed(h.SOLO, fn)
    after = resource.getrusage(resource.RUSAGE_SELF)
    user, sys_s = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    ev = {"span": sec.marks[0], **sec.fields(), "user_s": user, "sys_s": sys_s}
    ev["cpu_s"] = user + sys_s
    return ev, sec.results[0]


def quiet_library() -> None:
    """No progress bar, and no key from the environment: only the contenders sign."""
    os.environ["DISTCKPT_PROGRESS"] = "0"
    for name in SIGNING_ENV:
        os.environ.pop(name, None)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")


# --------------------------------------------------------------------------- hashing


def hash_pass(pool: ThreadPoolExecutor, pieces: list[memoryview], alg: str) -> float:
    """Hash every piece (each on its own, then the 4-byte tail, as a shard's chunk) on the
    pool's threads, 16 pieces per task; the threads' CPU seconds."""
    import crc32c

    from distckpt.signing import hashes

    tail = b"\0\0\0\0"
    make = None if alg == "crc32c" else hashes.hasher(alg)

    def work(group: list[memoryview]) -> float:
        c = time.thread_time()
        for piece in group:
            if make is None:
                crc32c.crc32c(piece)
            else:
                hsh = make()
                hsh.update(piece)
                hsh.update(tail)
                hsh.digest()
        return time.thread_time() - c

    groups = [pieces[k : k + 16] for k in range(0, len(pieces), 16)]
    return sum(pool.map(work, groups))


# --------------------------------------------------------------------------- the driver


class Driver(h.Driver):
    """The hash and sign parts in this process; the baseline part in two workers."""

    name = "bench_signing"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        quiet_library()
        if self.snapshot:
            sys.path.insert(0, self.snapshot["path"])
        import distckpt
        from distckpt.signing import SigningKey, hashes

        if self.snapshot and not distckpt.__file__.startswith(self.snapshot["path"]):
            raise SystemExit(f"imported {distckpt.__file__}, not the snapshot")
        self.distckpt = distckpt
        self.keyword, self.default = io_workers_api(distckpt)
        if not self.keyword:
            raise SystemExit("this distckpt takes no io_workers=: not the library to measure")
        given = args.workers or []
        self.ts = list(dict.fromkeys([self.default, *given]))
        args.default_workers = self.default  # in the JSON: --report finds it there
        made = hashes.available()
        self.algorithms = [a for a in args.algorithms if a in made]
        if not self.algorithms:
            raise SystemExit(f"none of {args.algorithms} can be computed here")
        keys = self.logdir / "keys"
        keys.mkdir()
        self.key, self.pub = keys / "signing.pem", keys / "signing.pub"
        SigningKey.generate().write(self.key, public=self.pub)
        self.other = keys / "other.pub"
        SigningKey.generate().write(keys / "other.pem", public=self.other)
        self.baseline = None
        if "baseline" in args.parts and args.baseline:
            self.baseline = h.library_copy(args.baseline, self.logdir / "baseline")

    def describe(self) -> str:
        a = self.args
        base = f", baseline {a.baseline}" if self.baseline else ""
        return (
            f"{a.gib:g} GiB in {a.tensors} {a.dtype} tensors on {a.device}, T = "
            f"{', '.join(map(str, self.ts))} (default {self.default}), "
            f"{', '.join(self.algorithms)}, parts {', '.join(a.parts)}, dirs {a.dir}, "
            f"{a.rounds} rounds{base}"
        )

    def env(self) -> dict[str, Any]:
        import torch

        blake3 = None
        try:
            import blake3 as b3

            blake3 = getattr(b3, "__version__", "?")
        except ImportError:
            pass
        return {
            "fs": {d: h.fs_type(Path(d).parent) for d in self.args.dir},
            "gpu": torch.cuda.get_device_name() if self.args.device == "cuda" else None,
            "cpu": platform.processor() or _cpu_model(),
            "affinity": len(os.sched_getaffinity(0)),
            "default_io_workers": self.default,
            "workers": self.ts,
            "algorithms": self.algorithms,
            "blake3": blake3,
            "baseline": self.baseline,
        }

    def run(self) -> None:
        a = self.args
        if "hash" in a.parts or "sign" in a.parts:
            state = State(a.gib, a.tensors, a.device, a.dtype)
            print(f"tensors ready: {state.nbytes / h.GiB:g} GiB", flush=True)
            if "hash" in a.parts:
                self.hash_part(state)
            if "sign" in a.parts:
                for parent in a.dir:
                    with h.run_dir(parent) as d:
                        self.sign_part(state, d)
            del state  # the workers of the baseline part hold their own
        if self.baseline is not None:
            self.baseline_part()

    # ----------------------------------------------------------------------- hash

    def hash_part(self, state: State) -> None:
        a = self.args
        pieces = state.host_pieces()
        nbytes = sum(len(p) for p in pieces)
        algs = [*self.algorithms, "crc32c"]
        pools = {t: ThreadPoolExecutor(t, thread_name_prefix="hash") for t in self.ts}
        print(f"== hash: {nbytes / h.GiB:g} GiB, {len(pieces)} pieces", flush=True)
        try:
            for pool in pools.values():  # warm-up: threads started, code paged in
                for alg in algs:
                    hash_pass(pool, pieces[:64], alg)
            for rnd, order in enumerate(h.rotations(algs, a.rounds)):
                busy = self.wait_idle()
                line = []
                for t, pool in pools.items():
                    for alg in order:
                        sec = h.timed(h.SOLO, lambda p=pool, x=alg: hash_pass(p, pieces, x))
                        cpu = sec.results[0]
                        self.events.append(
                            {
                                "part": "hash",
                                "op": "hash",
                                "who": alg,
                                "workers": t,
                                "dir": "",
                                "fs": "memory",
                                "round": rnd,
                                "bytes": nbytes,
                                "span": sec.marks[0],
                                "cpu_s": cpu,
                                "busy_before_round": busy,
                                **sec.fields(),
                            }
                        )
                        line.append(f"T{t} {alg} {nbytes / 1e9 / sec.marks[0]:.2f}")
                print(f" r{rnd} hash GB/s  " + "  ".join(line), flush=True)
        finally:
            for pool in pools.values():
                pool.shutdown()

    # ----------------------------------------------------------------------- sign

    def save(self, state: State, who: str, path: Path, t: int) -> dict[str, Any]:
        """Delete ``who``'s previous checkpoint, then its timed save with ``t`` workers."""
        shutil.rmtree(path, ignore_errors=True)
        kw: dict[str, Any] = {"io_workers": t}
        if who == "unsigned":
            os.environ.pop(HASH_ENV, None)
        else:
            os.environ[HASH_ENV] = who
            kw["signing_key"] = str(self.key)
        state.sync()
        try:
            ev, result = timed_op(
                lambda: (self.distckpt.save(state.src, path, **kw), state.sync())[0]
            )
        finally:
            os.environ.pop(HASH_ENV, None)
        ev.update(op="save", who=who, timings=dict(result.timings))
        ev["stored_bytes"] = result.bytes_written
        return ev

    def load(self, state: State, who: str, path: Path, t: int, cold: bool) -> dict[str, Any]:
        """``who``'s timed load with ``t`` workers, verified after."""
        kw: dict[str, Any] = {"io_workers": t}
        if who.endswith("-verified"):
            kw["trusted_keys"] = str(self.pub)
        state.reset()
        state.sync()
        if cold:
            h.evict([path])
        ev, result = timed_op(lambda: (self.distckpt.load(state.dst, path, **kw), state.sync())[0])
        state.verify(f"{who} load, T={t}")
        ev.update(op="load", who=who, timings=dict(result.timings))
        return ev

    def check_signed(self, state: State, paths: dict[str, Path]) -> None:
        """Each checkpoint's index names its algorithm (none for the unsigned one); a
        verified load refuses the unsigned checkpoint, and the signed ones when it trusts
        only another key."""
        from distckpt.errors import UntrustedCheckpointError

        for who, path in paths.items():
            meta = json.loads((path / "zarr.json").read_text())["attributes"]["distckpt"]
            got = meta.get("hash_algorithm")
            if got != (None if who == "unsigned" else who) or (got and "signature" not in meta):
                raise SystemExit(f"VERIFY FAILED: the {who} checkpoint's index names {got!r}")
        refusals = [(paths["unsigned"], self.pub)]
        refusals += [(paths[alg], self.other) for alg in self.algorithms]
        for path, keys in refusals:
            try:
                self.distckpt.load(state.dst, path, trusted_keys=str(keys))
            except UntrustedCheckpointError:
                continue
            raise SystemExit(f"VERIFY FAILED: {path.name} loaded with trusted keys {keys.name}")

    def sign_part(self, state: State, d: Path) -> None:
        a = self.args
        fs = h.fs_type(d)
        cold = a.cache == "cold" and fs != "tmpfs"
        print(f"== sign: {d} ({fs}, loads {'cold' if cold else 'from memory'})", flush=True)
        savers = ["unsigned", *self.algorithms]
        loaders = [w for w in LOADERS if w.split("-")[0] in savers]
        paths = {w: d / w for w in savers}
        source = {w: paths[w.split("-")[0]] for w in loaders}
        t0 = self.ts[0]
        for who in savers:  # warm-up: untimed, loads verified
            self.save(state, who, paths[who], t0)
        for who in loaders:
            self.load(state, who, source[who], t0, cold)
        self.check_signed(state, paths)
        save_orders = h.rotations(savers, a.rounds)
        load_orders = h.rotations(loaders, a.rounds)
        for rnd in range(a.rounds):
            tag = {"part": "sign", "dir": str(d), "fs": fs, "round": rnd, "bytes": state.nbytes}
            tag["busy_before_round"] = self.wait_idle()
            events = []
            for t in self.ts:
                for who in save_orders[rnd]:
                    events.append({**self.save(state, who, paths[who], t), "workers": t})
                for who in load_orders[rnd]:
                    events.append({**self.load(state, who, source[who], t, cold), "workers": t})
            self.events += [{**tag, **e} for e in events]
            self.check_memory(f"sign {fs} round {rnd}")
            for t in self.ts:
                for op in ("save", "load"):
                    mine = [e for e in events if e["op"] == op and e["workers"] == t]
                    times = "  ".join(f"{e['who']} {e['span']:.3f}" for e in mine)
                    print(f" r{rnd} T{t} {op}  {times}", flush=True)
            oth = max(e["foreign_cpu"] for e in events)
            print(f" r{rnd} other CPU before {tag['busy_before_round']:.0%}, timed max {oth:.0%}")

    # ----------------------------------------------------------------------- baseline

    def baseline_part(self) -> None:
        """Fresh workers every ``--peer-rounds`` rounds (started in turn first): where
        each process's tensors happen to lie in memory is not one version's luck."""
        a = self.args
        for parent in a.dir:
            with h.run_dir(parent) as d:
                orders = h.rotations(list(VERSIONS), a.rounds)
                for launch, first in enumerate(range(0, a.rounds, a.peer_rounds)):
                    rounds = range(first, min(first + a.peer_rounds, a.rounds))
                    starts = list(VERSIONS) if launch % 2 == 0 else list(VERSIONS)[::-1]
                    peers = self.start_peers(starts)
                    try:
                        self.baseline_rounds(peers, d, [(r, orders[r]) for r in rounds], launch)
                    finally:
                        for peer in peers.values():
                            peer.close()

    def start_peers(self, starts: list[str]) -> dict[str, h.Peer]:
        a = self.args
        assert self.baseline is not None
        spec = {"gib": a.gib, "tensors": a.tensors, "device": a.device, "dtype": a.dtype}
        spec["workers"] = self.ts[0]
        libraries = {"current": None, "baseline": self.baseline["path"]}
        peers: dict[str, h.Peer] = {}
        try:
            for who in starts:
                peers[who] = self.start_peer(__file__, spec, who, {}, library=libraries[who])
        except BaseException:
            for peer in peers.values():
                peer.close()
            raise
        self.check_memory("baseline workers")
        return peers

    def baseline_rounds(
        self, peers: dict[str, h.Peer], d: Path, rounds: list[tuple[int, list[str]]], launch: int
    ) -> None:
        a = self.args
        fs = h.fs_type(d)
        cold = a.cache == "cold" and fs != "tmpfs"
        names = ", ".join(f"{w} {Path(p.hello['distckpt_file']).parent}" for w, p in peers.items())
        print(f"== baseline: {d} ({fs}), T = {self.ts[0]}, workers {names}", flush=True)
        paths = {w: d / w for w in peers}
        for who, peer in peers.items():  # warm-up
            peer.ask(op="save", path=str(paths[who]), what="warm-up")
        for peer in peers.values():  # each reads both checkpoints
            for path in paths.values():
                peer.ask(op="load", path=str(path), what="warm-up")
        for rnd, order in rounds:
            tag = {"part": "baseline", "dir": str(d), "fs": fs, "round": rnd, "launch": launch}
            tag["busy_before_round"] = self.wait_idle()
            events = []
            for who in order:
                got = peers[who].ask(op="save", path=str(paths[who]), what=f"round {rnd}")
                events.append({**got, "op": "save", "who": who})
            # Both load the same files (saved by each version in turn): where a file's
            # pages lie moves a load by a few percent on tmpfs, as much as the goal.
            source = paths[VERSIONS[rnd % 2]]
            for who in order:
                if cold:
                    h.evict([source])
                got = peers[who].ask(op="load", path=str(source), what=f"round {rnd}")
                events.append({**got, "op": "load", "who": who, "source": source.name})
            self.events += [{**tag, "workers": self.ts[0], **e} for e in events]
            self.check_memory(f"baseline {fs} round {rnd}")
            for op in ("save", "load"):
                times = "  ".join(f"{e['who']} {e['span']:.3f}" for e in events if e["op"] == op)
                print(f" r{rnd} {op}  {times}", flush=True)
            oth = max(e["foreign_cpu"] for e in events)
            print(f" r{rnd} other CPU before {tag['busy_before_round']:.0%}, timed max {oth:.0%}")


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


# --------------------------------------------------------------------------- a worker


def peer_main(spec_file: str) -> None:
    """A baseline-part worker: its own tensors, then timed ordinary saves and loads with
    the library its ``PYTHONPATH`` names first, one per request (:func:`harness.serve`)."""
    spec = json.loads(Path(spec_file).read_text())
    quiet_library()
    import distckpt

    state = State(spec["gib"], spec["tensors"], spec["device"], spec["dtype"])
    keyword, default = io_workers_api(distckpt)
    kw = {"io_workers": spec["workers"]} if keyword else {}

    def handle(req: dict[str, Any]) -> dict[str, Any]:
        path = Path(req["path"])
        if req["op"] == "save":
            shutil.rmtree(path, ignore_errors=True)
            state.sync()
            ev, result = timed_op(lambda: (distckpt.save(state.src, path, **kw), state.sync())[0])
            ev["stored_bytes"] = result.bytes_written
        else:
            state.reset()
            state.sync()
            ev, result = timed_op(lambda: (distckpt.load(state.dst, path, **kw), state.sync())[0])
            state.verify(f"{req.get('what', '')} load")
        return {**ev, "timings": dict(result.timings), "bytes": state.nbytes}

    first = {"distckpt_file": distckpt.__file__, "io_workers_keyword": keyword}
    h.serve({**first, "default_io_workers": default}, handle)


# --------------------------------------------------------------------------- report


def paired_gmean(num: dict[Any, float], den: dict[Any, float]) -> float:
    """The geometric mean of the per-round ratios: with two contenders that take each
    position equally often, a cost of going first (or second) cancels out of it."""
    logs = [math.log(num[k] / den[k]) for k in num if k in den and den[k] > 0 and num[k] > 0]
    return math.exp(sum(logs) / len(logs)) if logs else float("nan")


def summarize(args: argparse.Namespace, events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (part, dir, op, contender, T): the spread of the times, GB/s, CPU; the ratios."""
    groups: dict[tuple[str, str, str, str, int], list[dict[str, Any]]] = {}
    for e in events:
        groups.setdefault((e["part"], e["dir"], e["op"], e["who"], e["workers"]), []).append(e)
    rows = []
    for (part, d, op, who, t), es in groups.items():
        spans = [e["span"] for e in es]
        row = {"part": part, "dir": d, "fs": es[0]["fs"], "op": op, "who": who, "workers": t}
        row.update(h.spread(spans), spans=spans)
        row["GBps"] = es[0]["bytes"] / 1e9 / row["median_s"]
        row["cpu_median_s"] = h.med([e["cpu_s"] for e in es])
        row["other_cpu_median"] = h.med([e["foreign_cpu"] for e in es])
        if part == "hash":
            row["core_GBps"] = es[0]["bytes"] / 1e9 / row["cpu_median_s"]
            row["parallel"] = h.med([e["cpu_s"] / e["span"] for e in es])
        tm = [e["timings"] for e in es if "timings" in e]
        if tm:
            row["phases_median"] = {k: h.med([x.get(k, 0.0) for x in tm]) for k in tm[0]}
        if "stored_bytes" in es[0]:
            row["stored_bytes"] = es[0]["stored_bytes"]
        rows.append(row)
    order = {"hash": 0, "sign": 1, "baseline": 2}
    names = [*HASHES, *SAVERS, *LOADERS, *VERSIONS]
    rows.sort(
        key=lambda r: (
            order[r["part"]],
            r["dir"],
            r["op"] != "save",
            r["workers"],
            names.index(r["who"]),
        )
    )
    default = getattr(args, "default_workers", None)

    def series(part: str, d: str, op: str, who: str, t: int, key: str) -> dict[Any, float]:
        return {e["round"]: e[key] for e in groups.get((part, d, op, who, t), [])}

    ratios = []

    def add(
        label: str,
        part: str,
        d: str,
        op: str,
        num: str,
        den: str,
        t: int,
        goal: tuple[str, float] | None = None,
        key: str = "span",
    ) -> None:
        a, b = series(part, d, op, num, t, key), series(part, d, op, den, t, key)
        q = h.ratio(a, b)
        if q is None:
            return
        fs = next((e["fs"] for e in events if e["dir"] == d and e["part"] == part), "")
        ratios.append(
            {"label": label, "part": part, "fs": fs, "dir": d, "workers": t, **q}
            | {"paired_gmean": paired_gmean(a, b)}
            | h.target(q["value"], goal)
        )

    ts = sorted({e["workers"] for e in events})
    dirs = list(dict.fromkeys(e["dir"] for e in events if e["part"] != "hash"))
    for t in ts:
        for alg in HASHES:  # the speed-up of T threads over one
            if t != 1 and (("hash", "", "hash", alg, 1) in groups):
                a = series("hash", "", "hash", alg, 1, "span")
                b = series("hash", "", "hash", alg, t, "span")
                q = h.ratio(a, b)
                if q is not None:
                    label = f"hash speed-up {alg} T{t}/T1"
                    ratios.append(
                        {"label": label, "part": "hash", "fs": "memory", "dir": "", "workers": t}
                        | q
                        | {"paired_gmean": paired_gmean(a, b)}
                        | h.target(q["value"], None)
                    )
    for d in dirs:
        for t in ts:
            for alg in ALGORITHMS:
                goal = SIGNED_GOAL if t == default else None
                add(f"save time {alg}/unsigned", "sign", d, "save", alg, "unsigned", t, goal)
                add(f"save cpu {alg}/unsigned", "sign", d, "save", alg, "unsigned", t, key="cpu_s")
            for alg in ALGORITHMS:
                for num, den in (
                    (f"{alg}-plain", "unsigned"),
                    (f"{alg}-verified", "unsigned"),
                    (f"{alg}-verified", f"{alg}-plain"),
                ):
                    add(f"load time {num}/{den}", "sign", d, "load", num, den, t)
                add(
                    f"load cpu {alg}-verified/unsigned",
                    "sign",
                    d,
                    "load",
                    f"{alg}-verified",
                    "unsigned",
                    t,
                    key="cpu_s",
                )
            for op in ("save", "load"):
                add(f"{op} time current/baseline", "baseline", d, op, *VERSIONS, t, BASELINE_GOAL)
                add(f"{op} cpu current/baseline", "baseline", d, op, *VERSIONS, t, key="cpu_s")
    return {"rows": rows, "ratios": ratios, "default_workers": default}


def print_report(summary: dict[str, Any]) -> None:
    rows = summary["rows"]
    hashed = [r for r in rows if r["part"] == "hash"]
    if hashed:
        print("\nhash: GB/s of the wall time, of one core (the threads' CPU time), cores at once")
        print(
            f"{'who':8} {'T':>3} {'n':>2} {'median s':>9} {'GB/s':>7} {'core GB/s':>10} "
            f"{'cores':>6} {'oth%':>5}"
        )
        for r in hashed:
            print(
                f"{r['who']:8} {r['workers']:>3} {r['n']:>2} {r['median_s']:9.3f} "
                f"{r['GBps']:7.2f} {r['core_GBps']:10.2f} {r['parallel']:6.2f} "
                f"{100 * r['other_cpu_median']:5.0f}"
            )
    timed = [r for r in rows if r["part"] != "hash"]
    if timed:
        print(f"\ndefault T = {summary['default_workers']}")
        print(
            f"{'part':8} {'fs':6} {'op':4} {'who':16} {'T':>3} {'n':>2} {'median s':>9} "
            f"{'min s':>7} {'max s':>7} {'GB/s':>6} {'cpu s':>6} {'oth%':>5}"
        )
        for r in timed:
            print(
                f"{r['part']:8} {r['fs'][:6]:6} {r['op']:4} {r['who']:16} {r['workers']:>3} "
                f"{r['n']:>2} {r['median_s']:9.3f} {r['min_s']:7.3f} {r['max_s']:7.3f} "
                f"{r['GBps']:6.2f} {r['cpu_median_s']:6.3f} {100 * r['other_cpu_median']:5.0f}"
            )
    if summary["ratios"]:
        print(
            f"\n{'ratio':40} {'fs':6} {'T':>3} {'of medians':>10} {'of mins':>8} "
            f"{'paired med [min..max]':>24} {'gmean':>6} {'target':>7} ok"
        )
        for q in summary["ratios"]:
            print(
                f"{q['label']:40} {q['fs'][:6]:6} {q['workers']:>3} {q['value']:10.3f} "
                f"{q['of_mins']:8.3f} {h.paired_text(q)} {q.get('paired_gmean', math.nan):6.3f} "
                f"{q['target']:>7} {h.ok_text(q)}"
            )
    h.print_phases(timed, lambda r: f"{r['part']:8} {r['op']:4} {r['who']:16} T{r['workers']:<3}")


# --------------------------------------------------------------------------- main


def parse(argv: list[str] | None = None) -> argparse.Namespace:

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    h.common_args(p)
    h.tensor_args(p)
    p.add_argument(
        "--workers",
        type=int,
        nargs="*",
        help="worker counts T measured besides the library's default (which comes first)",
    )
    p.add_argument(
        "--dir",
        action="append",
        help="parent directory of the checkpoints (a fresh run-PID-* directory inside it is "
        "used and removed; repeat for several); default: /dev/shm/distckpt-bench (tmpfs)",
    )
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument(
        "--parts",
        nargs="+",
        choices=["hash", "sign", "baseline"],
        default=["hash", "sign", "baseline"],
    )
    p.add_argument(
        "--algorithms",
        nargs="+",
        choices=ALGORITHMS,
        default=list(ALGORITHMS),
        help="the hashes of signed saves (those this process cannot compute are left out)",
    )
    p.add_argument(
        "--baseline",
        default="f32e27f",
        help="the library the baseline part compares with: a source tree (holding "
        "distckpt/) or a git revision of this repository (default f32e27f: before signed "
        "checkpoints); '' for none",
    )
    p.add_argument(
        "--peer-rounds",
        type=int,
        default=2,
        help="baseline part: rounds per pair of worker processes (then fresh ones)",
    )
    p.add_argument(
        "--cache",
        choices=["cold", "warm"],
        default="cold",
        help="on a non-tmpfs dir, evict the files before each timed load (cold, default)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 128 MiB, 2 rounds, tmpfs only")
    return h.settle_rank_args(p.parse_args(argv), ["/dev/shm/distckpt-bench"])


if __name__ == "__main__":
    h.main(parse(), Driver, summarize, print_report, peer_main)
