"""The node-local tier: frequent checkpoints in each node's own storage (a RAM disk or
NVMe), each rank's partitions copied to peers on other nodes, beside the rarer
persistent checkpoints of the shared directory.

Give a :class:`CheckpointManager <distckpt.CheckpointManager>` a :class:`LocalTier`::

    manager = distckpt.CheckpointManager(
        ckpt, "/shared/run", max_to_keep=3, checkpoint_interval=1000, step_counter=ckpt.step,
        local=distckpt.LocalTier("/dev/shm/run", interval=50, replicas=1, max_to_keep=2),
    )
    manager.restore_or_initialize()   # the newest whole local step, else the shared store
    for ...:
        train_step(); ckpt.step.add_(1)
        manager.save()                # persistent every 1000 steps, local every 50

See :mod:`distckpt.local.save` for how a local step is written and confirmed,
:mod:`distckpt.local.restore` for how a job restores from it, :mod:`distckpt.local.nodes`
for node identity and where replicas go, and :mod:`distckpt.local.files` for the layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from distckpt.local.nodes import NODE_ENV, node_identity

__all__ = ["NODE_ENV", "LocalTier", "node_identity"]


@dataclass(frozen=True)
class LocalTier:
    """Where and how often a :class:`~distckpt.CheckpointManager` saves node-locally.

    ``directory`` is a directory on each node's own storage; ``{node}`` in it is replaced
    by the node's identity (:func:`node_identity`), for nodes that share a file system,
    and for several "nodes" on one machine. ``interval`` (steps of the manager's
    ``step_counter``) and ``interval_secs`` space the local saves (measured from the last
    save of either tier); with neither, every :meth:`~distckpt.CheckpointManager.save`
    that is not a persistent one is a local one. ``replicas`` is how many peers on other
    nodes keep a copy of each rank's partitions (0: none; losing a node then loses the
    local steps, and the job falls back to the shared store). Each node keeps its
    ``max_to_keep`` newest local steps before the newest one, and the newest: a step is
    removed only once a newer one is confirmed and marked on every node.
    """

    directory: str | os.PathLike[str]
    interval: int | None = None
    interval_secs: float | None = None
    replicas: int = 1
    max_to_keep: int = 2

    def __post_init__(self) -> None:
        if self.interval is not None and self.interval < 1:
            raise ValueError(f"LocalTier interval must be at least 1 step, got {self.interval}")
        if self.interval_secs is not None and not self.interval_secs >= 0:
            raise ValueError(f"LocalTier interval_secs must be >= 0, got {self.interval_secs}")
        if self.replicas < 0:
            raise ValueError(f"LocalTier replicas must be >= 0, got {self.replicas}")
        if self.max_to_keep < 1:
            raise ValueError(f"LocalTier max_to_keep must be at least 1, got {self.max_to_keep}")
        if "://" in os.fspath(self.directory):
            raise ValueError(
                f"LocalTier directory {os.fspath(self.directory)!r} must be a node-local "
                "path, not a URL"
            )

    def path(self, node: str | None = None) -> str:
        """This node's directory (``{node}`` filled in)."""
        node = node_identity() if node is None else node
        return os.path.abspath(os.fspath(self.directory).replace("{node}", node))
