"""Which node each rank runs on, and where each rank's partitions are replicated.

**Node identity.** ``$DISTCKPT_NODE`` when set (any string: tests and unusual clusters
name their nodes with it), else ``$SLURM_NODEID`` inside a SLURM job, else the host name.
Ranks with the same identity share one node-local directory and fail together.

**Placement.** The nodes are ordered by their lowest rank; on each node the ranks are
ordered by rank (their *local index*). With ``replicas`` = k, the rank of local index
``j`` on node ``i`` sends its partitions to k peers: for ``d`` = 1..k, the rank of local
index ``j mod n'`` on node ``(i + d) mod N``, where ``N`` is the number of nodes and
``n'`` the number of ranks on that node. Every rank's data is therefore on k + 1
distinct nodes (its own and the next k), so losing any k nodes loses no local step; with
the same number of ranks on every node each rank also receives exactly k replicas.
``replicas`` above ``N - 1`` is lowered to ``N - 1`` (with a warning): there is no other
node to copy to.
"""

from __future__ import annotations

import contextlib
import os
import socket
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from distckpt import settings
from distckpt.comm import Communicator

#: Environment variable that names this process's node, overriding the others.
NODE_ENV = settings.NODE.name


def node_identity() -> str:
    """This process's node: ``$DISTCKPT_NODE``, ``$SLURM_NODEID``, or the host name."""
    return settings.NODE.get() or os.environ.get("SLURM_NODEID", "").strip() or socket.gethostname()


@dataclass(frozen=True)
class Topology:
    """The job's nodes as every rank sees them: ``nodes[i]`` lists node ``i``'s ranks."""

    nodes: tuple[tuple[int, ...], ...]
    names: tuple[str, ...]

    @classmethod
    def of(cls, identities: Sequence[str]) -> Topology:
        """From every rank's node identity, in rank order."""
        order: dict[str, list[int]] = {}
        for rank, name in enumerate(identities):
            order.setdefault(name, []).append(rank)
        return cls(tuple(tuple(r) for r in order.values()), tuple(order))

    def node_of(self, rank: int) -> int:
        for i, ranks in enumerate(self.nodes):
            if rank in ranks:
                return i
        raise ValueError(f"rank {rank} is on no node")

    def name_of(self, rank: int) -> str:
        return self.names[self.node_of(rank)]

    def leader(self, rank: int) -> bool:
        """Whether ``rank`` is the lowest rank of its node (it writes the node's copy of
        the replicated tensors, and removes the node's old steps)."""
        return self.nodes[self.node_of(rank)][0] == rank

    def usable_replicas(self, replicas: int) -> int:
        return max(0, min(replicas, len(self.nodes) - 1))

    def peers(self, rank: int, replicas: int) -> list[int]:
        """The ranks that keep a replica of ``rank``'s partitions (see the module doc)."""
        i = self.node_of(rank)
        j = self.nodes[i].index(rank)
        out = []
        for d in range(1, self.usable_replicas(replicas) + 1):
            ranks = self.nodes[(i + d) % len(self.nodes)]
            out.append(ranks[j % len(ranks)])
        return out

    def sources(self, rank: int, replicas: int) -> list[int]:
        """The ranks whose partitions ``rank`` keeps a replica of: ranks of the ``k``
        nodes before its own whose peers include it."""
        i = self.node_of(rank)
        out = []
        for d in range(1, self.usable_replicas(replicas) + 1):
            for r in self.nodes[(i - d) % len(self.nodes)]:
                if rank in self.peers(r, replicas):
                    out.append(r)
        return sorted(out)


_topologies: weakref.WeakKeyDictionary[Any, Topology] = weakref.WeakKeyDictionary()


def topology(comm: Communicator) -> Topology:
    """Collective the first time for ``comm``: every rank's node (cached)."""
    try:
        return _topologies[comm]
    except (KeyError, TypeError):
        pass
    topo = Topology.of(comm.allgather(node_identity()))
    with contextlib.suppress(TypeError):  # a communicator that cannot be weakly referenced
        _topologies[comm] = topo
    return topo
