"""Megatron-core ``dist_checkpointing`` strategies that save and load distckpt checkpoints.

``megatron.core.dist_checkpointing.save`` hands a sharded strategy the
``ShardedTensor`` and ``ShardedObject`` leaves of a sharded state dict; the strategies
here write them, on every rank, as one committed distckpt checkpoint in the
``distckpt`` folder of Megatron's checkpoint directory (beside Megatron's own
``common.pt`` and ``metadata.json``), and read them back onto any tensor-, pipeline- or
data-parallel layout::

    from megatron.core import dist_checkpointing
    from distckpt.integrations.megatron import DistckptSaveStrategy

    dist_checkpointing.save(sharded_state_dict, ckpt_dir, sharded_strategy=DistckptSaveStrategy())
    state = dist_checkpointing.load(sharded_state_dict, ckpt_dir)  # backend from metadata.json

Importing this module registers both strategies under the backend name ``"distckpt"``
(version 1), so ``sharded_strategy=("distckpt", 1)`` works too, and ``load`` finds the
load strategy from the checkpoint's ``metadata.json``.

How Megatron's leaves are stored:

* a ``ShardedTensor`` is the box ``global_offset`` / ``local_shape`` of the global tensor
  named by its ``key`` (``prepend_axis_num`` leading axes of length one added), stored as
  ``tensors/<key>``; only the main replica (``replica_id`` 0 or all zeros) writes it;
* a ``ShardedObject`` is serialised with ``torch.save`` and stored as a byte tensor
  ``objects/<unique_key>``, written by its main replica; a load reads it with
  ``torch.load(weights_only=True)``, as Megatron's own backends do: torch's restricted
  unpickler, which builds tensors, plain containers and the classes torch and
  megatron-core register (``add_safe_globals``), and nothing else. What it refuses is an
  error naming the object, unless the load strategy is made with ``allow_pickle=True``.

The distributed optimizer: megatron-core 0.16's reshardable formats give regular leaves.
``dp_reshardable`` cuts each bucket's data-parallel range into one
``ShardedTensor`` per parameter and padding, all of the bucket's key, so a rank holds
several boxes of one tensor: they follow one another, and are saved as the one box they
make (copied into one host tensor) and read back as the smallest box holding them, then
cut. ``fully_reshardable`` gives each parameter's state the parameter's own sharding.
Flattened ranges (``ShardedTensor.flattened_range``, the older ``fully_sharded_model_space``
format) are refused by megatron-core 0.16 itself when a ShardedTensor is made; one that
still carries a flattened range is refused here with a clear error.

A load reads a tensor asked for in one box straight into the leaf's own tensor (its data,
detached: the same memory), as Megatron's own strategies do. A leaf with
``allow_shape_mismatch`` (Megatron-LM's padded vocabularies, whose padding depends on the
tensor-parallel size) whose stored tensor has another shape gets the part of its box the
stored tensor holds, and zeros elsewhere, as with Megatron's own strategies.

Async saves: :meth:`DistckptSaveStrategy.async_save` starts distckpt's own background save
(state copied to host memory before it returns; written and committed on a background
thread) and returns an ``AsyncRequest`` without a function to run in Megatron's worker,
whose finalisation waits for the commit. Megatron then writes ``metadata.json``, so a
checkpoint directory with ``metadata.json`` always holds a committed distckpt checkpoint.
Megatron's ``AsyncCallsQueue`` sees a request without a function as done at once, so its
first ``maybe_finalize_async_calls`` after the save blocks until the commit; a loop that
must not block can ask :meth:`DistckptSaveStrategy.pending` first, on every rank, and
reduce the answers (``maybe_finalize_async_calls`` is collective: every rank must take the
same branch).

Requires ``megatron-core`` (the ``megatron`` extra); it is imported only when this module
is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import distckpt
from distckpt.engine.options import LOAD, merge
from distckpt.format import wellformed
from distckpt.integrations.megatron.leaves import (
    _OBJECTS,
    _TENSORS,
    BACKEND,
    SUBDIR,
    VERSION,
    _bounds,
    _box,
    _groups,
    _inner_offset,
    _inner_shape,
    _leaves,
    _object_value,
    _Overlap,
    _overlap,
    _own_tensor,
    _refuse_flattened,
    _stored_shapes,
    _where,
    checkpoint_path,
    save_state,
)
from distckpt.items import Branch
from distckpt.naming import unescape_key
from distckpt.slices import Box

# isort: split
# leaves.py imports megatron-core first, and says which extra to install if it is missing.
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    StrategyAction,
    register_default_strategy,
)


class DistckptSaveStrategy(AsyncSaveShardedStrategy):
    """Saves a Megatron sharded state dict as a committed distckpt checkpoint.

    ``comm``: distckpt's communicator over the ranks that save (default: the default
    process group). Other keywords are :func:`distckpt.save`'s (``compression``,
    ``io_workers``, ...). ``overwrite`` defaults to True: Megatron saves into a directory
    it has already prepared."""

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = VERSION,
        *,
        comm: Any = None,
        **save_keywords: Any,
    ) -> None:
        super().__init__(backend, version)
        self.comm = comm
        save_keywords.setdefault("overwrite", True)
        self.save_keywords = save_keywords
        self.result: distckpt.SaveResult | None = None
        self._handle: distckpt.AsyncSave | None = None

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> None:
        self.result = distckpt.save(
            save_state(sharded_state_dict),
            checkpoint_path(checkpoint_dir),
            self.comm,
            **self.save_keywords,
        )

    def pending(self) -> bool:
        """Whether the last :meth:`async_save` is still writing on this rank (this rank's
        answer: reduce it over the ranks before a collective such as Megatron's
        ``maybe_finalize_async_calls``)."""
        return self._handle is not None and not self._handle.done()

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> AsyncRequest:
        self._handle = handle = distckpt.save(
            save_state(sharded_state_dict),
            checkpoint_path(checkpoint_dir),
            self.comm,
            async_save=True,
            **self.save_keywords,
        )

        def finalize() -> None:
            self.result = handle.wait()

        return AsyncRequest(None, (), [finalize])


class DistckptLoadStrategy(LoadShardedStrategy):
    """Loads a checkpoint written by :class:`DistckptSaveStrategy` onto the layout of the
    given sharded state dict. Keywords are :func:`distckpt.load`'s (``io_workers``, ...).

    ``ShardedObject`` leaves are read with ``torch.load(weights_only=True)``: tensors,
    plain containers and the classes torch and megatron-core allow, nothing else.
    ``allow_pickle=True`` (or ``options`` with it) reads them with the full unpickler,
    which runs code from the checkpoint: only for checkpoints you trust."""

    def __init__(self, *, comm: Any = None, **load_keywords: Any) -> None:
        self.comm = comm
        self.load_keywords = load_keywords

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise CheckpointingException(
                f"the {BACKEND!r} load strategy cannot read a {loaded_backend!r} checkpoint"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise CheckpointingException(
                f"the {BACKEND!r} load strategy reads version {VERSION}, the checkpoint is "
                f"version {loaded_version}"
            )

    def load(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> Any:
        tensors: dict[str, Any] = Branch()
        objects: dict[str, Any] = Branch()
        wanted: list[ShardedTensor] = []
        for leaf in _leaves(sharded_state_dict):
            if isinstance(leaf, ShardedTensor):
                _refuse_flattened(leaf)
                wanted.append(leaf)
            elif isinstance(leaf, ShardedObject):
                objects[leaf.unique_key] = None
        # Each stored tensor is read once per rank, as the smallest box holding every box
        # this rank asks of it (several: tied weights, the distributed optimizer's buckets).
        read: dict[int, tuple[distckpt.Shard, Box] | torch.Tensor | _Overlap] = {}
        stored = _stored_shapes(wanted, checkpoint_dir)
        for group in _groups(wanted):
            where, name = _where(tensors, group[0])
            overlap = _overlap(group, stored)
            if overlap is not None:  # allow_shape_mismatch, and the shapes differ
                if overlap.shard is not None:
                    where[name] = overlap.shard
                read[id(group[0])] = overlap
                continue
            own = _own_tensor(group)
            if own is not None:  # read straight into the leaf's tensor, as Megatron's do
                where[name] = distckpt.Shard(own, _inner_shape(group[0]), _inner_offset(group[0]))
                read[id(group[0])] = group[0].data
                continue
            bounds = _bounds(group)
            shard = distckpt.Shard(
                torch.empty(bounds.lengths, dtype=group[0].dtype),
                _inner_shape(group[0]),
                bounds.offsets,
            )
            where[name] = shard
            for leaf in group:
                read[id(leaf)] = (shard, bounds)
        state = {_TENSORS: tensors, _OBJECTS: objects}
        keywords = dict(self.load_keywords)
        keywords.setdefault("strict", False)  # Megatron checks keys itself (its `strict`)
        allow_pickle = merge(
            keywords.get("options"),
            {k: v for k, v in keywords.items() if k in LOAD},
            LOAD,
            "DistckptLoadStrategy",
        ).allow_pickle
        result = distckpt.load(state, checkpoint_path(checkpoint_dir), self.comm, **keywords)
        missing = [
            name
            for name in getattr(result, "missing", [])
            if name.startswith(f"{_TENSORS}/") or name.startswith(f"{_OBJECTS}/")
        ]
        if missing:
            raise CheckpointingException(
                f"not in the checkpoint at {checkpoint_dir}: {sorted(missing)}"
            )

        def fill(leaf: Any) -> Any:
            if isinstance(leaf, ShardedTensor):
                got = read[id(leaf)]
                if isinstance(got, torch.Tensor):
                    return got
                if isinstance(got, _Overlap):
                    return got.filled(leaf)
                shard, bounds = got
                box = _box(leaf).relative_to(bounds)
                loaded = shard.tensor[box.slices()].clone().reshape(tuple(leaf.local_shape))
                if leaf.data is not None and leaf.data.device.type != "cpu":
                    loaded = loaded.to(leaf.data.device)
                return loaded
            if isinstance(leaf, ShardedObject):
                return _object_value(objects[leaf.unique_key], leaf.unique_key, allow_pickle)
            return leaf

        dict_list_map_inplace(fill, sharded_state_dict)
        return sharded_state_dict

    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> dict[str, ShardedTensor]:
        from distckpt import dtypes

        metadata: dict[str, ShardedTensor] = {}
        stacked: dict[str, list[tuple[tuple[int, ...], Any]]] = {}
        for variable in distckpt.list_variables(checkpoint_path(checkpoint_dir)):
            parts = variable.name.split("/")
            if parts[0] != _TENSORS or variable.shape is None or len(parts) not in (2, 3):
                continue
            key = unescape_key(parts[1])
            if len(parts) == 3:  # a layer of a stacked tensor
                numbers = parts[2].split(".")
                if not all(n.isascii() and n.isdigit() for n in numbers):
                    raise distckpt.CorruptCheckpointError(
                        f"{variable.name}: a stacked tensor's layer is named by its offsets "
                        "along the stacked axes (like 0 or 1.2)"
                    )
                index = tuple(int(n) for n in numbers)
                held = stacked.setdefault(key, [])
                if held and len(held[0][0]) != len(index):
                    raise distckpt.CorruptCheckpointError(
                        f"{variable.name}: the layers of {key!r} name different numbers of "
                        "stacked axes"
                    )
                held.append((index, variable))
                continue
            empty = torch.empty(
                variable.shape, dtype=dtypes.torch_dtype(variable.dtype), device="meta"
            )
            metadata[key] = ShardedTensor.from_rank_offsets(key, empty).without_data()
        for key, layers in stacked.items():
            outer = tuple(
                max(index[d] for index, _ in layers) + 1 for d in range(len(layers[0][0]))
            )
            variable = layers[0][1]
            dtype = dtypes.torch_dtype(variable.dtype)
            # The layers' names say how many there are: a shape storage may declare.
            shape = wellformed.shape_of(
                {"shape": [*outer, *variable.shape]}, variable.name, dtype.itemsize
            )
            empty = torch.empty(shape, dtype=dtype, device="meta")
            metadata[key] = ShardedTensor.from_rank_offsets(key, empty).without_data()
        return metadata

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        for variable in distckpt.list_variables(checkpoint_path(checkpoint_dir)):
            group, _, name = variable.name.partition("/")
            if group == _OBJECTS:
                obj = ShardedObject.empty_from_unique_key(unescape_key(name))
                metadata[obj.unique_key] = obj
        metadata.update(self.load_tensors_metadata(checkpoint_dir))
        return metadata


def register_default_distckpt_strategies() -> None:
    """Register the strategies under the backend name ``"distckpt"``, version 1 (done on
    import of this module)."""
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, DistckptSaveStrategy())
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, DistckptLoadStrategy())


register_default_distckpt_strategies()

__all__ = [
    "BACKEND",
    "VERSION",
    "DistckptLoadStrategy",
    "DistckptSaveStrategy",
    "SUBDIR",
    "checkpoint_path",
    "register_default_distckpt_strategies",
    "save_state",
]
