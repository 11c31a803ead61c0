"""The training-state layer: object graphs saved by name, as ``tf.train.Checkpoint``.

::

    ckpt = distckpt.Checkpoint(step=torch.tensor(1), optimizer=opt, net=net)
    ckpt.restore(distckpt.latest_checkpoint("run"))
    ...
    ckpt.save("run/ckpt")

Modules: :mod:`~distckpt.training.checkpoint` (the Checkpoint), :mod:`.tracking` (what
can be tracked, the graph walk), :mod:`.modules` (module names), :mod:`.optim`
(optimizer state by parameter name), :mod:`.stateful` (state dicts), :mod:`.handlers`
(save and restore per kind), :mod:`.session` (a restore in progress), :mod:`.status`
(restore statuses), :mod:`.pointer` (the ``latest`` file), :mod:`.rng`, :mod:`.cursor`.
"""

from __future__ import annotations

from distckpt.training.checkpoint import Checkpoint
from distckpt.training.cursor import SampleCursor
from distckpt.training.manager import CheckpointManager
from distckpt.training.pointer import latest_checkpoint
from distckpt.training.rng import RNGState
from distckpt.training.status import (
    CheckpointLoadStatus,
    InitializationOnlyStatus,
    UnmatchedError,
)
from distckpt.training.tracking import ObjectGraphError, TrackedDict, TrackedList

__all__ = [
    "Checkpoint",
    "CheckpointLoadStatus",
    "CheckpointManager",
    "InitializationOnlyStatus",
    "ObjectGraphError",
    "RNGState",
    "SampleCursor",
    "TrackedDict",
    "TrackedList",
    "UnmatchedError",
    "latest_checkpoint",
]
