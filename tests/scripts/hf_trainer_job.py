"""A tiny transformers.Trainer run through DistckptTrainer, for
tests/integrations/test_integration_hf_trainer.py.

``save DIR``: (torchrun, 2 processes, gloo, 2 samples each per step) 6 steps, a
checkpoint every 2 (``save_total_limit=2``). At each save every process keeps its
reference (torch.save): model, optimizer, scheduler and RNG after the save.

``resume DIR``: (1 process, 4 samples per step: the same global batch) 8 steps with
``resume_from_checkpoint=True``: at the first step after the restore, the model,
optimizer, scheduler, step and RNG (that of saved process 0) equal checkpoint-6's
reference bit for bit, and the batch is samples 24 to 27 of the epoch's order (the data
position). The retention keeps checkpoints 6 and 8. Prints ``OK <rank>``.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
from rank import assert_same, say
from transformers import TrainerCallback, TrainingArguments

from distckpt.integrations.hf_trainer import DistckptTrainer

mode, root = sys.argv[1], Path(sys.argv[2])
REFS = root / "refs"
RANK = int(os.environ.get("RANK", "0"))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)
        self.seen: list[torch.Tensor] = []  # the sample ids of each batch

    def forward(self, x, y, idx):  # type: ignore[no-untyped-def]
        self.seen.append(idx.clone())
        noise = torch.randn_like(x) * 0.01  # draws from the RNG the checkpoint carries
        return {"loss": torch.nn.functional.mse_loss(self.l2(torch.relu(self.l1(x + noise))), y)}


def rng() -> dict:
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": torch.from_numpy(np.random.get_state()[1].copy()),
    }


def snapshot(trainer) -> dict:  # type: ignore[no-untyped-def]
    return {
        "model": {k: v.clone() for k, v in trainer.model.state_dict().items()},
        "optimizer": trainer.optimizer.optimizer.state_dict(),
        "scheduler": trainer.lr_scheduler.state_dict(),
        "rng": rng(),
    }


class Check(TrainerCallback):
    trainer = None

    def on_save(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        if mode == "save":
            REFS.mkdir(exist_ok=True)
            torch.save(snapshot(self.trainer), REFS / f"step{state.global_step}-rank{RANK}.pt")

    def on_step_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        if mode == "resume" and state.global_step == 6:
            ref = torch.load(REFS / f"step6-rank{RANK % 2}.pt", weights_only=False)
            assert_same(snapshot(self.trainer), ref, "restored")
            say(f"RESTORED {RANK}")


def main() -> None:
    gen = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(32, 4, generator=gen), torch.randn(32, 2, generator=gen)
    data = [{"x": xs[i], "y": ys[i], "idx": torch.tensor(i)} for i in range(32)]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = TrainingArguments(
        output_dir=str(root / "out"),
        use_cpu=True,
        ddp_backend="gloo" if world > 1 else None,
        per_device_train_batch_size=4 // world,
        max_steps=6 if mode == "save" else 8,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=2,
        logging_strategy="no",
        report_to="none",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    check = Check()
    model = Net()
    trainer = DistckptTrainer(model=model, args=args, train_dataset=data, callbacks=[check])
    check.trainer = trainer
    if mode == "save":
        torch.manual_seed(10 + RANK)  # each process its own stream: restored per process
        random.seed(RANK)
        np.random.seed(RANK)
    trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
    kept = sorted(p.name for p in (root / "out").iterdir())
    if mode == "save" and RANK == 0:  # rank 0 removes: the others may look before it did
        assert kept == ["checkpoint-4", "checkpoint-6"], kept
    elif mode == "resume":
        assert kept == ["checkpoint-6", "checkpoint-8"], kept
        # the first batch after the resume: step 7's, samples 24..27 of the epoch's order
        order = torch.randperm(32, generator=torch.Generator().manual_seed(0))
        assert model.seen[0].tolist() == order[24:28].tolist(), (model.seen[0], order)
    sys.stdout.write(f"OK {RANK}\n")
    sys.stdout.flush()


main()
