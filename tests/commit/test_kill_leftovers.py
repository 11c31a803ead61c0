"""What a save killed by SIGKILL leaves is removed by the next save into its directory.

A real 3-rank torchrun job (tests/scripts/kill_leftovers.py) saves ``DIR/ckpt`` while one
rank is SIGKILLed at a chosen point; each point leaves a staging (or trash) directory.
Then a new save into the same path must remove it, commit, and load bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import distckpt
from distckpt.comm import SingleComm
from distckpt.commit.staging import leftovers
from tests.support.launch_util import SCRIPTS, load_script, output, run_ranks
from tests.support.make_golden import assert_same_bits

SCRIPT = SCRIPTS / "kill_leftovers.py"
kl = load_script(SCRIPT, "kill_leftovers_script")

WORLD = 3


@pytest.mark.timeout(300)
@pytest.mark.parametrize("point", kl.POINTS)
def test_the_next_save_removes_what_a_killed_save_left(point: str, tmp_path: Path) -> None:
    proc = run_ranks(
        WORLD, SCRIPT, point, str(tmp_path), timeout=240, env={"DISTCKPT_TIMEOUT": "60"}
    )
    assert proc.returncode != 0 and "KILLING" in proc.stdout, output(proc)
    assert "COMMITTED" not in proc.stdout, output(proc)
    left = leftovers(tmp_path)
    assert left, f"the kill left nothing to collect\n{output(proc)}"

    new: dict[str, Any] = {"w": distckpt.Shard(kl.full_w(2, WORLD), (kl.ROWS * WORLD, 16), (0, 0))}
    distckpt.save({**new, "step": 2}, tmp_path / "ckpt", SingleComm(), overwrite=True)
    assert leftovers(tmp_path) == [], f"left before: {left}"
    got: dict[str, Any] = {"w": torch.zeros(kl.ROWS * WORLD, 16), "step": None}
    distckpt.load(got, tmp_path / "ckpt", SingleComm())
    assert_same_bits(got["w"], kl.full_w(2, WORLD))
    assert got["step"] == 2
