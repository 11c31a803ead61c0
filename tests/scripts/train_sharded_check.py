"""The loss scaling of examples/train_sharded.py: on W ranks, the gradient of the first
step, after FSDP2's reduce-scatter, is the gradient of the mean over the global batch.

AdamW is nearly invariant to the scale of the gradients, so comparing the parameters of
runs on different world sizes would not catch a loss scaled by the wrong factor; this
compares the gradients themselves with those of one unsharded process.

Usage (torchrun or mpiexec, any W dividing 12): ``train_sharded_check.py``; rank 0
prints ``OK gradients <W>`` when every full gradient matches.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train_sharded as example  # noqa: E402
from rank import say  # noqa: E402

GLOBAL_BATCH = 12


def main() -> None:
    rank, world, mesh = example.setup()
    local = GLOBAL_BATCH // world
    model = example.build_model(mesh)
    xs, ys = example.samples(rank * local, (rank + 1) * local)
    ((model(xs) - ys) ** 2).mean().backward()  # the example's loss, step 0

    reference = example.build_model(None)
    xs, ys = example.samples(0, GLOBAL_BATCH)
    ((reference(xs) - ys) ** 2).mean().backward()

    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        got = example._full(p.grad)
        scale = q.grad.abs().max().item()
        err = (got - q.grad).abs().max().item()
        assert err <= 1e-5 * scale, f"{name}: gradient off by {err} (largest {scale})"
    if rank == 0:
        say(f"OK gradients {world}")
    # The example's teardown: every rank reaches its end first, and under MPI rank 0 (the
    # rendezvous store's host) lets go last. Destroying the group at once could abort
    # another rank still using it ("terminate called without an active exception").
    example.shutdown(rank)


if __name__ == "__main__":
    main()
