#!/usr/bin/env python
"""Per-process save and load: distckpt vs raw files, DCP and torch.save, in one process.

One process (no torchrun: distckpt uses its single-process communicator) holds N GiB in 16
equal tensors (GPU tensors when CUDA is available, bfloat16 there, float32 on CPU) and,
for each ``--dir``, alternates the contenders over the rounds (order rotated each round,
an untimed warm-up of each first, each contender's previous files deleted right before
its own timed save). T is ``--workers``, by default the library's default I/O worker
count. Contenders (see benchmarks/README.md):

* ``raw``: the limit with T threads and one plain file per tensor. Save: on CUDA every
  tensor is copied device-to-host into pinned buffers allocated beforehand (one
  synchronize), then T threads write the files (from the CPU tensors' own memory on CPU),
  each file fsynced, then the directory. Load: T threads ``preadv`` the files into the
  pinned buffers (CUDA; then host-to-device copies) or straight into the targets (CPU);
* ``distckpt``: ``distckpt.save/load(state, path, io_workers=T)``; ``distckpt-1``: the
  same with ``io_workers=1``;
* ``distckpt-async``: ``distckpt.save(state, path, async_save=True, io_workers=T)``: the
  blocking time (until the call returns) and the total (until ``wait()`` returns: the
  checkpoint is committed);
* ``copy``: the anchor of the blocking time: the pinned device-to-host copy (CUDA) or a
  copy into preallocated, touched host buffers (CPU);
* ``dcp``: ``torch.distributed.checkpoint.save/load(state, checkpoint_id=path)`` with the
  defaults (one file, one thread); ``dcp-T``: ``storage_writer=FileSystemWriter(path,
  thread_count=T)`` (its load reads those T files with the default reader);
* ``torch.save``: ``torch.save(state, file)`` plus fsync of the file and the directory
  (as every other contender makes its files durable) / ``torch.load(file,
  map_location=device, weights_only=True)``.

Timing: :func:`harness.timed` in one process (on CUDA each operation ends with a
``synchronize``, except the blocking part of the async save: the call's return is what
the caller waits for). On a disk (not tmpfs) the contender's files are evicted from the
page cache before each timed load (``--cache warm`` keeps them).

Evidence (``--evidence``, needs ``py-spy``): after the rounds, one more untimed save and
load of each contender, each with ``py-spy record --gil`` attached to this process
(samples of the thread holding the GIL, at ``--gil-rate`` per second): the seconds per
GiB some thread of the process held the GIL (its Python work, which no other thread can
do meanwhile), and the share of the I/O workers' time they sat idle while the operation
still had bytes to move (``distckpt.transfer.workers.USAGE``; raw's own pool the same
way). py-spy counts about 10% low; the process is slowed by the sampling, so these runs
are not timed.

Correctness: element k of tensor i holds the low bits of a hash of (i, k) (sign and top
exponent bit clear: finite values). Targets are filled with all-ones bits before every load; after
it the first, the last and two random rows of every tensor and one whole tensor
(rotating) are compared bit-exactly with the pattern; ``distckpt-async``'s warm-up
checkpoint is loaded and compared too. A mismatch aborts the run (``VERIFY FAILED``).
"""

from __future__ import annotations

import argparse
import inspect
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import crc32c
import harness as h

CONTENDERS = (
    "raw",
    "raw-1",
    "raw-crc-1",
    "distckpt",
    "distckpt-1",
    "distckpt-async",
    "copy",
    "dcp",
    "dcp-T",
    "torch.save",
)
LOADERS = ("raw", "raw-1", "raw-crc-1", "distckpt", "distckpt-1", "dcp", "dcp-T", "torch.save")
#: Bytes per checksum of ``raw-crc-1``: distckpt's inner chunk.
CRC_STEP = 1 << 20
CHUNK = 1 << 30  # bytes per write / preadv call

# --------------------------------------------------------------------------- files


def write_file(path: Path, data: memoryview, crc: bool = False) -> None:
    """Write ``data`` to a new file and fsync it; with ``crc``, :data:`CRC_STEP` bytes at a
    time, the crc32c of each computed before it is written (the least a format that
    checksums its bytes adds)."""
    step = CRC_STEP if crc else CHUNK
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        off = 0
        while off < len(data):
            piece = data[off : off + step]
            if crc:
                crc32c.crc32c(piece)
            off += os.pwrite(fd, piece, off)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_file(path: Path, into: memoryview, crc: bool = False) -> None:
    """Fill ``into`` from the file with ``preadv``; with ``crc``, :data:`CRC_STEP` bytes at
    a time, each checksummed once read."""
    step = CRC_STEP if crc else CHUNK
    fd = os.open(path, os.O_RDONLY)
    try:
        off = 0
        while off < len(into):
            piece = into[off : off + step]
            n = os.preadv(fd, [piece], off)
            if n <= 0:
                raise OSError(f"short read of {path} at {off}")
            if crc:
                crc32c.crc32c(piece[:n])
            off += n
    finally:
        os.close(fd)


def seconds(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def per_byte_costs(data: memoryview) -> dict[str, float]:
    """Seconds per GiB of what distckpt does to every byte it writes, on one core, a MiB
    at a time as distckpt does: crc32c, the content digest (XXH3-128), and both (the
    second from the cache), with a copy to compare."""
    import numpy as np
    import xxhash

    n = min(len(data), 256 << 20)
    src = np.frombuffer(data[:n], dtype=np.uint8)
    dst = np.empty_like(src)
    dst.fill(0)

    def crc(step: Any) -> None:
        crc32c.crc32c(step)

    def digest(step: Any) -> None:
        xxhash.xxh3_128_digest(step)

    def both(step: Any) -> None:
        crc32c.crc32c(step)
        xxhash.xxh3_128_digest(step)

    def copy(off: int) -> None:
        dst[off : off + CRC_STEP] = src[off : off + CRC_STEP]

    costs = {}
    for name, fn in (("crc32c", crc), ("xxh3-128", digest), ("crc32c+xxh3", both)):
        best = min(
            seconds(lambda fn=fn: [fn(data[o : o + CRC_STEP]) for o in range(0, n, CRC_STEP)])
            for _ in range(3)
        )
        costs[name] = best * h.GiB / n
    copies = min(seconds(lambda: [copy(o) for o in range(0, n, CRC_STEP)]) for _ in range(3))
    costs["memcpy"] = copies * h.GiB / n
    return costs


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- the contenders


class Bench(h.PatternTensors):
    """The tensors, the buffers and the contenders' operations."""

    def __init__(self, args: argparse.Namespace, distckpt: Any, keyword: bool) -> None:
        import torch
        import torch.distributed.checkpoint as dcp

        super().__init__(args.gib, args.tensors, args.device, args.dtype)
        self.dcp, self.distckpt = dcp, distckpt
        self.workers = args.workers
        self.io = {"distckpt": {"io_workers": args.workers}, "distckpt-1": {"io_workers": 1}}
        if not keyword:  # the library has no io_workers= yet
            self.io = {"distckpt": {}, "distckpt-1": {}}
        # Save-only keywords of the distckpt contenders.
        self.shape_io = {} if not args.inner_mib else {"inner_bytes": int(args.inner_mib * 2**20)}
        self.io["distckpt-async"] = self.io["distckpt"]
        self.pool = ThreadPoolExecutor(args.workers, thread_name_prefix="raw")
        self.raw_usage = {"busy_s": 0.0, "capacity_s": 0.0}  # raw's pool, as USAGE counts
        shape = (self.rows, self.cols)
        # host buffers: pinned (CUDA: raw's staging and the copy anchor) or touched (CPU copy)
        self.host = [torch.zeros(shape, dtype=self.dtype, pin_memory=self.cuda) for _ in self.names]

    def verify(self, got: dict[str, Any], rnd: int, what: str) -> None:
        """First, last and two random rows of every tensor, and one whole tensor."""
        rng = random.Random(rnd)
        whole = rnd % len(self.names)
        for i, name in enumerate(self.names):
            t = got[name]
            if (
                t.dtype != self.dtype
                or t.shape != (self.rows, self.cols)
                or t.device != self.device
            ):
                raise SystemExit(
                    f"VERIFY FAILED ({what}): {name} is {t.dtype} {t.shape} {t.device}"
                )
            flat = t.reshape(-1).view(self.int_dtype)
            rows = {0, self.rows - 1, rng.randrange(self.rows), rng.randrange(self.rows)}
            spans = [(0, t.numel())] if i == whole else [(r * self.cols, self.cols) for r in rows]
            for lo, n in spans:
                if not self.torch.equal(flat[lo : lo + n], self.pattern(i, lo, n)):
                    raise SystemExit(f"VERIFY FAILED ({what}): {name} elements {lo}..{lo + n}")

    def bytes_of(self, t: Any) -> memoryview:
        """The bytes of a contiguous CPU tensor, shared."""
        return memoryview(t.reshape(-1).view(self.torch.uint8).numpy())

    def copy_out(self) -> None:
        """The copy anchor: every tensor into the host buffers (pinned, one synchronize)."""
        for b, t in zip(self.host, self.src.values(), strict=True):
            b.copy_(t, non_blocking=self.cuda)
        self.sync()

    def raw_save(self, path: Path, who: str = "raw") -> None:
        """Plain files (T threads; ``raw-1``: one; ``raw-crc-1``: one, checksumming)."""
        path.mkdir()
        if self.cuda:
            self.copy_out()
        tensors = self.host if self.cuda else list(self.src.values())
        files = [(path / f"{n}.bin", self.bytes_of(t)) for n, t in zip(self.names, tensors)]
        crc = who == "raw-crc-1"
        if who == "raw":
            self.on_pool(write_file, files)
        else:  # one thread: the calling one, as distckpt-1 writes
            for f in files:
                write_file(*f, crc=crc)
        fsync_dir(path)

    def on_pool(self, fn: Callable[..., None], files: list[tuple[Path, memoryview]]) -> None:
        """``fn(*f)`` for every f on raw's T threads, their busy time counted."""
        busy = []

        def run(f: tuple[Path, memoryview]) -> None:
            t = time.perf_counter()
            fn(*f)
            busy.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        list(self.pool.map(run, files))
        self.raw_usage["busy_s"] += sum(busy)
        self.raw_usage["capacity_s"] += (time.perf_counter() - t0) * self.workers

    def raw_load(self, path: Path, who: str = "raw") -> None:
        targets = self.host if self.cuda else list(self.dst.values())
        files = [(path / f"{n}.bin", self.bytes_of(t)) for n, t in zip(self.names, targets)]
        crc = who == "raw-crc-1"
        if who == "raw":
            self.on_pool(read_file, files)
        else:
            for f in files:
                read_file(*f, crc=crc)
        if self.cuda:
            for t, b in zip(self.dst.values(), self.host, strict=True):
                t.copy_(b, non_blocking=True)

    def torch_save(self, path: Path) -> None:
        path.mkdir()
        with open(path / "state.pt", "wb") as f:
            self.torch.save(self.src, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(path)

    def steps(self, who: str, path: Path) -> list[Callable[..., Any]]:
        """The timed steps of ``who``'s save (the async save: the call, then the wait)."""
        dcp, io = self.dcp, self.io.get(who, {})
        if who == "distckpt-async":
            return [
                lambda: self.distckpt.save(self.src, path, async_save=True, **io, **self.shape_io),
                lambda handle: handle.wait().timings,
            ]
        ops: dict[str, Callable[[], Any]] = {
            "raw": lambda: self.raw_save(path),
            "raw-1": lambda: self.raw_save(path, "raw-1"),
            "raw-crc-1": lambda: self.raw_save(path, "raw-crc-1"),
            "copy": self.copy_out,
            "distckpt": lambda: self.distckpt.save(self.src, path, **io, **self.shape_io).timings,
            "dcp": lambda: dcp.save(self.src, checkpoint_id=str(path), no_dist=True),
            "dcp-T": lambda: dcp.save(
                self.src,
                storage_writer=dcp.FileSystemWriter(str(path), thread_count=self.workers),
                no_dist=True,
            ),
            "torch.save": lambda: self.torch_save(path),
        }
        ops["distckpt-1"] = ops["distckpt"]
        return [lambda: (ops[who](), self.sync())[0]]

    def load(self, who: str, path: Path) -> tuple[Any, dict[str, Any]]:
        """``who``'s load of ``path``: (distckpt's timings or None, the loaded tensors)."""
        timings = None
        got = self.dst
        if who.startswith("raw"):
            self.raw_load(path, who)
        elif who.startswith("distckpt"):
            timings = self.distckpt.load(self.dst, path, **self.io[who]).timings
        elif who.startswith("dcp"):
            self.dcp.load(self.dst, checkpoint_id=str(path), no_dist=True)
        else:
            got = self.torch.load(path / "state.pt", map_location=self.device, weights_only=True)
        self.sync()
        return timings, got


# --------------------------------------------------------------------------- evidence


class GilProbe:
    """``py-spy record --gil`` attached to this process while the ``with`` block runs:
    ``gil_s``, the seconds some thread held the GIL (samples / rate), and ``wall_s``."""

    def __init__(self, rate: int) -> None:
        found = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        if not os.path.exists(found):
            raise SystemExit("--evidence needs py-spy (pip install py-spy)")
        self.spy, self.rate = found, rate
        self.gil_s = self.wall_s = 0.0

    def __enter__(self) -> GilProbe:
        fd, self.out = tempfile.mkstemp(suffix=".raw")
        os.close(fd)
        command = [self.spy, "record", "--gil", "--nonblocking", "--format", "raw"]
        command += ["-r", str(self.rate), "-p", str(os.getpid()), "-o", self.out]
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()  # "Sampling process ...": attached
        if "Sampling" not in first:
            self.proc.kill()
            raise SystemExit(f"py-spy did not attach: {first.strip()}")
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self.t0
        self.proc.send_signal(signal.SIGINT)
        self.proc.communicate(timeout=120)
        with open(self.out) as f:  # "stack;frames count" per line
            samples = sum(int(line.rsplit(" ", 1)[1]) for line in f if line.strip())
        os.unlink(self.out)
        self.gil_s = samples / self.rate


# --------------------------------------------------------------------------- driver


def _takes(distckpt: Any, f: Any, name: str) -> bool:
    """Whether ``f`` takes the keyword ``name``: a parameter of its own, or, through its
    ``**keywords``, a field of ``CheckpointOptions`` (each may be given as a keyword)."""
    params = inspect.signature(f).parameters.values()
    if any(p.name == name and p.kind is not p.VAR_KEYWORD for p in params):
        return True
    options = getattr(distckpt, "CheckpointOptions", None)
    fields = getattr(options, "__dataclass_fields__", {})
    return name in fields and any(p.kind is p.VAR_KEYWORD for p in params)


def io_workers_api(distckpt: Any) -> tuple[bool, int]:
    """Whether ``save`` and ``load`` take ``io_workers=``, and the library's default count
    (while the library has none: the CPUs this process may use)."""
    keyword = all(_takes(distckpt, f, "io_workers") for f in (distckpt.save, distckpt.load))
    try:
        from distckpt.transfer import default_io_workers
    except ImportError:
        return keyword, len(os.sched_getaffinity(0))
    return keyword, default_io_workers()


class Driver(h.Driver):
    """Runs the contenders in this process, directory after directory."""

    name = "bench_rank"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        os.environ["DISTCKPT_PROGRESS"] = "0"
        if self.snapshot:
            sys.path.insert(0, self.snapshot["path"])
        import distckpt

        if self.snapshot and not distckpt.__file__.startswith(self.snapshot["path"]):
            raise SystemExit(f"imported {distckpt.__file__}, not the snapshot")
        self.distckpt = distckpt
        self.keyword, default = io_workers_api(distckpt)
        args.workers = args.workers or default
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    def describe(self) -> str:
        a = self.args
        kw = "" if self.keyword else " (distckpt has no io_workers= yet: not passed)"
        return (
            f"{a.gib:g} GiB in {a.tensors} {a.dtype} tensors on {a.device}, T = {a.workers} "
            f"workers{kw}, dirs {a.dir}, {a.rounds} rounds"
        )

    def env(self) -> dict[str, Any]:
        import torch

        gpu = torch.cuda.get_device_name() if self.args.device == "cuda" else None
        return {
            "fs": {d: h.fs_type(Path(d).parent) for d in self.args.dir},
            "gpu": gpu,
            "affinity": len(os.sched_getaffinity(0)),
            "io_workers_keyword": self.keyword,
            "per_byte_s_per_GiB": getattr(self, "costs", None),
        }

    def run(self) -> None:
        bench = Bench(self.args, self.distckpt, self.keyword)
        if not bench.cuda:
            first = bench.bytes_of(next(iter(bench.src.values())))
            self.costs = per_byte_costs(first)
            print(
                "per-byte costs on one core (s/GiB): "
                + ", ".join(f"{k} {v:.3f}" for k, v in self.costs.items()),
                flush=True,
            )
        try:
            for parent in self.args.dir:
                with h.run_dir(parent) as d:
                    self.measure(bench, d)
        finally:
            bench.pool.shutdown()

    def measure(self, bench: Bench, d: Path) -> None:
        """The warm-up, then the rounds, in directory ``d``."""
        a = self.args
        fs = h.fs_type(d)
        cold = a.cache == "cold" and fs != "tmpfs"
        loads = "cold: page cache evicted" if cold else "from memory"
        print(f"== {d} ({fs}, loads {loads})", flush=True)
        paths = {c: d / c for c in a.contenders}
        for who in a.contenders:  # warm-up: untimed, loads verified
            self.save(bench, who, paths[who], -1)
            if who == "distckpt-async" or who in LOADERS:
                bench.reset()
                loader = "distckpt" if who == "distckpt-async" else who
                _, got = bench.load(loader, paths[who])
                bench.verify(got, -1, f"{who} warm-up")
        for rnd, order in enumerate(h.rotations(a.contenders, a.rounds)):
            tag = {"dir": str(d), "fs": fs, "round": rnd, "bytes": bench.nbytes}
            tag["busy_before_round"] = self.wait_idle()
            events = [ev for who in order for ev in self.save(bench, who, paths[who], rnd)]
            for who in (w for w in order if w in LOADERS and not a.saves_only):
                bench.reset()
                if cold:
                    h.evict([paths[who]])
                sec = h.timed(h.SOLO, lambda w=who: bench.load(w, paths[w]))
                timings, got = sec.results[0]
                bench.verify(got, rnd, f"{who} load")
                del got, sec.results[:]  # torch.load's copy
                events.append({"op": "load", "who": who, "span": sec.marks[0], **sec.fields()})
                if timings is not None:
                    events[-1]["timings"] = dict(timings)
            self.events += [{**tag, **e} for e in events]
            self.check_memory(f"{fs} round {rnd}")
            oth = max(e["foreign_cpu"] for e in events)
            for op in ("block", "save", "load"):
                times = "  ".join(f"{e['who']} {e['span']:.3f}" for e in events if e["op"] == op)
                if times:
                    print(f" r{rnd} {op:5} {times}", flush=True)
            print(f" r{rnd} other CPU before {tag['busy_before_round']:.0%}, timed max {oth:.0%}")
        if a.evidence:
            self.evidence(bench, d, fs, paths)

    def evidence(self, bench: Bench, d: Path, fs: str, paths: dict[str, Path]) -> None:
        """One untimed save and load per contender under the GIL probe (see the module
        docstring); an ``evidence`` event each."""
        from distckpt.transfer.workers import USAGE

        for who in (w for w in self.args.contenders if w != "copy"):
            ops: list[tuple[str, Callable[[], Any]]] = [
                ("save", lambda w=who: [f() for f in self.untimed(bench, w, paths[w])])
            ]
            if who in LOADERS and not self.args.saves_only:
                ops.append(("load", lambda w=who: bench.load(w, paths[w])))
            for what, op in ops:
                if what == "load":
                    bench.reset()
                usage = USAGE if who.startswith("distckpt") else None
                before = usage.snapshot() if usage else dict(bench.raw_usage)
                with GilProbe(self.args.gil_rate) as probe:
                    op()
                after = usage.snapshot() if usage else dict(bench.raw_usage)
                capacity = after["capacity_s"] - before["capacity_s"]
                busy = after["busy_s"] - before["busy_s"]
                idle = 1 - busy / capacity if capacity > 0 else None
                self.events.append(
                    {
                        "dir": str(d),
                        "fs": fs,
                        "op": "evidence",
                        "what": what,
                        "who": who,
                        "gil_s_per_GiB": probe.gil_s * h.GiB / bench.nbytes,
                        "idle_share": idle,
                        "wall_s": probe.wall_s,
                    }
                )

    def untimed(self, bench: Bench, who: str, path: Path) -> list[Callable[[], Any]]:
        """``who``'s save steps as plain calls (the async save's wait takes the handle)."""
        shutil.rmtree(path, ignore_errors=True)
        steps = bench.steps(who, path)
        if len(steps) == 1:
            return steps
        first, wait = steps
        held: list[Any] = []
        return [lambda: held.append(first()), lambda: wait(held[0])]

    def save(self, bench: Bench, who: str, path: Path, rnd: int) -> list[dict[str, Any]]:
        """Delete ``who``'s previous files, then its timed save; its events."""
        shutil.rmtree(path, ignore_errors=True)
        bench.sync()
        before = resource.getrusage(resource.RUSAGE_SELF)
        sec = h.timed(h.SOLO, *bench.steps(who, path))
        after = resource.getrusage(resource.RUSAGE_SELF)
        if who == "copy":
            return [{"op": "block", "who": who, "span": sec.marks[0], **sec.fields()}]
        ev = {"op": "save", "who": who, "span": sec.marks[-1], **sec.fields()}
        # CPU of the whole process (all threads) in the kernel and in user space
        ev["sys_s"] = after.ru_stime - before.ru_stime
        ev["user_s"] = after.ru_utime - before.ru_utime
        if isinstance(sec.results[-1], dict):
            ev["timings"] = dict(sec.results[-1])
        if who != "distckpt-async":
            return [ev]
        block = {"op": "block", "who": who, "span": sec.marks[0], **sec.fields()}
        return [block, ev]


# --------------------------------------------------------------------------- report

#: (label, op, target): "<op> thr|speedup A/B" compare throughputs, the others times.
RATIOS: list[tuple[str, str, tuple[str, float] | None]] = [
    *[(f"{op} thr distckpt/raw", op, (">=", 0.85)) for op in ("save", "load")],
    *[(f"{op} thr distckpt-1/raw-1", op, (">=", 0.85)) for op in ("save", "load")],
    *[(f"{op} thr distckpt-1/raw-crc-1", op, None) for op in ("save", "load")],
    *[(f"{op} thr raw-crc-1/raw-1", op, None) for op in ("save", "load")],
    *[
        (f"{op} time distckpt/{other}", op, None)
        for op in ("save", "load")
        for other in ("dcp", "dcp-T", "torch.save")
    ],
    *[(f"{op} speedup distckpt/distckpt-1", op, (">=", 1.5)) for op in ("save", "load")],
    ("block distckpt-async/copy", "block", None),
    ("total distckpt-async/distckpt", "save", None),
]


def summarize(args: argparse.Namespace, events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (dir, op, contender): the spread of the times and GB/s; the ratios."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    evidence = [e for e in events if e["op"] == "evidence"]
    for e in events:
        if e["op"] != "evidence":
            groups.setdefault((e["dir"], e["op"], e["who"]), []).append(e)
    rows = []
    for (d, op, who), es in groups.items():
        spans = [e["span"] for e in es]
        row = {"dir": d, "fs": es[0]["fs"], "op": op, "who": who, **h.spread(spans)}
        row.update(GBps=es[0]["bytes"] / 1e9 / row["median_s"], spans=spans)
        row["other_cpu_median"] = h.med([e["foreign_cpu"] for e in es])
        if "sys_s" in es[0]:
            slowest = max(es, key=lambda e: e["span"])
            row["sys_median_s"] = h.med([e["sys_s"] for e in es])
            row["user_median_s"] = h.med([e["user_s"] for e in es])
            row["sys_of_slowest_s"] = slowest["sys_s"]
        tm = [e["timings"] for e in es if "timings" in e]
        if tm:
            row["phases_median"] = {k: h.med([t.get(k, 0.0) for t in tm]) for k in tm[0]}
        rows.append(row)
    ops = ("block", "save", "load")
    rows.sort(key=lambda r: (r["dir"], ops.index(r["op"]), CONTENDERS.index(r["who"])))

    ratios = []
    for d in dict.fromkeys(r["dir"] for r in rows):
        fs = next(r["fs"] for r in rows if r["dir"] == d)

        def series(op: str, who: str, d: str = d) -> dict[Any, float]:
            return {e["round"]: e["span"] for e in groups.get((d, op, who), [])}

        for label, op, goal in RATIOS:
            num, den = label.split()[-1].split("/")
            thr = label.split()[1] in ("thr", "speedup")  # a throughput ratio
            q = h.ratio(series(op, num), series(op, den), throughput=thr)
            if q is not None:
                ratios.append(
                    {"label": label, "fs": fs, "dir": d, **q, **h.target(q["value"], goal)}
                )
        for r in rows:  # steadiness: the slowest save against the median
            if r["dir"] == d and r["op"] == "save" and r["who"] in ("distckpt", "distckpt-1"):
                value = r["max_s"] / r["median_s"]
                label = f"save slowest/median {r['who']}"
                ratios.append(
                    {"label": label, "fs": fs, "dir": d, "value": value, "of_mins": value}
                    | dict.fromkeys(("paired_median", "paired_min", "paired_max"), value)
                    | h.target(value, ("<=", 1.3))
                )
    return {"rows": rows, "ratios": ratios, "evidence": evidence}


def print_report(summary: dict[str, Any]) -> None:
    print()
    print(
        f"{'fs':6} {'op':5} {'who':14} {'n':>2} {'median s':>9} {'min s':>8} {'max s':>8} "
        f"{'GB/s':>7} {'oth%':>5}"
    )
    for r in summary["rows"]:
        print(
            f"{r['fs'][:6]:6} {r['op']:5} {r['who']:14} {r['n']:>2} {r['median_s']:9.3f} "
            f"{r['min_s']:8.3f} {r['max_s']:8.3f} {r['GBps']:7.2f} "
            f"{100 * r['other_cpu_median']:5.0f}"
        )
    cpu = [r for r in summary["rows"] if "sys_median_s" in r]
    if cpu:
        print("\nsaves: CPU time of the process (s; kernel of the median round, of the slowest)")
        for r in cpu:
            print(
                f"  {r['fs'][:6]:6} {r['who']:14} user {r['user_median_s']:.3f}  "
                f"sys {r['sys_median_s']:.3f}  sys of the slowest {r['sys_of_slowest_s']:.3f}"
            )
    if summary.get("evidence"):
        print("\nevidence (one untimed save and load each, under py-spy --gil)")
        print(f"  {'fs':6} {'op':5} {'who':14} {'GIL s/GiB':>9} {'workers idle':>12}")
        for e in summary["evidence"]:
            idle = "" if e["idle_share"] is None else f"{100 * e['idle_share']:11.0f}%"
            print(
                f"  {e['fs'][:6]:6} {e['what']:5} {e['who']:14} {e['gil_s_per_GiB']:9.3f} "
                f"{idle:>12}"
            )
    print()
    h.print_fs_ratios(summary["ratios"])
    h.print_phases(summary["rows"], lambda r: f"{r['fs'][:6]:6} {r['op']:5} {r['who']:14}")


# --------------------------------------------------------------------------- main


def parse(argv: list[str] | None = None) -> argparse.Namespace:

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    h.common_args(p, launches=False)
    h.tensor_args(p)
    p.add_argument(
        "--workers",
        type=int,
        help="T: I/O workers of raw, distckpt, dcp-T (default: the library's default)",
    )
    p.add_argument(
        "--dir",
        action="append",
        help="parent directory of the files (a fresh run-PID-* directory inside it is used "
        "and removed; repeat for several); default: /dev/shm/distckpt-bench (tmpfs) and "
        "/tmp/distckpt-bench (disk)",
    )
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    p.add_argument(
        "--cache",
        choices=["cold", "warm"],
        default="cold",
        help="on a non-tmpfs dir, evict the files before each timed load (cold, default)",
    )
    p.add_argument(
        "--saves-only",
        action="store_true",
        help="time the saves only (loads are verified in the warm-up): no load, no check "
        "between two saves allocates and frees memory (see the steadiness section)",
    )
    p.add_argument(
        "--evidence",
        action="store_true",
        help="after the rounds, one untimed save and load each under py-spy --gil: GIL-held "
        "seconds per GiB and the I/O workers' idle share",
    )
    p.add_argument("--gil-rate", type=int, default=500, help="py-spy samples per second")
    p.add_argument("--quick", action="store_true", help="smoke run: 128 MiB, 2 rounds, tmpfs only")
    p.add_argument(
        "--inner-mib",
        type=float,
        default=None,
        help="distckpt's inner chunk size in MiB (default: the library's)",
    )
    return h.settle_rank_args(
        p.parse_args(argv), ["/dev/shm/distckpt-bench", "/tmp/distckpt-bench"]
    )


if __name__ == "__main__":
    h.main(parse(), Driver, summarize, print_report)
