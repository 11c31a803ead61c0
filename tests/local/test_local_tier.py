"""The node-local tier (distckpt.LocalTier): placement, the on-disk rules, the manager's
schedule and restore choice in one process; then real jobs of 4 ranks as 2 nodes under
mpiexec, torchrun and launch/relaunch.sh, with nodes SIGKILLed and their directories
deleted, a rank killed in the middle of a local save, and both nodes lost.

The jobs run tests/scripts/local_tier.py, which trains elementwise (bit-exact on any
world size) and, at the end, compares every rank's state with an uninterrupted replay.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import distckpt
from distckpt.comm.single import SingleComm
from distckpt.local import LocalTier, files
from distckpt.local.nodes import NODE_ENV, Topology, node_identity
from distckpt.storage.registry import open_store
from tests.support.launch_util import (
    MPI_LOCAL_ENV,
    MPIEXEC,
    REPO_ROOT,
    SCRIPTS,
    assert_all_ok,
    finish,
    needs_mpi,
    output,
    start,
    warm_mpi_rank,
)

SCRIPT = SCRIPTS / "local_tier.py"
TIMEOUT = 120  # seconds per job
JOB_ENV = {"DISTCKPT_TIMEOUT": "15"}  # survivors of a lost node give up after this


# ---------------------------------------------------------------- placement


@pytest.mark.parametrize("layout", [(2, 2), (3, 3, 3), (4, 2, 3), (1, 1), (5,), (2, 1, 2, 2)])
@pytest.mark.parametrize("replicas", [0, 1, 2])
def test_placement_survives_losing_any_replicas_nodes(layout: tuple[int, ...], replicas: int):
    names = [f"node{i}" for i, n in enumerate(layout) for _ in range(n)]
    topo = Topology.of(names)
    world = len(names)
    k = topo.usable_replicas(replicas)
    assert k == min(replicas, len(layout) - 1)
    for rank in range(world):
        homes = {topo.node_of(rank), *(topo.node_of(p) for p in topo.peers(rank, replicas))}
        assert len(homes) == k + 1, (rank, topo.peers(rank, replicas))
        for source in topo.sources(rank, replicas):
            assert rank in topo.peers(source, replicas)
    for lost in itertools.combinations(range(len(layout)), k):
        for rank in range(world):
            homes = {topo.node_of(rank), *(topo.node_of(p) for p in topo.peers(rank, replicas))}
            assert homes - set(lost), (lost, rank)
    if len(set(layout)) == 1:  # equal nodes: every rank keeps exactly k replicas
        assert all(len(topo.sources(r, replicas)) == k for r in range(world))


def test_node_identity_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NODE_ENV, raising=False)
    monkeypatch.delenv("SLURM_NODEID", raising=False)
    assert node_identity() == socket.gethostname()
    monkeypatch.setenv("SLURM_NODEID", "7")
    assert node_identity() == "7"
    monkeypatch.setenv(NODE_ENV, "left")
    assert node_identity() == "left"
    assert LocalTier("/x/{node}/y").path() == "/x/left/y"


@pytest.mark.parametrize(
    "kwargs, text",
    [
        ({"interval": 0}, "interval must be at least 1"),
        ({"interval_secs": -1.0}, "interval_secs must be >= 0"),
        ({"replicas": -1}, "replicas must be >= 0"),
        ({"max_to_keep": 0}, "max_to_keep must be at least 1"),
        ({"directory": "s3://bucket/x"}, "node-local path"),
    ],
)
def test_local_tier_refuses_bad_settings(kwargs: dict[str, Any], text: str) -> None:
    with pytest.raises(ValueError, match=text):
        LocalTier(**{"directory": "/tmp/x", **kwargs})


# ---------------------------------------------------------------- one process


class Job:
    """One process training a small state, with a manager that has a local tier."""

    def __init__(self, root: Path, **tier: Any) -> None:
        self.root = root
        self.step = torch.tensor(0)
        self.w = torch.zeros(6, 4)
        self.odd = {
            "bf16": torch.zeros(3, dtype=torch.bfloat16),
            "c128": torch.zeros(2, dtype=torch.complex128),
            "flag": torch.zeros((), dtype=torch.bool),
        }
        self.ckpt = distckpt.Checkpoint(
            step=self.step, w=self.w, odd=self.odd, meta={"seen": 0}, who=distckpt.PerRank("r0")
        )
        self.tier = LocalTier(root / "local-{node}", **{"max_to_keep": 2, **tier})
        self.manager = distckpt.CheckpointManager(
            self.ckpt,
            root / "run",
            max_to_keep=2,
            checkpoint_interval=5,
            step_counter=self.step,
            comm=SingleComm(),
            local=self.tier,
        )

    def train(self, steps: int, **save: Any) -> list[str | None]:
        paths = []
        for _ in range(steps):
            self.step.add_(1)
            s = int(self.step)
            self.w.add_(torch.arange(24.0).reshape(6, 4) * s)
            self.odd["bf16"].add_(0.5)
            self.odd["c128"].add_(complex(s, -s))
            self.odd["flag"].fill_(s % 2 == 1)
            self.ckpt.meta = {"seen": s}
            handle = self.manager.save(**save)
            if isinstance(handle, distckpt.AsyncSave):
                handle.wait()
                handle = handle.path
            paths.append(handle)
        return paths

    def values(self) -> dict[str, Any]:
        return {
            "step": int(self.step),
            "w": self.w.clone(),
            "bf16": self.odd["bf16"].clone(),
            "c128": self.odd["c128"].clone(),
            "flag": bool(self.odd["flag"]),
            "meta": self.ckpt.meta,
        }

    @property
    def local_dir(self) -> Path:
        return Path(self.tier.path())


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Equal values, tensors bit for bit."""
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype, k
            bits = [t.reshape(-1).view(torch.uint8) for t in (a[k], b[k])]
            assert torch.equal(*bits), k
        else:
            assert a[k] == b[k], k


def _resumed(root: Path, tier: str, number: int, expected: dict[str, Any] | None = None) -> Job:
    """A new job on ``root`` after restore_or_initialize(), which restored ``number`` of
    ``tier`` (and ``expected``, bit for bit, when given)."""
    job = Job(root)
    job.manager.restore_or_initialize()
    restored = job.manager.restored
    assert restored is not None and (restored.tier, restored.number) == (tier, number), restored
    if expected is not None:
        _same(job.values(), expected)
    return job


def test_schedule_restore_and_retention(tmp_path: Path) -> None:
    job = Job(tmp_path)
    assert job.manager.restore_or_initialize() is None and job.manager.restored is None
    paths = job.train(8)
    # The first save is persistent, then every 5 steps; the others go to the local tier.
    persistent = [Path(p).parent == tmp_path / "run" for p in paths]
    assert persistent == [True, False, False, False, False, True, False, False]
    # max_to_keep=2 older steps, plus the newest (until the next save confirms it is
    # marked on every node).
    assert sorted(os.listdir(job.local_dir)) == ["step-5", "step-7", "step-8"]
    expected = job.values()
    job.manager.close()

    again = Job(tmp_path)
    path = again.manager.restore_or_initialize()
    assert again.manager.restored is not None
    assert again.manager.restored.tier == "local" and again.manager.restored.number == 8
    assert path == str(again.local_dir / "step-8")
    _same(again.values(), expected)
    assert again.ckpt.save_counter == 8
    # Training goes on from there; the persistent schedule from the last persistent save
    # (step 6), not from the local step restored: a job that fails every few steps still
    # reaches the shared store.
    paths = again.train(5)
    assert [Path(p).parent == tmp_path / "run" for p in paths] == [False, False, True, False, False]
    again.manager.close()


def test_persistent_newer_than_local_wins(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.train(6)  # persistent 1 and 6, local 2..5
    job.manager.close()
    again = Job(tmp_path)
    again.manager.restore_or_initialize()
    restored = again.manager.restored
    assert restored is not None and restored.tier == "persistent" and restored.number == 6
    assert "no local step is newer than persistent checkpoint number 6" in restored.reason
    assert again.values()["step"] == 6
    # Local steps newer than the restored one are gone (none here); older ones stay.
    assert sorted(os.listdir(again.local_dir)) == ["step-3", "step-4", "step-5"]
    again.manager.close()


def test_step_without_marks_is_skipped_and_later_steps_dropped(tmp_path: Path) -> None:
    job = Job(tmp_path, max_to_keep=3)
    job.train(4)  # persistent 1, local 2, 3, 4
    expected_step = 3
    for mark in (job.local_dir / "step-4").glob("done.*"):
        mark.unlink()  # as if the ranks died before confirming step 4
    job.manager.close()
    again = _resumed(tmp_path, "local", 3)
    assert again.values()["step"] == expected_step
    assert not (again.local_dir / "step-4").exists()  # a timeline the job left
    again.manager.close()


def test_corrupt_local_piece_falls_back_to_persistent(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.train(3)  # persistent 1, local 2, 3
    job.manager.close()
    data = next((job.local_dir / "step-3").glob("o0.*.data"))
    raw = bytearray(data.read_bytes())
    raw[7] ^= 0xFF
    data.write_bytes(bytes(raw))
    again = Job(tmp_path)
    again.manager.restore_or_initialize()
    restored = again.manager.restored
    assert restored is not None and restored.tier == "persistent" and restored.number == 1
    assert "restoring local step 3 failed" in restored.reason and "crc32c" in restored.reason
    assert again.values()["step"] == 1
    again.manager.close()


def test_other_runs_local_steps_are_ignored(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.train(3)
    job.manager.close()
    other = Job(tmp_path)
    other.manager.close()
    shutil.move(tmp_path / "run", tmp_path / "elsewhere")
    fresh = Job(tmp_path)  # a new run directory: the local steps are another run's
    assert fresh.manager.restore_or_initialize() is None
    assert not any(files.survey(open_store(fresh.local_dir), "x"))
    fresh.manager.close()


@pytest.mark.parametrize("mode", [{"async_save": True}, {"lazy": True}])
def test_background_local_saves(tmp_path: Path, mode: dict[str, bool]) -> None:
    job = Job(tmp_path)
    paths = job.train(4, **mode)
    assert Path(paths[-1]).name == "step-4"
    expected = job.values()
    job.manager.close()
    _resumed(tmp_path, "local", 4, expected).manager.close()


def test_local_interval_in_steps_and_seconds(tmp_path: Path) -> None:
    job = Job(tmp_path, interval=2)
    paths = job.train(7)
    kinds = [None if p is None else Path(p).parent == tmp_path / "run" for p in paths]
    assert kinds == [True, None, False, None, False, True, None]
    job.manager.close()
    with pytest.raises(ValueError, match="needs the manager's step_counter"):
        distckpt.CheckpointManager(
            distckpt.Checkpoint(),
            tmp_path / "r2",
            comm=SingleComm(),
            local=LocalTier(tmp_path / "l2", interval=2),
        )


# ---------------------------------------------------------------- real jobs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _args(root: Path, *extra: str) -> list[str]:
    return ["--dir", str(root / "run"), "--tier", str(root / "local-{node}"), *extra]


def _restored(proc: Any) -> dict[str, Any]:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESTORED ")]
    assert len(lines) == 1, output(proc)
    record: dict[str, Any] = json.loads(lines[0][len("RESTORED ") :])
    return record


def _mpi_nodes(root: Path, nodes: list[str], *extra: str) -> Any:
    """mpiexec with 2 ranks per node, each node's ranks given their DISTCKPT_NODE; each
    rank forked warm through its proxy (see ``launch_util.run_mpi_ranks``)."""
    assert MPIEXEC is not None
    rank, warm = warm_mpi_rank(SCRIPT, *_args(root, *extra))
    cmd = [MPIEXEC]
    for i, node in enumerate(nodes):
        if i:
            cmd.append(":")
        cmd += [
            "-n",
            "2",
            "-env",
            NODE_ENV,
            node,
            *rank,
        ]
    return finish(start(cmd, {**MPI_LOCAL_ENV, **JOB_ENV, **warm}), TIMEOUT)


def _torchrun_nodes(root: Path, nodes: list[str], *extra: str) -> list[Any]:
    """One torchrun agent per node (2 ranks each), as a multi-node job on one machine."""
    port = _free_port()
    procs = []
    for i, node in enumerate(nodes):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(len(nodes)),
            "--node-rank",
            str(i),
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            str(SCRIPT),
            *_args(root, *extra),
        ]
        procs.append(start(cmd, {**JOB_ENV, NODE_ENV: node}))
    return [finish(p, TIMEOUT) for p in procs]


@needs_mpi
def test_mpiexec_lost_node_rank_killed_in_save_and_both_nodes_lost(tmp_path: Path) -> None:
    # Node b dies after step 13 and its directory is gone.
    first = _mpi_nodes(tmp_path, ["a", "b"], "--kill-node", "b", "--kill-at", "13")
    assert first.returncode != 0 and "KILLED" in first.stdout, output(first)
    assert not (tmp_path / "local-b").exists()
    # Restart on 4 ranks: local step 13, from node a's originals and replicas. Then rank 1
    # dies in the middle of the local save of step 15.
    (tmp_path / "run" / "killed").unlink()
    second = _mpi_nodes(tmp_path, ["a", "b"], "--die-in-save-at", "15")
    assert _restored(second) == {
        "tier": "local",
        "number": 13,
        "reason": "local step 13 is held whole by the surviving nodes",
        "world": 4,
    }, output(second)
    assert second.returncode != 0, output(second)
    # Restart on 2 ranks (node a only): step 15 was never confirmed, step 14 was.
    third = _mpi_nodes(tmp_path, ["a"])
    record = _restored(third)
    assert (record["tier"], record["number"], record["world"]) == ("local", 14, 2), output(third)
    assert "saved on 4 ranks, resharded onto 2" in record["reason"]
    assert_all_ok(third, 2)
    # Both nodes lost: the newest persistent checkpoint (step 11).
    for lost in tmp_path.glob("local-*"):
        shutil.rmtree(lost)
    fourth = _mpi_nodes(tmp_path, ["a", "b"])
    record = _restored(fourth)
    assert (record["tier"], record["number"]) == ("persistent", 11), output(fourth)
    assert record["reason"] == "the local tier holds no committed step"
    assert_all_ok(fourth, 4)


def test_torchrun_lost_node_resumes_on_fewer_ranks(tmp_path: Path) -> None:
    agents = _torchrun_nodes(
        tmp_path, ["a", "b"], "--kill-node", "b", "--kill-at", "13", "--async-save"
    )
    assert any("KILLED" in p.stdout for p in agents), "\n".join(map(output, agents))
    assert not (tmp_path / "local-b").exists()
    (again,) = _torchrun_nodes(tmp_path, ["a"], "--async-save")
    record = _restored(again)
    assert (record["tier"], record["number"], record["world"]) == ("local", 13, 2), output(again)
    assert_all_ok(again, 2)


@needs_mpi
def test_relaunch_after_a_lost_node(tmp_path: Path) -> None:
    assert MPIEXEC is not None
    env = {
        **MPI_LOCAL_ENV,
        **JOB_ENV,
        "PYTHON": sys.executable,
        "MPIEXEC": MPIEXEC,
        "TRAIN_SCRIPT": str(SCRIPT),
        "RUN_DIR": str(tmp_path / "run"),
        "NPROCS_SEQUENCE": "4 2",
        "RELAUNCH_ON_FAILURE": "1",
        "MAX_ATTEMPTS": "2",
    }
    args = ["--tier", str(tmp_path / "local-{node}"), "--node-of-rank"]
    proc = finish(
        start(
            [
                "bash",
                str(REPO_ROOT / "launch" / "relaunch.sh"),
                *args,
                "--kill-node",
                "n1",
                "--kill-at",
                "13",
            ],
            env,
        ),
        2 * TIMEOUT,
    )
    assert "relaunching (RELAUNCH_ON_FAILURE=1)" in proc.stderr, output(proc)
    records = [json.loads(ln[9:]) for ln in proc.stdout.splitlines() if ln.startswith("RESTORED ")]
    assert [(r["tier"], r.get("number"), r["world"]) for r in records] == [
        (None, None, 4),
        ("local", 13, 2),
    ], output(proc)
    assert_all_ok(proc, 2)


def test_survey_reads_only_marked_tokens(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    run = "r"
    (tmp_path / "step-3").mkdir()
    for owner in (0, 1):
        (tmp_path / "step-3" / f"o{owner}.aa.data").write_bytes(b"")
        (tmp_path / "step-3" / f"o{owner}.aa.json").write_text("{}")
    (tmp_path / "step-3" / "o0.bb.data").write_bytes(b"")
    (tmp_path / "step-3" / "o0.bb.json").write_text("{}")
    assert files.survey(store, run) == []  # no marks: nothing counts
    files.mark(store, files.Held(3, "aa", 2, run), 0)
    (tmp_path / "step-3" / "done.cc.r1").write_text("not json")
    (held,) = files.survey(store, run)
    assert (held.step, held.token, held.world, held.owners) == (3, "aa", 2, [0, 1])
    assert files.survey(store, "another run") == []
    np.testing.assert_equal(files.retain(store, 1, run, below=4), [])
    assert sorted(os.listdir(tmp_path / "step-3")) == [
        "done.aa.r0",
        "o0.aa.data",
        "o0.aa.json",
        "o1.aa.data",
        "o1.aa.json",
    ]


def test_going_back_replaces_the_abandoned_local_steps(tmp_path: Path) -> None:
    job = Job(tmp_path, max_to_keep=3)
    job.train(4)  # persistent 1, local 2, 3, 4
    job.ckpt.restore(str(tmp_path / "run" / "ckpt-1"), SingleComm())  # e.g. a loss spike
    assert job.values()["step"] == 1
    (path,) = job.train(1)  # step 2 again, of the new timeline
    assert Path(path).name == "step-2"
    assert sorted(os.listdir(job.local_dir)) == ["step-2"]
    expected = job.values()
    job.manager.close()
    _resumed(tmp_path, "local", 2, expected).manager.close()


def test_damaged_marks_are_skipped_not_raised(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.train(3)
    job.manager.close()
    step3 = job.local_dir / "step-3"
    (step3 / "done.abc.r7").write_text("[]")
    (step3 / "done.abd.r7").write_text('{"format": "distckpt-local", "step": 3}')
    (job.local_dir / "step-9").mkdir()
    (job.local_dir / "step-9" / "done.abe.r0").write_bytes(b"\xff\xfe")
    _resumed(tmp_path, "local", 3).manager.close()
    assert not (job.local_dir / "step-9").exists()


@needs_mpi
def test_mpiexec_damaged_copy_is_read_from_the_replica(tmp_path: Path) -> None:
    first = _mpi_nodes(tmp_path, ["a", "b"], "--steps", "3")  # persistent 1, local 2, 3
    assert_all_ok(first, 4)
    data = next((tmp_path / "local-a" / "step-3").glob("o0.*.data"))  # node a's own copy
    raw = bytearray(data.read_bytes())
    raw[5] ^= 0x10
    data.write_bytes(bytes(raw))
    second = _mpi_nodes(tmp_path, ["a", "b"], "--steps", "5")
    record = _restored(second)
    assert (record["tier"], record["number"]) == ("local", 3), output(second)
    assert "the copy of saved rank 0 on node a fails its checksum" in second.stderr
    assert_all_ok(second, 4)


def test_mpiexec_truncated_copy_is_read_from_the_replica(tmp_path: Path) -> None:
    """A node's copy shorter than its manifest says is left before anything is allocated
    for it, and the replica on the other node read instead (not the shared directory)."""
    first = _mpi_nodes(tmp_path, ["a", "b"], "--steps", "3")  # persistent 1, local 2, 3
    assert_all_ok(first, 4)
    data = next((tmp_path / "local-a" / "step-3").glob("o0.*.data"))  # node a's own copy
    data.write_bytes(data.read_bytes()[:7])
    second = _mpi_nodes(tmp_path, ["a", "b"], "--steps", "5")
    record = _restored(second)
    assert (record["tier"], record["number"]) == ("local", 3), output(second)
    assert "the copy of saved rank 0 on node a is shorter than its manifest" in second.stderr
    assert_all_ok(second, 4)
