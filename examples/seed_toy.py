"""TensorFlow's training-checkpoint guide, in PyTorch with distckpt.

A one-layer ``Net`` learns ``y = 5x + [0, 1, 2, 3, 4]`` from the inputs 0..9, two
samples a batch, with Adam(0.1) on the mean absolute error. Every run trains 50 steps
and saves every 10; a second run restores the newest checkpoint (model, optimizer
moments, the step counter and the data position) and carries on exactly where the
first stopped::

    python examples/seed_toy.py               # Initializing from scratch. ... ckpt-1..5
    python examples/seed_toy.py               # Restored from ./tf_ckpts/ckpt-5 ... ckpt-6..10
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


def train_and_checkpoint(directory: str, steps: int = 50) -> str | None:
    """Restore the newest checkpoint in ``directory`` if any, train, save every 10 steps."""
    torch.manual_seed(0)
    inputs, labels = toy_dataset()
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    iterator = distckpt.SampleCursor(size=10, batch_size=2)  # batches of 2, repeating
    ckpt = distckpt.Checkpoint(step=torch.tensor(1), optimizer=opt, net=net, iterator=iterator)

    latest = distckpt.latest_checkpoint(directory)
    ckpt.restore(latest)
    if latest:
        print(f"Restored from {latest}")
    else:
        print("Initializing from scratch.")

    for _ in range(steps):
        batch = next(iterator)
        loss = train_step(net, opt, inputs[batch], labels[batch])
        ckpt.step.add_(1)
        if int(ckpt.step) % 10 == 0:
            path = ckpt.save(f"{directory}/ckpt")
            print(f"Saved checkpoint for step {int(ckpt.step)}: {path}")
            print(f"loss {loss:1.2f}")
    return distckpt.latest_checkpoint(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="./tf_ckpts", help="run directory (default ./tf_ckpts)")
    parser.add_argument("--steps", type=int, default=50, help="training steps in this run")
    args = parser.parse_args()
    latest = train_and_checkpoint(args.dir, args.steps)
    if latest:
        print(f"Variables in {latest}:")
        for name, shape, dtype in distckpt.list_variables(latest):
            print(f"  {name} {'' if shape is None else list(shape)} {dtype}")


if __name__ == "__main__":
    main()
