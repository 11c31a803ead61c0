"""Failures on several ranks: validation, errors in the write phase and in load, a rank
killed while writing. Runs tests/scripts/failures.py under mpiexec and torchrun.

``errors`` mode runs ~20 cases in one launch (see the script's docstring); here every
case must have been reported by every rank with the same exception type and the same
failing rank, and no rank may report a failed check. ``kill`` mode SIGKILLs the last
rank in the middle of a save; this process then checks what is left on disk.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

import distckpt
from distckpt.comm import SingleComm
from distckpt.commit.staging import OWNER_FILE, collect_garbage, leftovers
from tests.support.launch_util import (
    MPIEXEC,
    SCRIPTS,
    check,
    hydra_keeps_survivors,
    load_script,
    needs_mpi,
    output,
    run_mpi,
    run_mpi_ranks,
    run_mpi_survivors,
    run_ranks,
    run_torchrun,
)
from tests.support.make_golden import TWO_RANKS, assert_same_bits

SCRIPT = SCRIPTS / "failures.py"


fs = load_script(SCRIPT, "failures_script")


GROUPS: dict[str, list[str]] = {
    "validation": [
        "shape",
        "dtype",
        "overlap",
        "gap",
        "replica",
        "value",
        "kind",
        "two",
        "unsupported",
        "unsupported-dtype",
        "exists",
    ],
    "write-phase": [
        "write-raise-rank1",
        "write-enospc-last",
        "write-raise-rank0",
        "write-fresh-rank1",
    ],
    "load": ["load-shape-one", "load-corrupt-one"],
    "load-missing-names": ["load-missing-all", "load-missing-one"],
    "golden-resharded": ["save-prev", "golden", "final"],
}


def expected_cases(world: int) -> dict[str, tuple[str | None, int | None]]:
    """case -> (exception type every rank raises, rank it happened on)."""
    last = world - 1
    cases: dict[str, tuple[str | None, int | None]] = {"save-prev": (None, None)}
    for name in ("shape", "dtype", "overlap", "gap", "replica", "value", "kind", "two"):
        cases[name] = ("ValidationError", 0)
    cases.update(
        {
            "unsupported": ("UnsupportedValueError", 1),
            "unsupported-dtype": ("UnsupportedValueError", last),
            "exists": ("CheckpointExists", 0),
            "write-raise-rank1": ("DiskOnFire", 1),
            "write-enospc-last": ("OSError", last),
            "write-raise-rank0": ("DiskOnFire", 0),
            "write-fresh-rank1": ("DiskOnFire", 1),
            "load-missing-all": ("MissingVariablesError", 0),
            "load-missing-one": ("MissingVariablesError", last),
            "load-shape-one": ("ShapeMismatchError", 1),
            "load-corrupt-one": ("CorruptCheckpointError", last),
            "golden": (None, None),
            "final": (None, None),
        }
    )
    return cases


class ErrorsRun:
    """The output of one ``errors`` launch, parsed."""

    def __init__(self, proc: subprocess.CompletedProcess[str], world: int) -> None:
        self.proc, self.world = proc, world
        self.records: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
        self.fails: dict[str, list[str]] = defaultdict(list)
        for line in proc.stdout.splitlines():
            if line.startswith("CASE "):
                rec = json.loads(line[5:])
                self.records[rec["case"]][rec["rank"]] = rec
            elif line.startswith("FAIL "):
                self.fails[line.split()[1]].append(line)

    def problems(self, cases: list[str]) -> list[str]:
        expected = expected_cases(self.world)
        problems = []
        for case in cases:
            typ, err_rank = expected[case]
            got = self.records.get(case, {})
            if sorted(got) != list(range(self.world)):
                problems.append(f"{case}: reported by ranks {sorted(got)}")
                continue
            types = {r: rec["type"] for r, rec in got.items()}
            if set(types.values()) != {typ}:
                problems.append(f"{case}: types by rank {types}, expected {typ} everywhere")
            ranks = {r: rec["err_rank"] for r, rec in got.items()}
            if set(ranks.values()) != {err_rank}:
                problems.append(f"{case}: err.rank by rank {ranks}, expected {err_rank}")
            messages = {rec["msg"] for rec in got.values()}
            if typ is not None and len(messages) != 1:
                problems.append(f"{case}: messages differ between ranks: {sorted(messages)}")
            problems += self.fails.get(case, [])
        return problems


ERRORS_ENV = {"DISTCKPT_TIMEOUT": "30"}  # a desynchronised case fails instead of hanging
LAUNCHERS = [
    pytest.param(("mpi", 4), marks=needs_mpi, id="mpi4"),
    pytest.param(("ranks", 3), id="ranks3"),
]


@pytest.fixture(scope="module", params=LAUNCHERS)
def errors_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> ErrorsRun:
    """One launch of every ``errors`` case, shared by the tests below."""
    launcher, world = request.param
    directory = tmp_path_factory.mktemp(f"errors-{launcher}")
    args = ["errors", str(directory), "--golden", str(TWO_RANKS)]
    if launcher == "mpi":
        proc = run_mpi_ranks(world, SCRIPT, *args, timeout=140, env=ERRORS_ENV)
    else:
        proc = run_ranks(world, SCRIPT, *args, timeout=140, env=ERRORS_ENV)
    return ErrorsRun(proc, world)


@pytest.mark.timeout(160)
def test_errors_launch_ran_every_case(errors_run: ErrorsRun) -> None:
    """The job went through every case on every rank (no hang, no crash); when no check
    failed, every rank said OK and the job exited with 0."""
    run = errors_run
    for case in expected_cases(run.world):
        assert sorted(run.records.get(case, {})) == list(range(run.world)), (case, output(run.proc))
    if not run.fails:
        oks = sorted(int(m) for m in re.findall(r"^OK (\d+)$", run.proc.stdout, re.MULTILINE))
        assert oks == list(range(run.world)), output(run.proc)
        check(run.proc)


@pytest.mark.timeout(160)
@pytest.mark.parametrize("group", list(GROUPS))
def test_errors_on_every_rank(errors_run: ErrorsRun, group: str) -> None:
    """Same exception type, failing rank and message on every rank; every per-rank check
    of the script (message words, nothing written, previous checkpoint intact) passed."""
    problems = errors_run.problems(GROUPS[group])
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- kill


def load_version(path: Path, world: int, version: int) -> None:
    """Single-process load of a checkpoint written by ``world`` ranks; bit-exact check."""
    state: dict[str, Any] = {
        "w": torch.zeros(fs.ROWS * world, 16),
        "b": torch.zeros(20),
        "rng": distckpt.PerRank(None),
        "step": None,
    }
    distckpt.load(state, path, SingleComm())
    assert_same_bits(state["w"], fs.full_w(version, world), f"{path} w")
    assert_same_bits(state["b"], fs.full_b(version), f"{path} b")
    assert_same_bits(state["rng"].value, fs.rng(0, version), f"{path} rng")
    assert state["step"] == version


KILL_TIMEOUT = 10  # DISTCKPT_TIMEOUT of the kill jobs


def run_kill(launcher: str, world: int, directory: Path, overwrite: bool) -> None:
    """Launch ``kill`` mode (the last rank dies in its first shard write, once the others
    have written theirs) and check the job and what is left on disk.

    ``launcher``:

    * ``mpi``: plain ``mpiexec``, the last rank SIGKILLed. Hydra kills every other rank
      as soon as one dies, so no survivor can be seen; what is checked is that the job
      ends promptly with the killed rank reported, nothing committed, the previous
      checkpoints intact, and the killed coordinator's staging directory left for the
      garbage collection.
    * ``mpi-survivors``: ``mpiexec -disable-auto-cleanup``, the last rank ending with
      ``os._exit(9)`` (hydra still SIGKILLs everyone once it reaps a rank killed by a
      signal); the others live on.
    * ``torchrun``: the last rank SIGKILLed; the others carry on through torchrun's
      SIGTERM (see the script).

    Under the last two, every other rank must be seen to give up by itself with
    CommTimeoutError within ``DISTCKPT_TIMEOUT`` (and a margin), the coordinator
    removing its staging directory."""
    args = ["kill", str(directory), *(["--overwrite"] if overwrite else [])]
    if launcher == "mpi-survivors":
        args.append("--exit")
    env = {"DISTCKPT_TIMEOUT": str(KILL_TIMEOUT)}
    start_time = time.monotonic()
    if launcher == "torchrun":
        proc = run_torchrun(world, SCRIPT, *args, timeout=80, env=env)
    elif launcher == "mpi":
        proc = run_mpi(world, SCRIPT, *args, timeout=80, env=env)
    else:
        proc = run_mpi_survivors(world, SCRIPT, *args, timeout=80, env=env)
    elapsed = time.monotonic() - start_time
    last = world - 1
    out = proc.stdout
    assert proc.returncode != 0, output(proc)
    assert "COMMITTED" not in out, output(proc)
    wrote = sorted(int(m) for m in re.findall(r"^WROTE (\d+) ", out, re.MULTILINE))
    assert wrote == list(range(last)), output(proc)  # the others had written their shards
    assert re.search(rf"^KILLING {last} ", out, re.MULTILINE), output(proc)
    # the launcher reports the dead rank's end
    if launcher == "torchrun":
        assert re.search(r"exitcode\s*: -9 .*\(SIGKILL\)", proc.stderr), output(proc)
    elif launcher == "mpi":
        assert "Killed (signal 9)" in out + proc.stderr, output(proc)
    markers = directory / "markers"
    survivors = {
        int(p.name.removeprefix("survivor-")): p.read_text() for p in markers.glob("survivor-*")
    }
    if launcher == "mpi":
        assert not survivors or all(
            float(line.split()[3]) < KILL_TIMEOUT + 5 for line in survivors.values()
        ), output(proc)
    else:  # every other rank is there to see, and gave up in time
        assert sorted(survivors) == list(range(last)), f"{survivors}\n{output(proc)}"
        for rank, line in survivors.items():
            _, who, error, seconds = line.split()
            assert (int(who), error) == (rank, "CommTimeoutError"), output(proc)
            assert float(seconds) < KILL_TIMEOUT + 5, output(proc)
    assert elapsed < 70, f"{elapsed:.1f} s\n{output(proc)}"

    # Every committed checkpoint is intact; the interrupted one never appeared.
    target = directory / ("prev" if overwrite else "target")
    load_version(directory / "prev", world, 1)
    load_version(directory / "other", world, 2)
    if not overwrite:
        assert not target.exists()
    left = leftovers(directory)
    # hydra kills the coordinator outright: its staging stays; one that gave up removed it
    assert len(left) == (1 if launcher == "mpi" else 0), left
    for staging in left:
        assert staging.name.startswith(f".{target.name}.staging-")
        assert not (staging / "zarr.json").exists()  # no index was written
        for r in range(last):  # what the survivors wrote is only in there
            assert (staging / "w" / f"c.{r}.0").is_file()
        owner = json.loads((staging / OWNER_FILE).read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(owner["pid"], 0)  # the coordinator is gone, so the directory is stale
    assert sorted(collect_garbage(directory)) == left
    assert leftovers(directory) == []
    # and a new save to the same path succeeds (here from one process)
    new: dict[str, Any] = {"w": torch.arange(6.0), "step": 4}
    distckpt.save(new, target, SingleComm(), overwrite=overwrite)
    got: dict[str, Any] = {"w": torch.zeros(6), "step": None}
    distckpt.load(got, target, SingleComm())
    assert_same_bits(got["w"], new["w"])
    assert got["step"] == 4
    load_version(directory / "other", world, 2)


@needs_mpi
@pytest.mark.timeout(100)
def test_rank_killed_while_writing_mpi(tmp_path: Path) -> None:
    """Under plain mpiexec no survivor can be seen (hydra kills them at once): the job
    ends promptly, reporting the killed rank; nothing is committed, the previous
    checkpoints load bit for bit, and the killed coordinator's staging directory is
    collected as stale."""
    run_kill("mpi", 3, tmp_path, overwrite=False)


@needs_mpi
@pytest.mark.timeout(100)
def test_rank_killed_while_replacing_mpi_survivors(tmp_path: Path) -> None:
    """Under ``mpiexec -disable-auto-cleanup`` the other ranks live on: each gives up with
    CommTimeoutError within DISTCKPT_TIMEOUT, the checkpoint being replaced stays whole."""
    if not hydra_keeps_survivors():
        pytest.skip(f"{MPIEXEC} is not MPICH's hydra (no -disable-auto-cleanup)")
    run_kill("mpi-survivors", 3, tmp_path, overwrite=True)


@pytest.mark.timeout(100)
def test_rank_killed_while_replacing_torchrun(tmp_path: Path) -> None:
    """Under torchrun the survivor gives up by itself (it carries on through torchrun's
    SIGTERM), with CommTimeoutError in time; the checkpoint being replaced stays whole."""
    run_kill("torchrun", 2, tmp_path, overwrite=True)
