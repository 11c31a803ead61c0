"""Odd names in a run directory: an entry whose name does not parse is skipped (and
reported by ``distckpt gc``), never fatal, and never taken for what it is not. Numbers in
names are ASCII digits in canonical form only (distckpt.numbering): ``ckpt-٤`` (an
Arabic-Indic four) is not step 4, ``ckpt-05`` is not step 5."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import distckpt
from distckpt.local import files
from distckpt.numbering import number, numbered, signed
from distckpt.storage.registry import open_store
from distckpt.tools.runs import list_run
from distckpt.training.pointer import _older
from tests.support.hostile_util import cli
from tests.support.launch_util import bounded

BOUND = 60

#: Entries named like leftovers of saves, none of which is one.
ODD_LEFTOVERS = [
    "...trash-0",  # a trash of "."
    "..staging-ab",  # of ""
    ".ckpt-x.staging-",  # no token
    ".ckpt-3.staging-zz",  # a token that is not hex
    "....staging-1",  # of ".."
]
#: Entries named like a manager's checkpoints, none of which is one of its steps.
ODD_STEPS = ["ckpt-\u0664", "ckpt-05", "ckpt-1e3", "ckpt-+5", "ckpt- 5", "ckpt-5_0", "ckpt-"]


def listing(tree: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(tree)): (p.lstat().st_mode, p.lstat().st_mtime_ns)
        for p in sorted(tree.rglob("*"))
    }


@pytest.mark.timeout(120)
def test_odd_entries_in_a_run_directory_stop_no_save(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for name in ODD_LEFTOVERS:
        (run / name).mkdir()
    (run / ".ckpt-9.trash-ab").symlink_to(tmp_path)  # a link: never a leftover
    for name in ODD_STEPS:  # committed checkpoints, holding w = 99
        distckpt.save({"w": torch.full((4,), 99.0)}, run / name)
    odd_names = (*ODD_LEFTOVERS, *ODD_STEPS, ".ckpt-9.trash-ab")

    def odd() -> dict[str, tuple[int, int]]:
        return {k: v for k, v in listing(run).items() if k.split("/")[0] in odd_names}

    before = odd()
    with bounded(BOUND):
        distckpt.save({"w": torch.ones(4)}, run / "plain")
        ckpt = distckpt.Checkpoint(w=torch.zeros(4))
        with distckpt.CheckpointManager(ckpt, run, max_to_keep=2) as manager:
            assert manager.restore_or_initialize() is None  # none of them is a step
            for k in range(1, 4):
                ckpt.w.fill_(k)
                manager.save()
            assert manager.checkpoints == [str(run / "ckpt-2"), str(run / "ckpt-3")]
        restored = distckpt.Checkpoint(w=torch.zeros(4))
        with distckpt.CheckpointManager(restored, run, max_to_keep=2) as manager:
            assert manager.restore_or_initialize() == str(run / "ckpt-3")
            assert torch.equal(restored.w, torch.full((4,), 3.0))
            assert manager.checkpoints == [str(run / "ckpt-2"), str(run / "ckpt-3")]
    gc = cli("gc", run)
    assert gc.returncode == 0, gc
    for name in [*ODD_LEFTOVERS, ".ckpt-9.trash-ab"]:
        assert f"skipped {str(run / name)!r}" in gc.stdout, (name, gc.stdout)
    assert odd() == before  # left untouched: not an entry, not a time changed
    ls = cli("ls", "--json", run)
    assert ls.returncode == 0, ls


def test_a_step_in_other_digits_is_never_adopted(tmp_path: Path) -> None:
    """A committed checkpoint named ``ckpt-٤`` (and one ``ckpt-04``) beside the
    manager's ``ckpt-1``: the manager restores ``ckpt-1`` and never lists the others."""
    run = tmp_path / "run"
    ckpt = distckpt.Checkpoint(w=torch.ones(4))
    with distckpt.CheckpointManager(ckpt, run) as manager:
        manager.save()
    for name in ("ckpt-\u0664", "ckpt-04"):
        distckpt.save({"w": torch.full((4,), 4.0), "save_counter": 4}, run / name)
    restored = distckpt.Checkpoint(w=torch.zeros(4))
    with distckpt.CheckpointManager(restored, run) as manager:
        assert manager.restore_or_initialize() == str(run / "ckpt-1")
        assert manager.checkpoints == [str(run / "ckpt-1")]
    assert torch.equal(restored.w, torch.ones(4))
    steps = {e.name: e.number for e in list_run(run).entries}
    assert steps["ckpt-1"] == 1 and steps["ckpt-\u0664"] in (None, 4)  # (4: the index's)
    assert not _older("ckpt-\u0664", "ckpt-5", []) and not _older("ckpt-1", "ckpt-\u0664", [])


def test_a_local_step_in_other_digits_is_not_a_step(tmp_path: Path) -> None:
    node = tmp_path / "node"
    (node / "step-\u0662").mkdir(parents=True)  # an Arabic-Indic two
    (node / "step-02").mkdir()
    (node / "step-2").mkdir()
    store = open_store(node)
    files.drop_newer(store, 0)
    assert sorted(os.listdir(node)) == ["step-02", "step-\u0662"]
    assert files.survey(store, "run") == []


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("0", 0),
        ("7", 7),
        ("12", 12),
        ("9" * 18, 10**18 - 1),
        ("9" * 19, None),
        ("05", None),
        ("00", None),
        ("", None),
        ("\u0664", None),  # Arabic-Indic
        ("\u096a", None),  # Devanagari
        ("\uff14", None),  # fullwidth
        ("\u00b2", None),  # superscript two: isdigit() says yes
        ("1e3", None),
        ("+5", None),
        ("-5", None),
        (" 5", None),
        ("5_0", None),
        ("1.0", None),
    ],
)
def test_numbers_in_names_are_ascii_digits_in_canonical_form(text: str, want: int | None) -> None:
    assert number(text) == want
    assert numbered(f"ckpt-{text}", "ckpt-") == want
    assert numbered(f"r{text}.json", "r", ".json") == want


def test_signed_numbers() -> None:
    assert [signed(t) for t in ("-3", "3", "-0", "--3", "-\u0664")] == [-3, 3, None, None, None]
