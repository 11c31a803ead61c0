"""Jobs across the two "nodes" of tests/support/nodes.py, for tests/cluster/test_two_nodes.py.

Run under torchrun (one agent per node) or mpiexec (hydra's launcher entering each
node), 2 nodes of 2 ranks; the node of a rank is what the library finds (its host name:
neither ``$DISTCKPT_NODE`` nor ``$SLURM_NODEID`` is set).

``two_nodes.py probe DIR``, two cases:

* ``topology``: this rank's host name and node identity, the library's grouping of
  the ranks into nodes, and the device of its ``/dev/shm`` (each node has its own tmpfs).
* ``exchange``: a load of fully replicated state saved in ``DIR`` (shared by both
  nodes): the bytes each rank read and received, the stored bytes, and the bytes the
  node's ``eth0`` received during the load (measured by the node's first rank).

``two_nodes.py train --ckpt-dir R --local-dir T --events S --steps N [...]``: training with a
node-local tier (one replica on the other node), as tests/scripts/local_tier.py, with a
sharded state of 4 MiB; at the end every rank compares its state, bit for bit, with an
uninterrupted replay. Events with the test go through files in ``S``:

* ``--hold-at K``: after the save of step K, each rank writes ``held.<rank>``; then the
  ranks of the first node wait in a barrier, and those of the second for a ``go`` file
  that never comes (the test kills their node). The survivors print ``GAVEUP <rank>``.
* ``--cut-at K``: in the local save of step K, right before the replicas are sent, each
  rank writes ``insave.<rank>`` and waits for ``cut`` (the test has taken a node's link
  down); the save must then fail: each rank prints ``CASE {json}`` with the error and
  the seconds from ``cut`` to it, and writes ``failed.<rank>``.

Prints ``RESTORED {json}`` on rank 0, ``OK <rank>`` per rank when every value matches.
A rank that gave up exits at once with 3 (``os._exit``: no exit barrier with lost peers).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch
from rank import RowsJob, record, same_bits, say

import distckpt
from distckpt.comm import Communicator
from distckpt.format.index import read_index
from distckpt.format.stored import Pieces
from distckpt.local import nodes
from distckpt.local.save import topology

W_SHAPE = (4096, 256)  # float32, sharded by rows: 1 MiB a rank on 4 ranks
WAIT = 120.0  # seconds a rank waits for the test's next event at most


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {WAIT} s")
        time.sleep(0.01)


def rx_bytes(iface: str = "eth0") -> int:
    """Bytes received on ``iface`` of this process's network namespace."""
    for line in Path("/proc/self/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == iface:
            return int(counters.split()[0])
    raise LookupError(f"no interface {iface}")


# ---------------------------------------------------------------- probe


def generate(key: object, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randn(shape, generator=g, dtype=torch.float32)


def replicated_state() -> dict[str, Any]:
    state: dict[str, Any] = {f"small/{i}": generate(("small", i), (48, 64)) for i in range(100)}
    state["big"] = generate("big", (1024, 1024))
    x = generate("odd", (16,))
    state["odd/f64"] = x[0].double()
    state["odd/bf16"] = x[:15].reshape(5, 3).bfloat16()
    state["odd/i8"] = (x[:9] * 50).to(torch.int8)
    return state


def probe(comm: Communicator, root: Path) -> int:
    rank = comm.rank
    topo = topology(comm)
    record(
        "topology",
        rank,
        host=socket.gethostname(),
        identity=nodes.node_identity(),
        nodes=[list(n) for n in topo.nodes],
        names=list(topo.names),
        env=[v for v in (nodes.NODE_ENV, "SLURM_NODEID") if v in os.environ],
        shm=os.stat("/dev/shm").st_dev,
    )
    path = root / "replicated"
    distckpt.save(replicated_state(), path, comm, inner_bytes=256 * 1024)
    target = {k: torch.zeros_like(v) for k, v in replicated_state().items()}
    leader = topo.leader(rank)
    comm.barrier()
    before = rx_bytes() if leader else 0
    comm.barrier()
    result = distckpt.load(target, path, comm)
    comm.barrier()
    received = rx_bytes() - before if leader else None
    wrong = [k for k, v in replicated_state().items() if not same_bits(target[k], v)]
    variables = read_index(path)["variables"]
    stored = headers = 0
    for name, entry in variables.items():
        if entry.get("kind") != "tensor":
            continue
        for p in Pieces(entry, name):
            stored += p.size
            if p.inner is not None:  # its chunk index: read by every rank reading part of it
                chunks = 1
                for b, i in zip(p.block, p.inner, strict=True):
                    chunks *= -(-b // i)
                headers += chunks * (16 + 4) + 8
    record(
        "exchange",
        rank,
        node=topo.node_of(rank),
        read=result.bytes_read,
        exchanged=result.bytes_exchanged,
        stored=stored,
        headers=headers,
        eth0_received=received,
        wrong=wrong,
    )
    comm.barrier()
    say(f"OK {rank}")
    return 0


# ---------------------------------------------------------------- train


def train(comm: Communicator, args: argparse.Namespace) -> int:
    rank, size = comm.rank, comm.size
    signals = Path(args.events)
    job = RowsJob(rank, size, W_SHAPE)
    manager = job.manager(args.ckpt_dir, args.local_dir, args.persistent_every, comm)
    job.restore(manager, size)

    cut = signals / "cut"
    moment: dict[str, float] = {}  # when this rank saw the cut
    if args.cut_at >= 0:

        def cut_in_the_middle(step: int) -> None:
            if step == args.cut_at:
                (signals / f"insave.{rank}").touch()
                wait_for(cut)
                moment["cut"] = time.monotonic()

        job.before_replicate(cut_in_the_middle)

    while int(job.step) < args.steps:
        s = job.train_step()
        try:
            manager.save()
        except Exception as exc:
            if s != args.cut_at:
                raise
            since = time.monotonic() - moment["cut"]
            record("cut", rank, step=s, error=type(exc).__name__, message=str(exc), seconds=since)
            (signals / f"failed.{rank}").touch()
            os._exit(3)
        if s == args.hold_at:
            comm.barrier()
            (signals / f"held.{rank}").touch()
            if topology(comm).node_of(rank) != 0:
                wait_for(signals / "go")  # never: the test kills this node
            try:
                comm.barrier()
            except Exception as exc:
                say(f"GAVEUP {rank}: {type(exc).__name__}: {exc}")
                os._exit(3)
            say(f"FAIL {rank}: the barrier after the lost node returned")
            os._exit(1)
    manager.close()

    checks = job.checks(args.steps)
    checks["node"] = nodes.node_identity() == socket.gethostname()
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        say(f"FAIL {rank}: {bad}")
        return 1
    say(f"OK {rank}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["probe", "train"])
    ap.add_argument("dir", nargs="?")
    # (no option is a prefix of one of torchrun's: its parser would take it)
    ap.add_argument("--ckpt-dir")
    ap.add_argument("--local-dir")
    ap.add_argument("--events")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--persistent-every", type=int, default=10)
    ap.add_argument("--hold-at", type=int, default=-1)
    ap.add_argument("--cut-at", type=int, default=-1)
    args = ap.parse_args()
    comm = distckpt.comm.auto()
    if args.mode == "probe":
        return probe(comm, Path(args.dir))
    return train(comm, args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
