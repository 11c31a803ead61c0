"""The structure-aware fuzzer of hostile checkpoints (``tests/support/hostile_fuzz.py``): a fixed
handful of examples of every family, each in a child process of its own, checked for the
right values or a CheckpointError, within a deadline, nothing outside touched, and never
a signal. The driver runs as a process of its own (it forks a child per example, which
the test process, with threads of other tests about, must not do). A campaign:
``python tests/support/hostile_fuzz.py --examples 5000 --seed N``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support import hostile_fuzz

#: Examples in the suite: one of every family (the same ones every run).
EXAMPLES = int(os.environ.get("DISTCKPT_HOSTILE_EXAMPLES", str(len(hostile_fuzz.FAMILIES))))
SEED = int(os.environ.get("DISTCKPT_HOSTILE_SEED", "20261125"))


def test_hostile_checkpoints_give_right_values_or_one_clear_error(tmp_path: Path) -> None:
    out = tmp_path / "records.json"
    run = subprocess.run(
        [
            sys.executable,
            hostile_fuzz.__file__,
            "--examples",
            str(EXAMPLES),
            "--seed",
            str(SEED),
            "--work",
            str(tmp_path),
            "--json",
            str(out),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=EXAMPLES * hostile_fuzz.EXAMPLE_BOUND + 120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.exists(), (run.returncode, run.stdout[-3000:], run.stderr[-3000:])
    records = json.loads(out.read_text())
    assert len(records) == EXAMPLES
    assert {r["family"] for r in records} == set(hostile_fuzz.FAMILIES[:EXAMPLES])
    broken = [r for r in records if r["violations"]]
    assert not broken, json.dumps(broken, indent=1, default=str)[:20000]
    assert run.returncode == 0, run.stdout[-3000:]
