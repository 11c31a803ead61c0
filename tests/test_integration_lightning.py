"""distckpt.integrations.lightning: Lightning's own checkpoint path, through the plugin
and through the sharded strategy.

* DDP (``DistckptCheckpointIO``): 2 torchrun ranks (gloo) fit 6 steps with
  ModelCheckpoint (every 2 steps, top 2 by step, ``save_last``); the fit resumes with
  ``ckpt_path="last"`` on 1 process.
* ModelParallel (``DistckptModelParallelStrategy``, FSDP2): the same on 2 ranks, each
  writing its shards, resumed on 3 ranks (uneven shards).

The script checks, right after the restore, the model, optimizer, scheduler, loops, RNG
and data position bit for bit against what was saved, the retention (exactly the two
newest kept) and every kept checkpoint read back whole.
"""

from __future__ import annotations

import pytest
from launch_util import SCRIPTS, assert_all_ok, run_single, run_torchrun

pytest.importorskip("lightning")

SCRIPT = SCRIPTS / "lightning_job.py"
TIMEOUT = 120  # seconds, per launch


def test_lightning_ddp_saves_on_2_and_resumes_on_1(tmp_path):
    assert_all_ok(run_torchrun(2, SCRIPT, "save", str(tmp_path), timeout=TIMEOUT), 2)
    proc = run_single(SCRIPT, "resume", str(tmp_path), timeout=TIMEOUT)
    assert_all_ok(proc, 1)
    assert "RESTORED 0" in proc.stdout


def test_lightning_model_parallel_saves_on_2_and_resumes_on_3(tmp_path):
    assert_all_ok(run_torchrun(2, SCRIPT, "save", str(tmp_path), "--sharded", timeout=TIMEOUT), 2)
    proc = run_torchrun(3, SCRIPT, "resume", str(tmp_path), "--sharded", timeout=TIMEOUT)
    assert_all_ok(proc, 3)
    assert proc.stdout.count("RESTORED") == 3
