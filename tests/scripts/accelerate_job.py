"""A tiny Accelerate training loop through DistckptAccelerator, for
tests/integrations/test_integration_accelerate.py.

``save DIR``: (torchrun, 2 processes on gloo) 5 steps of a prepared model, AdamW, StepLR
and a shuffled dataloader (SeedableRandomSampler); ``save_state`` with automatic naming
after steps 2, 4 and 5 (``total_limit=2``). Each process keeps, with torch.save, its
reference at the last save: model, optimizer, scheduler, RNG, sampler, progress.

``resume DIR``: (1 process, or torchrun) ``load_state()`` of the newest checkpoint; the
model, optimizer and scheduler equal the reference bit for bit, each process's RNG is
that of saved process ``rank % 2``, the progress (a custom object) and the sampler's
epoch are restored, and skipping the batches already taken gives the next batch of the
saved order. Prints ``OK <rank>``.
"""

from __future__ import annotations

import fractions
import random
import sys
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from rank import assert_same, say
from torch.utils.data import DataLoader, TensorDataset

import distckpt
from distckpt.integrations.accelerate import DistckptAccelerator

mode, root = sys.argv[1], Path(sys.argv[2])
REFS = root / "refs"


class Progress:
    """Where the loop is: registered for checkpointing (typed values, no pickle)."""

    def __init__(self) -> None:
        self.epoch, self.batch, self.samples = 0, 0, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch, "samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batch, self.samples = state["epoch"], state["batch"], state["samples"]


def rng() -> dict:
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": torch.from_numpy(np.random.get_state()[1].copy()),
    }


def main() -> None:
    torch.manual_seed(0)
    accelerator = DistckptAccelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=str(root), automatic_checkpoint_naming=True, total_limit=2
        ),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    rank, world = accelerator.process_index, accelerator.num_processes
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 4, generator=gen), torch.randn(48, 2, generator=gen))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    loader = DataLoader(data, batch_size=2, shuffle=True)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if mode == "save":
        torch.manual_seed(10 + rank)  # each process its own streams: restored per process
        random.seed(rank)
        np.random.seed(rank)
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x + torch.randn_like(x) * 0.01), y)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            progress.batch += 1
            progress.samples += len(x) * world
            if progress.batch in (2, 4, 6):
                accelerator.save_state()
            if progress.batch == 6:
                break
        REFS.mkdir(exist_ok=True)
        reference = {
            "model": accelerator.unwrap_model(model).state_dict(),
            "optimizer": opt.optimizer.state_dict(),
            "scheduler": sched.scheduler.state_dict(),
            "rng": rng(),
            "progress": progress.state_dict(),
            "seed": loader.get_sampler().initial_seed,
        }
        torch.save(reference, REFS / f"rank{rank}.pt")
        kept = sorted(p.name for p in (root / "checkpoints").iterdir())
        assert kept == ["checkpoint_1", "checkpoint_2"], kept
        # A state distckpt cannot store without pickle fails the save on every process,
        # and loses nothing: no checkpoint, none removed, the next name unchanged.
        bad = Progress()
        bad.epoch = fractions.Fraction(1, 3)  # type: ignore[assignment]
        accelerator.register_for_checkpointing(bad)
        try:
            accelerator.save_state()
            raise AssertionError("saved a Fraction without allow_pickle")
        except distckpt.UnsupportedValueError as exc:
            assert "custom" in str(exc) and "allow_pickle" in str(exc), exc
        accelerator._custom_objects.remove(bad)
        # A state that differs by process is refused on every process, the message
        # showing the values as the object returned them and where they differ.
        mine = Progress()
        mine.samples = 100 + rank
        accelerator.register_for_checkpointing(mine)
        try:
            accelerator.save_state()
            raise AssertionError("saved a custom state that differs by process")
        except distckpt.ValidationError as exc:
            message = str(exc)
            assert "{'map'" not in message, message
            assert "'custom': the value differs between rank 0 ({'0': {'epoch': 0," in message
            assert "first at ['1']['samples']: 100 on rank 0, 101 on rank 1" in message, message
            assert "distckpt.PerRank" in message, message
        accelerator._custom_objects.remove(mine)
        accelerator.wait_for_everyone()
        kept = sorted(p.name for p in (root / "checkpoints").iterdir())
        assert kept == ["checkpoint_1", "checkpoint_2"], kept
        assert accelerator.save_iteration == 3
        # A checkpoint is never overwritten: the same error on every process.
        accelerator.project_configuration.iteration = 2
        try:
            accelerator.save_state()
            raise AssertionError("overwrote checkpoint_2")
        except distckpt.CheckpointExists:
            pass
        accelerator.project_configuration.iteration = 3
    else:
        accelerator.load_state()
        ref = torch.load(REFS / f"rank{rank % 2}.pt", weights_only=False)
        assert_same(accelerator.unwrap_model(model).state_dict(), ref["model"], "model")
        assert_same(opt.optimizer.state_dict(), ref["optimizer"], "optimizer")
        assert_same(sched.scheduler.state_dict(), ref["scheduler"], "scheduler")
        assert_same(rng(), ref["rng"], "rng")
        assert progress.state_dict() == ref["progress"] == {"epoch": 0, "batch": 6, "samples": 24}
        sampler = loader.get_sampler()
        assert (sampler.initial_seed, sampler.epoch) == (ref["seed"], 0)
        assert accelerator.save_iteration == 3
        # The data position: skipping the samples taken (by 2 processes) leaves this
        # process the next batch of the epoch's order, dealt round-robin by process.
        order = torch.randperm(48, generator=torch.Generator().manual_seed(ref["seed"]))
        taken = accelerator.skip_first_batches(loader, progress.samples // (2 * world))
        x, _ = next(iter(taken))
        start = progress.samples + 2 * rank
        assert torch.equal(x, data.tensors[0][order[start : start + 2]]), "data position"
        say(f"RESTORED {rank}")
    sys.stdout.write(f"OK {rank}\n")
    sys.stdout.flush()
    accelerator.end_training()


main()
