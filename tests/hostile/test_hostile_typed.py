"""No stored byte names a callable: every typed value a checkpoint may hold, with hostile
class names and fields, through every loader, under an audit hook
(``tests/scripts/typed_walk.py``, one process per test).

Each loader -- DeepSpeed's engine, ``distckpt.load``, the DCP reader and ``dcp.load``,
Megatron's load strategy, ``inspect``, ``verify``, ``export`` and ``diff`` -- must end
with a result of plain data, tensors and the table's types only, or a CheckpointError;
and while it runs the process imports no module, starts no process, executes no code,
looks up no pickled global and opens no file outside the work directory.
DeepSpeed's engine refuses every tag outside its table, and every field a row does not
know, as a CorruptCheckpointError naming where the value lies (``deepspeed.env_report:
subprocess.Popen`` with ``fields`` ran a command before the table).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launch_util import SCRIPTS

SCRIPT = SCRIPTS / "typed_walk.py"
TIMEOUT = 240


def walk(tmp_path: Path, *flags: str) -> list[dict]:
    out = tmp_path / "records.json"
    work = tmp_path / "work"
    work.mkdir()
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(work), str(out), *flags],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"},
    )
    assert run.returncode == 0 and out.exists(), run.stderr[-4000:]
    assert not (work / "ran").exists()
    return json.loads(out.read_text())


def check(results: list[dict]) -> dict[tuple[str, str], str]:
    """Every violation, and the outcome of each (case, loader)."""
    pristine = results[0]
    assert pristine["case"] == "pristine"
    assert all(r["outcome"] == "ok" for r in pristine["records"]), pristine
    broken = [
        (c["case"], r["loader"], r["violations"])
        for c in results
        for r in c["records"]
        if r["violations"]
    ]
    assert not broken, json.dumps(broken, indent=1)[:20000]
    return {(c["case"], r["loader"]): r["outcome"] for c in results[1:] for r in c["records"]}


@pytest.mark.timeout(TIMEOUT + 30)
def test_stored_values_build_nothing_in_any_loader(tmp_path):
    outcomes = check(walk(tmp_path))
    assert outcomes[("pickled value", "distckpt.load")].startswith("UnsupportedValueError")
    assert outcomes[("pickled value", "inspect")] == "ok"  # shown as <pickled object>
    assert outcomes[("pickled object", "megatron")].startswith("UnsupportedValueError")
    assert "weights_only=True" in outcomes[("pickled object", "megatron")]
    assert outcomes[("compressed archive", "megatron")].startswith("CorruptCheckpointError")


@pytest.mark.timeout(TIMEOUT + 30)
def test_deepspeed_typed_values_are_a_closed_table(tmp_path):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed (.ci/run installs it)")
    outcomes = check(walk(tmp_path, "--deepspeed"))
    engine = {case: out for (case, loader), out in outcomes.items() if loader == "deepspeed"}
    assert len(engine) > 80
    for case, outcome in engine.items():
        if case == "tag not a string":  # a plain dict that holds the key: data, as saved
            assert outcome == "ok"
            continue
        assert outcome.startswith("CorruptCheckpointError: model.pt/"), (case, outcome)
    assert (
        "is not a type distckpt rebuilds" in engine["deepspeed.env_report:subprocess.Popen fields"]
    )


def test_a_malformed_stored_rng_state_is_corrupt():
    """RNGState hands stored values to the generators' own setters: what they refuse is a
    CorruptCheckpointError naming RNGState, not whatever the setter raised."""
    import torch

    import distckpt
    from distckpt.training import RNGState

    for bad in (
        {"numpy": [1, 2]},
        {"numpy": ["MT19937", [1] * 10, 0, 0, 0.0]},
        {"python": [3, [1] * 5, None]},
        {"python": "abc"},
        {"torch": torch.zeros(3)},
        {"torch": 5},
    ):
        with pytest.raises(distckpt.CorruptCheckpointError, match="RNGState"):
            RNGState().load_state_dict(bad)


class Note:
    """An object outside torch's allowlist, as a ShardedObject may hold."""

    def __init__(self, text: str) -> None:
        self.text = text


def test_a_sharded_object_outside_the_allowlist_loads_only_with_allow_pickle(tmp_path):
    """Megatron's ShardedObjects are read with torch.load(weights_only=True): plain data
    loads, an object of another class is refused naming the object, and loads with
    allow_pickle=True (the user's explicit choice)."""
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    import distckpt
    from distckpt.comm import SingleComm
    from distckpt.integrations.megatron import DistckptLoadStrategy, DistckptSaveStrategy

    def objects(data=None):
        return {"o": ShardedObject("o", data, (1,), (0,), replica_id=0)}

    for name, data in (("plain", {"tp": 2, "rng": torch.arange(3)}), ("note", Note("hi"))):
        (tmp_path / name).mkdir()
        DistckptSaveStrategy(comm=SingleComm()).save(objects(data), tmp_path / name)
    loaded = DistckptLoadStrategy(comm=SingleComm()).load(objects(), tmp_path / "plain")
    assert loaded["o"]["tp"] == 2 and torch.equal(loaded["o"]["rng"], torch.arange(3))
    with pytest.raises(distckpt.UnsupportedValueError, match="'o/shard_0_1'.*allow_pickle"):
        DistckptLoadStrategy(comm=SingleComm()).load(objects(), tmp_path / "note")
    strategy = DistckptLoadStrategy(comm=SingleComm(), allow_pickle=True)
    assert strategy.load(objects(), tmp_path / "note")["o"].text == "hi"
    options = distckpt.CheckpointOptions(allow_pickle=True)
    strategy = DistckptLoadStrategy(comm=SingleComm(), options=options)
    assert strategy.load(objects(), tmp_path / "note")["o"].text == "hi"
