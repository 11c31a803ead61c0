"""TensorFlow's training-checkpoint guide, in PyTorch with distckpt.

A one-layer ``Net`` learns ``y = 5x + [0, 1, 2, 3, 4]`` from the inputs 0..9, two
samples a batch, with Adam(0.1) on the mean absolute error. As in the guide, the script
trains twice in one process: the first run trains 50 steps and saves every 10 through a
``CheckpointManager`` that keeps 3; then brand-new objects (net, optimizer, iterator,
checkpoint and a new manager on the same directory, which takes it over from the first)
restore the newest checkpoint (model, optimizer moments, the step counter and the data
position) and carry on exactly where the first stopped::

    python examples/seed_toy.py               # Initializing from scratch. ... ckpt-1..5,
                                              # Restored from ./tf_ckpts/ckpt-5 ... ckpt-6..10
    python examples/seed_toy.py --dir /tmp/x  # another run directory

The checkpoint keys printed at the end are the object-graph names: ``net/l1/weight``,
``optimizer/state/net/l1/weight/exp_avg``, ``step``, ``iterator`` ...
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import distckpt


class Net(nn.Module):
    """A simple linear model."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(1, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l1(x)


def toy_dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs 0..9 (one feature) and labels ``5x + [0, 1, 2, 3, 4]``."""
    inputs = torch.arange(10.0)[:, None]
    labels = inputs * 5.0 + torch.arange(5.0)[None, :]
    return inputs, labels


def train_step(net: Net, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One Adam step on the mean absolute error; returns the loss."""
    opt.zero_grad()
    loss = (net(x) - y).abs().mean()
    loss.backward()
    opt.step()
    return loss.item()


def train_and_checkpoint(net: Net, manager: distckpt.CheckpointManager, steps: int = 50) -> None:
    """The guide's loop: restore the newest checkpoint if any, train, save every 10 steps.

    The guide's ``ckpt``, ``opt`` and ``iterator`` are the manager's checkpoint and the
    optimizer and data iterator it tracks.
    """
    ckpt = manager.checkpoint
    opt: torch.optim.Optimizer = ckpt.optimizer
    iterator: distckpt.SampleCursor = ckpt.iterator
    inputs, labels = toy_dataset()

    ckpt.restore(manager.latest_checkpoint)
    if manager.latest_checkpoint:
        print(f"Restored from {manager.latest_checkpoint}")
    else:
        print("Initializing from scratch.")

    for _ in range(steps):
        batch = next(iterator)
        loss = train_step(net, opt, inputs[batch], labels[batch])
        ckpt.step.add_(1)
        if int(ckpt.step) % 10 == 0:
            save_path = manager.save()
            print(f"Saved checkpoint for step {int(ckpt.step)}: {save_path}")
            print(f"loss {loss:1.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="./tf_ckpts", help="run directory (default ./tf_ckpts)")
    parser.add_argument("--steps", type=int, default=50, help="training steps in each run")
    args = parser.parse_args()
    torch.manual_seed(0)

    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    iterator = distckpt.SampleCursor(size=10, batch_size=2)  # batches of 2, repeating
    ckpt = distckpt.Checkpoint(step=torch.tensor(1), optimizer=opt, net=net, iterator=iterator)
    manager = distckpt.CheckpointManager(ckpt, args.dir, max_to_keep=3)
    train_and_checkpoint(net, manager, args.steps)

    # The guide's second run: everything new, the same directory. The new manager takes
    # the directory over from the first; restoring brings back where it stopped.
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    iterator = distckpt.SampleCursor(size=10, batch_size=2)
    ckpt = distckpt.Checkpoint(step=torch.tensor(1), optimizer=opt, net=net, iterator=iterator)
    manager = distckpt.CheckpointManager(ckpt, args.dir, max_to_keep=3)
    train_and_checkpoint(net, manager, args.steps)

    print(manager.checkpoints)  # the three newest
    latest = manager.latest_checkpoint
    if latest:
        print(f"Variables in {latest}:")
        for name, shape, dtype in distckpt.list_variables(latest):
            print(f"  {name} {'' if shape is None else list(shape)} {dtype}")


if __name__ == "__main__":
    main()
