"""Two real nodes on this machine (tests/nodes.py): each its own network namespace on a
veth link, host name, /dev/shm and /etc/hosts. Jobs of 2 nodes x 2 ranks under torchrun
(multi-node c10d rendezvous, gloo on the veth) and mpiexec (hydra entering each node in
place of ssh), running tests/scripts/two_nodes.py:

* the library finds the nodes from the real host names, and a load of replicated state
  reads each stored byte once over both nodes, the rest crossing the link;
* a node lost (every process of it killed, its /dev/shm gone): the job resumes on the
  surviving node and a fresh replacement from the local tier's replicas, bit for bit;
* a node's link taken down in the middle of a local save: every rank fails within
  DISTCKPT_TIMEOUT, nothing is committed, and once the link is back the next job's
  save of that step succeeds.

Needs root, ``unshare``/``nsenter`` (util-linux) and ``ip`` (iproute2); skips without.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nodes
import pytest
from launch_util import SCRIPTS, assert_all_ok, bounded, cases, finish, needs_mpi, output

SCRIPT = SCRIPTS / "two_nodes.py"
TIMEOUT = 90  # seconds per job
CUT_TIMEOUT = 10  # DISTCKPT_TIMEOUT of the job whose link is cut
SLACK = 10  # seconds past it by which every rank must have failed

_why_not = nodes.unavailable()
pytestmark = pytest.mark.skipif(_why_not is not None, reason=f"no nodes here: {_why_not}")


@pytest.fixture
def bed(tmp_path: Path) -> Iterator[tuple[nodes.Node, nodes.Node]]:
    with nodes.two_nodes(tmp_path / "bed") as pair:
        yield pair


def _joined(procs: list[subprocess.Popen[str]], timeout: float = TIMEOUT) -> Any:
    """The agents' results as one (return codes, outputs together), for the checks."""
    done = [finish(p, timeout) for p in procs]
    return subprocess.CompletedProcess(
        [str(a) for a in done[0].args],
        max(abs(d.returncode) for d in done),
        "".join(d.stdout for d in done),
        "".join(d.stderr for d in done),
    )


def _restored(proc: Any) -> dict[str, Any]:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESTORED ")]
    assert len(lines) == 1, output(proc)
    record: dict[str, Any] = json.loads(lines[0][len("RESTORED ") :])
    return record


def _check_probe(proc: Any, a: nodes.Node, b: nodes.Node) -> None:
    assert_all_ok(proc, 4)
    found = cases(proc)
    topo = found["topology"]
    hosts = [a.name, a.name, b.name, b.name]
    for rank in range(4):
        r = topo[rank]
        assert (r["host"], r["identity"], r["env"]) == (hosts[rank], hosts[rank], []), r
        assert r["nodes"] == [[0, 1], [2, 3]] and r["names"] == [a.name, b.name], r
    # Each node its own /dev/shm: one device per node, two in all.
    assert topo[0]["shm"] == topo[1]["shm"] != topo[2]["shm"] == topo[3]["shm"], topo
    # The replicated load: every stored byte read once over both nodes (the small
    # chunk indexes by each rank reading part of a piece); the rest exchanged, and
    # what a node did not read itself arrived over its eth0.
    rows = [found["exchange"][rank] for rank in range(4)]
    assert all(r["wrong"] == [] for r in rows), rows
    stored, headers = rows[0]["stored"], rows[0]["headers"]
    read = sum(r["read"] for r in rows)
    assert stored <= read <= stored + 4 * headers, (read, stored, headers)
    assert all(r["exchanged"] > 0 for r in rows), rows
    for node in (0, 1):
        mine = [r for r in rows if r["node"] == node]
        (counted,) = [r["eth0_received"] for r in mine if r["eth0_received"] is not None]
        needed = stored - sum(r["read"] for r in mine)
        assert counted >= needed > stored // 4, (node, counted, needed, stored)


@pytest.mark.timeout(150)
def test_torchrun_finds_the_nodes_and_reads_each_byte_once(
    bed: tuple[nodes.Node, nodes.Node], tmp_path: Path
) -> None:
    a, b = bed
    with bounded(140, "the torchrun job"):
        proc = _joined(nodes.torchrun([a, b], SCRIPT, "probe", str(tmp_path / "ckpt")))
    _check_probe(proc, a, b)


@needs_mpi
@pytest.mark.timeout(150)
def test_mpiexec_finds_the_nodes_and_reads_each_byte_once(
    bed: tuple[nodes.Node, nodes.Node], tmp_path: Path
) -> None:
    a, b = bed
    with bounded(140, "the mpiexec job"):
        proc = finish(nodes.mpiexec(a, b, SCRIPT, "probe", str(tmp_path / "ckpt")), TIMEOUT)
    _check_probe(proc, a, b)
