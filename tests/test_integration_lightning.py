"""distckpt.integrations.lightning: Lightning's own checkpoint path, through the plugin.

2 ranks (torchrun, DDP on gloo) fit 6 steps with ModelCheckpoint (every 2 steps, top 2 by
step, ``save_last``); the fit then resumes with ``ckpt_path="last"`` on 1 process and on
3 ranks, and the scripts check, right after the restore, the model, optimizer, scheduler,
loops, RNG and data position bit for bit against what rank 0 handed to the plugin, the
retention (exactly the two newest kept) and every kept checkpoint read back whole.
"""

from __future__ import annotations

import shutil

import pytest
from launch_util import SCRIPTS, assert_all_ok, run_single, run_torchrun

pytest.importorskip("lightning")

SCRIPT = SCRIPTS / "lightning_job.py"
TIMEOUT = 120  # seconds, per launch


def test_lightning_ddp_saves_on_2_and_resumes_on_1_and_3(tmp_path):
    # Each resume runs in the directory of the save (ModelCheckpoint keeps its retention
    # state only in the directory it saved to): the saved run is put back in between.
    run, kept = tmp_path / "run", tmp_path / "kept"
    run.mkdir()
    assert_all_ok(run_torchrun(2, SCRIPT, "save", str(run), timeout=TIMEOUT), 2)
    shutil.copytree(run, kept, symlinks=True)
    assert_all_ok(run_single(SCRIPT, "resume", str(run), timeout=TIMEOUT), 1)
    shutil.rmtree(run)
    kept.rename(run)
    proc = run_torchrun(3, SCRIPT, "resume", str(run), timeout=TIMEOUT)
    assert_all_ok(proc, 3)
    assert proc.stdout.count("RESTORED") == 3
