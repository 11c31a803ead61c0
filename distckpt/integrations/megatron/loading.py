"""A load of Megatron's sharded state dict from a distckpt checkpoint: every leaf's box
mapped onto the stored layout of its key (:mod:`~distckpt.integrations.megatron.layout`),
each stored variable read once per rank, then cut into the leaves.

Collective, on every rank: rank 0 reads the index and shares it
(:func:`~distckpt.engine.load.read_shared_index`), each rank plans its reads from it, and
one :func:`~distckpt.engine.load.load_indexed` reads them. A leaf that cannot be read (a
shape that does not fit the stored tensor) is reported after the load, on the ranks
asking for it, so no rank stops before a collective the others are in.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

import distckpt
from distckpt import dtypes
from distckpt.engine.inspect import index_variables
from distckpt.engine.load import load_indexed, read_shared_index
from distckpt.integrations.megatron.imports import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    dict_list_map_inplace,
    nested_values,
)
from distckpt.integrations.megatron.layout import TENSORS, Layout, Plan, layouts, plan
from distckpt.integrations.megatron.leaves import (
    _OBJECTS,
    _object_value,
    checkpoint_path,
    full_box,
    own_tensor,
    refuse_flattened,
)
from distckpt.items import Branch
from distckpt.pipeline import communicator
from distckpt.pipeline.options import LOAD, merge_or_refuse, resolve_run
from distckpt.signing.keys import trusted_keys


class MegatronShapeMismatchError(distckpt.ShapeMismatchError, CheckpointingException):
    """A requested tensor does not fit the stored one: distckpt's
    :class:`~distckpt.ShapeMismatchError`, and the ``CheckpointingException`` megatron-core's
    callers catch."""


class MegatronMissingKeysError(
    distckpt.MissingVariablesError, CheckpointingException, CheckpointException
):
    """Leaves asked for that the checkpoint does not hold (under Megatron's
    ``StrictHandling.ASSUME_OK_UNEXPECTED``, which leaves the check to the strategy):
    distckpt's :class:`~distckpt.MissingVariablesError`, megatron-core's
    ``CheckpointingException``, and the ``torch.distributed.checkpoint``
    ``CheckpointException`` that megatron-core's ``torch_dist`` load raises there, so
    code written against either backend catches it. ``missing``: the stored names asked
    for; ``failures``: this rank's error, as torch's exception gives it."""

    def __init__(self, message: str, missing: list[str], unexpected: list[str]) -> None:
        super().__init__(message, missing, unexpected)
        self._failures = {_rank(): (KeyError(message), traceback.StackSummary())}


def _rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _Key:
    """This rank's leaves of one key, their plan, and the tensors their reads fill."""

    def __init__(self, leaves: list[ShardedTensor], stored: Layout | None) -> None:
        first = leaves[0]
        self.leaves = leaves
        # Read in the stored dtype, then cast to each leaf's, as torch_dist's load copies
        # into the leaf's tensor (an int64 tensor asked for as float32 loads).
        self.dtype = dtypes.torch_dtype(stored.dtype) if stored is not None else first.dtype
        shape = tuple(int(n) for n in first.global_shape)
        others = {tuple(leaf.global_shape) for leaf in leaves} - {shape}
        self.plan = (
            Plan(problem=f"{first.key}: asked with global shapes {[list(shape), *others]}")
            if others
            else plan(
                first.key,
                shape,
                [full_box(leaf) for leaf in leaves],
                stored,
                any(leaf.allow_shape_mismatch for leaf in leaves),
            )
        )
        self.tensors: dict[tuple[str, ...], torch.Tensor] = {}
        self.in_place: set[int] = set()  # leaves read straight into their own tensor
        users: dict[tuple[str, ...], list[int]] = {}
        for i, parts in enumerate(self.plan.parts):
            for part in parts:
                users.setdefault(part.path, []).append(i)
        for i, (leaf, parts) in enumerate(zip(leaves, self.plan.parts)):
            if len(parts) == 1 and users[parts[0].path] == [i]:
                fits = parts[0].where == full_box(leaf) and leaf.dtype == self.dtype
                own = own_tensor(leaf) if fits else None
                if own is not None:  # read straight into it, as Megatron's own do
                    self.tensors[parts[0].path] = own.view(parts[0].stored.lengths)
                    self.in_place.add(i)
        for path, (_, box) in self.plan.reads.items():
            if path not in self.tensors:
                self.tensors[path] = torch.empty(box.lengths, dtype=self.dtype)

    def state(self, tensors: dict[str, Any]) -> None:
        """Put this key's reads into the state ``tensors`` that the load fills."""
        for path, (shape, box) in self.plan.reads.items():
            where = tensors
            for name in path[:-1]:
                where = where.setdefault(name, Branch())
            where[path[-1]] = distckpt.Shard(self.tensors[path], shape, box.offsets)

    def filled(self, i: int) -> torch.Tensor:
        """Leaf ``i`` as loaded: its own tensor, a view of the one read, or a new tensor
        put together from its parts (zeros where the stored tensor holds none)."""
        leaf, parts = self.leaves[i], self.plan.parts[i]
        if i in self.in_place:
            return leaf.data
        box = full_box(leaf)
        pieces = [
            (part, self.tensors[part.path][part.stored.relative_to(read).slices()])
            for part in parts
            for read in [self.plan.reads[part.path][1]]
        ]
        if len(pieces) == 1 and pieces[0][0].where == box:
            loaded = pieces[0][1].reshape(tuple(leaf.local_shape)).to(leaf.dtype)
        else:
            covered = sum(part.where.numel for part in parts) == box.numel
            loaded = (torch.empty if covered else torch.zeros)(box.lengths, dtype=leaf.dtype)
            for part, piece in pieces:
                loaded[part.where.relative_to(box).slices()] = piece.reshape(part.where.lengths)
            loaded = loaded.reshape(tuple(leaf.local_shape))
        if isinstance(leaf.data, torch.Tensor) and leaf.data.device.type != "cpu":
            loaded = loaded.to(leaf.data.device)
        return loaded


def load_state(
    sharded_state_dict: Any, checkpoint_dir: str | Path, comm: Any, keywords: dict[str, Any]
) -> Any:
    """Fill Megatron's ``sharded_state_dict`` from the checkpoint of ``checkpoint_dir``
    (collective); ``keywords`` are :func:`distckpt.load`'s."""
    comm = communicator(comm)
    keywords = dict(keywords)
    keywords.setdefault("strict", False)  # Megatron checks keys itself (its `strict`)
    options, refused = merge_or_refuse(
        keywords.pop("options", None), keywords, LOAD, "DistckptLoadStrategy"
    )
    run = resolve_run(options, checkpoint_path(checkpoint_dir), comm)
    index = read_shared_index(run.store, comm, trusted_keys(options.trusted_keys))
    stored = layouts(index_variables(index))

    wanted: dict[str, list[ShardedTensor]] = {}
    objects: dict[str, Any] = Branch()
    for leaf in nested_values(sharded_state_dict):
        if isinstance(leaf, ShardedTensor):
            refuse_flattened(leaf)
            wanted.setdefault(leaf.key, []).append(leaf)
        elif isinstance(leaf, ShardedObject):
            objects[leaf.unique_key] = None
    keys = {key: _Key(leaves, stored.get(key)) for key, leaves in wanted.items()}
    tensors: dict[str, Any] = Branch()
    for key in keys.values():
        key.state(tensors)
    state = {TENSORS: tensors, _OBJECTS: objects}
    try:
        result = load_indexed(state, run, index, comm, refused=refused)
    except MegatronShapeMismatchError:
        raise
    except distckpt.ShapeMismatchError as exc:  # megatron-core's callers catch its own
        raise MegatronShapeMismatchError(str(exc)) from exc
    missing = [
        name
        for name in result.missing
        if name.startswith(f"{TENSORS}/") or name.startswith(f"{_OBJECTS}/")
    ]
    if missing:
        raise MegatronMissingKeysError(
            f"not in the checkpoint at {checkpoint_dir}: {sorted(missing)}", sorted(missing), []
        )
    problems = [key.plan.problem for key in keys.values() if key.plan.problem]
    if problems:
        raise MegatronShapeMismatchError("; ".join(problems))

    where = {id(leaf): (key, i) for key in keys.values() for i, leaf in enumerate(key.leaves)}

    def fill(leaf: Any) -> Any:
        if isinstance(leaf, ShardedTensor):
            key, i = where[id(leaf)]
            return key.filled(i)
        if isinstance(leaf, ShardedObject):
            return _object_value(objects[leaf.unique_key], leaf.unique_key, options.allow_pickle)
        return leaf

    dict_list_map_inplace(fill, sharded_state_dict)
    return sharded_state_dict
