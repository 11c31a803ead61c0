"""Pickling is opt-in on both sides: refused by default, stored and restored only when asked."""

from __future__ import annotations

import fractions
import os

import pytest
import torch

import distckpt
from distckpt.comm import SingleComm
from distckpt.commit.staging import leftovers
from distckpt.errors import UnsupportedValueError


class Marker:
    """Unpickling this object leaves a trace, as a malicious pickle would run code."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_unpickled, (self.value,))


TRACE: list[int] = []


def _unpickled(value: int) -> Marker:
    TRACE.append(value)
    obj = Marker.__new__(Marker)
    obj.value = value
    return obj


def test_objects_are_refused_by_default_and_nothing_is_written(tmp_path):
    state = {"w": torch.ones(3), "frac": fractions.Fraction(1, 3)}
    with pytest.raises(UnsupportedValueError, match=r"'frac'.*allow_pickle=True"):
        distckpt.save(state, tmp_path / "ck", SingleComm())
    assert not (tmp_path / "ck").exists() and leftovers(tmp_path) == []


def test_opt_in_round_trip_and_load_needs_opt_in_too(tmp_path):
    TRACE.clear()
    state = {
        "w": torch.arange(4.0),
        "frac": fractions.Fraction(1, 3),
        "mixed": [1, {"k": Marker(7)}, (2.5, Marker(8))],
        "rank_obj": distckpt.PerRank(Marker(9)),
    }
    distckpt.save(state, tmp_path / "ck", SingleComm(), allow_pickle=True)
    assert TRACE == []

    target = {"w": torch.zeros(4), "frac": None, "mixed": None, "rank_obj": distckpt.PerRank(None)}
    with pytest.raises(UnsupportedValueError, match=r"pickled Python object.*allow_pickle=True"):
        distckpt.load(target, tmp_path / "ck", SingleComm())
    assert TRACE == []  # refused before anything was unpickled

    distckpt.load(target, tmp_path / "ck", SingleComm(), allow_pickle=True)
    assert torch.equal(target["w"], torch.arange(4.0))
    assert target["frac"] == fractions.Fraction(1, 3)
    assert target["mixed"][0] == 1 and target["mixed"][1]["k"].value == 7
    assert isinstance(target["mixed"][2], tuple) and target["mixed"][2][1].value == 8
    assert target["rank_obj"].value.value == 9
    assert sorted(TRACE) == [7, 8, 9]


def test_index_holds_no_pickle_without_opt_in(tmp_path):
    distckpt.save({"v": {"a": (1, 2)}, "w": torch.ones(2)}, tmp_path / "ck", SingleComm())
    raw = (tmp_path / "ck" / "zarr.json").read_text()
    assert '"pickle"' not in raw
    assert os.path.getsize(tmp_path / "ck" / "zarr.json") > 0


class Holder:
    """A stateful object whose state holds objects that are not typed values."""

    def __init__(self, cfg: object = None, tag: object = None) -> None:
        self.cfg, self.tag = cfg, tag

    def state_dict(self) -> dict:
        return {"cfg": self.cfg, "tag": self.tag}

    def load_state_dict(self, state: dict) -> None:
        self.cfg, self.tag = state["cfg"], state["tag"]


def test_checkpoint_objects_need_the_opt_in_on_both_sides(tmp_path):
    TRACE.clear()
    ckpt = distckpt.Checkpoint(w=torch.ones(2), holder=Holder(fractions.Fraction(2, 3), Marker(5)))
    with pytest.raises(UnsupportedValueError, match="allow_pickle=True"):
        ckpt.write(tmp_path / "refused", SingleComm())
    assert not (tmp_path / "refused").exists()
    path = ckpt.save(tmp_path / "ckpt", SingleComm(), allow_pickle=True)

    fresh = distckpt.Checkpoint(w=torch.zeros(2), holder=Holder())
    with pytest.raises(UnsupportedValueError, match="pickled Python object"):
        fresh.restore(path, SingleComm())
    assert TRACE == []
    fresh = distckpt.Checkpoint(w=torch.zeros(2), holder=Holder())
    fresh.restore(path, SingleComm(), allow_pickle=True).assert_consumed()
    assert torch.equal(fresh.w, torch.ones(2))
    assert fresh.holder.cfg == fractions.Fraction(2, 3) and fresh.holder.tag.value == 5


def test_manager_passes_the_opt_in_to_save_and_restore(tmp_path):
    TRACE.clear()
    ckpt = distckpt.Checkpoint(holder=Holder(fractions.Fraction(1, 3), Marker(7)))
    refused = distckpt.CheckpointManager(ckpt, tmp_path / "refused", comm=SingleComm())
    with refused, pytest.raises(UnsupportedValueError, match="allow_pickle=True"):
        refused.save()
    run = tmp_path / "run"
    with distckpt.CheckpointManager(ckpt, run, comm=SingleComm(), allow_pickle=True) as manager:
        manager.save()
    fresh = distckpt.Checkpoint(holder=Holder())
    strict = distckpt.CheckpointManager(fresh, run, comm=SingleComm())
    with strict, pytest.raises(UnsupportedValueError, match="pickled Python object"):
        strict.restore_or_initialize()
    assert TRACE == []
    with distckpt.CheckpointManager(fresh, run, comm=SingleComm(), allow_pickle=True) as manager:
        assert manager.restore_or_initialize() == str(run / "ckpt-1")
    assert fresh.holder.cfg == fractions.Fraction(1, 3) and fresh.holder.tag.value == 7
