"""Pipeline parallelism: ranks that hold different variables save, load and restore.

One launch of 4 ranks per launcher (tests/scripts/pipeline.py does the work): a job of
3 ranks saves three pipeline stages (a stage per rank), jobs of 2 and 4 ranks load them
strictly with the stages moved between ranks and split over two, bit for bit, through
``load``, ``load_hf``, ``Checkpoint.restore`` and ``restore_or_initialize`` from the
node-local tier; strictness is over the job: a stored variable no rank holds fails a
strict load on every rank with the same error before anything is read, is reported by
``strict=False`` and leaves ``assert_consumed`` failing on every rank. Without
launching: how the ranks agree on the names no rank takes, and what each rank sends.
"""

from __future__ import annotations

import math
import random
import subprocess
from pathlib import Path

import pytest

from distckpt.comm import SingleComm
from distckpt.pipeline.matching import _left_by_all, _share, gather_left
from tests.support.launch_util import (
    SCRIPTS,
    assert_all_ok,
    cases,
    needs_mpi,
    output,
    run_mpi_ranks,
    run_ranks,
)

SCRIPT = SCRIPTS / "pipeline.py"
NPROCS = 4
LAUNCH_TIMEOUT = 150  # seconds (about 11 s alone; a loaded 2-core machine needs more)
JOB_ENV = {"DISTCKPT_TIMEOUT": "60"}  # a rank stuck in a collective fails the launch
#: The records every rank prints, and whose message must be the same on every rank.
SAME_ON_EVERY_RANK = ("unexpected4-load", "unexpected4-hf", "unexpected4-status", "missing4")


def check_job(proc: subprocess.CompletedProcess[str]) -> None:
    assert_all_ok(proc, NPROCS)
    found = cases(proc)
    for case in SAME_ON_EVERY_RANK:
        records = found.get(case, {})
        assert sorted(records) == list(range(NPROCS)), f"{case}: {records}\n{output(proc)}"
        messages = {r["message"] for r in records.values()}
        assert len(messages) == 1, f"{case}: the ranks' errors differ: {messages}"
    # the job's unexpected name: one error, raised where rank 0 found it, on every rank
    assert {r["error_rank"] for r in found["unexpected4-load"].values()} == {0}
    assert found["unexpected4-load"][0]["message"].endswith(
        "in the checkpoint but not in the state: stage2/w"
    )
    assert found["missing4"][0]["message"].endswith("missing from the checkpoint: stage2/extra")


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_pipeline_torchrun(tmp_path: Path) -> None:
    proc = run_ranks(NPROCS, SCRIPT, str(tmp_path), timeout=LAUNCH_TIMEOUT, env=JOB_ENV)
    check_job(proc)


@needs_mpi
@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_pipeline_mpiexec(tmp_path: Path) -> None:
    proc = run_mpi_ranks(NPROCS, SCRIPT, str(tmp_path), timeout=LAUNCH_TIMEOUT, env=JOB_ENV)
    check_job(proc)


@pytest.mark.parametrize("seed", range(25))
def test_the_job_leaves_what_every_rank_leaves(seed: int) -> None:
    """Random jobs: the names no rank takes, from each rank's share alone; a share is
    nothing for a rank that takes every name, else at most a bit per name and 4 bytes
    per name taken."""
    rng = random.Random(seed)
    names = sorted(f"stage{rng.randrange(9)}/layer{i}" for i in range(rng.randrange(0, 400)))
    ranks = rng.randrange(1, 9)
    taken = []
    for _ in range(ranks):
        kind = rng.randrange(3)  # a stage, every name, or a scattered few
        if kind == 0:
            stage = f"stage{rng.randrange(9)}/"
            taken.append({n for n in names if n.startswith(stage)})
        elif kind == 1:
            taken.append(set(names))
        else:
            taken.append(set(rng.sample(names, rng.randrange(0, len(names) + 1))))
    shares = [_share(names, [n for n in names if n not in t]) for t in taken]
    assert _left_by_all(names, shares) == [n for n in names if not any(n in t for t in taken)]
    for t, share in zip(taken, shares, strict=True):
        assert (share is None) == (t == set(names))
        if share is not None:
            assert len(share[1]) <= min(math.ceil(len(names) / 8), 4 * len(t))


def test_one_rank_agrees_alone() -> None:
    payloads, left = gather_left(SingleComm(), "mine", ["a", "b", "c"], ["b"])
    assert payloads == ["mine"] and left == ["b"]
    assert gather_left(SingleComm(), None, ["a"], [])[1] == []
