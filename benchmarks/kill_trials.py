#!/usr/bin/env python
"""Not a timing: ``kill -9`` of a random rank at a random moment of a save, over many
trials, and what each kill leaves.

Each trial, in a fresh directory ``DIR``, with ``--world`` torchrun ranks and
``--mib`` MiB of state per rank (one sharded tensor and a few small ones):

1. a job saves version 0 of the state to ``DIR/ckpt`` and ends: the previous checkpoint;
2. a second job starts saving version 1 over it (``overwrite=True``; with
   ``--background``, a background save waited for); once every rank has said that its
   save began, the driver waits a random delay, uniform over 0 .. 1.2x the time a whole
   save took in step 1, and sends SIGKILL to one rank chosen at random (torchrun then ends
   the others with SIGTERM, as it would after any lost rank);
3. checked: ``DIR/ckpt`` loads, bit for bit, as version 0 or (when the kill came after the
   commit) version 1: the kill never costs the previous checkpoint;
4. a third job saves version 2 into ``DIR/ckpt`` and ends; checked: no staging or trash
   directory is left in ``DIR`` (``distckpt.commit.staging.leftovers``), and ``DIR/ckpt``
   loads as version 2 bit for bit.

Where each kill fell is random (that is the point: the hooks of
``tests/commit/test_kill_leftovers.py`` reach chosen points deterministically; this covers
the moments between them), so this is a stress run, not a test. Printed: one line per
trial (the rank killed, the delay as a share of a save, what the kill left, the version
found after it), then the tally; the exit status is 1 when any trial failed.

    python benchmarks/kill_trials.py                      # 20 trials, 3 ranks, /dev/shm
    python benchmarks/kill_trials.py --trials 5 --background --mib 64 --dir /tmp/kt
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness as h

ROWS_PER_MIB = 1024  # rows of 256 float32 per MiB


def _state(rank: int, world: int, version: int, mib: int) -> dict[str, Any]:
    import torch

    import distckpt

    rows = mib * ROWS_PER_MIB
    g = torch.Generator().manual_seed(1000 * version + rank)
    w = torch.rand(rows, 256, generator=g)
    small = {f"b{i}": torch.full((64,), float(version * 10 + i)) for i in range(8)}
    return {
        "w": distckpt.Shard(w, (rows * world, 256), (rows * rank, 0)),
        **small,
        "step": version,
    }


def _full(world: int, version: int, mib: int) -> dict[str, Any]:
    import torch

    parts = [_state(r, world, version, mib) for r in range(world)]
    full: dict[str, Any] = {"w": torch.cat([p["w"].tensor for p in parts])}
    full.update({k: v for k, v in parts[0].items() if k not in ("w",)})
    return full


def worker(directory: str, version: int, mib: int, background: bool) -> int:
    """One rank of a saving job: say ``BEGIN <rank> <pid>``, save, say ``DONE <rank>``."""
    from rank import say

    import distckpt
    from distckpt.comm import auto

    comm = auto()
    state = _state(comm.rank, comm.size, version, mib)
    comm.barrier()
    say(f"BEGIN {comm.rank} {os.getpid()}")
    if background:
        distckpt.save(state, Path(directory) / "ckpt", comm, overwrite=True, async_save=True).wait()
    else:
        distckpt.save(state, Path(directory) / "ckpt", comm, overwrite=True)
    say(f"DONE {comm.rank}")
    return 0


def _env() -> dict[str, str]:
    env = {**os.environ, **{k: v for k, v in h.TORCHRUN_ENV.items() if v is not None}}
    tests_scripts = h.ROOT / "tests" / "scripts"
    env["PYTHONPATH"] = f"{h.ROOT}:{tests_scripts}:{env.get('PYTHONPATH', '')}"
    env.setdefault("DISTCKPT_TIMEOUT", "30")
    return env


def _cmd(args: argparse.Namespace, directory: Path, version: int) -> list[str]:
    flags = ["--background"] if args.background else []
    return [
        *h.torchrun(args.world),
        __file__,
        "--worker-of",
        str(directory),
        str(version),
        str(args.mib),
        *flags,
    ]


def _clean_job(args: argparse.Namespace, directory: Path, version: int) -> float:
    """Run a whole saving job; the seconds from the last BEGIN to the last DONE."""
    proc = subprocess.Popen(
        _cmd(args, directory, version),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    begun = done = 0.0
    for line in proc.stdout:
        if line.startswith("BEGIN "):
            begun = time.monotonic()
        elif line.startswith("DONE "):
            done = time.monotonic()
    errors = proc.stderr.read()
    if proc.wait(timeout=args.job_timeout) != 0:
        raise RuntimeError(f"saving job of version {version} failed ({proc.returncode}):\n{errors}")
    return done - begun


def _killed_job(
    args: argparse.Namespace, directory: Path, span: float, rng: random.Random
) -> dict[str, Any]:
    proc = subprocess.Popen(
        _cmd(args, directory, 1),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # torchrun's report of the kill
        text=True,
        bufsize=1,
    )
    assert proc.stdout is not None
    pids: dict[int, int] = {}
    deadline = time.monotonic() + args.job_timeout
    while len(pids) < args.world and time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("BEGIN "):
                _, rank, pid = line.split()
                pids[int(rank)] = int(pid)
    if len(pids) < args.world:
        proc.kill()
        raise RuntimeError("the ranks never all began their save")
    share = rng.uniform(0.0, 1.2)
    victim = rng.randrange(args.world)
    time.sleep(share * span)
    with contextlib.suppress(ProcessLookupError):  # it may have ended already
        os.kill(pids[victim], signal.SIGKILL)
    rest = proc.stdout.read()
    code = proc.wait(timeout=args.job_timeout)
    return {"victim": victim, "share": share, "code": code, "done": rest.count("DONE ")}


def _load(path: Path, world: int, mib: int) -> dict[str, Any]:
    import torch

    import distckpt
    from distckpt.comm import SingleComm

    rows = mib * ROWS_PER_MIB * world
    got: dict[str, Any] = {"w": torch.zeros(rows, 256)}
    got.update({f"b{i}": torch.zeros(64) for i in range(8)})
    got["step"] = None
    distckpt.load(got, path, SingleComm())
    return got


def _version_of(got: dict[str, Any], world: int, mib: int) -> int | None:
    import torch

    for version in (0, 1, 2):
        want = _full(world, version, mib)
        same = got["step"] == want["step"] and all(
            torch.equal(got[k].view(torch.int32), want[k].view(torch.int32))
            for k in want
            if k != "step"
        )
        if same:
            return version
    return None


def trial(args: argparse.Namespace, n: int, rng: random.Random) -> dict[str, Any]:
    from distckpt.commit.staging import leftovers

    directory = Path(tempfile.mkdtemp(prefix=f"trial{n}-", dir=args.dir))
    try:
        span = _clean_job(args, directory, 0)
        kill = _killed_job(args, directory, span, rng)
        left_by_kill = [Path(p).name for p in leftovers(directory)]
        after_kill = _version_of(
            _load(directory / "ckpt", args.world, args.mib), args.world, args.mib
        )
        _clean_job(args, directory, 2)
        left = [Path(p).name for p in leftovers(directory)]
        final = _version_of(_load(directory / "ckpt", args.world, args.mib), args.world, args.mib)
        ok = after_kill in (0, 1) and final == 2 and not left
        return {
            **kill,
            "span": span,
            "left_by_kill": left_by_kill,
            "after_kill": after_kill,
            "left": left,
            "final": final,
            "ok": ok,
        }
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--mib", type=int, default=16, help="MiB of state per rank (default 16)")
    p.add_argument("--background", action="store_true", help="background saves, waited for")
    p.add_argument("--dir", default="/dev/shm", help="parent of the trial directories")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--job-timeout", type=float, default=300.0)
    p.add_argument("--worker-of", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker_of:
        directory, version, mib = args.worker_of
        return worker(directory, int(version), int(mib), args.background)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    print(
        f"kill_trials: {args.trials} trials, {args.world} ranks, {args.mib} MiB per rank, "
        f"{'background' if args.background else 'blocking'} saves, seed {seed}"
    )
    passed = 0
    for n in range(args.trials):
        r = trial(args, n, rng)
        passed += r["ok"]
        print(
            f"trial {n:2d}: killed rank {r['victim']} at {r['share']:.2f} of a save "
            f"({r['span']:.2f} s), job exit {r['code']}, {r['done']} ranks done; "
            f"left {len(r['left_by_kill'])} leftover(s); loads version {r['after_kill']}; "
            f"after the next save: left {r['left'] or 'nothing'}, version {r['final']}"
            f"{'' if r['ok'] else '  FAILED'}",
            flush=True,
        )
    print(f"{passed} of {args.trials} trials left nothing behind and lost nothing")
    return 0 if passed == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
