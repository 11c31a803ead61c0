"""The machinery the benchmark drivers share (see benchmarks/README.md).

* statistics: contender orders for alternating rounds, medians, ratios (of medians, of
  mins, paired per round) and targets;
* the machine: CPU used by other processes (``/proc/stat``), memory (``/proc/meminfo``),
  file system types, page-cache eviction, waiting for an idle machine, the exclusive run
  lock;
* a run: a frozen copy of the library (the *snapshot*), and of another version of it to
  compare with (:func:`library_copy`: a source tree or a git revision), a :class:`Driver`
  that launches workers with a spec file (:meth:`Driver.launch_worker`) or keeps them
  running to serve requests (:meth:`Driver.start_peer`, :func:`serve`), the results JSON
  and ``--report``;
* timed sections: :func:`timed` on a torchrun rank (:class:`RankWorker`) or in one process
  (:data:`SOLO`);
* conformance runs (another project's own tests through distckpt): the tests' environment,
  a run stopped with its spawned processes past its time, JUnit reports and error lines,
  the per-file table.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import io
import json
import operator
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

GiB = 1 << 30
MiB = 1 << 20
#: One lock for every benchmark of this directory: two runs on one machine time each other.
LOCK = "/tmp/bench_engine.lock"
#: Environment of torchrun workers: one thread per rank, gloo over loopback.
TORCHRUN_ENV: dict[str, str | None] = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
ROOT = Path(__file__).resolve().parent.parent

# --------------------------------------------------------------------------- statistics


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: Sequence[float]) -> dict[str, float]:
    """``n``, ``median_s``, ``min_s``, ``max_s`` of per-round times."""
    return {"n": len(xs), "median_s": med(xs), "min_s": min(xs), "max_s": max(xs)}


def rotations(items: Sequence[str], rounds: int) -> list[list[str]]:
    """Round r runs the contenders rotated by r, reversed every other cycle: each contender
    takes every position once every len(items) rounds (for 3 contenders, 6 rounds are the 6
    permutations)."""
    items = list(items)
    n = len(items)
    out = []
    for r in range(rounds):
        order = items[r % n :] + items[: r % n]
        if (r // n) % 2:
            order.reverse()
        out.append(order)
    return out


def ratio(
    num: Mapping[Any, float], den: Mapping[Any, float], *, throughput: bool = False
) -> dict[str, float] | None:
    """Compare two contenders from their per-round values (keyed by round).

    A time ratio num/den, or with ``throughput`` the throughput ratio num/den (time den /
    time num). ``value`` divides the medians, ``of_mins`` the best rounds, ``paired_*``
    summarize the per-round ratios (which cancel slow rounds that hit both). None when the
    two have no round in common."""
    pairs = [num[k] / den[k] for k in num if k in den and den[k] > 0]
    if not pairs:
        return None
    if throughput:
        num, den = den, num
        pairs = [1 / x for x in pairs]
    return {
        "value": med(list(num.values())) / med(list(den.values())),
        "of_mins": min(num.values()) / min(den.values()),
        "paired_median": med(pairs),
        "paired_min": min(pairs),
        "paired_max": max(pairs),
    }


_OPS = {">=": operator.ge, "<=": operator.le, "<": operator.lt, ">": operator.gt}


def target(value: float, goal: tuple[str, float] | None) -> dict[str, Any]:
    """``target`` (text) and ``ok`` (None without a goal) of a ratio."""
    if goal is None:
        return {"target": "", "ok": None}
    return {"target": f"{goal[0]} {goal[1]}", "ok": bool(_OPS[goal[0]](value, goal[1]))}


def paired_text(q: Mapping[str, Any]) -> str:
    return f"{q['paired_median']:8.3f} [{q['paired_min']:.3f}..{q['paired_max']:.3f}]"


def ok_text(q: Mapping[str, Any]) -> str:
    return "" if q.get("ok") is None else ("yes" if q["ok"] else "NO")


def tensor_args(p: argparse.ArgumentParser) -> None:
    """The options of :class:`PatternTensors`: ``--gib``, ``--tensors``, ``--device``,
    ``--dtype`` (None: bfloat16 on CUDA, float32 on CPU)."""
    import torch

    cuda = torch.cuda.is_available()
    p.add_argument("--gib", type=float, default=1.0, help="GiB of tensor data (default 1)")
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if cuda else "cpu")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16", "float64"],
        help="default: bfloat16 on CUDA, float32 on CPU",
    )


class PatternTensors:
    """``tensors`` tensors of ``gib`` GiB in all, on ``device``, filled with a pattern any
    reader can check (:meth:`pattern`), and targets of loads of the same shapes: the
    state the one-process drivers (``bench_rank.py``, ``bench_signing.py``) save."""

    def __init__(self, gib: float, tensors: int, device: str, dtype: str) -> None:
        import torch

        self.torch = torch
        self.cuda = device == "cuda"
        index = torch.cuda.current_device() if self.cuda else None
        self.device = torch.device(device, index)  # cuda:N: compared with t.device
        self.dtype = getattr(torch, dtype)
        size = torch.empty((), dtype=self.dtype).element_size()
        self.int_dtype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
        self.bits = 8 * size
        self.cols = 4096
        self.rows = int(gib * GiB) // (tensors * self.cols * size)
        self.names = [f"t{i:02d}" for i in range(tensors)]
        self.nbytes = tensors * self.rows * self.cols * size
        shape = (self.rows, self.cols)
        self.src = {n: self.tensor(shape) for n in self.names}
        for i, t in enumerate(self.src.values()):
            t.reshape(-1).view(self.int_dtype).copy_(self.pattern(i, 0, t.numel()))
        self.dst = {n: self.tensor(shape) for n in self.names}
        self.reset()

    def tensor(self, shape: tuple[int, int]) -> Any:
        return self.torch.empty(shape, dtype=self.dtype, device=self.device)

    def pattern(self, i: int, lo: int, n: int) -> Any:
        """Elements lo..lo+n of tensor i as integers: the low bits of a 32-bit hash of the
        element's global index, sign and top exponent bit clear (finite values)."""
        torch = self.torch
        g = torch.arange(lo, lo + n, dtype=torch.int64, device=self.device)
        g += i * self.rows * self.cols
        x = (g ^ (g >> 32)) & 0xFFFFFFFF
        for _ in range(2):  # products stay below 2**59: no int64 overflow
            x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
        x = (x >> 16) ^ x
        return (x & ((1 << (self.bits - 2)) - 1)).to(self.int_dtype)

    def reset(self) -> None:
        """All-ones bits (a NaN, never in the pattern) in every target."""
        for t in self.dst.values():
            t.view(self.int_dtype).fill_(-1)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()


def print_phases(
    rows: Iterable[Mapping[str, Any]],
    label: Callable[[Mapping[str, Any]], str],
    field: str = "phases_median",
    digits: int = 3,
) -> None:
    """The table of distckpt's phases: each row's ``field`` (phase: seconds), after
    ``label(row)``; nothing when no row has it."""
    found = [r for r in rows if field in r]
    if not found:
        return
    over = "median over rounds" + (" of the max over ranks" if "max_over" in field else "")
    print(f"\ndistckpt phases ({over}, s):")
    for r in found:
        phases = "  ".join(
            f"{k} {v:.{digits}f}" for k, v in r[field].items() if isinstance(v, float)
        )
        print(f"  {label(r)} {phases}")


def print_fs_ratios(ratios: Iterable[Mapping[str, Any]]) -> None:
    """The table of ratios by file system: of medians, of mins, paired, target."""
    print(
        f"{'ratio':36} {'fs':6} {'of medians':>10} {'of mins':>8} {'paired med [min..max]':>24} "
        f"{'target':>7} ok"
    )
    for q in ratios:
        print(
            f"{q['label']:36} {q['fs'][:6]:6} {q['value']:10.3f} {q['of_mins']:8.3f} "
            f"{paired_text(q)} {q['target']:>7} {ok_text(q)}"
        )


# --------------------------------------------------------------------------- the machine


def cpu_times() -> tuple[int, int]:
    """(busy, steal) jiffies of the whole machine, from /proc/stat."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = f[:8]
    return user + nice + system + irq + softirq, steal


def own_cpu() -> int:
    """utime + stime jiffies of this process (all its threads)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def cpu_share(jiffies: float, seconds: float) -> float:
    """``jiffies`` of CPU time over ``seconds`` as a fraction of all CPUs (>= 0)."""
    hz, ncpu = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
    return max(0.0, jiffies / hz / max(seconds, 1e-9) / ncpu)


def meminfo() -> dict[str, float]:
    """MemAvailable, Shmem and Cached in GiB."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        if k in ("MemAvailable", "Shmem", "Cached"):
            out[k] = int(v.split()[0]) / (1 << 20)
    return out


def fs_type(path: Path) -> str:
    """The type of the file system holding ``path`` (the longest mount point above it)."""
    path = path.resolve()
    best, kind = "", "?"
    for line in Path("/proc/mounts").read_text().splitlines():
        mnt, typ = line.split()[1:3]
        inside = str(path) == mnt or str(path).startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) > len(best):
            best, kind = mnt, typ
    return kind


def evict(paths: Sequence[Path]) -> None:
    """Drop the (clean) pages of every file under ``paths`` from the page cache."""
    for root in paths:
        for dirpath, _dirs, files in os.walk(root):
            for f in files:
                try:
                    fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def wait_idle(max_wait: float, idle_busy: float) -> float:
    """Wait (up to ``max_wait`` s) until other processes use less than ``idle_busy`` of the
    CPUs over one second; return the last measured busy fraction."""
    deadline = time.monotonic() + max_wait
    while True:
        b0, _ = cpu_times()
        time.sleep(1.0)
        busy = cpu_share(cpu_times()[0] - b0, 1.0)
        if busy < idle_busy or time.monotonic() > deadline:
            return busy
        time.sleep(4.0)


def exclusive(lock_path: str) -> Any:
    """Hold an exclusive lock for the whole run: two benchmark runs on one machine would
    time each other. Waits (with a message) while another run holds it."""
    import fcntl

    fh = open(lock_path, "a+")  # noqa: SIM115 - held open for the whole run
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        print(
            f"waiting for another benchmark run to finish (lock {lock_path}: {fh.read().strip()})",
            flush=True,
        )
        fcntl.flock(fh, fcntl.LOCK_EX)
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()} since {time.strftime('%H:%M:%S')}\n")
    fh.flush()
    return fh


@contextlib.contextmanager
def run_dir(parent: str | Path) -> Iterator[Path]:
    """A fresh ``run-PID-*`` directory inside ``parent``, removed afterwards (and ``parent``
    too if then empty): concurrent runs never touch each other's files."""
    parent = Path(parent).absolute()
    parent.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix=f"run-{os.getpid()}-", dir=parent))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(OSError):
            parent.rmdir()


# --------------------------------------------------------------------------- the library


def take_snapshot(dst_parent: Path) -> dict[str, Any]:
    """Copy the distckpt package as it is now into ``dst_parent``: every launch of the run
    imports that copy, even if the working tree changes while the benchmark runs."""
    spec = importlib.util.find_spec("distckpt")
    assert spec is not None and spec.submodule_search_locations
    src = Path(list(spec.submodule_search_locations)[0])
    return _copy_package(src, dst_parent)


def _copy_package(src: Path, dst_parent: Path) -> dict[str, Any]:
    """Copy the package directory ``src`` to ``dst_parent/distckpt``; its description
    (source, hash of its modules, git HEAD and modified files of the tree it came from)."""
    dst = dst_parent / "distckpt"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    info: dict[str, Any] = {"source": str(src), "sha256": _tree_digest(dst)}
    info["path"] = str(dst_parent)
    with contextlib.suppress(OSError):
        git = ["git", "-C", str(src.parent)]
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
        info["git_head"] = head.stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", str(src)], capture_output=True, text=True
        )
        info["git_dirty"] = [x for x in dirty.stdout.split("\n") if x]
    return info


def _tree_digest(package: Path) -> str:
    """The first 16 hex digits of a SHA-256 over the package's modules (names and bytes)."""
    digest = hashlib.sha256()
    for f in sorted(package.rglob("*.py")):
        digest.update(str(f.relative_to(package)).encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:16]


def library_copy(source: str, dst_parent: Path) -> dict[str, Any]:
    """A frozen copy of *another* version of the library, to run beside the snapshot in
    workers of its own (their ``PYTHONPATH`` starts with ``info["path"]``).

    ``source`` is a directory (a source tree holding ``distckpt/``, or the package
    itself), or else a git revision of this repository (``git archive REV distckpt``: no
    worktree is made). Returns the copy's description, as :func:`take_snapshot` does."""
    where = Path(source)
    if where.is_dir():
        pkg = where / "distckpt" if (where / "distckpt" / "__init__.py").is_file() else where
        if pkg.name != "distckpt" or not (pkg / "__init__.py").is_file():
            raise SystemExit(f"{source}: neither a source tree of distckpt nor its package")
        return _copy_package(pkg.resolve(), dst_parent)
    git = ["git", "-C", str(ROOT)]
    rev = subprocess.run(
        [*git, "rev-parse", "--verify", "--quiet", f"{source}^{{commit}}"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not rev:
        raise SystemExit(f"{source}: not a directory, nor a git revision of {ROOT}")
    tar = subprocess.run([*git, "archive", "--format=tar", rev, "distckpt"], capture_output=True)
    if tar.returncode != 0 or not tar.stdout:
        raise SystemExit(f"git archive {rev} distckpt failed: {tar.stderr.decode()[-400:]}")
    dst_parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(tar.stdout), mode="r:") as archive:
        archive.extractall(dst_parent, filter="data")
    dst = dst_parent / "distckpt"
    return {
        "source": f"git {source}",
        "sha256": _tree_digest(dst),
        "path": str(dst_parent),
        "git_head": rev,
        "git_dirty": [],
    }


# --------------------------------------------------------------------------- a run


class Driver:
    """One benchmark run: its arguments, events, memory readings, log directory and the
    library snapshot its workers import. Subclasses implement :meth:`run`."""

    name = "bench"

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.events: list[dict[str, Any]] = []
        self.mem: list[dict[str, Any]] = []
        self.logdir = Path(tempfile.mkdtemp(prefix=f"{self.name}-logs-"))
        self.snapshot = take_snapshot(self.logdir / "snapshot") if args.snapshot else None

    def describe(self) -> str:
        """The first line of the run's output (after the driver's name)."""
        return ""

    def env(self) -> dict[str, Any]:
        """The file systems measured and anything else about the machine, for the JSON."""
        return {}

    def run(self) -> None:
        raise NotImplementedError

    def wait_idle(self) -> float:
        return wait_idle(self.args.wait_idle, self.args.idle_busy)

    def check_memory(self, label: str) -> dict[str, float]:
        """Record meminfo after ``label``; stop the run below 3 GiB available."""
        m = meminfo()
        self.mem.append({"after": label, **m})
        if m["MemAvailable"] < 3.0:
            raise SystemExit(f"MemAvailable {m['MemAvailable']:.1f} GiB after {label}: stopping")
        return m

    def library_path(self) -> str:
        """Where workers import this run's distckpt from: the snapshot, or the checkout."""
        return self.snapshot["path"] if self.snapshot else str(ROOT)

    def worker_env(
        self, env_extra: Mapping[str, str | None], library: str | None = None
    ) -> dict[str, str]:
        """The environment of a worker: launcher variables scrubbed, ``env_extra`` applied
        (None removes), ``library`` (default: :meth:`library_path`) first on
        ``PYTHONPATH``."""
        scrub = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        env = {k: v for k, v in os.environ.items() if k not in scrub}
        env["PYTHONUNBUFFERED"] = "1"
        for k, v in env_extra.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        first = library or self.library_path()
        env["PYTHONPATH"] = os.pathsep.join([first, *filter(None, [env.get("PYTHONPATH")])])
        return env

    def start_peer(
        self,
        script: str | Path,
        spec: dict[str, Any],
        label: str,
        env_extra: Mapping[str, str | None],
        library: str | None = None,
    ) -> Peer:
        """Start ``python script --worker SPEC`` as a :class:`Peer` that stays up and
        serves requests (the worker calls :func:`serve`); ``library`` (default: the
        snapshot) first on its ``PYTHONPATH``. Its first reply must say that it imported
        distckpt from there."""
        fd, name = tempfile.mkstemp(prefix=f"peer-{label}-", suffix=".spec.json", dir=self.logdir)
        os.close(fd)
        Path(name).write_text(json.dumps(spec))
        first = library or self.library_path()
        log = self.logdir / f"{label}.log"
        with open(log, "w") as fh:
            proc = subprocess.Popen(
                [sys.executable, str(Path(script).resolve()), "--worker", name],
                env=self.worker_env(env_extra, first),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=fh,
                text=True,
            )
        peer = Peer(proc, label, log)
        hello = peer.reply()
        if not hello.get("distckpt_file", "").startswith(first):
            peer.close()
            raise SystemExit(f"peer {label} imported {hello.get('distckpt_file')}, not {first}")
        peer.hello = hello
        return peer

    def launch_worker(
        self,
        cmd_head: list[str],
        script: str | Path,
        spec: dict[str, Any],
        label: str,
        env_extra: Mapping[str, str | None],
    ) -> tuple[dict[str, Any], float, dict[str, float]]:
        """Run ``cmd_head script --worker SPEC``: the spec (with a result file added) in the
        log directory, launcher variables scrubbed, ``env_extra`` applied (None removes),
        the library snapshot first on ``PYTHONPATH``. Stops the run on a failed launch,
        workers that imported another distckpt, or low memory. Returns (the workers'
        result, wall seconds of the launch, meminfo after it)."""
        fd, result = tempfile.mkstemp(prefix="res-", suffix=".json", dir=self.logdir)
        os.close(fd)
        spec_file = Path(result).with_suffix(".spec.json")
        spec_file.write_text(json.dumps({**spec, "result": result}))
        env = self.worker_env(env_extra)
        cmd = [*cmd_head, str(Path(script).resolve()), "--worker", str(spec_file)]
        log = self.logdir / f"{label}.log"
        t = time.perf_counter()
        with open(log, "w") as fh:
            proc = subprocess.run(
                cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=self.args.launch_timeout
            )
        wall = time.perf_counter() - t
        if proc.returncode != 0:
            sys.stderr.write(log.read_text()[-6000:])
            raise SystemExit(f"launch {label} failed (rc {proc.returncode}); log {log}")
        out = json.loads(Path(result).read_text())
        if self.snapshot and not out["distckpt_file"].startswith(self.snapshot["path"]):
            raise SystemExit(f"workers imported {out['distckpt_file']}, not the snapshot")
        return out, wall, self.check_memory(label)


class Peer:
    """A worker process that stays up between operations (:meth:`Driver.start_peer`): one
    JSON line in on its stdin per request, one JSON line back on its stdout. Its stderr
    (and whatever it prints) goes to its log in the run's log directory."""

    def __init__(self, proc: subprocess.Popen[str], label: str, log: Path) -> None:
        self.proc, self.label, self.log = proc, label, log
        self.hello: dict[str, Any] = {}

    def reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            sys.stderr.write(self.log.read_text()[-6000:])
            raise SystemExit(f"peer {self.label} ended (rc {self.proc.returncode}); log {self.log}")
        out: dict[str, Any] = json.loads(line)
        if "error" in out:
            raise SystemExit(f"peer {self.label}: {out['error']}")
        return out

    def ask(self, **request: Any) -> dict[str, Any]:
        """Send one request and wait for its reply."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.reply()

    def close(self, timeout: float = 60) -> None:
        """Ask the worker to end (closing its stdin) and wait for it; kill it if it hangs."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def serve(first: dict[str, Any], handle: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """The worker's side of a :class:`Peer`: reply ``first`` (it must name
    ``distckpt_file``), then ``handle(request)`` for every request line until stdin closes.
    The replies take the process's stdout; anything else printed goes to stderr (the log).
    An exception ends the worker after replying ``{"error": ...}``."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj: dict[str, Any]) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    send(first)
    for line in sys.stdin:
        try:
            out = handle(json.loads(line))
        except BaseException as exc:
            send({"error": f"{type(exc).__name__}: {exc}"})
            raise
        send(out)


def torchrun(nproc: int) -> list[str]:
    """The command head of a torchrun launch of ``nproc`` workers on this host."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
    ]


def run_rank_job(nproc: int, script: str, args: Sequence[str], timeout: float) -> Any:
    """torchrun ``script --worker --out FILE *args`` on ``nproc`` ranks of this host (one
    thread each, gloo over loopback, this checkout first on the path) and what its rank 0
    wrote to FILE (JSON): for the standalone drivers that need no :class:`Driver`."""
    env = {
        **os.environ,
        **{k: v for k, v in TORCHRUN_ENV.items() if v is not None},
        "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
    }
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "result.json"
        cmd = [*torchrun(nproc), script, "--worker", "--out", str(out), *args]
        subprocess.run(cmd, env=env, check=True, timeout=timeout)
        return json.loads(out.read_text())


def common_args(p: argparse.ArgumentParser, *, launches: bool = True) -> None:
    """Options every driver has: results, report, snapshot, lock, idle wait (and, for
    drivers that launch workers, the hidden ``--worker`` and ``--launch-timeout``)."""
    if launches:
        p.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    p.add_argument("--json", help="write the results here")
    p.add_argument(
        "--report", metavar="JSON", help="print the report of a saved --json file and exit"
    )
    p.add_argument(
        "--no-snapshot",
        dest="snapshot",
        action="store_false",
        help="import distckpt from the working tree (default: a copy taken at start, so "
        "concurrent edits cannot mix versions within a run)",
    )
    p.add_argument(
        "--lock", default=LOCK, help="lock file serializing benchmark runs ('' for none)"
    )
    if launches:
        p.add_argument("--launch-timeout", type=float, default=1800)
    p.add_argument(
        "--wait-idle",
        type=float,
        default=60,
        help="wait up to this many seconds for the machine to be idle before measuring",
    )
    p.add_argument(
        "--idle-busy",
        type=float,
        default=0.25,
        help="'idle': other processes use less than this fraction of the CPUs",
    )


def write_results(args: argparse.Namespace, drv: Driver, t0: float, summary: Any) -> None:
    """Write ``args.json``: the command, the machine, the summary and every event."""
    import torch

    doc = {
        "argv": sys.argv,
        "args": {k: v for k, v in vars(args).items() if k != "worker"},
        "env": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            **drv.env(),
        },
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "wall_s": time.time() - t0,
        "summary": summary,
        "events": drv.events,
        "memory": drv.mem,
        "distckpt_snapshot": drv.snapshot,
    }
    Path(args.json).write_text(json.dumps(doc, indent=1))
    print(f"\nwrote {args.json}")


Summarize = Callable[[argparse.Namespace, list[dict[str, Any]]], Any]


def main(
    args: argparse.Namespace,
    driver: Callable[[argparse.Namespace], Driver],
    summarize: Summarize,
    print_report: Callable[[Any], None],
    worker_main: Callable[[str], None] | None = None,
) -> None:
    """A driver's command line: a worker launch (``--worker``), ``--report`` of a saved
    file (the saved arguments over the defaults), or a run under the lock that prints the
    report and writes the JSON. The log directory is removed only after a run that
    succeeded."""
    if getattr(args, "worker", None):
        assert worker_main is not None
        worker_main(args.worker)
        return
    if args.report:
        doc = json.loads(Path(args.report).read_text())
        saved = argparse.Namespace(**{**vars(args), **doc["args"]})
        print_report(summarize(saved, doc["events"]))
        return
    lock = exclusive(args.lock) if args.lock else None
    t0 = time.time()
    drv = driver(args)
    print(f"{drv.name}: {drv.describe()}; logs {drv.logdir}", flush=True)
    if drv.snapshot:
        s = drv.snapshot
        print(
            f"distckpt snapshot {s['sha256']} of {s['source']} (HEAD "
            f"{s.get('git_head', '?')[:10]}, {len(s.get('git_dirty', []))} files modified)",
            flush=True,
        )
    drv.run()
    summary = summarize(args, drv.events)
    print_report(summary)
    if args.json:
        write_results(args, drv, t0, summary)
    shutil.rmtree(drv.logdir, ignore_errors=True)
    if lock is not None:
        lock.close()


# --------------------------------------------------------------------------- timed sections


class Group(Protocol):
    """What :func:`timed` needs of the processes it times."""

    rank: int
    world: int

    def barrier(self) -> None: ...

    def gather(self, obj: Any) -> list[Any]: ...


class _Solo:
    """One process: the trivial group."""

    rank, world = 0, 1

    def barrier(self) -> None:
        pass

    def gather(self, obj: Any) -> list[Any]:
        return [obj]


SOLO: Group = _Solo()


@dataclass
class Section:
    """A timed section: ``marks[k]`` is max over ranks of the end of step k minus min over
    ranks of the start; ``own`` the slowest rank's own time to the end of step 0;
    ``foreign_cpu`` the CPU used by other processes of the machine meanwhile (a fraction
    of all CPUs; jiffies, so coarse) and ``steal`` the hypervisor's steal time; ``results``
    this rank's step results."""

    marks: list[float]
    own: float
    foreign_cpu: float
    steal: float
    results: list[Any]

    def fields(self) -> dict[str, float]:
        return {"own": self.own, "foreign_cpu": self.foreign_cpu, "steal": self.steal}


def timed(group: Group, *steps: Callable[..., Any]) -> Section:
    """A barrier, then every rank notes its start, runs ``steps[0]()``, then each further
    ``steps[k](result of step k-1)``, noting the time after each; then a barrier. Times are
    ``max(end) - min(start)`` over the ranks (CLOCK_MONOTONIC is one clock for the
    processes of a host): the wall time from the common barrier until the slowest rank is
    done. The only collectives are the two barriers and a gather after the second."""
    c0 = own_cpu()
    group.barrier()
    m0 = cpu_times() if group.rank == 0 else (0, 0)
    ts = [time.perf_counter()]
    results: list[Any] = []
    for k, step in enumerate(steps):
        results.append(step(*results[-1:]) if k else step())
        ts.append(time.perf_counter())
    group.barrier()
    m1 = cpu_times() if group.rank == 0 else (0, 0)
    c1 = own_cpu()
    got = group.gather((ts, c1 - c0))
    start = min(g[0][0] for g in got)
    marks = [max(g[0][k] for g in got) - start for k in range(1, len(ts))]
    mine = sum(g[1] for g in got)
    return Section(
        marks=marks,
        own=max(g[0][1] - g[0][0] for g in got),
        foreign_cpu=cpu_share(m1[0] - m0[0] - mine, marks[-1]),
        steal=cpu_share(m1[1] - m0[1], marks[-1]),
        results=results,
    )


class RankWorker:
    """One torchrun rank (``--worker SPEC``): a gloo group, a 1-D CPU mesh, distckpt's
    communicator over it, DCP; ``out`` is what rank 0 reports to the driver."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        self.torch, self.dist, self.spec = torch, dist, spec
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mesh = init_device_mesh("cpu", (self.world,))
        import torch.distributed.checkpoint as dcp

        import distckpt

        self.distckpt, self.dcp = distckpt, dcp
        self.comm = distckpt.comm.auto()
        self.out: dict[str, Any] = {
            "world": self.world,
            "events": [],
            "distckpt_file": distckpt.__file__,
        }

    def run(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.dist.destroy_process_group()

    @classmethod
    def main(cls, spec_file: str) -> None:
        """Run a worker from its spec file; rank 0 writes ``out`` to the result file."""
        spec = json.loads(Path(spec_file).read_text())
        w = cls(spec)
        w.run()
        w.barrier()
        if w.rank == 0:
            Path(spec["result"]).write_text(json.dumps(w.out))
        w.close()

    def barrier(self) -> None:
        self.dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        got: list[Any] = [None] * self.world
        self.dist.all_gather_object(got, obj)
        return got

    def allmax(self, d: Mapping[str, float]) -> dict[str, float]:
        got = self.gather(dict(d))
        return {k: max(g[k] for g in got) for k in d}

    def check(self, err: str | None, what: str) -> None:
        """Abort every rank with ``VERIFY FAILED`` if any rank reports an error."""
        bad = [f"rank {r}: {e}" for r, e in enumerate(self.gather(err)) if e]
        if bad:
            raise SystemExit(f"VERIFY FAILED ({what}): " + "; ".join(bad))

    def rmtree(self, *paths: Path) -> None:
        """Rank 0 removes ``paths`` between two barriers."""
        self.barrier()
        if self.rank == 0:
            for p in paths:
                shutil.rmtree(p, ignore_errors=True)
        self.barrier()


def settle_rank_args(args: Any, dirs: list[str]) -> Any:
    """The defaults of a per-process driver's parsed ``args`` (bench_rank, bench_signing):
    the dtype for the device, ``--quick``'s smoke sizes on tmpfs, ``dirs`` when no
    ``--dir`` was given."""
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.quick:
        args.gib = 0.125
        args.rounds = min(args.rounds, 2)
        args.dir = args.dir or ["/dev/shm/distckpt-bench"]
        args.wait_idle = min(args.wait_idle, 5)
    if not args.dir:
        args.dir = list(dirs)
    return args


# --------------------------------------------------------------------------- conformance runs
# The conformance drivers (dcp_conformance, megatron_conformance, deepspeed_conformance) run
# another project's own tests through distckpt, one pytest run per file and mode.

#: The outcomes a conformance run tells apart, the worst first.
OUTCOMES = ("failed", "error", "killed", "passed", "skipped")
EXCEPTION_LINE = re.compile(
    r"^(?:(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Failed|Failure)\b"
    r"(?::.*)?|(?:[a-z_]\w*\.)+[A-Z]\w*: .*)$"
)


@dataclass
class TestOutcome:
    """One test's outcome in one mode: passed, failed, error, skipped, or killed (started,
    never finished), with the first meaningful line of its error or skip reason."""

    outcome: str
    error: str = ""


@dataclass
class FileRun:
    """One test file's run in one mode: its exit code (None: killed), its time, its tests
    by pytest node id, and a note on what went wrong with the run itself."""

    returncode: int | None
    seconds: float
    tests: dict[str, Any]
    note: str = ""

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(OUTCOMES, 0)
        for test in self.tests.values():
            counts[test.outcome] += 1
        return counts

    def cell(self) -> str:
        """passed/failed/skipped (error and killed count as failed), ``!`` after a note."""
        c = self.counts()
        text = f"{c['passed']}/{c['failed'] + c['error'] + c['killed']}/{c['skipped']}"
        return text + (" !" if self.note else "")


def file_runs(
    name: str, modes: Sequence[str], runs: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """The results JSON's record of file ``name`` in each mode it ran in (``runs``: mode ->
    file name -> :class:`FileRun`)."""
    found = {}
    for mode in modes:
        done = runs[mode].get(name)
        if done is not None:
            found[mode] = {
                "returncode": done.returncode,
                "seconds": round(done.seconds, 1),
                "counts": done.counts(),
                "note": done.note,
            }
    return found


def clip(line: str, width: int = 300) -> str:
    """``line``, its middle cut out if it is longer than ``width`` characters."""
    if len(line) <= width:
        return line
    head = (width * 2) // 3
    return f"{line[:head]} ... {line[-(width - head - 5) :]}"


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON records of a file written one line each by the tests' processes (none if
    it is absent; a line cut short by a process killed mid-write is passed over)."""
    found = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return found


def exception_lines(text: str, wrappers: Sequence[re.Pattern[str]] = ()) -> list[str]:
    """The lines of ``text`` that name an exception and its message, ``wrappers`` (those
    that only carry another exception) left out."""
    found = []
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("E ") or line == "E":
            line = line[1:].strip()  # pytest's mark of an exception's lines
        if EXCEPTION_LINE.match(line) and not any(w.match(line) for w in wrappers):
            found.append(line)
    return found


def error_line(text: str, output: str = "", wrappers: Sequence[re.Pattern[str]] = ()) -> str:
    """The first meaningful line of a failure: the innermost exception's type and message.
    A rank that died without reporting its exception to the test (``Expected exit code 0
    but got 1``) printed it: the first one in the test's captured ``output`` is taken."""
    found = exception_lines(text, wrappers)
    chosen = found[-1] if found else ""
    if output and (not found or "Expected exit code" in text):
        printed = exception_lines(output, wrappers)
        chosen = printed[0] if printed else chosen
    if not chosen:
        chosen = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return clip(chosen)


def read_junit(
    path: Path,
    rel: Path,
    make: Callable[[str, str], Any] = TestOutcome,
    wrappers: Sequence[re.Pattern[str]] = (),
) -> dict[str, Any]:
    """Each test case of the JUnit XML report ``path`` of one file's run (``rel``, relative
    to pytest's root), by pytest node id: ``make(outcome, error line)``."""
    import xml.etree.ElementTree as ET

    module = rel.with_suffix("").as_posix().replace("/", ".")
    tests: dict[str, Any] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        if classname == module:
            test = f"{rel.as_posix()}::{name}"
        elif classname.startswith(module + "."):
            test = f"{rel.as_posix()}::{classname[len(module) + 1 :].replace('.', '::')}::{name}"
        else:  # a collection error and the like
            test = f"{rel.as_posix()}::{classname or '<collection>'}::{name}"
        outcome = make("passed", "")
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is None:
                continue
            message = element.get("message", "")
            if tag == "skipped":
                outcome = make("skipped", clip(message.strip()))
                break
            output = "\n".join(
                part.text or "" for part in case if part.tag in ("system-out", "system-err")
            )
            text = f"{message}\n{element.text or ''}"
            kind = "failed" if tag == "failure" else "error"
            outcome = make(kind, error_line(text, output, wrappers))
            break
        tests[test] = outcome
    return tests


def conformance_env(
    paths: Sequence[str | Path], tmpdir: Path, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of a conformance run's tests: this one with ``paths`` first on
    ``PYTHONPATH`` (the distckpt tested, in every process the tests start too), one thread
    per process, gloo over loopback, ``TMPDIR`` a fresh folder, then ``extra``."""
    env = dict(os.environ)
    parts = [str(p) for p in paths]
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    env.update({k: v for k, v in TORCHRUN_ENV.items() if v is not None})
    env.update(PYTHONPATH=os.pathsep.join(parts), TMPDIR=str(tmpdir))
    env.update(extra or {})
    return env


def run_logged(
    command: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    log: Path,
    timeout: float,
    grace: float = 0,
) -> int | None:
    """Run ``command`` in a session of its own, its output to ``log``; its exit code, or
    None once past ``timeout``: then it is stopped with SIGTERM (if ``grace``: a launcher
    that stops its own workers, given ``grace`` seconds) and its whole process group with
    SIGKILL (the processes the tests spawned too)."""
    import signal

    with log.open("w", encoding="utf-8") as out:
        process = subprocess.Popen(
            list(command),
            cwd=cwd,
            env=dict(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return process.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            if grace:
                process.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=grace)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return None


def conformance_args(parser: argparse.ArgumentParser) -> None:
    """The options every conformance driver has."""
    parser.add_argument("--json", type=Path, help="write every test's outcome here")
    parser.add_argument("-k", dest="keyword", help="pytest's -k expression")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a test may take")
    parser.add_argument(
        "--file-timeout", type=float, default=4 * 3600, help="seconds one file's run may take"
    )
    parser.add_argument("--python", default=sys.executable, help="the interpreter of the tests")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")


@contextlib.contextmanager
def work_dir(prefix: str, keep: bool) -> Iterator[Path]:
    """A fresh temporary directory for a conformance run, removed afterwards unless
    ``keep``."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield root
    finally:
        if keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def print_file_table(
    files: Sequence[str], modes: Sequence[str], runs: Mapping[str, Mapping[str, FileRun]]
) -> None:
    """Per file and mode: passed/failed/skipped, and the totals; then the notes."""
    width = max([len(name) for name in files] + [len("file")])
    print()
    print(f"{'file':<{width}}  " + "  ".join(f"{m + ' p/f/s':>15}" for m in modes))
    totals = {mode: [0, 0, 0] for mode in modes}
    for name in files:
        cells = []
        for mode in modes:
            run = runs[mode].get(name)
            cells.append(f"{run.cell() if run else '-':>15}")
            if run is not None:
                c = run.counts()
                totals[mode][0] += c["passed"]
                totals[mode][1] += c["failed"] + c["error"] + c["killed"]
                totals[mode][2] += c["skipped"]
        print(f"{name:<{width}}  " + "  ".join(cells))
    print(
        f"{'total':<{width}}  "
        + "  ".join(f"{'/'.join(map(str, totals[mode])):>15}" for mode in modes)
    )
    for mode in modes:
        for name, run in runs[mode].items():
            if run.note:
                print(f"  ! {mode} {name}: {run.note}")


def run_pytest_file(
    python: str,
    rel: Path,
    *,
    cwd: Path,
    env: Mapping[str, str],
    work: Path,
    timeout: float,
    file_timeout: float,
    keyword: str | None = None,
    options: Sequence[str] = (),
    make: Callable[[str, str], Any] = TestOutcome,
    wrappers: Sequence[re.Pattern[str]] = (),
) -> FileRun:
    """One test file's pytest run in a process of its own (``-p no:cacheprovider``, a
    per-test ``--timeout`` from pytest-timeout, ``options``, a JUnit XML report for the
    outcomes, what a test printed in it), its output in ``work/output.txt``; past
    ``file_timeout`` the run and every process it spawned are killed."""
    import xml.etree.ElementTree as ET

    junit = work / "junit.xml"
    command = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rN"]
    command += [f"--timeout={timeout:g}", f"--junitxml={junit}"]
    command += ["-o", "junit_logging=all"]  # what a rank printed: the exception it could not report
    command += [*options, rel.as_posix()]
    if keyword:
        command += ["-k", keyword]
    started = time.monotonic()
    log = work / "output.txt"
    returncode = run_logged(command, cwd=cwd, env=env, log=log, timeout=file_timeout)
    seconds = time.monotonic() - started
    note = "" if returncode is not None else f"killed after {file_timeout:g} s"
    tests: dict[str, Any] = {}
    if junit.exists():
        try:
            tests = read_junit(junit, rel, make, wrappers)
        except ET.ParseError as exc:
            note = note or f"unreadable JUnit report: {exc}"
    elif not note:
        tail = log.read_text(encoding="utf-8", errors="replace")
        note = "no JUnit report: " + error_line(tail[-4000:], wrappers=wrappers)
    return FileRun(returncode, seconds, tests, note)


def find_differences(
    baseline: str, modes: Sequence[str], runs: Mapping[str, Mapping[str, FileRun]]
) -> Iterator[dict[str, Any]]:
    """Every test whose outcome in a mode differs from its outcome in mode ``baseline``
    (``absent``: not run there): the mode, the test, both outcomes (the baseline's under
    the baseline's name), the error line, and the other fields of the test's outcome."""
    import dataclasses

    for mode in modes:
        if mode == baseline:
            continue
        for name, run in runs[mode].items():
            before_run = runs[baseline].get(name)
            base_tests = before_run.tests if before_run else {}
            for test, outcome in run.tests.items():
                before = base_tests.get(test)
                was = before.outcome if before else "absent"
                if was != outcome.outcome:
                    fields = dataclasses.asdict(outcome)
                    yield {
                        "mode": mode,
                        "test": test,
                        baseline: was,
                        "outcome": fields.pop("outcome"),
                        "error": fields.pop("error"),
                        **fields,
                    }
