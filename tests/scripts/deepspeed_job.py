"""Ranks of tests/integrations/test_deepspeed.py: DeepSpeed on CPU processes (gloo).

Each mode takes STAGES, ZeRO stages separated by commas: one launch runs the mode for each
in turn, in ROOT/stage<N> (an engine per stage; a launch costs more than an engine).
``save ROOT STAGES``: train a small model 3 steps with ZeRO stage STAGE, save_checkpoint
through distckpt's engine (tag ``t``) and through DeepSpeed's own (torch.save) engine,
check that every file reads back through distckpt as DeepSpeed's own wrote it, then train
2 more steps; the states saved and after the 2 steps are written as references.
``resume ROOT STAGES``: a fresh model (other weights), load_checkpoint through distckpt's
engine, and check model and optimizer bit for bit against the references: on the saved
number of processes (also the 2 steps after), or on another one, the model always and the
optimizer where DeepSpeed allows it (stage 0: it is in the model states file; stages 1
and 2: DeepSpeed refuses it, checked, and the model loads without it; stage 3: refused
too, and a load without it is distckpt's ConversionError on any number of processes).
``tags ROOT STAGES``: each rank asks save_checkpoint for a tag of its own (DeepSpeed only
warns): every rank gets distckpt's ValidationError naming both places, and nothing is
committed or left staged; a save with one tag then loads back bit for bit.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import deepspeed
import torch
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

from distckpt import ConversionError, ValidationError
from distckpt.integrations.deepspeed import DistckptCheckpointEngine, use_distckpt

SAVED_WORLD = 2
TAG = "t"


def make(stage: int, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "steps_per_print": 1000,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def train(engine, steps: int, first: int) -> None:
    rank = torch.distributed.get_rank()
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(2, 4, generator=g)
        loss = engine(x).pow(2).sum()
        engine.backward(loss)
        engine.step()


def plain(obj):
    """A copy of ``obj`` with objects as their class and attributes, OrderedDicts as dicts."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain(v) for v in obj) if type(obj) in (list, tuple) else obj
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return (type(obj), plain(dict(vars(obj))))
    return obj


def assert_same(got, want, where: str = "") -> None:
    got, want = plain(got), plain(want)
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), (where, type(got))
        assert got.dtype == want.dtype and got.shape == want.shape, (where, got, want)
        assert torch.equal(got, want), (where, got, want)
        return
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (where, got, want)
        for k in want:
            assert_same(got[k], want[k], f"{where}/{k}")
        return
    if isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), (where, got, want)
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{where}/{i}")
        return
    assert type(got) is type(want) and got == want, (where, got, want)


def snapshot(engine) -> dict:
    return {
        "model": {k: v.clone() for k, v in engine.module.state_dict().items()},
        "optimizer": plain(engine.optimizer.state_dict()),
    }


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    for stage in (int(s) for s in sys.argv[3].split(",")):  # one engine after another
        run(mode, root / f"stage{stage}", stage)
    torch.distributed.barrier()
    os.write(1, f"OK {torch.distributed.get_rank()}\n".encode())  # one write: ranks share the pipe
    sys.stdout.flush()


def run(mode: str, root: Path, stage: int) -> None:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    refs = root / "refs"
    if mode == "save":
        if rank == 0:
            root.mkdir(exist_ok=True)
        torch.distributed.barrier()
        engine = make(stage, seed=0)
        train(engine, 3, first=0)
        own = engine.checkpoint_engine  # DeepSpeed's, of its config (torch.save's zip format)
        assert isinstance(own, TorchCheckpointEngine), type(own)
        engine.save_checkpoint(str(root / "torch"), tag=TAG)
        ours = use_distckpt(engine)
        assert isinstance(engine.checkpoint_engine, DistckptCheckpointEngine)
        engine.save_checkpoint(str(root / "ds"), tag=TAG)
        saved = snapshot(engine)
        names = sorted(p.name for p in (root / "torch" / TAG).glob("*.pt"))
        assert names == sorted(p.name for p in (root / "ds" / TAG).glob("*.pt")), names
        for name in names:  # every process reads every file back
            want = torch.load(root / "torch" / TAG / name, weights_only=False)
            assert_same(ours.load(str(root / "ds" / TAG / name)), want, name)
        train(engine, 2, first=3)
        after = snapshot(engine)
        if rank == 0:
            refs.mkdir(exist_ok=True)
        torch.distributed.barrier()
        torch.save({"saved": saved, "after": after}, refs / f"rank{rank}.pt")
    elif mode == "tags":
        if rank == 0:
            root.mkdir(exist_ok=True)
        torch.distributed.barrier()
        engine = make(stage, seed=0)
        train(engine, 2, first=0)
        use_distckpt(engine)
        try:  # DeepSpeed's torch.save engine writes each rank's files under its own tag
            engine.save_checkpoint(str(root / "ds"), tag=f"tag-{rank}")
        except ValidationError as exc:
            assert "same place" in str(exc), exc
            assert all(str(root / "ds" / f"tag-{r}") in str(exc) for r in range(world)), exc
        else:
            raise AssertionError("ranks saving to different tags were not refused")
        torch.distributed.barrier()
        scripts = ("zero_to_fp32.py", "zero_to_torch.py")  # DeepSpeed copies them first
        files = [p for p in root.rglob("*") if p.is_file() and p.name not in scripts]
        assert files == [], files  # no index, no array, no stub, no `latest`
        staged = [p for p in root.rglob("*") if "staging" in p.name]
        assert staged == [], staged
        saved = snapshot(engine)
        engine.save_checkpoint(str(root / "ds"), tag=TAG)
        fresh = make(stage, seed=1)
        use_distckpt(fresh)
        fresh.load_checkpoint(str(root / "ds"), tag=TAG)
        assert_same(fresh.module.state_dict(), saved["model"], "model")
        assert_same(snapshot(fresh)["optimizer"], saved["optimizer"], "optimizer")
    else:
        engine = make(stage, seed=1)
        use_distckpt(engine)
        ref = torch.load(refs / f"rank{rank % SAVED_WORLD}.pt", weights_only=False)
        same_world = world == SAVED_WORLD
        if stage == 3:  # zero_to_fp32 would torch.load the files: refused by distckpt first
            try:
                engine.load_checkpoint(str(root / "ds"), tag=TAG, load_optimizer_states=False)
            except ConversionError as exc:
                assert "zero_to_fp32" in str(exc) and "load_optimizer_states" in str(exc), exc
            else:
                raise AssertionError("a ZeRO 3 load without optimizer states was not refused")
        if same_world or stage == 0:
            engine.load_checkpoint(str(root / "ds"), tag=TAG)
            assert_same(engine.module.state_dict(), ref["saved"]["model"], "model")
            assert_same(snapshot(engine)["optimizer"], ref["saved"]["optimizer"], "optimizer")
            if same_world:
                train(engine, 2, first=3)
                assert_same(snapshot(engine), ref["after"], "after")
        elif stage != 3:  # stage 3 on another number: only the refusal above is checked
            try:
                engine.load_checkpoint(str(root / "ds"), tag=TAG)
            except Exception as exc:  # DeepSpeed's ZeRORuntimeException
                assert "world size" in str(exc), exc
            else:
                raise AssertionError("DeepSpeed loaded ZeRO optimizer states on another DP size")
            engine.load_checkpoint(
                str(root / "ds"),
                tag=TAG,
                load_optimizer_states=False,
                load_lr_scheduler_states=False,
            )
            assert_same(engine.module.state_dict(), ref["saved"]["model"], "model")
        sys.stdout.write(f"RESTORED {stage} {rank}\n")


main()
