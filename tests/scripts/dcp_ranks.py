"""``torch.distributed.checkpoint`` through distckpt, both ways, on N ranks then M.

Usage (under torchrun or mpiexec, gloo on CPU)::

    dcp_ranks.py save DIR [URL]   # N ranks
    dcp_ranks.py load DIR [URL]   # M ranks, another world size

``save`` trains an FSDP2 model and its Adam state for 3 steps and writes, with the real
``dcp.save`` and :class:`~distckpt.integrations.dcp.DistckptWriter`:

* ``DIR/fsdp``: ``get_state_dict(model, optim)`` (DTensors, fqn-keyed optimizer state,
  param_groups), a step and a dict of values; the same to ``URL/fsdp`` when given (S3);
* ``DIR/plain``: a plain state (same on every rank) with DCP's planner options changed:
  no flattening, and replicas saved by the lowest rank;
* ``DIR/objects``: a state holding a Python object that is not a typed value;

and with :func:`distckpt.save`, ``DIR/native``: the FSDP state as distckpt saves it. Rank 0
writes every full tensor to ``DIR/expected.safetensors`` and the values to
``DIR/expected.json``.

``load`` builds a fresh model (another seed) on M ranks and checks, bit for bit against
the expected files: ``distckpt.load`` of ``fsdp`` (written through DCP), ``dcp.load``
with :class:`~distckpt.integrations.dcp.DistckptReader` of ``native`` (written by
distckpt) and of ``URL/fsdp``, ``dcp.load`` of ``plain`` into a flat state with DCP's
load planner unflattened, and that ``objects`` is refused without ``allow_pickle`` and read
with it. Each rank prints ``OK <rank>`` last.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from rank import finish_job, fsdp_mlp, start_job
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

import distckpt
from distckpt.integrations.dcp import DistckptReader, DistckptWriter

VALUES = {"epoch": 2, "best": {"loss": 0.25, "tags": ["a", "b"]}}


def build(seed: int, mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = fsdp_mlp(seed, (24, 40, 5), mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def fsdp_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd, "step": 3, "values": dict(VALUES)}


def plain_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(7, 5, generator=g),
        "h": torch.randn(9, generator=g).to(torch.bfloat16),
        "nested": {"ids": torch.randint(0, 1 << 40, (4,), generator=g), "note": "kept"},
    }


def full(state: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of ``state``, whole (DTensors gathered), by a flat name (collective)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(full(value, f"{name}."))
        elif isinstance(value, torch.Tensor):
            whole = value.full_tensor() if hasattr(value, "full_tensor") else value
            out[name] = whole.detach().clone().contiguous()
    return out


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    assert sorted(got) == sorted(want), (where, sorted(set(got) ^ set(want)))
    for name, value in want.items():
        g = got[name]
        ok = g.dtype == value.dtype and g.shape == value.shape
        assert ok and torch.equal(
            g.reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)
        ), (where, name)


def save(directory: Path, url: str | None, mesh: Any, rank: int) -> None:
    model, optim = build(0, mesh)
    for step in range(3):
        torch.manual_seed(100 + step)
        loss = model(torch.randn(8, 24)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
    state = fsdp_state(model, optim)
    dcp.save(state, storage_writer=DistckptWriter(directory / "fsdp"))
    if url:
        dcp.save(state, checkpoint_id=f"{url}/fsdp", storage_writer=DistckptWriter())
    distckpt.save(state, directory / "native")
    planner = DefaultSavePlanner(flatten_state_dict=False, dedup_save_to_lowest_rank=True)
    dcp.save(plain_state(1), storage_writer=DistckptWriter(directory / "plain"), planner=planner)
    objects = {"w": torch.ones(3), "when": datetime.date(2026, 11, 25)}
    dcp.save(objects, storage_writer=DistckptWriter(directory / "objects"))
    expected = full(state)
    if rank == 0:
        save_file(expected, str(directory / "expected.safetensors"))
        sd_optim = state["optim"]
        groups = [{k: v for k, v in g.items() if k != "params"} for g in sd_optim["param_groups"]]
        (directory / "expected.json").write_text(json.dumps({"param_groups": groups}))


def load(directory: Path, url: str | None, mesh: Any) -> None:
    expected = load_file(str(directory / "expected.safetensors"))
    groups = json.loads((directory / "expected.json").read_text())["param_groups"]

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
        model, optim = build(7, mesh)
        model(torch.zeros(1, 24)).sum().backward()  # Adam's state exists, to be filled
        optim.step()
        optim.zero_grad()
        state = fsdp_state(model, optim)
        # DCP fills the keys the target has: the values' shape, not theirs
        state["step"], state["values"] = 0, {"epoch": 0, "best": {"loss": 0.0, "tags": []}}
        return model, optim, state

    def check(
        model: nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any], where: str
    ) -> None:
        set_state_dict(
            model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        same(full(fsdp_state(model, optim)), expected, where)
        assert state["step"] == 3 and state["values"] == VALUES, (
            where,
            state["step"],
            state["values"],
        )
        got = [
            {k: v for k, v in g.items() if k != "params"} for g in state["optim"]["param_groups"]
        ]
        assert json.loads(json.dumps(got)) == groups, (where, got, groups)

    # Written by dcp.save through distckpt, read by distckpt.load on another world size.
    model, optim, state = fresh()
    distckpt.load(state, directory / "fsdp")
    check(model, optim, state, "distckpt.load of dcp.save")
    # Written by distckpt.save, read by dcp.load through distckpt.
    for where in [directory / "native", *([f"{url}/fsdp"] if url else [])]:
        model, optim, state = fresh()
        dcp.load(state, storage_reader=DistckptReader(where))
        check(model, optim, state, f"dcp.load of {where}")
    # DCP's load planner without flattening, a flat state.
    target = {"w": torch.zeros(7, 5), "h": torch.zeros(9, dtype=torch.bfloat16)}
    planner = DefaultLoadPlanner(flatten_state_dict=False, allow_partial_load=True)
    dcp.load(target, storage_reader=DistckptReader(directory / "plain"), planner=planner)
    want = plain_state(1)
    same(target, {"w": want["w"], "h": want["h"]}, "plain, unflattened planner")
    nested: dict[str, Any] = {"nested": {"ids": torch.zeros(4, dtype=torch.int64), "note": ""}}
    dcp.load(
        nested,
        storage_reader=DistckptReader(directory / "plain"),
        planner=DefaultLoadPlanner(allow_partial_load=True),
    )
    assert (
        torch.equal(nested["nested"]["ids"], want["nested"]["ids"])
        and nested["nested"]["note"] == "kept"
    )
    # An object DCP pickled: refused unless the reader allows pickle.
    objects: dict[str, Any] = {"w": torch.zeros(3), "when": None}
    try:
        dcp.load(objects, storage_reader=DistckptReader(directory / "objects"))
    except BaseException as exc:  # DCP raises a CheckpointException (a BaseException)
        failures = getattr(exc, "failures", {0: exc})
        assert all("allow_pickle=True" in str(e) for e in failures.values()), failures
    else:
        raise AssertionError("a pickled value was read without allow_pickle")
    dcp.load(objects, storage_reader=DistckptReader(directory / "objects", allow_pickle=True))
    assert objects["when"] == datetime.date(2026, 11, 25) and torch.equal(
        objects["w"], torch.ones(3)
    )


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    mode, directory = sys.argv[1], Path(sys.argv[2])
    url = sys.argv[3] if len(sys.argv) > 3 else None
    rank, world = start_job()
    mesh = init_device_mesh("cpu", (world,))
    if mode == "save":
        save(directory, url, mesh, rank)
    else:
        load(directory, url, mesh)
    finish_job(rank)


if __name__ == "__main__":
    main()
