"""distckpt.integrations.deepspeed: DeepSpeed's own save_checkpoint / load_checkpoint on
CPU processes (gloo, DeepSpeed's CPU accelerator), through distckpt's checkpoint engine.

A small model trains 3 steps on 2 torchrun ranks and is saved (tag ``t``) through
distckpt's engine and DeepSpeed's own (torch.save) engine: every file read back through
distckpt equals DeepSpeed's own, bit for bit. The checkpoint is then loaded by a fresh
job (other initial weights):

* on 2 ranks: model and optimizer bit for bit, and 2 more steps end where the saving
  job's 2 more steps ended;
* on 3 (and 1) ranks: the model bit for bit; the optimizer too with ZeRO stage 0 (it is
  in the model states file); with ZeRO stages 1 and 2 DeepSpeed refuses optimizer states
  saved on another data-parallel size (checked), and loads the model without them.

With ZeRO stage 3 the checkpoint loads on 2 ranks; a load without the optimizer states
(``load_optimizer_states=False``, on 2 ranks and on 3) is a ``distckpt.ConversionError``
naming DeepSpeed's ``zero_to_fp32`` and what to do instead: DeepSpeed would read the
files itself with ``torch.load``, not through the checkpoint engine (before, a bare
``IsADirectoryError``).
"""

from __future__ import annotations

import re

import pytest

from tests.support.launch_util import SCRIPTS, assert_all_ok, run_ranks

pytest.importorskip("deepspeed")

SCRIPT = SCRIPTS / "deepspeed_job.py"
TIMEOUT = 180  # seconds, per launch (DeepSpeed's first start on a machine builds an op)
ENV = {"DS_ACCELERATOR": "cpu"}


def launch(nprocs: int, *args: str) -> str:
    done = run_ranks(nprocs, SCRIPT, *args, timeout=TIMEOUT, env=ENV)
    assert_all_ok(done, nprocs)
    return done.stdout


#: The ZeRO stages and the other numbers of processes each is loaded on besides 2.
OTHERS = {1: (), 2: (3,), 0: (3, 1), 3: (3,)}


def stages(nprocs: int) -> str:
    return ",".join(str(s) for s, others in OTHERS.items() if nprocs in (2, *others))


@pytest.mark.timeout(4 * TIMEOUT + 30)
def test_deepspeed_saves_on_2_and_loads_on_2_and_others(tmp_path):
    """Each launch runs every stage it has a part in, one engine after another."""
    launch(2, "save", str(tmp_path), stages(2))
    for nprocs in (2, 3, 1):
        out = launch(nprocs, "resume", str(tmp_path), stages(nprocs))
        restored = set(re.findall(r"^RESTORED (\d) (\d)$", out, re.M))
        want = {(s, str(r)) for s in stages(nprocs).split(",") for r in range(nprocs)}
        assert restored == want, out


@pytest.mark.timeout(TIMEOUT + 30)
def test_ranks_saving_to_different_tags_are_refused_and_nothing_is_committed(tmp_path):
    """DeepSpeed lets each rank name its own tag (its tag check only warns by default) and
    its torch.save engine writes each rank's files there. One distckpt checkpoint per save
    cannot: every rank gets a ValidationError naming the places, nothing is committed or
    left staged (before, each rank wrote its arrays under its own tag, and the coordinator
    committed its tag without them), and a save with one tag loads back bit for bit."""
    launch(2, "tags", str(tmp_path), "1")


def test_deepspeed_objects_are_typed_values_not_pickles():
    """What DeepSpeed puts in its dicts besides tensors and plain values is stored as
    typed values of a closed table and rebuilt from it, each with its own type."""
    import torch
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from distckpt.integrations.deepspeed.types import decode, encode
    from distckpt.values import encode as encode_value

    tree = {
        "shapes": [{"w": torch.Size([8, 4])}],
        "stage": ZeroStageEnum.gradients,
        "mapping": {"w": fragment_address(numel=30, start=2)},
        "scaler": LossScaler(4.0),
        "dynamic": DynamicLossScaler(
            init_scale=2.0**8,
            scale_window=10,
            min_scale=1,
            delayed_shift=2,
            consecutive_hysteresis=False,
        ),
        "betas": (0.9, 0.999),
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
    }
    stored = encode(tree)
    encode_value(stored)  # plain typed values: distckpt stores them without pickling
    back = decode(stored)
    assert back["shapes"][0]["w"] == torch.Size([8, 4])
    assert isinstance(back["shapes"][0]["w"], torch.Size)
    assert back["stage"] is ZeroStageEnum.gradients
    assert back["mapping"]["w"] == fragment_address(numel=30, start=2)
    assert type(back["scaler"]) is LossScaler and vars(back["scaler"]) == vars(tree["scaler"])
    assert type(back["dynamic"]) is DynamicLossScaler
    assert vars(back["dynamic"]) == vars(tree["dynamic"])
    assert back["betas"] == (0.9, 0.999)
    assert back["dtype"] is torch.bfloat16
    assert back["device"] == torch.device("cpu")


def test_a_loss_scaler_with_an_unknown_attribute_is_refused_when_saved():
    """A save stores only what a load rebuilds: an attribute outside the table's row is
    refused at save time (stored pickled only with allow_pickle)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    import distckpt
    from distckpt.integrations.deepspeed.types import TYPE_TAG, encode

    scaler = LossScaler(2.0)
    scaler.hook = print
    with pytest.raises(distckpt.UnsupportedValueError, match="'hook'"):
        encode({"loss_scaler": scaler}, "optim.pt")
    with pytest.raises(distckpt.UnsupportedValueError, match="reserved"):
        encode({"client": {TYPE_TAG: "mine"}}, "model.pt")


def test_a_stored_typed_value_outside_the_table_is_corrupt_and_builds_nothing():
    """Typed values as storage may hold them: every tag outside the table, every field a
    row does not know and every value of the wrong type is a CorruptCheckpointError naming
    where it lies; nothing is looked up by a stored name (the full walk through every
    loader, with an audit hook, is tests/hostile/test_hostile_typed.py)."""
    import distckpt
    from distckpt.integrations.deepspeed.types import TYPE_TAG, decode

    scaler = "deepspeed.runtime.fp16.loss_scaler:LossScaler"
    for bad, message in (
        ({TYPE_TAG: "os:system", "attributes": {}}, "'os:system' is not a type"),
        ({TYPE_TAG: "subprocess:Popen", "fields": {"args": "id"}}, "is not a type"),
        ({TYPE_TAG: "deepspeed.runtime.engine:subprocess.Popen", "attributes": {}}, "not a"),
        ({TYPE_TAG: "torch.nn:Linear", "fields": {"in_features": 2}}, "not a type"),
        ({TYPE_TAG: "torch.device", "value": "no-such-device"}, "not a torch device"),
        ({TYPE_TAG: "torch.dtype", "value": "_dynamo"}, "not a torch dtype"),
        ({TYPE_TAG: "torch.Size", "value": ["x"]}, "is not an integer"),
        ({TYPE_TAG: "torch.Size", "value": [1] * 65}, "a torch.Size"),
        ({TYPE_TAG: scaler}, "stored with"),
        ({TYPE_TAG: scaler, "attributes": {"cur_scale": 1.0}}, "lacks its field 'dynamic'"),
        (
            {TYPE_TAG: scaler, "attributes": {"cur_scale": 1.0, "dynamic": False, "x": 1}},
            "has no field 'x'",
        ),
        ({TYPE_TAG: scaler, "attributes": {"cur_scale": "1", "dynamic": False}}, "not a number"),
        ({TYPE_TAG: "deepspeed.runtime.fp16.loss_scaler:NoSuchClass", "attributes": {}}, "not"),
        ({TYPE_TAG: "deepspeed.runtime.zero.config:ZeroStageEnum", "enum": 99}, "no ZeroStage"),
        ({TYPE_TAG: "deepspeed.runtime.zero.config:ZeroStageEnum", "enum": True}, "no ZeroStage"),
        (
            {TYPE_TAG: "deepspeed.utils.tensor_fragment:fragment_address", "fields": {"x": 1}},
            "has no field 'x'",
        ),
        (
            {
                TYPE_TAG: "deepspeed.utils.tensor_fragment:fragment_address",
                "fields": {"numel": -1, "start": 0},
            },
            "is negative",
        ),
    ):
        with pytest.raises(distckpt.CorruptCheckpointError, match=message) as caught:
            decode({"nested": [bad]}, "optim.pt")
        assert str(caught.value).startswith("optim.pt/nested/0")


def test_a_saved_tag_is_replaced_only_when_asked(tmp_path):
    """One process, the engine alone: a second save of a tag is refused; ``overwrite=True``
    or options with ``overwrite=True`` replace it, and the new values are read back, also
    by an engine that loaded the tag before (it parses a tag's index once, not forever)."""
    import torch
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    import distckpt
    from distckpt.integrations.deepspeed import DistckptCheckpointEngine

    info = CheckpointCommitInfo(tag="t", save_dir=str(tmp_path), save_latest=False)
    path = str(tmp_path / "t" / "mp_rank_00_model_states.pt")

    def save(engine: DistckptCheckpointEngine, value: float) -> None:
        engine.create(info)
        engine.makedirs(str(tmp_path / "t"), exist_ok=True)
        engine.save({"module": {"w": torch.full((3,), value)}}, path)
        engine.commit(info)

    reader = DistckptCheckpointEngine()
    save(DistckptCheckpointEngine(), 1.0)
    assert torch.equal(reader.load(path)["module"]["w"], torch.full((3,), 1.0))
    with pytest.raises(distckpt.CheckpointExists):
        save(DistckptCheckpointEngine(), 2.0)
    save(DistckptCheckpointEngine(overwrite=True), 3.0)
    assert torch.equal(reader.load(path)["module"]["w"], torch.full((3,), 3.0))
    save(DistckptCheckpointEngine(options=distckpt.CheckpointOptions(overwrite=True)), 4.0)
    assert torch.equal(reader.load(path)["module"]["w"], torch.full((3,), 4.0))
    with pytest.raises(distckpt.CheckpointExists):  # the keyword wins over the options
        save(
            DistckptCheckpointEngine(
                options=distckpt.CheckpointOptions(overwrite=True), overwrite=False
            ),
            5.0,
        )


def test_a_save_hashes_nothing_for_a_later_save_and_reads_back_bit_for_bit(tmp_path):
    """The engine never builds a save on an earlier one, so its saves compute no content
    digests (the index names no digest algorithm), even with options asking for
    ``incremental``; the values, a tensor of several inner chunks among them, come back
    bit for bit."""
    import json

    import torch
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    import distckpt
    from distckpt.integrations.deepspeed import DistckptCheckpointEngine

    info = CheckpointCommitInfo(tag="t", save_dir=str(tmp_path), save_latest=False)
    path = str(tmp_path / "t" / "mp_rank_00_model_states.pt")
    g = torch.Generator().manual_seed(7)
    state = {
        "module": {"w": torch.randn(1000, 700, generator=g), "b": torch.randn(5, generator=g)},
        "step": 3,
    }
    options = distckpt.CheckpointOptions(incremental=True, inner_bytes=1 << 16)
    engine = DistckptCheckpointEngine(options=options)
    engine.create(info)
    engine.save(state, path)
    engine.commit(info)
    index = json.loads((tmp_path / "t" / "zarr.json").read_text())
    assert "digests" not in json.dumps(index)
    back = DistckptCheckpointEngine().load(path)
    assert back["step"] == 3
    for name, want in state["module"].items():
        got = back["module"][name]
        assert got.dtype == want.dtype and torch.equal(
            got.view(torch.int32), want.view(torch.int32)
        )


def test_a_file_declaring_more_than_memory_is_refused_before_allocating(tmp_path):
    """A checkpoint whose index (checksums recomputed) declares a tensor larger than this
    machine's memory: ``load`` refuses the file before allocating anything, naming it."""
    import torch
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    import distckpt
    from distckpt.integrations.deepspeed import DistckptCheckpointEngine
    from distckpt.testing.hostile import Crafted

    info = CheckpointCommitInfo(tag="t", save_dir=str(tmp_path), save_latest=False)
    path = str(tmp_path / "t" / "mp_rank_00_model_states.pt")
    engine = DistckptCheckpointEngine()
    engine.create(info)
    engine.save({"module": {"w": torch.ones(4)}}, path)
    engine.commit(info)
    assert torch.equal(engine.load(path)["module"]["w"], torch.ones(4))

    def grow(variables):
        entry = variables["mp_rank_00_model_states.pt/module/w"]
        entry["shape"] = [1 << 50]
        for piece in entry["pieces"]:
            piece.update(block=[1 << 50], size=(4 << 50) + 4)
            piece["box"][1] = [1 << 50]

    Crafted(tmp_path / "t").edit_index(grow)
    with pytest.raises(distckpt.CheckpointError, match="more than the .* allowed"):
        engine.load(path)
