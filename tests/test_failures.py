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
from launch_util import SCRIPTS, check, load_script, needs_mpi, output, run_mpi, run_torchrun
from make_golden import TWO_RANKS, assert_same_bits

import distckpt
from distckpt.comm import SingleComm
from distckpt.storage.staging import OWNER_FILE, collect_garbage, leftovers

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
    pytest.param(("torchrun", 3), id="torchrun3"),
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
        proc = run_mpi(world, SCRIPT, *args, timeout=140, env=ERRORS_ENV)
    else:
        proc = run_torchrun(world, SCRIPT, *args, timeout=140, env=ERRORS_ENV)
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


def run_kill(launcher: str, world: int, directory: Path, overwrite: bool) -> None:
    args = ["kill", str(directory), *(["--overwrite"] if overwrite else [])]
    env = {"DISTCKPT_TIMEOUT": "10"}
    start = time.monotonic()
    if launcher == "mpi":
        proc = run_mpi(world, SCRIPT, *args, timeout=80, env=env)
    else:
        proc = run_torchrun(world, SCRIPT, *args, timeout=80, env=env)
    elapsed = time.monotonic() - start
    last = world - 1
    out = proc.stdout
    assert proc.returncode != 0, output(proc)
    assert "COMMITTED" not in out, output(proc)
    wrote = sorted(int(m) for m in re.findall(r"^WROTE (\d+) ", out, re.MULTILINE))
    assert wrote == list(range(last)), output(proc)  # the others had written their shards
    assert re.search(rf"^KILLING {last} ", out, re.MULTILINE), output(proc)
    for seconds in re.findall(r"^SURVIVOR \d+ \w+ ([\d.]+)$", out, re.MULTILINE):
        assert float(seconds) < 10 + 5, output(proc)
    assert elapsed < 70, f"{elapsed:.1f} s\n{output(proc)}"

    # Every committed checkpoint is intact; the interrupted one never appeared.
    target = directory / ("prev" if overwrite else "target")
    load_version(directory / "prev", world, 1)
    load_version(directory / "other", world, 2)
    if not overwrite:
        assert not target.exists()
    left = leftovers(directory)
    if launcher == "mpi":  # mpiexec kills the coordinator outright: its staging stays
        assert len(left) == 1, left
    assert len(left) <= 1, left
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
    run_kill("mpi", 3, tmp_path, overwrite=False)


@pytest.mark.timeout(100)
def test_rank_killed_while_replacing_torchrun(tmp_path: Path) -> None:
    run_kill("torchrun", 2, tmp_path, overwrite=True)
