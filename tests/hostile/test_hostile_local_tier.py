"""Hostile races on the node-local tier: another process rewrites or truncates a data
file of a local step between the moment a restore checks a piece's crc32c and the
moment it copies the piece. The restore must copy what it checked: the values read
before the change, or a CorruptCheckpointError (then the manager falls back to the
shared directory); never other values, and never a signal (a mapped file that shrinks
kills its reader with SIGBUS: each such restore runs in a process of its own).

The moment is reached deterministically: the restore's crc32c is wrapped so that, right
after the check of a piece, the file changes. Run as a script, this module restores
once with such a race and prints the outcome as JSON (see :func:`restore_racing`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import distckpt
from tests.support.hostile_util import local_manager
from tests.support.warm_ranks import run_ranks

BOUND = 60  # seconds for a restore in a process of its own
STEPS = (1, 2)  # step 1 persistent, step 2 in the local tier only


def values_at(step: int) -> dict[str, torch.Tensor]:
    """What the job holds after ``step``: pieces of distinct bytes (distinct crc32c)."""
    return {
        "w": torch.arange(32.0).reshape(8, 4) + 100 * step,
        "b": torch.arange(16, dtype=torch.int32) * 7 + step,
    }


def fresh(strided: bool) -> distckpt.Checkpoint:
    """Targets to restore into: contiguous (read straight into), or a transposed view
    (read through a copy of each piece)."""
    w = torch.full((4, 8), -1.0).t() if strided else torch.full((8, 4), -1.0)
    return distckpt.Checkpoint(
        step=torch.tensor(0), w=w, b=torch.full((16,), -1, dtype=torch.int32)
    )


def saved(root: Path) -> None:
    ckpt = fresh(strided=False)
    with local_manager(root, ckpt) as m:
        for step in STEPS:
            ckpt.step.fill_(step)
            for name, value in values_at(step).items():
                getattr(ckpt, name).copy_(value)
            m.save()


def restore_racing(root: Path, change: str, strided: bool) -> dict[str, Any]:
    """Restore from ``root`` while ``change`` ("flip": a byte of the piece just checked;
    "truncate": the whole data file, to nothing) strikes right after each check."""
    from distckpt.format.shard_io import crc32c
    from distckpt.local import restore

    (data,) = (root / "local" / f"step-{STEPS[-1]}").glob("o0.*.data")
    manifest = json.loads(data.with_suffix(".json").read_bytes())
    # Pieces by crc32c: each is small, checked in one call (distinct bytes: distinct crcs).
    at = {t["crc"]: t["offset"] for t in manifest["tensors"]}
    assert len(at) == len(manifest["tensors"]) and all(
        t["nbytes"] < 1024 for t in manifest["tensors"]
    )
    struck: list[int] = []

    def checked_then_changed(buffer: Any, value: int = 0) -> int:
        crc = crc32c(buffer, value)
        if value == 0 and crc in at and crc not in struck:  # the check of a whole piece
            struck.append(crc)
            if change == "flip":
                with open(data, "r+b") as f:
                    f.seek(at[crc])
                    byte = f.read(1)
                    f.seek(at[crc])
                    f.write(bytes([byte[0] ^ 0x40]))
            else:
                os.truncate(data, 0)
        return crc

    restore.crc32c = checked_then_changed  # (this process restores once, then exits)
    ckpt = fresh(strided)
    with local_manager(root, ckpt) as m:
        m.restore_or_initialize()
        restored = m.restored
    assert restored is not None
    return {
        "tier": restored.tier,
        "number": restored.number,
        "reason": restored.reason,
        "struck": len(struck),
        "step": int(ckpt.step),
        **{name: getattr(ckpt, name).tolist() for name in values_at(0)},
    }


def exact(outcome: dict[str, Any], step: int) -> bool:
    """The outcome holds the values of ``step``, bit for bit."""
    if outcome["step"] != step:
        return False
    for name, value in values_at(step).items():
        got = torch.tensor(outcome[name], dtype=value.dtype).reshape(-1)
        if not torch.equal(got.view(torch.uint8), value.reshape(-1).view(torch.uint8)):
            return False
    return True


def in_own_process(root: Path, change: str, strided: bool) -> dict[str, Any]:
    """:func:`restore_racing` in a process of its own (forked warm), which must end
    normally: a signal would show as ``rank 0 exited with -N``."""
    layout = "strided" if strided else "contiguous"
    run = run_ranks(1, __file__, str(root), change, layout, timeout=BOUND, plain=True)
    assert run.returncode == 0, f"the restore did not end normally:\n{run.stderr[-3000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_a_byte_changed_after_the_check_is_not_restored(tmp_path: Path, strided: bool) -> None:
    saved(tmp_path)
    outcome = in_own_process(tmp_path, "flip", strided)
    assert outcome["struck"] == 3  # every piece (step, w, b) changed right after its check
    # What was checked was copied: the local step's values, exactly as saved.
    assert (outcome["tier"], outcome["number"]) == ("local", STEPS[-1]), outcome
    assert exact(outcome, STEPS[-1]), outcome


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_a_data_file_truncated_after_the_check_is_no_signal(tmp_path: Path, strided: bool) -> None:
    saved(tmp_path)
    outcome = in_own_process(tmp_path, "truncate", strided)
    assert outcome["struck"] >= 1
    if outcome["tier"] == "local":  # every piece was read before the file shrank
        assert exact(outcome, STEPS[-1]), outcome
    else:  # a piece read after it: a clear error, and the shared directory instead
        assert (outcome["tier"], outcome["number"]) == ("persistent", STEPS[0]), outcome
        assert "restoring local step 2 failed" in outcome["reason"], outcome
        assert "truncated" in outcome["reason"], outcome
        assert exact(outcome, STEPS[0]), outcome


if __name__ == "__main__":
    root, change, layout = sys.argv[1:4]
    print(json.dumps(restore_racing(Path(root), change, layout == "strided")))
