"""distckpt.integrations.hf_trainer: ``Trainer.train(resume_from_checkpoint=True)``.

2 processes (torchrun, gloo, 2 samples each per step) train 6 steps, saving every 2 with
``save_total_limit=2``; one process with 4 samples per step (the same global batch, so
the Trainer's step-based data position means the same samples) resumes from the newest
checkpoint, and the script checks at its first step the model, optimizer, scheduler and
RNG bit for bit against what process 0 held at the save, the batch it is given (samples
24 to 27 of the epoch's order) and the retention.
"""

from __future__ import annotations

import pytest

from tests.support.launch_util import SCRIPTS, assert_all_ok, run_ranks, run_single

pytest.importorskip("transformers")

SCRIPT = SCRIPTS / "hf_trainer_job.py"
TIMEOUT = 120  # seconds, per launch


def test_trainer_saves_on_2_and_resumes_on_1(tmp_path):
    assert_all_ok(run_ranks(2, SCRIPT, "save", str(tmp_path), timeout=TIMEOUT), 2)
    proc = run_single(SCRIPT, "resume", str(tmp_path), timeout=TIMEOUT)
    assert_all_ok(proc, 1)
    assert "RESTORED 0" in proc.stdout
