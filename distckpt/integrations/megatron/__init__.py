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
  named by its ``key``, its ``prepend_axis_num`` prepended axes (Megatron's stacked
  layers) included as leading axes of length one: all of a key's boxes make one variable
  ``tensors/<key>`` of Megatron's ``global_shape``. Only the main replica (``replica_id``
  0 or all zeros) writes it. A load maps each leaf's box onto that variable, so a tensor
  saved with any stacking loads under any other: plain as stacked, stacked as plain, or
  with another number of prepended axes. Checkpoints written before, which stored a
  stacked tensor one variable per layer (``tensors/<key>/<layer>``), load the same way;
  a save still writes that layout for a key some rank holds in boxes that do not make one
  box (an interleaved pipeline's layers), agreed by one collective
  (:mod:`~distckpt.integrations.megatron.layout`);
* a ``ShardedObject`` is serialised with ``torch.save`` and stored as a byte tensor
  ``objects/<unique_key>``, written by its main replica; a load reads it with
  ``torch.load(weights_only=True)``, as Megatron's own backends do: torch's restricted
  unpickler, which builds tensors, plain containers and the classes torch and
  megatron-core register (``add_safe_globals``), and nothing else. What it refuses is an
  error naming the object, unless the load strategy is made with ``allow_pickle=True``.

The distributed optimizer: megatron-core 0.16's reshardable formats give regular leaves.
``dp_reshardable`` cuts each bucket's data-parallel range into one
``ShardedTensor`` per parameter and padding, all of the bucket's key, so a rank holds
several boxes of one tensor: they make one box, saved as such (copied into one host
tensor) and read back as the smallest box holding them, then cut (views of it).
``fully_reshardable`` gives each parameter's state the parameter's own sharding.
Flattened ranges (``ShardedTensor.flattened_range``, the older ``fully_sharded_model_space``
format) are refused by megatron-core 0.16 itself when a ShardedTensor is made; one that
still carries a flattened range is refused here with a clear error.

A load reads a tensor asked for in one box straight into the leaf's own tensor (its data,
detached: the same memory), as Megatron's own strategies do. A leaf of another dtype
than the stored tensor gets the stored values cast to its dtype, as with ``torch_dist``. A leaf with
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

Requires ``megatron-core`` (the ``megatron`` extra). Without it this module still
imports, and making a strategy or calling :func:`save_state` raises an ImportError that
names the extra.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import distckpt
from distckpt import dtypes
from distckpt.integrations.megatron.imports import (
    MISSING,
    AsyncRequest,
    AsyncSaveShardedStrategy,
    CheckpointingException,
    LoadShardedStrategy,
    ShardedObject,
    ShardedTensor,
    StrategyAction,
    register_default_strategy,
    require,
)
from distckpt.integrations.megatron.layout import layouts
from distckpt.integrations.megatron.leaves import (
    _OBJECTS,
    BACKEND,
    SUBDIR,
    VERSION,
    checkpoint_path,
    save_state,
    unjoined,
)
from distckpt.integrations.megatron.loading import load_state
from distckpt.naming import unescape_key
from distckpt.pipeline import communicator


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
        require()
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
        comm = communicator(self.comm)
        self.result = distckpt.save(
            save_state(sharded_state_dict, _layered(sharded_state_dict, comm)),
            checkpoint_path(checkpoint_dir),
            comm,
            **self.save_keywords,
        )

    def pending(self) -> bool:
        """Whether the last :meth:`async_save` is still writing on this rank (this rank's
        answer: reduce it over the ranks before a collective such as Megatron's
        ``maybe_finalize_async_calls``)."""
        return self._handle is not None and not self._handle.done()

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> AsyncRequest:
        comm = communicator(self.comm)
        self._handle = handle = distckpt.save(
            save_state(sharded_state_dict, _layered(sharded_state_dict, comm)),
            checkpoint_path(checkpoint_dir),
            comm,
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
        require()
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
        return load_state(sharded_state_dict, checkpoint_dir, self.comm, self.load_keywords)

    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> dict[str, ShardedTensor]:
        """Each stored tensor's key, global shape (prepended axes included) and dtype,
        whichever layout it is stored in."""
        variables = distckpt.list_variables(checkpoint_path(checkpoint_dir))
        metadata: dict[str, ShardedTensor] = {}
        for key, layout in layouts(variables).items():
            dtype = dtypes.torch_dtype(layout.dtype)
            empty = torch.empty(layout.shape, dtype=dtype, device="meta")
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


def _layered(sharded_state_dict: Any, comm: Any) -> list[str]:
    """Collective: the keys some rank holds boxes of that make no one box (an interleaved
    pipeline's layers), which every rank then stores one variable per layer."""
    return sorted({key for keys in comm.allgather(unjoined(sharded_state_dict)) for key in keys})


def register_default_distckpt_strategies() -> None:
    """Register the strategies under the backend name ``"distckpt"``, version 1 (done on
    import of this module, with megatron-core installed)."""
    require()
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, DistckptSaveStrategy())
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, DistckptLoadStrategy())


if MISSING is None:
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
