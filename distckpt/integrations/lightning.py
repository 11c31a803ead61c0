"""distckpt as PyTorch Lightning's checkpoint format: :class:`DistckptCheckpointIO`.

One argument to the ``Trainer``; ``ModelCheckpoint`` (its ``save_top_k`` retention,
``save_last``) and ``ckpt_path="last"`` work as before::

    from distckpt.integrations.lightning import DistckptCheckpointIO

    trainer = Trainer(strategy="ddp", plugins=[DistckptCheckpointIO()])
    trainer.fit(model, ckpt_path="last")

Each ``*.ckpt`` path becomes a distckpt checkpoint (a directory, or a prefix of an object
store for ``s3://...`` paths): committed atomically, checksummed, its tensors readable
by plain zarr readers under ``data/``. The loops' progress, the callbacks' states and
the hyper-parameters travel as typed values; an object that is none of those is
refused unless ``allow_pickle=True``.

Which ranks call it. Lightning's strategies (DDP, single device, and FSDP or
ModelParallel with a *full* state dict) call ``save_checkpoint`` and
``remove_checkpoint`` on global rank 0 only, with the whole state in hand (DDP
replicates it): this plugin writes it from that rank alone, with a one-rank
communicator, so no rank waits in a collective that the others never enter (they wait
in Lightning's barrier after the save). ``load_checkpoint`` is called on every rank when
a fit resumes: the load is collective over the job's ``torch.distributed`` group (one
read per byte, shared), or one process's when none is initialized. Sharded states
(FSDP's and ModelParallel's ``state_dict_type="sharded"``) are written by Lightning
through ``torch.distributed.checkpoint``, not through a ``CheckpointIO``: for FSDP2
under ``ModelParallelStrategy`` use :class:`DistckptModelParallelStrategy` instead, whose
``save_checkpoint`` every rank calls (each writes its DTensor shards, rank 0 the rest)
and whose ``load_checkpoint`` fills the job's own shards, on any world size. Lightning's
dict already holds the shards as DTensors, so distckpt writes them as they lie: no
``torch.distributed.checkpoint`` in between.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy

import distckpt
from distckpt.comm import Communicator, SingleComm, auto
from distckpt.integrations.trees import load_tree, save_tree


class DistckptCheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` that writes and reads distckpt checkpoints.

    ``options`` (a :class:`distckpt.CheckpointOptions`) and its fields as keywords
    (``compression``, ``allow_pickle``, ``io_workers``, ...) apply to every save and load;
    a ``Trainer.save_checkpoint(..., storage_options=CheckpointOptions(...))`` replaces
    them for that save. A save replaces a checkpoint at the same path atomically (as
    ``last.ckpt`` is, every time). ``comm`` is the communicator of loads (default: found
    from the job, see :func:`distckpt.comm.auto`).
    """

    def __init__(
        self,
        options: distckpt.CheckpointOptions | None = None,
        *,
        comm: Communicator | None = None,
        **keywords: Any,
    ) -> None:
        self.options = (options or distckpt.CheckpointOptions()).replace(**keywords)
        self.comm = comm
        #: What the last save wrote (and took unchanged from the one before it).
        self.last_result: distckpt.SaveResult | None = None

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike[str],
        storage_options: Any | None = None,
    ) -> None:
        """Write ``checkpoint`` at ``path`` (called on global rank 0 only, by Lightning)."""
        options = self.options if storage_options is None else storage_options
        if not isinstance(options, distckpt.CheckpointOptions):
            raise TypeError(
                "DistckptCheckpointIO takes storage_options=distckpt.CheckpointOptions(...), "
                f"got {type(storage_options).__name__}"
            )
        self.last_result = save_tree(
            checkpoint,
            path,
            SingleComm(),
            base=_base(self.last_result, path),
            options=options.replace(overwrite=True),
        )

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """The checkpoint dict saved at ``path``; every rank of the job calls it together.

        Nothing is unpickled unless the plugin was made with ``allow_pickle=True``
        (``weights_only`` has nothing more to restrict). The tensors are on the CPU, or
        moved to ``map_location`` when it names a device.
        """
        checkpoint = load_tree(path, self.comm or auto(), options=self.options)
        if isinstance(map_location, (str, torch.device)):
            device = torch.device(map_location)
            return _to(checkpoint, device)  # type: ignore[no-any-return]
        return checkpoint

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete the checkpoint at ``path`` whole (never a half-deleted one in sight)."""
        distckpt.remove(path, missing_ok=True)


def _base(last: distckpt.SaveResult | None, path: str | os.PathLike[str]) -> str | None:
    """What a save at ``path`` builds on: the checkpoint saved before (at a step,
    ``last.ckpt`` repeats the step's checkpoint), whose unchanged pieces become hard links
    or server-side copies instead of writes; None for the first save, or the same path."""
    if last is None or os.fspath(last.path) == os.fspath(path):
        return None
    return os.fspath(last.path)


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_to(v, device) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    return obj


class DistckptModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` whose sharded checkpoints are distckpt
    checkpoints, written by every rank (its DTensor shards) and read back resharded
    onto any world size; ``distckpt_options`` (a :class:`distckpt.CheckpointOptions`)
    applies to every save and load. With ``save_distributed_checkpoint=False`` the
    full state goes through the ``CheckpointIO`` on rank 0, as in Lightning."""

    def __init__(
        self,
        *args: Any,
        distckpt_options: distckpt.CheckpointOptions | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.distckpt_options = distckpt_options or distckpt.CheckpointOptions()
        #: What the last sharded save wrote (and took unchanged from the one before it).
        self.last_result: distckpt.SaveResult | None = None

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        filepath: str | os.PathLike[str],
        storage_options: Any | None = None,
    ) -> None:
        if not self._save_distributed_checkpoint:
            super().save_checkpoint(checkpoint, os.fspath(filepath), storage_options)
            return
        path = self.broadcast(os.fspath(filepath))  # every rank writes to rank 0's path
        self.last_result = save_tree(
            checkpoint,
            path,
            auto(),
            whole=self.global_rank == 0,  # Lightning keeps rank 0's unsharded state
            base=_base(self.last_result, path),
            options=self.distckpt_options.replace(overwrite=True),
        )

    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike[str], weights_only: bool | None = None
    ) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = self.broadcast(os.fspath(checkpoint_path))
        model, module = self.model, self.lightning_module
        if model is None or module is None:
            raise RuntimeError("load_checkpoint before the strategy has its model")
        sharded = StateDictOptions(full_state_dict=False)
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        targets = {
            "state_dict": get_model_state_dict(model, options=sharded),
            "optimizer_states": [
                get_optimizer_state_dict(model, o, options=sharded) for o in optimizers
            ],
        }
        checkpoint = load_tree(path, auto(), targets=targets, options=self.distckpt_options)
        strict = StateDictOptions(strict=module.strict_loading)
        set_model_state_dict(model, checkpoint["state_dict"], options=strict)
        for optimizer, state in zip(optimizers, checkpoint.get("optimizer_states", [])):
            set_optimizer_state_dict(model, optimizer, state, options=sharded)
        return checkpoint

    def remove_checkpoint(self, filepath: str | os.PathLike[str]) -> None:
        if self.is_global_zero:
            distckpt.remove(filepath, missing_ok=True)
