"""distckpt.integrations.trees: a framework's checkpoint dict saved, and loaded back
without a target, with its key types, tuples and tensors exactly as they were."""

from __future__ import annotations

import collections
import fractions

import pytest
import torch

import distckpt
from distckpt.integrations.trees import STRUCTURE, load_tree, save_tree
from tests.support.launch_util import SCRIPTS, load_script

assert_same = load_script(SCRIPTS / "rank.py", "rank").assert_same


def _tree() -> dict:
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters())
    net(torch.ones(3)).sum().backward()
    opt.step()
    return {
        "state_dict": collections.OrderedDict(net.state_dict()),
        "optimizer_states": [opt.state_dict()],  # int keys, tuples (betas), None
        "pair": (torch.arange(3), "x"),
        "odd/key%": {1: torch.zeros(1, dtype=torch.bfloat16), "a": (1, 2)},
        "hyper_parameters": {"betas": (0.9, 0.99), 2: None, "nan": float("nan")},
        "empty": {},
        "scalar": torch.tensor(float("nan")),
    }


def test_round_trip_bit_for_bit(tmp_path):
    tree = _tree()
    save_tree(tree, tmp_path / "a.ckpt")
    back = load_tree(tmp_path / "a.ckpt")
    expected = dict(tree, state_dict=dict(tree["state_dict"]))
    assert_same(back, expected)
    names = {v.name for v in distckpt.list_variables(tmp_path / "a.ckpt")}
    assert "data/state_dict/weight" in names and "data/optimizer_states/0/state/0/exp_avg" in names


def test_objects_need_allow_pickle(tmp_path):
    tree = {"w": torch.ones(2), "hp": {"frac": fractions.Fraction(1, 3)}}
    with pytest.raises(distckpt.UnsupportedValueError, match="allow_pickle"):
        save_tree(tree, tmp_path / "a.ckpt")
    save_tree(tree, tmp_path / "a.ckpt", allow_pickle=True)
    with pytest.raises(distckpt.UnsupportedValueError):
        load_tree(tmp_path / "a.ckpt")
    back = load_tree(tmp_path / "a.ckpt", allow_pickle=True)
    assert back["hp"]["frac"] == fractions.Fraction(1, 3)


def test_refuses_what_it_did_not_write_and_hostile_structures(tmp_path):
    distckpt.save({"w": torch.ones(2)}, tmp_path / "plain")
    with pytest.raises(distckpt.CheckpointError, match="no 'structure' value"):
        load_tree(tmp_path / "plain")
    hostile = [
        ("dict", [("w", "tensor"), ("ghost", "tensor")]),  # a tensor the index lacks
        ("dict", [("w", ("set", []))]),
        ("dict", [(1.5, "value")]),
        "tensor",
    ]
    for i, structure in enumerate(hostile):
        distckpt.save({"data": {"w": torch.ones(2)}, STRUCTURE: structure}, tmp_path / f"h{i}")
        with pytest.raises(distckpt.CorruptCheckpointError, match="structure"):
            load_tree(tmp_path / f"h{i}")


def test_declared_size_is_checked_before_allocating(tmp_path):
    save_tree({"w": torch.ones(1024)}, tmp_path / "a.ckpt")
    with pytest.raises(distckpt.CheckpointError, match="4096 bytes"):
        load_tree(tmp_path / "a.ckpt", max_bytes=4095)
    assert torch.equal(load_tree(tmp_path / "a.ckpt", max_bytes=4096)["w"], torch.ones(1024))
