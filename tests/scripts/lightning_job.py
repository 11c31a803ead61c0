"""Tiny Lightning fits through distckpt, for tests/integrations/test_integration_lightning.py.

One launch runs both: DDP with DistckptCheckpointIO in DIR/ddp, then (on more than one
rank) DistckptModelParallelStrategy in DIR/sharded.

``save DIR``: (2 ranks, torchrun, on gloo) 6 steps; ModelCheckpoint every 2 steps,
top 2 by step, and last.ckpt. Rank 0 also keeps, with torch.save, every dict it hands
to the plugin (DIR/refs/<name>.pt): the reference the restores are checked against.

``resume DIR``: (1 process, or torchrun) ``fit(ckpt_path="last")`` to step 10; right
after the restore the model, the optimizer, the scheduler, the loops' progress, the
step and the RNG state (kept by a callback) equal last.ckpt's reference bit for bit.
Every rank then loads each remaining checkpoint through the plugin and compares it
with its reference; the retention must have kept exactly the two newest by step.
Prints ``OK <rank>``.

Sharded, the fit runs under DistckptModelParallelStrategy (FSDP2: the model
``fully_shard``-ed over the data-parallel mesh), every rank writes its shards, and the
references hold the full tensors (gathered from the shards).
"""

from __future__ import annotations

import os
import random
import re
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from rank import assert_same, say

from distckpt.integrations.lightning import DistckptCheckpointIO, DistckptModelParallelStrategy

mode = sys.argv[1]
SHARDED = False  # which of the two fits runs now (see run)


def full(obj):  # type: ignore[no-untyped-def]
    """``obj`` with every DTensor gathered whole (collective: every rank, same order)."""
    if hasattr(obj, "full_tensor"):
        return obj.full_tensor()
    if isinstance(obj, dict):
        return {k: full(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(full(v) for v in obj)
    return obj


CKPTS = REFS = Path()  # the running fit's checkpoints and references (see run)


class RecordingIO(DistckptCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):  # type: ignore[no-untyped-def]
        super().save_checkpoint(checkpoint, path, storage_options)
        result = self.last_result
        if Path(path).name == "last.ckpt":  # the step's checkpoint again: all of it reused
            assert result is not None and result.bytes_written == 0 < result.bytes_reused, result
        REFS.mkdir(exist_ok=True)
        torch.save(checkpoint, REFS / (Path(path).name + ".pt"))


class RecordingStrategy(DistckptModelParallelStrategy):
    def save_checkpoint(self, checkpoint, filepath, storage_options=None):  # type: ignore[no-untyped-def]
        reference = full(checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options)
        result = self.last_result
        if Path(filepath).name == "last.ckpt":  # nothing written (the tiny tensors: by rank 0)
            assert result is not None and result.bytes_written == 0, result
            assert self.global_rank != 0 or result.bytes_reused > 0, result
        if self.global_rank == 0:
            REFS.mkdir(exist_ok=True)
            torch.save(reference, REFS / (Path(filepath).name + ".pt"))


class RNG(Callback):
    """The process's RNG state in the checkpoint (typed values: no pickle)."""

    restored: dict | None = None

    def state_dict(self):  # type: ignore[no-untyped-def]
        return {"torch": torch.get_rng_state(), "python": random.getstate()}

    def load_state_dict(self, state):  # type: ignore[no-untyped-def]
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        RNG.restored = {"torch": torch.get_rng_state(), "python": random.getstate()}


class Batches:
    """Batches of 4 per rank in a fixed order; resumable: its state is the global position
    (samples consumed by every rank), so another world size resumes where it stopped."""

    def __init__(self, rank: int, world: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 4, generator=gen), torch.randn(64, 2, generator=gen)
        self.rank, self.world, self.pos = rank, world, 0

    def __len__(self) -> int:
        return len(self.x) // (4 * self.world)

    def __iter__(self):  # type: ignore[no-untyped-def]
        if self.pos + 4 * self.world > len(self.x):  # the epoch is over
            self.pos = 0
        while self.pos + 4 * self.world <= len(self.x):
            start = self.pos + 4 * self.rank
            self.pos += 4 * self.world
            yield self.x[start : start + 4], self.y[start : start + 4], torch.tensor(start)

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.first: int | None = None  # the first sample of the first batch after a resume
        layers = [torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)]
        self.net = torch.nn.Sequential(*layers)

    def training_step(self, batch, i):  # type: ignore[no-untyped-def]
        x, y, start = batch
        if mode == "resume" and self.first is None:
            self.first = int(start)
        noise = torch.randn_like(x) * 0.01  # draws from the RNG the checkpoint carries
        return torch.nn.functional.mse_loss(self.net(x + noise), y)

    def configure_model(self) -> None:
        if SHARDED:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)}

    def on_train_start(self) -> None:
        if mode != "resume":
            return
        ref = torch.load(REFS / "last.ckpt.pt", weights_only=False)
        trainer = self.trainer
        assert_same(full(self.state_dict()), ref["state_dict"], "model")
        optimizer = trainer.optimizers[0]
        if SHARDED:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            optimizer = get_optimizer_state_dict(trainer.strategy.model, optimizer)
        else:
            optimizer = optimizer.state_dict()
        assert_same(full(optimizer), ref["optimizer_states"][0], "optimizer")
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        assert_same(scheduler.state_dict(), ref["lr_schedulers"][0], "scheduler")
        assert trainer.global_step == ref["global_step"] == 6, trainer.global_step
        assert_same(trainer.fit_loop.state_dict(), ref["loops"]["fit_loop"], "fit_loop")
        saved = [v for k, v in ref["callbacks"].items() if k == "RNG"][0]
        assert_same(RNG.restored, saved, "rng")
        kind = "sharded" if SHARDED else "ddp"
        say(f"RESTORED {kind} {trainer.global_rank}")


def fit() -> None:
    torch.manual_seed(0)
    random.seed(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    loader = Batches(int(os.environ.get("RANK", "0")), world)
    checkpoints = ModelCheckpoint(
        dirpath=CKPTS,
        every_n_train_steps=2,
        save_top_k=2,
        monitor="step",
        mode="max",
        save_last=True,
    )
    strategy: object = "ddp" if world > 1 else "auto"
    if SHARDED:
        strategy = RecordingStrategy(
            data_parallel_size=world, tensor_parallel_size=1, process_group_backend="gloo"
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=6 if mode == "save" else 10,
        callbacks=[checkpoints, RNG()],
        plugins=[RecordingIO()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = Tiny()
    trainer.fit(model, loader, ckpt_path="last" if mode == "resume" else None)
    rank = trainer.global_rank
    if mode == "resume":  # 2 ranks x 6 steps x 4 samples were consumed: this rank's next
        assert model.first == 48 + 4 * rank, model.first
    trainer.strategy.barrier()
    kept = sorted(p.name for p in CKPTS.iterdir())
    steps = sorted(int(m[1]) for name in kept if (m := re.search(r"step=(\d+)", name)))
    assert steps == ([4, 6] if mode == "save" else [8, 10]) and "last.ckpt" in kept, kept
    assert len(kept) == 3, kept
    io = DistckptCheckpointIO()
    for name in kept:
        reference = torch.load(REFS / f"{name}.pt", weights_only=False)
        assert_same(io.load_checkpoint(CKPTS / name), reference, name)
    trainer.strategy.barrier()


def main() -> None:
    global SHARDED, CKPTS, REFS
    root = Path(sys.argv[2])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for SHARDED in (False, True) if world > 1 else (False,):
        folder = root / ("sharded" if SHARDED else "ddp")
        CKPTS, REFS = folder / "ckpts", folder / "refs"
        RNG.restored = None
        fit()
    sys.stdout.write(f"OK {int(os.environ.get('RANK', '0'))}\n")
    sys.stdout.flush()


main()
