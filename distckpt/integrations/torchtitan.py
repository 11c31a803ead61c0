"""distckpt as torchtitan's checkpointer: :class:`DistckptCheckpointManager`, a subclass
of torchtitan's DCP ``CheckpointManager`` that keeps its schedule, its state (model
parts, optimizers, LR schedulers, dataloader, train state) and its options, and writes
and reads every native checkpoint through distckpt
(:mod:`distckpt.integrations.dcp`). Selected in a torchtitan config function::

    from distckpt.integrations.torchtitan import with_distckpt

    def llama3_8b_distckpt() -> Trainer.Config:
        return with_distckpt(llama3_8b())      # then --checkpoint.folder s3://bucket/run

What changes against torchtitan's own:

* each ``step-N`` is a committed distckpt checkpoint (atomic: a crash mid-save leaves
  the previous step whole, and resuming never picks a half-written step), checksummed,
  in any distckpt store (``checkpoint.folder`` may be ``s3://``, ``az://``, ``gs://``);
* resuming finds the newest *committed* ``step-N`` (torchtitan's looks for a
  ``.metadata`` file), and retention (``keep_latest_k``) deletes through the store;
* ``checkpoint.compression`` (``zstd``, ``blosc-zstd``, ``blosc-lz4``) compresses the
  stored tensors; a resume on another world size reshards, as with DCP.

Hugging Face exports and loads (``last_save_in_hf``, ``initial_load_in_hf``) stay
torchtitan's. ``async_mode`` is torchtitan's: ``async`` saves through ``dcp.async_save``
in a thread, ``async_with_pinned_mem`` in DCP's checkpoint process with torchtitan's
stager, both over torchtitan's gloo group, as its own checkpointer does.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torchtitan.components.checkpointer import MODEL, CheckpointManager
from torchtitan.components.checkpointer.dcp import AsyncMode

from distckpt.format.index import is_committed
from distckpt.integrations.dcp import DistckptReader, DistckptWriter
from distckpt.numbering import numbered
from distckpt.storage.registry import open_store

log = logging.getLogger("distckpt")


class DistckptCheckpointManager(CheckpointManager):
    """torchtitan's checkpoint manager, saving and resuming through distckpt."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        compression: str | None = None
        """Compression of the stored tensors: zstd, blosc-zstd, blosc-lz4, or none."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if self.compression == "none":
                self.compression = None

    def __init__(self, config: Config, **kwargs: Any) -> None:
        CheckpointManager.__init__(self, config, **kwargs)
        self.compression = config.compression
        self.in_flight: str | None = None  # the step an asynchronous save is writing

    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: Any,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        if to_hf:
            return super().dcp_save(
                state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
            )
        writer = DistckptWriter(checkpoint_id, compression=self.compression)
        self.in_flight = None if async_mode == AsyncMode.DISABLED else checkpoint_id
        if async_mode == AsyncMode.ASYNC:
            return dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)
        if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            return dcp.async_save(
                state_dict,
                storage_writer=writer,
                process_group=self.pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self.stager,
            )
        dcp.save(state_dict, storage_writer=writer)
        return None

    def dcp_load(
        self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool
    ) -> None:
        if from_hf:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        dcp.load(state_dict, storage_reader=DistckptReader(checkpoint_id))
        if MODEL in self.states:  # torchtitan flattens the model's states: put them back
            self.states[MODEL].load_state_dict(state_dict)

    def _find_load_step(self, folder: str = "") -> int:
        """The newest committed ``step-N`` of ``folder`` (default: the checkpoint folder)."""
        steps = self._steps(folder or self.folder)
        committed = [
            n for n, name in steps if is_committed(open_store(folder or self.folder).child(name))
        ]
        return max(committed, default=-1)

    def _purge_stale_checkpoints(self) -> None:
        """Rank 0: delete all but the newest ``keep_latest_k`` steps, through the store; a
        step an asynchronous save is still writing counts as one of them (torchtitan's
        own, writing in place, counts it too)."""
        if self.keep_latest_k <= 0 or (dist.is_initialized() and dist.get_rank() != 0):
            return
        store = open_store(self.folder)
        steps = self._steps(self.folder)
        writing = self.in_flight.rstrip("/").rsplit("/", 1)[-1] if self.in_flight else ""
        n = numbered(writing, "step-")
        if n is not None and writing not in {name for _, name in steps}:
            steps = sorted([*steps, (n, writing)])
        for _, name in steps[: -self.keep_latest_k]:
            log.info("removing %s (keep_latest_k=%d)", store.where(name), self.keep_latest_k)
            store.delete_tree(name)

    @staticmethod
    def _steps(folder: str) -> list[tuple[int, str]]:
        found = [(numbered(name, "step-"), name) for name in open_store(folder).list()]
        return sorted((n, name) for n, name in found if n is not None)


def with_distckpt(config: Any, **changes: Any) -> Any:
    """``config`` (a torchtitan ``Trainer.Config``) with its checkpoint section made a
    :class:`DistckptCheckpointManager.Config`, every setting kept; ``changes`` set fields
    of it (``compression="zstd"``)."""
    old = config.checkpoint
    kept = {
        f.name: getattr(old, f.name)
        for f in dataclasses.fields(old)
        if f.init
        and f.name in {g.name for g in dataclasses.fields(DistckptCheckpointManager.Config)}
    }
    config.checkpoint = DistckptCheckpointManager.Config(**{**kept, **changes})
    return config
