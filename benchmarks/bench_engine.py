#!/usr/bin/env python
"""Save / resharded-load benchmark: distckpt vs torch.distributed.checkpoint vs raw files.

One run of the *driver* (``python benchmarks/bench_engine.py ...``) launches torchrun
workers (this same file, ``--worker SPEC``) with gloo, ``OMP_NUM_THREADS=1`` and
``GLOO_SOCKET_IFNAME=lo``, collects what rank 0 of each launch reports, and prints a
table and ratios (see benchmarks/README.md).

Contenders, all on identical data (float32 DTensors sharded on dim 0 over a 1-D CPU mesh):

* ``distckpt``: ``distckpt.save(state, path, comm)`` / ``distckpt.load(state, path, comm)``;
* ``dcp``: ``torch.distributed.checkpoint.save(state, checkpoint_id=path)`` / ``.load``
  (FileSystemWriter defaults: one file per rank, fsync on);
* ``raw``: the limit. Save: every rank writes its local shards, in order, into ONE file
  per rank with a single ``writev`` (no headers, no checksums), then ``fsync`` of the file
  and of the directory. One file per rank is the honest upper bound: fewest opens, fsyncs
  and syscalls. Load on M ranks: reader j ``preadv``s the j-th 1/M byte range of the
  concatenation of the writers' files straight into a pre-touched buffer (the same total
  bytes as the checkpoint data, no copy, no checksum).

Case A: 16 x (4096 x 4096) float32 (1 GiB) saved on 4 ranks, loaded on 2 and on 3 ranks
(DTensor Shard(0) targets on the new mesh: a resharded load). Each round is: save launch
(4 ranks; untimed warm-up save of every contender, then timed saves of all three, order
rotated each round; each contender's warm-up copy is deleted right before its timed
save) -> load launch on 2 ranks -> load launch on 3 ranks (each: untimed warm-up load of
every contender, then timed loads, order rotated) -> delete.

Case B: 1,000 tensors of 48 x 64 float32, saved and loaded on the same world size
(4 and 16 ranks). One launch per world size; the workers loop over the rounds (warm-up
round first), the order rotated each round; each checkpoint is deleted before the next.

Timing: a barrier, then every rank records its start, runs the operation and records its
end; the reported time is max(end) - min(start) over the ranks (CLOCK_MONOTONIC is shared
by the processes of one host): the wall time from the common barrier until the slowest
rank is done. On a disk (not tmpfs) every file of the checkpoints is evicted from the
page cache (posix_fadvise DONTNEED: they are clean after the fsyncs) before each timed
load, so loads read the device (``--cache warm`` keeps them cached).

Correctness: every element holds a closed-form value of (tensor, global row, column).
Before each load the targets are filled with -1; after it, the first and last local rows
of every tensor and one whole tensor (rotating) are compared with the formula (every
tensor in case B); the raw reader checks sampled elements of its byte range. A mismatch
aborts the benchmark.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CONTENDERS = ("distckpt", "dcp", "raw")
MOD = 16777213  # values stay below 2**24: exact in float32
GiB = 1 << 30


# --------------------------------------------------------------------------- data


def expected_block(index: int, row0: int, nrows: int, ncols: int):
    import torch

    rows = torch.arange(row0, row0 + nrows, dtype=torch.int64).unsqueeze(1)
    cols = torch.arange(ncols, dtype=torch.int64).unsqueeze(0)
    return ((index * 1_000_003 + rows * 4099 + cols) % MOD).to(torch.float32)


def expected_element(index: int, row: int, col: int) -> float:
    return float((index * 1_000_003 + row * 4099 + col) % MOD)


def chunk_rows(nrows: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of DTensor Shard(0) piece ``index`` (torch.chunk semantics)."""
    size = -(-nrows // parts)
    start = min(size * index, nrows)
    return start, max(0, min(size, nrows - start))


def names(spec: dict[str, Any]) -> list[str]:
    return [f"w{i:04d}" for i in range(spec["ntensors"])]


def make_state(spec: dict[str, Any], mesh, *, fill: bool) -> dict[str, Any]:
    """DTensors Shard(0) on ``mesh``; filled with the formula, or with -1 (touched)."""
    import torch
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import empty as dt_empty

    rank, world = mesh.get_rank(), mesh.size()
    rows, cols = spec["rows"], spec["cols"]
    state = {}
    for i, name in enumerate(names(spec)):
        dt = dt_empty((rows, cols), dtype=torch.float32, device_mesh=mesh, placements=[Shard(0)])
        local = dt.to_local()
        row0, n = chunk_rows(rows, world, rank)
        assert tuple(local.shape) == (n, cols), (local.shape, n, cols)
        if fill:
            local.copy_(expected_block(i, row0, n, cols))
        else:
            local.fill_(-1.0)
        state[name] = dt
    return state


def reset(state: dict[str, Any]) -> None:
    for dt in state.values():
        dt.to_local().fill_(-1.0)


def verify(
    spec: dict[str, Any], state: dict[str, Any], rank: int, world: int, salt: int
) -> str | None:
    """None if the restored state holds the formula's values, else a description."""
    import torch

    rows, cols = spec["rows"], spec["cols"]
    row0, n = chunk_rows(rows, world, rank)
    if n == 0:
        return None
    all_full = spec["ntensors"] * n * cols <= (1 << 22)
    full = (salt + rank) % spec["ntensors"]
    for i, name in enumerate(names(spec)):
        local = state[name].to_local()
        if all_full or i == full:
            if not torch.equal(local, expected_block(i, row0, n, cols)):
                return f"{name}: local block rows {row0}..{row0 + n} differs"
        else:
            for r in (0, n - 1):
                if not torch.equal(local[r], expected_block(i, row0 + r, 1, cols)[0]):
                    return f"{name}: row {row0 + r} differs"
    return None


# --------------------------------------------------------------------------- raw files


def writer_layout(spec: dict[str, Any], writers: int) -> list[list[tuple[int, int, int]]]:
    """Per writer rank: the (tensor index, first row, rows) it stores, in file order."""
    out = []
    for w in range(writers):
        row0, n = chunk_rows(spec["rows"], writers, w)
        out.append([(i, row0, n) for i in range(spec["ntensors"]) if n])
    return out


def raw_save(state: dict[str, Any], path: Path, rank: int) -> None:
    from distckpt.engine.arrays import host_array

    path.mkdir(parents=True, exist_ok=True)
    views = [memoryview(host_array(dt.to_local()).reshape(-1).view("u1")) for dt in state.values()]
    fd = os.open(path / f"rank{rank:05d}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for start in range(0, len(views), 1024):
            batch = views[start : start + 1024]
            want = sum(v.nbytes for v in batch)
            done = os.writev(fd, batch)
            if done < want:  # finish a short write
                flat = memoryview(b"".join(bytes(v) for v in batch))[done:]
                while flat:
                    flat = flat[os.write(fd, flat) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def raw_share(spec: dict[str, Any], writers: int, rank: int, world: int) -> tuple[int, int, int]:
    """(total bytes, start, end) of reader ``rank``'s byte range of the concatenated files."""
    total = spec["ntensors"] * spec["rows"] * spec["cols"] * 4
    elems = total // 4
    return total, (rank * elems // world) * 4, ((rank + 1) * elems // world) * 4


def raw_file_sizes(spec: dict[str, Any], writers: int) -> list[int]:
    return [sum(n * spec["cols"] * 4 for _, _, n in lay) for lay in writer_layout(spec, writers)]


def raw_load(spec: dict[str, Any], path: Path, writers: int, rank: int, world: int, buf) -> int:
    """Read this reader's share into ``buf`` (a uint8 array). Returns bytes read."""
    _, start, end = raw_share(spec, writers, rank, world)
    sizes = raw_file_sizes(spec, writers)
    pos = 0  # global offset of the current file
    got = 0
    for w, size in enumerate(sizes):
        lo, hi = max(start, pos), min(end, pos + size)
        if lo < hi:
            fd = os.open(path / f"rank{w:05d}.bin", os.O_RDONLY)
            try:
                off = lo
                while off < hi:
                    dst = memoryview(buf[off - start : hi - start])
                    n = os.preadv(fd, [dst], off - pos)
                    if n <= 0:
                        raise OSError(f"short read of {path}/rank{w:05d}.bin at {off - pos}")
                    off += n
                    got += n
            finally:
                os.close(fd)
        pos += size
    return got


def raw_verify(
    spec: dict[str, Any], writers: int, rank: int, world: int, buf, salt: int
) -> str | None:
    import numpy as np

    _, start, end = raw_share(spec, writers, rank, world)
    if end == start:
        return None
    cols = spec["cols"]
    # element offsets of each (writer, tensor) run in the concatenation
    starts, runs = [], []
    pos = 0
    for lay in writer_layout(spec, writers):
        for i, row0, n in lay:
            starts.append(pos)
            runs.append((i, row0, n))
            pos += n * cols
    vals = buf[: end - start].view(np.float32)
    rng = np.random.default_rng(salt * 1000 + rank)
    picks = set(rng.integers(0, vals.size, 512).tolist()) | {0, vals.size - 1}
    for k in sorted(picks):
        e = start // 4 + k
        j = bisect.bisect_right(starts, e) - 1
        i, row0, _ = runs[j]
        r, c = divmod(e - starts[j], cols)
        want = expected_element(i, row0 + r, c)
        if vals[k] != want:
            where = f"raw element {e} (tensor {i}, row {row0 + r}, col {c})"
            return f"{where} is {vals[k]}, expected {want}"
    return None


def cpu_times() -> tuple[int, int]:
    """(busy, steal) jiffies of the whole machine, from /proc/stat."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = f[:8]
    return user + nice + system + irq + softirq, steal


def own_cpu() -> int:
    """utime + stime jiffies of this process (all its threads)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def evict(paths: list[Path]) -> None:
    """Drop the (clean) pages of every file under ``paths`` from the page cache."""
    for root in paths:
        if not root.exists():
            continue
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


# --------------------------------------------------------------------------- worker


class Worker:
    def __init__(self, spec: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        self.dist = dist
        self.spec = spec
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
        self.cold = spec["cold"]

    def barrier(self) -> None:
        self.dist.barrier()

    def timed(self, fn) -> tuple[float, float, Any]:
        """Barrier, run ``fn`` on every rank, barrier; (span, slowest rank's own time, result)."""
        c0 = own_cpu()
        self.barrier()
        m0 = cpu_times() if self.rank == 0 else (0, 0)
        t0 = time.perf_counter()
        res = fn()
        t1 = time.perf_counter()
        self.barrier()
        m1 = cpu_times() if self.rank == 0 else (0, 0)
        c1 = own_cpu()
        spans: list[Any] = [None] * self.world
        self.dist.all_gather_object(spans, (t0, t1, c1 - c0))
        span = max(e for _, e, _ in spans) - min(s for s, _, _ in spans)
        own = max(e - s for s, e, _ in spans)
        # CPU used by other processes of the machine during the section, as a fraction of
        # all CPUs (jiffies: coarse), and the steal time the hypervisor reported.
        hz, ncpu = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
        mine = sum(c for _, _, c in spans)
        self.last_foreign = max(0.0, (m1[0] - m0[0] - mine) / hz / max(span, 1e-9) / ncpu)
        self.last_steal = (m1[1] - m0[1]) / hz / max(span, 1e-9) / ncpu
        return span, own, res

    def allmax(self, d: dict[str, float]) -> dict[str, float]:
        got: list[Any] = [None] * self.world
        self.dist.all_gather_object(got, d)
        return {k: max(g[k] for g in got) for k in d}

    def check(self, err: str | None, what: str) -> None:
        errs: list[Any] = [None] * self.world
        self.dist.all_gather_object(errs, err)
        bad = [f"rank {r}: {e}" for r, e in enumerate(errs) if e]
        if bad:
            raise SystemExit(f"VERIFY FAILED ({what}): " + "; ".join(bad))

    def rmtree(self, *paths: Path) -> None:
        self.barrier()
        if self.rank == 0:
            for p in paths:
                shutil.rmtree(p, ignore_errors=True)
        self.barrier()

    # ---- the three contenders
    def save(self, who: str, state: dict[str, Any], path: Path) -> Any:
        if who == "distckpt":
            res = self.distckpt.save(state, path, comm=self.comm)
            return {"timings": res.timings, "bytes": res.bytes_written, "files": res.files_written}
        if who == "dcp":
            self.dcp.save(state, checkpoint_id=str(path))
            return None
        raw_save(state, path, self.rank)
        return None

    def load(self, who: str, state: dict[str, Any], path: Path, buf, writers: int) -> Any:
        if who == "distckpt":
            res = self.distckpt.load(state, path, comm=self.comm)
            return {"timings": res.timings, "bytes": res.bytes_read}
        if who == "dcp":
            self.dcp.load(state, checkpoint_id=str(path))
            return None
        return {"bytes": raw_load(self.spec, path, writers, self.rank, self.world, buf)}

    def verify_load(self, who: str, state, buf, writers: int, salt: int) -> None:
        if who == "raw":
            err = raw_verify(self.spec, writers, self.rank, self.world, buf, salt)
        else:
            err = verify(self.spec, state, self.rank, self.world, salt)
        self.check(err, f"{who} load on {self.world} ranks")

    def raw_buffer(self, writers: int):
        import numpy as np

        _, start, end = raw_share(self.spec, writers, self.rank, self.world)
        buf = np.empty(end - start, dtype=np.uint8)
        buf.fill(0)  # touched, like the DTensor targets
        return buf

    def reset_for(self, who: str, state, buf) -> None:
        if who == "raw":
            buf.fill(0)
        else:
            reset(state)

    # ---- modes
    def run_save(self) -> None:
        """Case A save launch: warm-up round, then one timed save of each contender."""
        spec = self.spec
        base = Path(spec["dir"])
        src = make_state(spec, self.mesh, fill=True)
        warm = {c: base / f"warmup-{c}" for c in CONTENDERS}
        for who in spec["order"]:
            self.save(who, src, warm[who])
            self.barrier()
        paths = {c: Path(p) for c, p in spec["paths"].items()}
        for who in spec["order"]:
            # Untimed: remove this contender's warm-up copy right before its timed save, so
            # every contender writes into memory freed just before (see README: on this VM
            # fresh pages are far more expensive than recycled ones).
            self.rmtree(warm[who])
            span, own, res = self.timed(lambda w=who, p=paths: self.save(w, src, p[w]))
            ev = {
                "op": "save",
                "who": who,
                "world": self.world,
                "span": span,
                "own": own,
                "foreign_cpu": self.last_foreign,
                "steal": self.last_steal,
            }
            if res is not None:
                ev["timings_max"] = self.allmax(res["timings"])
                ev["timings_rank0"] = res["timings"]
                ev["files_rank0"] = res["files"]
            self.out["events"].append(ev)

    def run_load(self) -> None:
        """Case A load launch (M ranks): warm-up load of each contender, then timed loads."""
        spec = self.spec
        writers = spec["saved_world"]
        paths = {c: Path(p) for c, p in spec["paths"].items()}
        state = make_state(spec, self.mesh, fill=False)
        buf = self.raw_buffer(writers)
        for who in spec["order"]:  # warm-up, verified too
            self.reset_for(who, state, buf)
            self.load(who, state, paths[who], buf, writers)
            self.verify_load(who, state, buf, writers, salt=spec["round"] + 101)
        for who in spec["order"]:
            self.reset_for(who, state, buf)
            if self.cold:
                self.barrier()
                if self.rank == 0:
                    evict(list(paths.values()))
            span, own, res = self.timed(lambda w=who: self.load(w, state, paths[w], buf, writers))
            self.verify_load(who, state, buf, writers, salt=spec["round"])
            ev = {
                "op": f"load{writers}->{self.world}",
                "who": who,
                "world": self.world,
                "span": span,
                "own": own,
                "foreign_cpu": self.last_foreign,
                "steal": self.last_steal,
            }
            if res is not None:
                ev["bytes_max"] = self.allmax({"b": float(res["bytes"])})["b"]
            self.out["events"].append(ev)

    def run_small(self) -> None:
        """Case B launch: warm-up round, then rounds of save + same-world load."""
        spec = self.spec
        base = Path(spec["dir"])
        src = make_state(spec, self.mesh, fill=True)
        dst = make_state(spec, self.mesh, fill=False)
        buf = self.raw_buffer(self.world)
        orders = spec["orders"]
        for rnd in range(-1, spec["rounds"]):
            order = orders[rnd % len(orders)] if rnd >= 0 else list(CONTENDERS)
            paths = {c: base / f"B{self.world}-r{rnd + 1}-{c}" for c in CONTENDERS}
            for who in order:
                span, own, res = self.timed(lambda w=who, p=paths: self.save(w, src, p[w]))
                if rnd >= 0:
                    ev = {
                        "op": "save",
                        "who": who,
                        "world": self.world,
                        "round": rnd,
                        "span": span,
                        "own": own,
                        "foreign_cpu": self.last_foreign,
                        "steal": self.last_steal,
                    }
                    if res is not None:
                        ev["timings_max"] = self.allmax(res["timings"])
                        ev["timings_rank0"] = res["timings"]
                        ev["files_rank0"] = res["files"]
                    self.out["events"].append(ev)
            for who in order:
                self.reset_for(who, dst, buf)
                if self.cold:
                    self.barrier()
                    if self.rank == 0:
                        evict(list(paths.values()))
                span, own, _ = self.timed(
                    lambda w=who, p=paths: self.load(w, dst, p[w], buf, self.world)
                )
                self.verify_load(who, dst, buf, self.world, salt=rnd + 7)
                if rnd >= 0:
                    self.out["events"].append(
                        {
                            "op": f"load{self.world}->{self.world}",
                            "who": who,
                            "world": self.world,
                            "round": rnd,
                            "span": span,
                            "own": own,
                            "foreign_cpu": self.last_foreign,
                            "steal": self.last_steal,
                        }
                    )
            self.rmtree(*paths.values())


def worker_main(spec_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    w = Worker(spec)
    getattr(w, {"save": "run_save", "load": "run_load", "small": "run_small"}[spec["mode"]])()
    w.barrier()
    if w.rank == 0:
        Path(spec["result"]).write_text(json.dumps(w.out))
    w.dist.destroy_process_group()


# --------------------------------------------------------------------------- driver


def meminfo() -> dict[str, float]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        if k in ("MemAvailable", "Shmem", "Cached"):
            out[k] = int(v.split()[0]) / (1 << 20)  # GiB
    return out


def fs_type(path: Path) -> str:
    path = path.resolve()
    best, kind = "", "?"
    for line in Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        mnt = parts[1]
        if (str(path) == mnt or str(path).startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(
            best
        ):
            best, kind = mnt, parts[2]
    return kind


def launch_worker(
    drv: Any,
    cmd_head: list[str],
    script: Path,
    spec: dict[str, Any],
    label: str,
    env_extra: dict[str, str | None],
) -> tuple[dict[str, Any], float, dict[str, float]]:
    """Run ``cmd_head script --worker SPEC`` for driver ``drv``: the spec (with a result file
    added) in ``drv.logdir``, launcher variables scrubbed, ``env_extra`` applied (None
    removes), the library snapshot first on ``PYTHONPATH``. Stops the run on a failed launch,
    workers that imported another distckpt, or low memory. Returns (the workers' result,
    wall seconds of the launch, meminfo after it)."""
    fd, result = tempfile.mkstemp(prefix="res-", suffix=".json", dir=drv.logdir)
    os.close(fd)
    spec_file = Path(result).with_suffix(".spec.json")
    spec_file.write_text(json.dumps({**spec, "result": result}))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONUNBUFFERED"] = "1"
    for k, v in env_extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    first = drv.snapshot["path"] if drv.snapshot else str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(
        [first] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    cmd = [*cmd_head, str(script.resolve()), "--worker", str(spec_file)]
    log = drv.logdir / f"{label}.log"
    t = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.run(
            cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=drv.args.launch_timeout
        )
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        sys.stderr.write(Path(log).read_text()[-6000:])
        raise SystemExit(f"launch {label} failed (rc {proc.returncode}); log {log}")
    out = json.loads(Path(result).read_text())
    if drv.snapshot and not out["distckpt_file"].startswith(drv.snapshot["path"]):
        raise SystemExit(f"workers imported {out['distckpt_file']}, not the snapshot")
    m = meminfo()
    drv.mem.append({"after": label, **m})
    if m["MemAvailable"] < 3.0:
        raise SystemExit(f"MemAvailable {m['MemAvailable']:.1f} GiB after {label}: stopping")
    return out, wall, m


def orders_for(rounds: int) -> list[list[str]]:
    """A different order each round: the 6 permutations, interleaved so that each contender
    goes first, second and third equally often every 3 rounds."""
    perms = [list(p) for p in itertools.permutations(CONTENDERS)]
    seq = [perms[i] for i in (0, 3, 4, 1, 2, 5)]  # (d,c,r) (c,r,d) (r,d,c) (d,r,c) (c,d,r) (r,c,d)
    return [seq[i % 6] for i in range(rounds)]


class Driver:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.events: list[dict[str, Any]] = []
        self.mem: list[dict[str, Any]] = []
        self.logdir = Path(tempfile.mkdtemp(prefix="bench_engine-logs-"))
        self.snapshot = self.take_snapshot() if args.snapshot else None

    def take_snapshot(self) -> dict[str, Any]:
        """Copy the distckpt package as it is now: every launch of this run uses that copy,
        even if the working tree changes while the benchmark runs."""
        import hashlib
        import importlib.util

        spec = importlib.util.find_spec("distckpt")
        assert spec is not None and spec.submodule_search_locations
        src = Path(list(spec.submodule_search_locations)[0])
        dst = self.logdir / "snapshot" / "distckpt"
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        digest = hashlib.sha256()
        for f in sorted(dst.rglob("*.py")):
            digest.update(str(f.relative_to(dst)).encode() + b"\0" + f.read_bytes())
        info: dict[str, Any] = {
            "source": str(src),
            "sha256": digest.hexdigest()[:16],
            "path": str(dst.parent),
        }
        try:
            root = src.parent
            info["git_head"] = subprocess.run(
                ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
            info["git_dirty"] = subprocess.run(
                ["git", "-C", str(root), "status", "--porcelain", "--", str(src)],
                capture_output=True,
                text=True,
            ).stdout.split("\n")
            info["git_dirty"] = [x for x in info["git_dirty"] if x]
        except OSError:
            pass
        return info

    def wait_idle(self) -> float:
        """Wait (up to --wait-idle s) until other processes use < --idle-busy of the CPUs
        over one second; return the last measured busy fraction."""
        deadline = time.monotonic() + self.args.wait_idle
        ncpu = os.cpu_count() or 1
        hz = os.sysconf("SC_CLK_TCK")
        while True:
            b0, _ = cpu_times()
            time.sleep(1.0)
            b1, _ = cpu_times()
            busy = (b1 - b0) / hz / ncpu
            if busy < self.args.idle_busy or time.monotonic() > deadline:
                return busy
            time.sleep(4.0)

    def launch(self, nproc: int, spec: dict[str, Any], label: str) -> dict[str, Any]:
        busy = self.wait_idle()
        cmd_head = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
        ]
        threads = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        out, wall, m = launch_worker(self, cmd_head, Path(__file__), spec, label, threads)
        for e in out["events"]:
            e["busy_before_launch"] = busy
        print(
            f"  {label}: {wall:.1f}s launch; "
            + ", ".join(f"{e['op']} {e['who']} {e['span']:.3f}s" for e in out["events"])
            + f"  [avail {m['MemAvailable']:.1f} GiB, shmem {m['Shmem']:.1f} GiB, "
            f"other CPU before {busy:.0%}, during timed max "
            f"{max((e['foreign_cpu'] for e in out['events']), default=0):.0%}]",
            flush=True,
        )
        return out

    def cold_for(self, d: Path) -> bool:
        if self.args.cache == "warm":
            return False
        return fs_type(d) != "tmpfs"

    def case_a(self, d: Path) -> None:
        a = self.args
        spec0 = {
            "ntensors": a.a_tensors,
            "rows": a.a_rows,
            "cols": a.a_cols,
            "dir": str(d),
            "cold": self.cold_for(d),
            "saved_world": a.a_save_world,
        }
        paths = {c: str(d / f"A-{c}") for c in CONTENDERS}
        orders = orders_for(a.rounds)
        for rnd in range(a.rounds):
            for p in paths.values():
                shutil.rmtree(p, ignore_errors=True)
            order = orders[rnd]
            print(f" case A {d} round {rnd + 1}/{a.rounds} order {order}", flush=True)
            tag = {"case": "A", "dir": str(d), "fs": fs_type(d), "round": rnd}
            out = self.launch(
                a.a_save_world,
                {**spec0, "mode": "save", "order": order, "paths": paths, "round": rnd},
                f"A-r{rnd}-save",
            )
            self.events += [{**tag, **e} for e in out["events"]]
            for k, m in enumerate(a.a_load_worlds):
                lorder = orders[(rnd + 1 + k) % len(orders)]
                out = self.launch(
                    m,
                    {**spec0, "mode": "load", "order": lorder, "paths": paths, "round": rnd},
                    f"A-r{rnd}-load{m}",
                )
                self.events += [{**tag, **e} for e in out["events"]]
            for p in paths.values():
                shutil.rmtree(p, ignore_errors=True)

    def case_b(self, d: Path) -> None:
        a = self.args
        for n in a.b_worlds:
            print(f" case B {d} world {n}", flush=True)
            spec = {
                "ntensors": a.b_tensors,
                "rows": a.b_rows,
                "cols": a.b_cols,
                "dir": str(d),
                "cold": self.cold_for(d),
                "mode": "small",
                "rounds": a.rounds,
                "orders": orders_for(a.rounds),
            }
            out = self.launch(n, spec, f"B-w{n}")
            tag = {"case": "B", "dir": str(d), "fs": fs_type(d)}
            self.events += [{**tag, **e} for e in out["events"]]

    def run(self) -> None:
        a = self.args
        for parent in a.dir:
            parent = Path(parent).absolute()
            # A directory of our own inside --dir: concurrent runs never touch each other's files.
            parent.mkdir(parents=True, exist_ok=True)
            d = Path(tempfile.mkdtemp(prefix=f"run-{os.getpid()}-", dir=parent))
            print(
                f"== {d} ({fs_type(d)}, loads "
                f"{'cold: page cache evicted' if self.cold_for(d) else 'from memory'})",
                flush=True,
            )
            try:
                if "A" in a.case:
                    self.case_a(d)
                if "B" in a.case:
                    self.case_b(d)
            finally:
                shutil.rmtree(d, ignore_errors=True)
                with contextlib.suppress(OSError):
                    parent.rmdir()  # only if empty


def exclusive(lock_path: str):
    """Hold an exclusive lock for the whole run: two benchmark runs on one machine would
    time each other. Waits (with a message) while another run holds it."""
    import fcntl

    fh = open(lock_path, "a+")  # noqa: SIM115 - held open for the whole run
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        print(
            "waiting for another bench_engine run to finish "
            f"(lock {lock_path}: {fh.read().strip()})",
            flush=True,
        )
        fcntl.flock(fh, fcntl.LOCK_EX)
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()} since {time.strftime('%H:%M:%S')}\n")
    fh.flush()
    return fh


# --------------------------------------------------------------------------- report


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(args: argparse.Namespace, events: list[dict[str, Any]]) -> dict[str, Any]:
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for e in events:
        groups.setdefault((e["case"], e["dir"], e["op"], e["world"], e["who"]), []).append(e)
    nbytes = {
        "A": args.a_tensors * args.a_rows * args.a_cols * 4,
        "B": args.b_tensors * args.b_rows * args.b_cols * 4,
    }
    rows = []
    for (case, d, op, world, who), es in sorted(groups.items()):
        spans = [e["span"] for e in es]
        row = {
            "case": case,
            "dir": d,
            "fs": es[0]["fs"],
            "op": op,
            "world": world,
            "who": who,
            "n": len(spans),
            "median_s": med(spans),
            "min_s": min(spans),
            "max_s": max(spans),
            "bytes": nbytes[case],
            "GiBps": nbytes[case] / GiB / med(spans),
            "spans": spans,
            "other_cpu_median": med([e.get("foreign_cpu", 0.0) for e in es]),
        }
        br = [e["bytes_max"] for e in es if "bytes_max" in e]
        if br:
            row["bytes_read_max_rank"] = max(br)
        tm = [e["timings_max"] for e in es if "timings_max" in e]
        if tm:
            row["phases_median_max_over_ranks"] = {k: med([t[k] for t in tm]) for k in tm[0]}
            row["phases_median_rank0"] = {
                k: med([e["timings_rank0"][k] for e in es]) for k in tm[0]
            }
        rows.append(row)

    def pick(case, d, op, world, who):
        for r in rows:
            if (r["case"], r["dir"], r["op"], r["world"], r["who"]) == (case, d, op, world, who):
                return r
        return None

    def paired(case, d, op, world, num, den):
        a = {e.get("round"): e["span"] for e in groups.get((case, d, op, world, num), [])}
        b = {e.get("round"): e["span"] for e in groups.get((case, d, op, world, den), [])}
        return [a[k] / b[k] for k in a if k in b]

    ratios = []

    def add(label, case, d, op, world, num, den, target=None, invert=False):
        rn, rd = pick(case, d, op, world, num), pick(case, d, op, world, den)
        if rn is None or rd is None:
            return
        pr = paired(case, d, op, world, num, den)
        if invert:  # throughput ratio num/den = time den / time num
            val = rd["median_s"] / rn["median_s"]
            pr = [1 / x for x in pr]
        else:
            val = rn["median_s"] / rd["median_s"]
        ok = None
        if target is not None:
            ok = val >= target[1] if target[0] == ">=" else val <= target[1]
        mins = rd["min_s"] / rn["min_s"] if invert else rn["min_s"] / rd["min_s"]
        ratios.append(
            {
                "label": label,
                "dir": d,
                "fs": rn["fs"],
                "value": val,
                "of_mins": mins,
                "paired_median": med(pr),
                "paired_min": min(pr),
                "paired_max": max(pr),
                "target": f"{target[0]} {target[1]}" if target else "",
                "ok": ok,
            }
        )

    for d in sorted({e["dir"] for e in events}):
        shm = any(r["fs"] == "tmpfs" for r in rows if r["dir"] == d)
        s = args.a_save_world
        add(
            "A save thr distckpt/raw",
            "A",
            d,
            "save",
            s,
            "distckpt",
            "raw",
            (">=", 0.7) if shm else None,
            invert=True,
        )
        for m in args.a_load_worlds:
            add(
                f"A load{s}->{m} thr distckpt/raw",
                "A",
                d,
                f"load{s}->{m}",
                m,
                "distckpt",
                "raw",
                (">=", 0.6),
                invert=True,
            )
        add("A save time distckpt/dcp", "A", d, "save", s, "distckpt", "dcp")
        for m in args.a_load_worlds:
            add(f"A load{s}->{m} time distckpt/dcp", "A", d, f"load{s}->{m}", m, "distckpt", "dcp")
        for n in args.b_worlds:
            add(
                f"B save time distckpt/dcp (w{n})",
                "B",
                d,
                "save",
                n,
                "distckpt",
                "dcp",
                ("<=", 0.5) if n == max(args.b_worlds) else None,
            )
            add(f"B load time distckpt/dcp (w{n})", "B", d, f"load{n}->{n}", n, "distckpt", "dcp")
            add(f"B save time distckpt/raw (w{n})", "B", d, "save", n, "distckpt", "raw")
    return {"rows": rows, "ratios": ratios}


def print_report(summary: dict[str, Any]) -> None:
    rows, ratios = summary["rows"], summary["ratios"]
    print()
    print(
        f"{'case':4} {'fs':6} {'op':10} {'world':>5} {'who':9} {'n':>2} {'median s':>9} "
        f"{'min s':>8} {'max s':>8} {'GiB/s':>7} {'oth%':>5}"
    )
    for r in rows:
        print(
            f"{r['case']:4} {r['fs'][:6]:6} {r['op']:10} {r['world']:>5} {r['who']:9} {r['n']:>2} "
            f"{r['median_s']:9.3f} {r['min_s']:8.3f} {r['max_s']:8.3f} {r['GiBps']:7.2f} "
            f"{100 * r['other_cpu_median']:5.0f}"
        )
    print()
    print(
        f"{'ratio':36} {'fs':6} {'of medians':>10} {'of mins':>8} {'paired med [min..max]':>24} "
        f"{'target':>7} ok"
    )
    for q in ratios:
        ok = "" if q["ok"] is None else ("yes" if q["ok"] else "NO")
        print(
            f"{q['label']:36} {q['fs'][:6]:6} {q['value']:10.3f} {q['of_mins']:8.3f} "
            f"{q['paired_median']:8.3f} [{q['paired_min']:.3f}..{q['paired_max']:.3f}] "
            f"{q['target']:>7} {ok}"
        )
    phases = [r for r in rows if "phases_median_max_over_ranks" in r]
    if phases:
        print()
        print("distckpt save phases (median over rounds of the max over ranks, s):")
        for r in phases:
            ph = r["phases_median_max_over_ranks"]
            print(
                f"  case {r['case']} {r['fs'][:6]:6} world {r['world']:>2}: "
                + "  ".join(f"{k} {v:.3f}" for k, v in ph.items())
            )


# --------------------------------------------------------------------------- main


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    p.add_argument("--case", nargs="+", choices=["A", "B"], default=["A", "B"])
    p.add_argument(
        "--dir",
        action="append",
        help="parent directory of the benchmark's files (a fresh run-PID-* directory "
        "inside it is used and removed; repeat for several); "
        "default: /dev/shm/distckpt-bench and /tmp/distckpt-bench",
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 16 x 1024x1024 (64 MiB), 100 small tensors, B on 4 ranks, 2 rounds",
    )
    p.add_argument(
        "--cache",
        choices=["cold", "warm"],
        default="cold",
        help="on a non-tmpfs dir, evict the files before each timed load (cold, default)",
    )
    p.add_argument("--json", help="write the results here")
    p.add_argument(
        "--report", metavar="JSON", help="print the report of a saved --json file and exit"
    )
    p.add_argument(
        "--no-snapshot",
        dest="snapshot",
        action="store_false",
        help="import distckpt from the working tree in every launch (default: a copy "
        "taken at start, so concurrent edits cannot mix versions within a run)",
    )
    p.add_argument(
        "--lock",
        default="/tmp/bench_engine.lock",
        help="lock file serializing benchmark runs on this machine ('' for none)",
    )
    p.add_argument("--launch-timeout", type=float, default=1800)
    p.add_argument(
        "--wait-idle",
        type=float,
        default=60,
        help="before each launch wait up to this many seconds for the machine to be idle",
    )
    p.add_argument(
        "--idle-busy",
        type=float,
        default=0.25,
        help="'idle': other processes use less than this fraction of the CPUs",
    )
    p.add_argument("--a-tensors", type=int, default=16)
    p.add_argument("--a-rows", type=int, default=4096)
    p.add_argument("--a-cols", type=int, default=4096)
    p.add_argument("--a-save-world", type=int, default=4)
    p.add_argument("--a-load-worlds", type=int, nargs="+", default=[2, 3])
    p.add_argument("--b-tensors", type=int, default=1000)
    p.add_argument("--b-rows", type=int, default=48)
    p.add_argument("--b-cols", type=int, default=64)
    p.add_argument("--b-worlds", type=int, nargs="+", default=[4, 16])
    args = p.parse_args(argv)
    if args.quick:
        args.a_rows = args.a_cols = 1024
        args.b_tensors = 100
        args.b_worlds = [4]
        args.rounds = min(args.rounds, 2)
    if not args.dir:
        args.dir = ["/dev/shm/distckpt-bench", "/tmp/distckpt-bench"]
    return args


def write_results(args: argparse.Namespace, fs: Any, t0: float, summary: Any, drv: Any) -> None:
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
            "fs": fs,
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


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.worker:
        worker_main(args.worker)
        return
    if args.report:
        doc = json.loads(Path(args.report).read_text())
        saved = argparse.Namespace(**{**vars(args), **doc["args"]})
        print_report(summarize(saved, doc["events"]))
        return

    lock = exclusive(args.lock) if args.lock else None
    t0 = time.time()
    drv = Driver(args)
    print(
        f"bench_engine: cases {args.case}, dirs {args.dir}, {args.rounds} rounds; "
        f"logs {drv.logdir}",
        flush=True,
    )
    if drv.snapshot:
        print(
            f"distckpt snapshot {drv.snapshot['sha256']} of {drv.snapshot['source']} "
            f"(HEAD {drv.snapshot.get('git_head', '?')[:10]}, "
            f"{len(drv.snapshot.get('git_dirty', []))} files modified)",
            flush=True,
        )
    drv.run()
    summary = summarize(args, drv.events)
    print_report(summary)
    if args.json:
        fs = {d: fs_type(Path(d).parent) for d in args.dir}
        write_results(args, fs, t0, summary, drv)
    shutil.rmtree(drv.logdir, ignore_errors=True)
    if lock is not None:
        lock.close()


if __name__ == "__main__":
    main()
