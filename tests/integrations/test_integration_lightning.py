"""distckpt.integrations.lightning: Lightning's own checkpoint path, through the plugin
and through the sharded strategy.

* DDP (``DistckptCheckpointIO``): 2 torchrun ranks (gloo) fit 6 steps with
  ModelCheckpoint (every 2 steps, top 2 by step, ``save_last``); the fit resumes with
  ``ckpt_path="last"`` on 3 ranks.
* ModelParallel (``DistckptModelParallelStrategy``, FSDP2): the same on 2 ranks, each
  writing its shards, resumed on 3 ranks (uneven shards).

One launch saves both (2 ranks), one resumes both (3 ranks). The script checks, right
after the restore, the model, optimizer, scheduler, loops, RNG and data position bit for
bit against what was saved, the retention (exactly the two newest kept) and every kept
checkpoint read back whole.
"""

from __future__ import annotations

import re

import pytest

from tests.support.launch_util import SCRIPTS, assert_all_ok, run_ranks

pytest.importorskip("lightning")

SCRIPT = SCRIPTS / "lightning_job.py"
TIMEOUT = 120  # seconds, per launch


@pytest.mark.timeout(2 * TIMEOUT + 30)
def test_lightning_saves_on_2_and_resumes_on_3(tmp_path):
    """One launch of each: DDP, then ModelParallel (launches cost seconds each)."""
    assert_all_ok(run_ranks(2, SCRIPT, "save", str(tmp_path), timeout=TIMEOUT), 2)
    proc = run_ranks(3, SCRIPT, "resume", str(tmp_path), timeout=TIMEOUT)
    assert_all_ok(proc, 3)
    for kind in ("ddp", "sharded"):
        assert sorted(re.findall(rf"RESTORED {kind} (\d)", proc.stdout)) == ["0", "1", "2"]
