"""A stand-in for a training script that honours distckpt's preemption contract.

Plain Python (no torch, no MPI library), so the launch scripts can be tested in a
second. Every rank "trains" ``--steps`` steps of ``--step-time`` seconds each; rank 0
(``PMI_RANK`` under mpiexec, ``RANK`` under torchrun, else 0) saves the state in
``<dir>/stub_state.json`` when it stops (preempted or done), every rank resumes from it,
and rank 0 reports each step in ``<dir>/stub_progress.json`` as it goes::

    {"step": 7, "worlds": [4, 2], "restart_counts": ["0", "1"]}

``worlds`` lists the world size of every run that started; ``restart_counts`` the
``SLURM_RESTART_COUNT`` each run saw (``"-"`` outside SLURM).

The contract, as the real trainer keeps it:

* SIGTERM or SIGUSR1: finish the current step, save, and exit with 75; rank 0 first
  writes ``$DISTCKPT_PREEMPTED_FILE`` (when set) as JSON
  ``{"step": ..., "checkpoint": ..., "signal": ...}``;
* a normal finish exits 0.

Test knobs: ``--preempt-after K`` makes every rank act as if signalled after ``K`` steps
of this run; ``--fail-at S`` makes every rank exit with 3 on reaching step ``S``.
Ranks print ``rank R/W start at step S``, ``rank R/W preempted at step S by SIG`` and
``rank R/W done at step S``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from rank import say

EXIT_PREEMPTED = 75
STATE = "stub_state.json"
#: Rank 0's step while it runs, for tests that wait for a step; never read by the stub.
PROGRESS = "stub_progress.json"


def _rank_world() -> tuple[int, int]:
    for rank_var, size_var in (("PMI_RANK", "PMI_SIZE"), ("RANK", "WORLD_SIZE")):
        if rank_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ.get(size_var, "1"))
    return 0, 1


def _write_json(path: Path, value: dict[str, Any]) -> None:
    """Write ``path`` atomically: a reader sees the old file or the new one, whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


#: How long a rank waits at a barrier for the others of its launch (seconds).
BARRIER_TIMEOUT = 120.0


def barrier(run_dir: Path, name: str, rank: int, world: int) -> None:
    """Wait until every rank of this launch (the children of one launcher process: one
    ``mpiexec`` proxy, one ``torchrun`` agent) has reached barrier ``name``: each leaves
    a file, and waits for ``world`` of them, up to :data:`BARRIER_TIMEOUT`."""
    where = run_dir / ".stub-barriers" / f"{os.getppid()}-{name}"
    where.mkdir(parents=True, exist_ok=True)
    (where / str(rank)).touch()
    deadline = time.monotonic() + BARRIER_TIMEOUT
    while sum(1 for _ in where.iterdir()) < world:
        if time.monotonic() > deadline:
            say(f"rank {rank}/{world} gave up waiting at barrier {name}")
            sys.exit(4)
        time.sleep(0.005)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--preempt-after", type=int, default=None)
    parser.add_argument("--fail-at", type=int, default=None)
    args, _ = parser.parse_known_args()  # the real trainer's other flags are ignored

    rank, world = _rank_world()
    run_dir = Path(args.dir)
    state_file = run_dir / STATE
    stop: list[str] = []

    def on_signal(signum: int, _frame: object) -> None:
        stop.append(signal.Signals(signum).name)  # acted on at the next step boundary

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGUSR1, on_signal)

    state: dict[str, Any] = {"step": 0, "worlds": [], "restart_counts": []}
    if state_file.exists():
        state = json.loads(state_file.read_text())
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        state["worlds"].append(world)
        state["restart_counts"].append(os.environ.get("SLURM_RESTART_COUNT", "-"))
        _write_json(state_file, state)
    step = int(state["step"])
    say(f"rank {rank}/{world} start at step {step}")
    # Every rank has read the state before rank 0 may write the next (a rank that starts
    # late would otherwise read where this run stops).
    barrier(run_dir, "start", rank, world)

    done = 0
    while step < args.steps:
        if args.fail_at is not None and step >= args.fail_at:
            say(f"rank {rank}/{world} fails at step {step}")
            sys.exit(3)
        if stop or (args.preempt_after is not None and done >= args.preempt_after):
            reason = stop[0] if stop else "SIGTERM"
            if rank == 0:  # the "final checkpoint": resume from here
                state["step"] = step
                _write_json(state_file, state)
                marker = os.environ.get("DISTCKPT_PREEMPTED_FILE")
                if marker:
                    Path(marker).parent.mkdir(parents=True, exist_ok=True)
                    _write_json(
                        Path(marker),
                        {"step": step, "checkpoint": str(state_file), "signal": reason},
                    )
            say(f"rank {rank}/{world} preempted at step {step} by {reason}")
            # The ranks of a real job leave together after their collective final save:
            # none leaves before all have stopped (mpiexec, seeing one end, kills the rest).
            barrier(run_dir, "stop", rank, world)
            sys.exit(EXIT_PREEMPTED)
        time.sleep(args.step_time)
        step += 1
        done += 1
        if rank == 0:
            _write_json(run_dir / PROGRESS, {"step": step})
    if rank == 0:
        state["step"] = step
        _write_json(state_file, state)
    say(f"rank {rank}/{world} done at step {step}")


if __name__ == "__main__":
    main()
