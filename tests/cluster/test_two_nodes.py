"""Two real nodes on this machine (tests/support/nodes.py): each its own network namespace on a
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
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import nodes
from tests.support.launch_util import SCRIPTS, assert_all_ok, cases, finish, needs_mpi, output

SCRIPT = SCRIPTS / "two_nodes.py"
TIMEOUT = 90  # seconds per job
CUT_TIMEOUT = 10  # DISTCKPT_TIMEOUT of the job whose link is cut
SLACK = 10  # seconds past it by which every rank must have failed

_why_not = nodes.unavailable()
pytestmark = pytest.mark.skipif(_why_not is not None, reason=f"no nodes here: {_why_not}")


@pytest.fixture
def bed(tmp_path: Path) -> Iterator[nodes.Bed]:
    with nodes.two_nodes(tmp_path / "bed") as made:
        yield made


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
def test_torchrun_finds_the_nodes_and_reads_each_byte_once(bed: nodes.Bed, tmp_path: Path) -> None:
    a, b = bed.a, bed.b
    proc = _joined(bed.torchrun([a, b], SCRIPT, "probe", str(tmp_path / "ckpt")))
    _check_probe(proc, a, b)


@needs_mpi
@pytest.mark.timeout(150)
def test_mpiexec_finds_the_nodes_and_reads_each_byte_once(bed: nodes.Bed, tmp_path: Path) -> None:
    a, b = bed.a, bed.b
    proc = finish(bed.mpiexec(SCRIPT, "probe", str(tmp_path / "ckpt")), TIMEOUT)
    _check_probe(proc, a, b)


def _wait_for(paths: list[Path], procs: list[subprocess.Popen[str]], seconds: float) -> None:
    """Until every file of ``paths`` exists (the ranks' events); fails with the jobs'
    output if a job ends first or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        ended = [p for p in procs if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            missing = [p.name for p in paths if not p.exists()]
            outputs = "\n".join(output(finish(p, 30)) for p in procs)
            raise AssertionError(f"{missing} never came (a job ended: {bool(ended)})\n{outputs}")
        time.sleep(0.01)


def _train(signals: Path, tmp_path: Path, *extra: str) -> list[str]:
    signals.mkdir(exist_ok=True)
    run, tier = tmp_path / "run", "/dev/shm/distckpt-tier"
    return ["train", "--ckpt-dir", str(run), "--local-dir", tier, "--events", str(signals), *extra]


def _committed(node: nodes.Node, step: int) -> list[str]:
    """The done marks of local step ``step`` in the node's own /dev/shm (as its ranks
    see it, through the node's root)."""
    where = node.shm / "distckpt-tier" / f"step-{step}"
    return sorted(p.name.rsplit(".", 1)[1] for p in where.glob("done.*")) if where.exists() else []


@pytest.mark.timeout(150)
def test_torchrun_lost_node_resumes_from_the_replicas(bed: nodes.Bed, tmp_path: Path) -> None:
    a, b = bed.a, bed.b
    signals = tmp_path / "signals"
    args = _train(signals, tmp_path, "--steps", "7", "--hold-at", "5")
    procs = bed.torchrun([a, b], SCRIPT, *args, env={"DISTCKPT_TIMEOUT": "15"})
    _wait_for([signals / f"held.{r}" for r in range(4)], procs, TIMEOUT)
    # Step 5 is committed on both nodes: each holds its ranks' marks of it.
    assert _committed(a, 5) == ["r0", "r1"] and _committed(b, 5) == ["r2", "r3"]
    shm = b.shm
    b.kill()  # every process of node B, its /dev/shm and its end of the link
    assert not shm.exists()
    first = _joined(procs)
    assert first.returncode != 0, output(first)
    gave_up = sorted(int(r) for r in re.findall(r"^GAVEUP (\d+): ", first.stdout, re.M))
    assert gave_up == [0, 1], output(first)
    # A fresh node B, its /dev/shm empty: ranks 2 and 3 fetch their partitions from
    # their replicas on node A; the run goes on to step 7 and ends bit for bit where
    # an uninterrupted one does.
    fresh = bed.replace_b()
    assert not (fresh.shm / "distckpt-tier").exists()
    second = _joined(bed.torchrun([a, fresh], SCRIPT, *_train(signals, tmp_path, "--steps", "7")))
    assert _restored(second) == {
        "tier": "local",
        "number": 5,
        "reason": "local step 5 is held whole by the surviving nodes",
        "world": 4,
    }, output(second)
    assert_all_ok(second, 4)
    assert _committed(a, 7) == ["r0", "r1"] and _committed(fresh, 7) == ["r2", "r3"]


def _persistent(run: Path) -> dict[str, tuple[int, int]]:
    """Every file of the run directory but the manager's lease and its lock file (the
    lease is renewed while a job runs): its size and modification time."""
    return {
        str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(run.rglob("*"))
        if p.is_file() and ".distckpt-lock" not in p.name
    }


@pytest.mark.timeout(150)
def test_torchrun_link_cut_in_a_save_fails_every_rank_and_commits_nothing(
    bed: nodes.Bed, tmp_path: Path
) -> None:
    a, b = bed.a, bed.b
    signals, run = tmp_path / "signals", tmp_path / "run"
    env = {"DISTCKPT_TIMEOUT": str(CUT_TIMEOUT)}
    procs = bed.torchrun(
        [a, b], SCRIPT, *_train(signals, tmp_path, "--steps", "6", "--cut-at", "4"), env=env
    )
    # Every rank is in the local save of step 4, its data laid out, about to send its
    # replica to the other node: node B's link goes down.
    _wait_for([signals / f"insave.{r}" for r in range(4)], procs, TIMEOUT)
    before = _persistent(run)
    pointer = (run / "latest").read_bytes()
    b.link(up=False)
    (signals / "cut").touch()
    _wait_for([signals / f"failed.{r}" for r in range(4)], procs, CUT_TIMEOUT + SLACK)
    b.link(up=True)
    first = _joined(procs)
    assert first.returncode != 0, output(first)
    failed = cases(first)["cut"]
    assert sorted(failed) == [0, 1, 2, 3], output(first)
    for record in failed.values():
        assert record["error"] == "CommTimeoutError", record
        assert f"failed (timeout {CUT_TIMEOUT} s)" in record["message"], record
        assert record["seconds"] <= CUT_TIMEOUT + SLACK, record
    # Nothing torn: the shared directory as it was (ckpt-1 and its pointer), and no node
    # holds a mark of step 4 (its files may be there: no job counts them); step 3 whole.
    assert _persistent(run) == before and (run / "latest").read_bytes() == pointer
    assert json.loads(pointer)["latest"] == "ckpt-1"
    assert _committed(a, 4) == [] and _committed(b, 4) == []
    assert _committed(a, 3) == ["r0", "r1"] and _committed(b, 3) == ["r2", "r3"]
    # The link back: the next job resumes from step 3, and its save of step 4 succeeds.
    second = _joined(bed.torchrun([a, b], SCRIPT, *_train(signals, tmp_path), env=env))
    record = _restored(second)
    assert (record["tier"], record["number"], record["world"]) == ("local", 3, 4), output(second)
    assert_all_ok(second, 4)
    assert _committed(a, 4) == ["r0", "r1"] and _committed(b, 4) == ["r2", "r3"]
