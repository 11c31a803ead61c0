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

from typing import TYPE_CHECKING

from distckpt.exports import exports

if TYPE_CHECKING:
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

_WHERE = {
    "Checkpoint": "distckpt.training.checkpoint",
    "SampleCursor": "distckpt.training.cursor",
    "CheckpointManager": "distckpt.training.manager",
    "latest_checkpoint": "distckpt.training.pointer",
    "RNGState": "distckpt.training.rng",
    "CheckpointLoadStatus": "distckpt.training.status",
    "InitializationOnlyStatus": "distckpt.training.status",
    "UnmatchedError": "distckpt.training.status",
    "ObjectGraphError": "distckpt.training.tracking",
    "TrackedDict": "distckpt.training.tracking",
    "TrackedList": "distckpt.training.tracking",
}
__getattr__, __dir__ = exports(globals(), _WHERE)

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
