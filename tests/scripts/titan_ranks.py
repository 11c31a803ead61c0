"""torchtitan's checkpoint component on distckpt, with torchtitan's own classes.

Usage (under torchrun or mpiexec, gloo on CPU)::

    titan_ranks.py save DIR    # N ranks: 4 steps, a checkpoint each (keep_latest_k=2)
    titan_ranks.py load DIR    # M ranks: resume from the newest committed step

The state is what torchtitan's trainer hands its checkpointer: the model parts (FSDP2),
an ``OptimizersContainer`` (AdamW), an ``LRSchedulersContainer`` (warm-up), the
dataloader (a stateful cursor) and the train state (step and RNG). ``save`` writes, on
rank 0, every full tensor and the other states after the last step to
``DIR/expected.safetensors`` and ``DIR/expected.json``; ``load`` builds everything fresh
(another seed) and checks, after ``manager.load()``, each of them bit for bit. Each
rank prints ``OK <rank>`` last.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rank import finish_job, fsdp_mlp, start_job
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import default_adamw

from distckpt.integrations.torchtitan import DistckptCheckpointManager


class Cursor:
    """The dataloader's position (a torchtitan dataloader is stateful likewise)."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


class TrainState:
    """The step and the RNG, as torchtitan's trainer saves its own."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        torch.set_rng_state(state["rng"])


def build(seed: int, mesh: Any, directory: Path, folder: str) -> tuple[Any, ...]:
    model = fsdp_mlp(seed, (16, 48, 4), mesh)
    optimizer_config = default_adamw(lr=1e-2)
    optimizer_config.implementation = "for-loop"
    optimizers = optimizer_config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(
        optimizers=optimizers, training_steps=10
    )
    cursor, train = Cursor(), TrainState()
    config = DistckptCheckpointManager.Config(
        enable=True,
        folder=folder,
        interval=1,
        keep_latest_k=2,
        compression="zstd",
        async_mode="async" if folder.endswith("async") else "disabled",
    )
    manager = config.build(
        dataloader=cursor,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train},
        sd_adapter=None,
        base_folder=str(directory),
    )
    return model, optimizers, schedulers, cursor, train, manager


def everything(model: nn.Module, optimizers: Any) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer slot, whole (collective)."""
    out = {f"model.{k}": v.full_tensor().clone() for k, v in model.state_dict().items()}
    for key, value in optimizers.state_dict().items():
        if isinstance(value, torch.Tensor):
            whole = value.full_tensor() if hasattr(value, "full_tensor") else value
            out[f"optim.{key}"] = whole.detach().clone().reshape(-1)
    return out


def others(schedulers: Any, cursor: Cursor, train: TrainState) -> dict[str, Any]:
    return {
        "schedulers": json.loads(json.dumps(schedulers.state_dict(), default=str)),
        "position": cursor.position,
        "step": train.step,
        "rng": torch.get_rng_state().tolist(),
    }


#: Trained and saved identically, synchronously and with dcp.async_save.
FOLDERS = ("ckpt", "ckpt-async")


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    mode, directory = sys.argv[1], Path(sys.argv[2])
    rank, world = start_job()
    mesh = init_device_mesh("cpu", (world,))
    for folder in FOLDERS:
        if mode == "save":
            save(mesh, directory, folder, write_expected=folder == FOLDERS[0])
        else:
            resume(mesh, directory, folder)
    finish_job(rank)


def save(mesh: Any, directory: Path, folder: str, write_expected: bool) -> None:
    model, optimizers, schedulers, cursor, train, manager = build(0, mesh, directory, folder)
    for step in range(1, 5):
        batch = torch.randn(8, 16, generator=torch.Generator().manual_seed(cursor.position))
        model(batch).square().mean().backward()
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()
        cursor.position += 8
        train.step = step
        torch.manual_seed(1000 + step)  # the RNG moves on, as sampling would
        assert manager.save(step)
    manager.close()
    expected = everything(model, optimizers)
    if write_expected and dist.get_rank() == 0:
        save_file(expected, str(directory / "expected.safetensors"))
        state = others(schedulers, cursor, train)
        (directory / "expected.json").write_text(json.dumps(state))


def resume(mesh: Any, directory: Path, folder: str) -> None:
    model, optimizers, schedulers, cursor, train, manager = build(7, mesh, directory, folder)
    torch.manual_seed(99)
    assert manager.load(), "nothing to resume from"
    manager.close()
    got = others(schedulers, cursor, train)
    want = json.loads((directory / "expected.json").read_text())
    for key in ("schedulers", "position", "step", "rng"):
        assert got[key] == want[key], (key, got[key], want[key])
    expected = load_file(str(directory / "expected.safetensors"))
    found = everything(model, optimizers)
    assert sorted(found) == sorted(expected), sorted(set(found) ^ set(expected))
    for name, value in expected.items():
        same = found[name].dtype == value.dtype and found[name].shape == value.shape
        assert same and torch.equal(found[name], value), (folder, name)


if __name__ == "__main__":
    main()
