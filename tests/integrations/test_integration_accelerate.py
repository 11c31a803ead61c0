"""distckpt.integrations.accelerate: ``save_state`` / ``load_state`` of an Accelerate loop.

2 processes (torchrun, gloo) train 6 steps, saving with automatic naming after steps 2,
4 and 6 (``total_limit=2``: the first is removed); ``load_state()`` then restores the
newest on 1 process and on 3, and the script checks the model, optimizer, scheduler,
every process's RNG (from saved process ``rank % 2``), the registered progress, the
sampler's seed and epoch and the next batch of data bit for bit.

FSDP2 (tests/scripts/accelerate_fsdp2_job.py): Accelerate's own preparation shards the
model on 2 processes (its state set to FSDP2 by hand: Accelerate enables FSDP only on
accelerators); ``save_state`` to an explicit directory, ``load_state`` on 3 processes,
and the gathered parameters and AdamW slots equal the saved ones bit for bit.
"""

from __future__ import annotations

import shutil

import pytest

from tests.support.launch_util import SCRIPTS, assert_all_ok, run_ranks, run_single

pytest.importorskip("accelerate")

SCRIPT = SCRIPTS / "accelerate_job.py"
TIMEOUT = 120  # seconds, per launch


def test_accelerate_saves_on_2_and_resumes_on_1_and_3(tmp_path):
    run, kept = tmp_path / "run", tmp_path / "kept"
    run.mkdir()
    assert_all_ok(run_ranks(2, SCRIPT, "save", str(run), timeout=TIMEOUT), 2)
    shutil.copytree(run, kept, symlinks=True)
    assert_all_ok(run_single(SCRIPT, "resume", str(run), timeout=TIMEOUT), 1)
    proc = run_ranks(3, SCRIPT, "resume", str(kept), timeout=TIMEOUT)
    assert_all_ok(proc, 3)
    assert proc.stdout.count("RESTORED") == 3


def test_accelerate_fsdp2_saves_on_2_and_resumes_on_3(tmp_path):
    """Accelerate's own FSDP2 preparation (forced on CPU: see the script), 2 -> 3 ranks."""
    script = SCRIPTS / "accelerate_fsdp2_job.py"
    assert_all_ok(run_ranks(2, script, "save", str(tmp_path), timeout=TIMEOUT), 2)
    proc = run_ranks(3, script, "load", str(tmp_path), timeout=TIMEOUT)
    assert_all_ok(proc, 3)
    assert proc.stdout.count("RESTORED") == 3
