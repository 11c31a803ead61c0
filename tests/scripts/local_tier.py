"""A training job with a node-local tier, for tests/local/test_local_tier.py.

Run under mpiexec or torchrun (any world size that divides 8), as 2 "nodes":
``$DISTCKPT_NODE`` set per node by the launcher, or ``--node-of-rank`` (the node of rank
``r`` is ``n{r // 2}``). Saves every step: persistently every ``--persistent-every``
steps to ``--run``, node-locally (one replica) the other steps to ``--tier``
(``{node}`` in it becomes each node's name).

The state is updated elementwise from the step and each element's global index, so a
resumed run on any world size must end bit for bit where an uninterrupted one does;
at the end every rank replays the whole run for its own boxes and compares.

Failure injection:
* ``--kill-node N --kill-at K``: after the save of step K, the ranks of node ``N`` delete
  that node's local directory (the node is lost) and SIGKILL themselves. Only in the
  first attempt on a run directory (a ``killed`` file marks later ones), so a relaunch
  goes on.
* ``--die-in-save-at K``: rank 1 SIGKILLs itself in the middle of the local save of step
  K (its data written, before the ranks confirm the step). Also only once.

Prints ``RESTORED {json}`` on rank 0 and ``OK <rank>`` per rank when every value matches.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys

from rank import RowsJob, say

import distckpt
from distckpt.local import nodes

W_SHAPE = (8, 6)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", "--dir", required=True)
    ap.add_argument("--tier", required=True)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--persistent-every", type=int, default=10)
    ap.add_argument("--node-of-rank", action="store_true")
    ap.add_argument("--kill-node", default=None)
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--die-in-save-at", type=int, default=-1)
    ap.add_argument("--async-save", action="store_true")
    args = ap.parse_args()

    comm = distckpt.comm.auto(timeout=float(os.environ.get("DISTCKPT_TIMEOUT", "20")))
    rank, size = comm.rank, comm.size
    if args.node_of_rank:
        os.environ[nodes.NODE_ENV] = f"n{rank // 2}"
    node = nodes.node_identity()

    job = RowsJob(rank, size, W_SHAPE)
    manager = job.manager(args.run, args.tier, args.persistent_every, comm)
    job.restore(manager, size)

    marker = os.path.join(args.run, "killed")
    first_attempt = not os.path.exists(marker)
    if args.die_in_save_at >= 0 and rank == 1 and first_attempt:

        def dying(step: int) -> None:
            if step == args.die_in_save_at:
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)

        job.before_replicate(dying)

    while int(job.step) < args.steps:
        s = job.train_step()
        handle = manager.save(async_save=args.async_save)
        if args.async_save and handle is not None:
            handle.wait()
        if s == args.kill_at and first_attempt and args.kill_node is not None:
            comm.barrier()  # every rank has marked step s: it is committed
            if node == args.kill_node:
                open(marker, "w").close()
                shutil.rmtree(job.tier.path(), ignore_errors=True)
                say(f"KILLED {rank} at {s}")
                os.kill(os.getpid(), signal.SIGKILL)
    manager.close()

    # Against an uninterrupted run of the same steps, for this rank's boxes.
    bad = [k for k, ok in job.checks(args.steps).items() if not ok]
    if bad:
        w_ref = job.replay(args.steps)[0]
        say(f"FAIL {rank}: {bad} w={job.w.tolist()} ref={w_ref.tolist()}")
        return 1
    say(f"OK {rank}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
