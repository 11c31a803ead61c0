"""distckpt.Checkpoint: the behaviours of TensorFlow's training-checkpoint guide.

One process (``SingleComm``) for the object-graph behaviour: partial and delayed
restore, restore statuses, optimizer state by parameter name, tied weights, wrapper
prefixes, RNG and data positions, the ``latest`` pointer. One multi-rank test: an FSDP2
model and its Adam state saved on 4 ranks and restored on 2 (torchrun, gloo, CPU). And
``examples/seed_toy.py``, the guide's walk-through, run as a script: its second run (new
objects, a new manager on the same directory) ends bit for bit where one run would.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from torch import nn

import distckpt
from distckpt.comm import SingleComm
from distckpt.errors import (
    CheckpointNotFoundError,
    ShapeMismatchError,
    UnsupportedValueError,
)
from distckpt.training import (
    Checkpoint,
    InitializationOnlyStatus,
    ObjectGraphError,
    RNGState,
    SampleCursor,
    UnmatchedError,
    latest_checkpoint,
)
from distckpt.training.lock import LOCK_FILE
from tests.support.launch_util import REPO_ROOT, SCRIPTS, check, output, run_ranks, run_single

pytestmark = pytest.mark.timeout(120)
COMM = SingleComm()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(1, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l1(x)


def _toy_run(tmp_path: Path) -> tuple[str, Net, torch.optim.Optimizer]:
    """The guide's setup after three training steps, saved once."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    cursor = SampleCursor(size=10, batch_size=2)
    inputs = torch.arange(10.0)[:, None]
    labels = inputs * 5 + torch.arange(5.0)
    for _ in range(3):
        idx = next(cursor)
        opt.zero_grad()
        (net(inputs[idx]) - labels[idx]).abs().mean().backward()
        opt.step()
    ckpt = Checkpoint(step=torch.tensor(4), optimizer=opt, net=net, iterator=cursor)
    return ckpt.save(tmp_path / "ckpt", COMM), net, opt


def _listed(message: str, title: str) -> list[str]:
    """The names an UnmatchedError lists under ``title``."""
    found = re.search(re.escape(title) + r" \(\d+\): ([^;]*)", message)
    assert found is not None, message
    return found.group(1).split(", ")


def _variables(path: str) -> set[str]:
    return {v.name for v in distckpt.list_variables(path)}


# ---------------------------------------------------------------- the guide's behaviours


def test_partial_restore_fills_just_the_bias(tmp_path: Path) -> None:
    path, net, _ = _toy_run(tmp_path)
    bias = torch.zeros(5)
    fake_layer = Checkpoint(bias=bias)
    root = Checkpoint(net=Checkpoint(l1=fake_layer))
    status = root.restore(path, COMM)
    assert torch.equal(bias, net.l1.bias.detach())  # filled in place, bit for bit
    status.assert_existing_objects_matched()
    status.assert_nontrivial_match()
    with pytest.raises(UnmatchedError) as info:
        status.assert_consumed()
    unused = _listed(str(info.value), "not matched to any object")
    assert "net/l1/weight" in unused and "step" in unused and "net/l1/bias" not in unused
    assert "optimizer/state/net/l1/weight/exp_avg" in unused and "iterator/position" in unused

    # Delayed restore: the kernel arrives later and is filled as it is assigned.
    fake_layer.weight = torch.zeros(5, 1)
    assert torch.equal(fake_layer.weight, net.l1.weight.detach())
    with pytest.raises(UnmatchedError) as info:
        status.assert_consumed()
    assert "net/l1/weight" not in _listed(str(info.value), "not matched to any object")
    status.expect_partial()


def test_assert_existing_objects_matched_fails_for_new_objects(tmp_path: Path) -> None:
    path, _, _ = _toy_run(tmp_path)
    root = Checkpoint(net=Net(), extra=torch.zeros(2))
    status = root.restore(path, COMM).expect_partial()
    with pytest.raises(UnmatchedError, match="objects that received no value \\(1\\): extra"):
        status.assert_existing_objects_matched()
    root.later = 3
    with pytest.raises(UnmatchedError, match="extra, later"):
        status.assert_existing_objects_matched()


def test_full_restore_consumes_everything(tmp_path: Path) -> None:
    path, net, opt = _toy_run(tmp_path)
    torch.manual_seed(1)
    net2 = Net()
    opt2 = torch.optim.Adam(net2.parameters(), lr=0.5)
    cursor2 = SampleCursor(size=10, batch_size=2)
    ckpt = Checkpoint(step=torch.tensor(1), optimizer=opt2, net=net2, iterator=cursor2)
    ckpt.restore(path, COMM).assert_consumed().assert_existing_objects_matched()
    assert int(ckpt.step) == 4 and cursor2.position == 6 and ckpt.save_counter == 1
    assert opt2.param_groups[0]["lr"] == 0.1
    for p, q in zip(net.parameters(), net2.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(net.parameters(), net2.parameters()):
        for slot in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][slot], opt2.state[q][slot])


def test_restore_none_is_initialization_only() -> None:
    status = Checkpoint(net=Net()).restore(None)
    assert isinstance(status, InitializationOnlyStatus)
    with pytest.raises(UnmatchedError, match="nothing was restored"):
        status.assert_consumed()
    with pytest.raises(AssertionError):  # as TensorFlow's
        status.assert_existing_objects_matched()
    assert status.expect_partial() is status


def test_unmatched_values_warn_unless_expect_partial(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, _, _ = _toy_run(tmp_path)
    caplog.set_level(logging.WARNING, logger="distckpt")
    root = Checkpoint(net=Checkpoint(l1=Checkpoint(bias=torch.zeros(5))))
    root.restore(path, COMM)
    root.write(tmp_path / "partial", COMM)  # the next save reports what was left behind
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "net/l1/weight" in warnings[0] and "expect_partial" in warnings[0]

    caplog.clear()
    root2 = Checkpoint(net=Checkpoint(l1=Checkpoint(bias=torch.zeros(5))))
    root2.restore(path, COMM).expect_partial()
    root2.write(tmp_path / "partial2", COMM)
    del root2
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_delayed_restore_of_lists_and_dicts(tmp_path: Path) -> None:
    a, b, c = torch.randn(3), torch.randn(2, 2), torch.randn(4)
    saved = Checkpoint(listed=[a, b], mapped={"one": c, "two": 2.5})
    path = saved.write(tmp_path / "c", COMM)
    assert _variables(path) >= {"listed/0", "listed/1", "mapped/one", "mapped/two"}

    restore = Checkpoint(listed=[], mapped={})
    status = restore.restore(path, COMM)
    with pytest.raises(UnmatchedError, match="listed/0, listed/1, mapped/one, mapped/two"):
        status.assert_consumed()
    v1 = torch.zeros(3)
    restore.listed.append(v1)
    assert torch.equal(v1, a)
    restore.mapped["two"] = 0.0  # a Python value is replaced by the saved one
    assert restore.mapped["two"] == 2.5
    restore.mapped["two"] = 7.0  # ... once
    assert restore.mapped["two"] == 7.0
    restore.mapped.update(one=torch.zeros(4))
    assert torch.equal(restore.mapped["one"], c)
    with pytest.raises(UnmatchedError, match=r"\(1\): listed/1$"):
        status.assert_consumed()
    restore.listed.extend([torch.zeros(2, 2)])
    assert torch.equal(restore.listed[1], b)
    status.assert_consumed()


def test_delayed_restore_of_lazy_modules(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(2))
    x = torch.randn(3, 6)
    expected = model(x).detach()
    path = Checkpoint(model=model).write(tmp_path / "c", COMM)

    torch.manual_seed(1)
    fresh = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(2))
    status = Checkpoint(model=fresh).restore(path, COMM)
    status.assert_existing_objects_matched()  # lazy parameters do not exist yet
    with pytest.raises(UnmatchedError, match="waiting for a lazy module.*model/0/bias"):
        status.assert_consumed()
    out = fresh(x)  # the first call creates the parameters; the restore fills them first
    assert torch.equal(out, expected)
    status.assert_consumed()


def test_shape_mismatch_names_the_variable_and_both_shapes(tmp_path: Path) -> None:
    path, _, _ = _toy_run(tmp_path)
    wide = nn.Module()
    wide.l1 = nn.Linear(1, 7)
    with pytest.raises(ShapeMismatchError) as info:
        Checkpoint(net=wide).restore(path, COMM)
    message = str(info.value)
    assert "net/l1/" in message and "[7" in message and "[5" in message


# ---------------------------------------------------------------- optimizers


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int) -> None:
    for i in range(start, start + steps):
        gen = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 4, generator=gen), torch.randn(5, 3, generator=gen)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_optimizer_resumes_bit_identically_after_recreation(tmp_path: Path, kind: str) -> None:
    make = OPTIMIZERS[kind]
    model = _mlp(0)
    opt = make(list(model.parameters()))
    _train(model, opt, 10, 0)
    path = Checkpoint(model=model, optimizer=opt).save(tmp_path / "ckpt", COMM)
    _train(model, opt, 10, 10)
    params_a = [p.detach().clone() for p in model.parameters()]

    fresh = _mlp(123)  # other initial values
    # parameters in another order: integer ids would now point at the wrong tensors
    fresh_opt = make(list(reversed(list(fresh.parameters()))))
    assert not fresh_opt.state  # has never stepped: its state is created by the restore
    Checkpoint(model=fresh, optimizer=fresh_opt).restore(path, COMM).assert_consumed()
    _train(fresh, fresh_opt, 10, 10)
    for a, b in zip(params_a, fresh.parameters()):
        assert torch.equal(a, b)


def test_optimizer_slots_are_stored_by_parameter_name(tmp_path: Path) -> None:
    path, _, _ = _toy_run(tmp_path)
    names = _variables(path)
    for param in ("weight", "bias"):
        for slot in ("step", "exp_avg", "exp_avg_sq"):
            assert f"optimizer/state/net/l1/{param}/{slot}" in names
    index = json.loads((Path(path) / "zarr.json").read_text())["attributes"]["distckpt"]
    groups = index["variables"]["optimizer/param_groups"]["value"]
    assert groups[0]["map"]["params"] == ["net/l1/weight", "net/l1/bias"]


def test_optimizer_assigned_after_restore_is_filled(tmp_path: Path) -> None:
    path, net, opt = _toy_run(tmp_path)
    torch.manual_seed(3)
    net2 = Net()
    root = Checkpoint(net=net2)
    status = root.restore(path, COMM)
    root.optimizer = torch.optim.Adam(net2.parameters(), lr=1.0)  # delayed: state created
    for p, q in zip(net.parameters(), net2.parameters()):
        assert torch.equal(opt.state[p]["exp_avg_sq"], root.optimizer.state[q]["exp_avg_sq"])
    assert root.optimizer.param_groups[0]["lr"] == 0.1
    with pytest.raises(UnmatchedError, match=r"\(4\): iterator/batch_size, .*, step$"):
        status.assert_consumed()


def test_unnamed_optimizer_parameter_is_an_error(tmp_path: Path) -> None:
    stray = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([stray], lr=0.1)
    with pytest.raises(ObjectGraphError, match="no module or tensor in the Checkpoint names"):
        Checkpoint(optimizer=opt).write(tmp_path / "c", COMM)


def test_scheduler_and_grad_scaler_state(tmp_path: Path) -> None:
    model = _mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for _ in range(5):
        opt.step()
        sched.step()
    path = Checkpoint(model=model, optimizer=opt, sched=sched, scaler=scaler).write(
        tmp_path / "c", COMM
    )
    model2 = _mlp(0)
    opt2 = torch.optim.SGD(model2.parameters(), lr=1.0)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=1.0)
    ckpt = Checkpoint(model=model2, optimizer=opt2, sched=sched2, scaler=scaler2)
    ckpt.restore(path, COMM).assert_consumed()
    assert sched2.state_dict() == sched.state_dict()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.25
    assert scaler2.state_dict() == scaler.state_dict()


# ---------------------------------------------------------------- names


def test_tied_weights_are_saved_once_and_fill_both(tmp_path: Path) -> None:
    def tied() -> nn.Module:
        m = nn.Module()
        m.enc = nn.Embedding(6, 4)
        m.dec = nn.Linear(4, 6, bias=False)
        m.dec.weight = m.enc.weight
        return m

    torch.manual_seed(0)
    model = tied()
    path = Checkpoint(model=model).write(tmp_path / "c", COMM)
    assert "model/enc/weight" in _variables(path) and "model/dec/weight" not in _variables(path)

    torch.manual_seed(1)
    again = tied()
    Checkpoint(model=again).restore(path, COMM).assert_consumed()
    assert torch.equal(again.dec.weight, model.enc.weight)

    untied = nn.Module()  # the alias record fills a weight that is no longer tied
    untied.enc, untied.dec = nn.Embedding(6, 4), nn.Linear(4, 6, bias=False)
    Checkpoint(model=untied).restore(path, COMM).assert_consumed()
    assert torch.equal(untied.enc.weight, model.enc.weight)
    assert torch.equal(untied.dec.weight, model.enc.weight)


def test_compile_and_data_parallel_prefixes_do_not_change_names(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = Net()
    inner = Net()
    inner.l1 = torch.compile(inner.l1)  # a compiled submodule: l1._orig_mod.weight
    wrapped = [torch.compile(net), nn.DataParallel(net), inner]
    for i, model in enumerate(wrapped):
        path = Checkpoint(net=model).write(tmp_path / f"c{i}", COMM)
        assert _variables(path) == {"net/l1/weight", "net/l1/bias", "save_counter"}
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:  # DistributedDataParallel's "module." (a one-process group is enough to wrap)
        ddp = nn.parallel.DistributedDataParallel(net)
        path = Checkpoint(net=ddp).write(tmp_path / "ddp", COMM)
        assert _variables(path) == {"net/l1/weight", "net/l1/bias", "save_counter"}
    finally:
        dist.destroy_process_group()
    plain = Net()
    Checkpoint(net=plain).restore(tmp_path / "c0", COMM).assert_consumed()
    assert torch.equal(plain.l1.weight, net.l1.weight)
    target = nn.DataParallel(Net())
    Checkpoint(net=target).restore(tmp_path / "c0", COMM).assert_consumed()
    assert torch.equal(target.module.l1.bias, net.l1.bias)


# ---------------------------------------------------------------- RNG, data, values


def test_rng_state_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)
    path = Checkpoint(rng=RNGState()).write(tmp_path / "c", COMM)
    expected = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    Checkpoint(rng=RNGState()).restore(path, COMM).assert_consumed()
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])
    assert [random.random() for _ in range(3)] == expected[2]
    assert {v.dtype for v in distckpt.list_variables(path) if v.name.startswith("rng/")} == {
        "per_rank"
    }


def test_iterator_position_round_trip(tmp_path: Path) -> None:
    cursor = SampleCursor(size=10, batch_size=4)
    first = [next(cursor) for _ in range(3)]
    assert first == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    path = Checkpoint(iterator=cursor).write(tmp_path / "c", COMM)
    expected = [next(cursor) for _ in range(2)]
    fresh = SampleCursor(size=10, batch_size=4)
    Checkpoint(iterator=fresh).restore(path, COMM).assert_consumed()
    assert [next(fresh) for _ in range(2)] == expected
    share = SampleCursor(size=10, batch_size=4, rank=1, world_size=2)
    Checkpoint(iterator=share).restore(path, COMM)
    assert next(share) == [3, 5]  # rank 1 of 2 takes every other sample of the global batch


def test_python_values_and_later_attributes(tmp_path: Path) -> None:
    saved = Checkpoint(epoch=3, name="run-a", ratio=0.5, shape=(2, 3), nothing=None)
    saved.extra = torch.arange(4.0)
    path = saved.write(tmp_path / "c", COMM)
    restore = Checkpoint(epoch=0, name="", ratio=0.0, shape=(), nothing=1)
    status = restore.restore(path, COMM)
    assert (restore.epoch, restore.name, restore.ratio, restore.shape, restore.nothing) == (
        3,
        "run-a",
        0.5,
        (2, 3),
        None,
    )
    restore.extra = torch.zeros(4)  # assigned after the restore: filled in place
    assert torch.equal(restore.extra, torch.arange(4.0))
    status.assert_consumed()
    # a name is restored once: training code that reassigns keeps its new values
    restore.epoch = restore.epoch + 1
    restore.extra = restore.extra + 1
    assert restore.epoch == 4 and torch.equal(restore.extra, torch.arange(1.0, 5.0))


def test_unsupported_objects_are_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedValueError, match="'fn': cannot track a builtins.function"):
        Checkpoint(fn=lambda: 0)
    with pytest.raises(ObjectGraphError, match="'save' is a Checkpoint method"):
        Checkpoint(save=1)

    class Opaque:
        def state_dict(self) -> dict[str, object]:
            return {"obj": object()}

        def load_state_dict(self, state: dict[str, object]) -> None:
            pass

    with pytest.raises(UnsupportedValueError, match="'thing/obj'"):
        Checkpoint(thing=Opaque()).write(tmp_path / "c", COMM)
    assert not (tmp_path / "c").exists()


# ---------------------------------------------------------------- numbering and the pointer


def test_save_counter_numbering_and_latest_pointer(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert latest_checkpoint(run) is None
    ckpt = Checkpoint(w=torch.zeros(2))
    paths = [ckpt.save(run / "ckpt", COMM) for _ in range(3)]
    assert paths == [str(run / f"ckpt-{n}") for n in (1, 2, 3)]
    assert ckpt.save_counter == 3
    pointer = json.loads((run / "latest").read_text())
    assert list(pointer)[0] == "checksum" and pointer.pop("checksum").startswith("crc32c:")
    assert pointer == {
        "format": "distckpt-pointer",
        "version": 1,
        "latest": "ckpt-3",
        "all": ["ckpt-1", "ckpt-2", "ckpt-3"],
    }
    assert latest_checkpoint(run) == str(run / "ckpt-3") == distckpt.latest_checkpoint(run)

    ckpt.write(run / "side", COMM)  # write(): no numbering, no pointer
    assert ckpt.save_counter == 3 and latest_checkpoint(run) == str(run / "ckpt-3")

    fresh = Checkpoint(w=torch.ones(2))
    fresh.restore(latest_checkpoint(run), COMM).assert_consumed()
    assert fresh.save_counter == 3
    assert fresh.save(run / "ckpt", COMM) == str(run / "ckpt-4")
    assert json.loads((run / "latest").read_text())["all"][-2:] == ["ckpt-3", "ckpt-4"]

    shutil.rmtree(run / "ckpt-4")
    with pytest.raises(CheckpointNotFoundError, match="ckpt-4"):
        latest_checkpoint(run)


# ---------------------------------------------------------------- examples/seed_toy.py

SEED_TOY = REPO_ROOT / "examples" / "seed_toy.py"


def _seed_toy() -> ModuleType:
    spec = importlib.util.spec_from_file_location("seed_toy", SEED_TOY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_seed_toy_runs_the_guide_twice_in_one_process(tmp_path: Path) -> None:
    run = tmp_path / "tf_ckpts"
    proc = run_single(SEED_TOY, "--dir", str(run), timeout=120)
    check(proc)
    lines = proc.stdout.splitlines()
    restored_at = lines.index(f"Restored from {run / 'ckpt-5'}")
    first, second = lines[:restored_at], lines[restored_at + 1 :]
    assert first[0] == "Initializing from scratch.", output(proc)
    saved = re.compile(r"Saved checkpoint for step (\d+): (\S+)$")

    def saves(part: list[str]) -> list[tuple[int, str]]:
        return [(int(m[1]), m[2]) for line in part if (m := saved.match(line))]

    assert saves(first) == [(10 * k, str(run / f"ckpt-{k}")) for k in range(1, 6)], output(proc)
    assert saves(second) == [(10 * k, str(run / f"ckpt-{k}")) for k in range(6, 11)], output(proc)
    assert str([str(run / f"ckpt-{k}") for k in (8, 9, 10)]) in second, output(proc)
    on_disk = sorted(p.name for p in run.iterdir() if p.name.startswith("ckpt"))
    assert on_disk == ["ckpt-10", "ckpt-8", "ckpt-9"]
    assert not (run / LOCK_FILE).exists()  # released at exit

    # One uninterrupted run with the example's code: 99 updates take the step counter
    # from 1 to 100, where the interrupted run saved ckpt-10.
    toy = _seed_toy()
    torch.manual_seed(0)
    net = toy.Net()
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    iterator = SampleCursor(size=10, batch_size=2)
    ckpt = Checkpoint(step=torch.tensor(1), optimizer=opt, net=net, iterator=iterator)
    with distckpt.CheckpointManager(ckpt, tmp_path / "straight", max_to_keep=3, comm=COMM) as m:
        toy.train_and_checkpoint(net, m, steps=99)
    assert int(ckpt.step) == 100

    net2 = toy.Net()
    opt2 = torch.optim.Adam(net2.parameters(), lr=0.1)
    iterator2 = SampleCursor(size=10, batch_size=2)
    ckpt2 = Checkpoint(step=torch.tensor(1), optimizer=opt2, net=net2, iterator=iterator2)
    ckpt2.restore(run / "ckpt-10", COMM).assert_consumed()
    assert int(ckpt2.step) == 100 and iterator2.position == iterator.position
    for a, b in zip(net.parameters(), net2.parameters(), strict=True):
        assert torch.equal(a, b)
        for key, value in opt.state[a].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt2.state[b][key])), key


# ---------------------------------------------------------------- multi-rank


def test_fsdp2_saved_on_4_ranks_restores_on_2(tmp_path: Path) -> None:
    script = SCRIPTS / "training_fsdp.py"
    saved = run_ranks(4, script, "save", str(tmp_path), timeout=240)
    check(saved)
    assert saved.stdout.count("OK save") == 4, output(saved)
    restored = run_ranks(2, script, "restore", str(tmp_path), timeout=240)
    check(restored)
    assert restored.stdout.count("OK restore") == 2, output(restored)
    # RNG states are per rank: on 2 ranks, rank r takes what rank r % 4 saved, with a warning
    assert "saved on 4 ranks are restored on 2" in restored.stderr, output(restored)
