"""distckpt as DeepSpeed's checkpoint engine (``save_checkpoint`` / ``load_checkpoint``).

DeepSpeed writes a checkpoint through a ``CheckpointEngine``: ``create(info)``, then each
process ``save(state_dict, path)`` for the files it owns (``mp_rank_00_model_states.pt``
from data-parallel rank 0, ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` from ZeRO rank
``r``), then ``commit(info)`` on every process. :class:`DistckptCheckpointEngine` keeps
the ``save`` calls in memory and writes them at ``commit`` as ONE distckpt checkpoint at
``save_dir/tag``, committed atomically; ``load(path)`` reads one file's dict back::

    from distckpt.integrations.deepspeed import use_distckpt

    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config, ...)
    use_distckpt(engine)                       # every process, once
    engine.save_checkpoint("run", tag="step-100")
    engine.load_checkpoint("run", tag="step-100")

(DeepSpeed chooses its engine from its config, with no entry for one of another library:
:func:`use_distckpt` sets ``engine.checkpoint_engine``.)

Each file's dict is stored under the file's name, its tensors as zarr arrays written by
the process that saved the file (``mp_rank_00_model_states.pt/module/0.weight``), and
beside it, as the value ``<file name>.structure``, the containers it was made of
(:mod:`distckpt.integrations.trees`). Nothing is pickled: the objects DeepSpeed puts in
these dicts that are not tensors or plain values -- ``torch.Size`` (``param_shapes``),
``torch.dtype``, ``torch.device``, the ZeRO stage, ``fragment_address`` and loss scalers
-- are typed values of a closed table (:mod:`distckpt.integrations.deepspeed.types`):
a load rebuilds exactly these types, from plain checked fields, and no stored byte names
a class, a module or a function. Other objects are refused unless the engine is made
with ``options=CheckpointOptions(allow_pickle=True)`` (they are then pickled, and a load
unpickles them only with that option too). ``OrderedDict`` comes back as ``dict``.

DeepSpeed checks that the files it is about to load exist: a file's name is the folder
of its arrays, and for a file that holds no tensor ``commit`` leaves, after the
checkpoint is committed, a small text file at that path naming the checkpoint. ``load``
reads only the distckpt checkpoint.

Changes of the number of processes are those DeepSpeed itself allows: a ``load`` may be
asked for any file by any process (each reads its own, no collective), so the model
states, and with ZeRO stage 0 the optimizer (it is in the model states file), load on
any number of processes; with ZeRO stages 1 and 2 DeepSpeed refuses optimizer states
saved with another data-parallel size (its "universal checkpoint" conversion), while
``load_checkpoint(..., load_optimizer_states=False)`` loads the model. With ZeRO stage 3
DeepSpeed refuses optimizer states saved with another data-parallel size too, and
``load_optimizer_states=False`` makes it rebuild the model with ``zero_to_fp32``, which
reads the ``.pt`` files itself with ``torch.load``, not through the checkpoint engine:
:func:`use_distckpt` makes such a call a :class:`distckpt.ConversionError` saying so
before anything is read (on any number of processes). The same goes for DeepSpeed's
``zero_to_fp32.py`` script and its universal-checkpoint conversion, which do not read
these checkpoints.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from typing import Any

import torch

import distckpt
from distckpt.comm.single import SingleComm
from distckpt.format.index import read_index_bytes
from distckpt.integrations import trees
from distckpt.integrations.deepspeed.types import NEEDS_DEEPSPEED, TYPE_TAG, decode, encode
from distckpt.items import has_tensor
from distckpt.storage.registry import open_store
from distckpt.training.session import StoredCheckpoint

try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
        CheckpointCommitInfo,
        CheckpointEngine,
    )
except ImportError as exc:  # the module imports; using it says which extra to install
    _MISSING: ImportError | None = exc
    CheckpointEngine = object
    CheckpointCommitInfo = Any
else:
    _MISSING = None


def _require_deepspeed() -> None:
    if _MISSING is not None:
        raise ImportError(NEEDS_DEEPSPEED) from _MISSING


STRUCTURE_SUFFIX = ".structure"
ENGINE_NAME = "DistckptCheckpointEngine"
STUB = "distckpt checkpoint: {checkpoint}\nfile: {name}\n"


def use_distckpt(
    engine: Any,
    options: distckpt.CheckpointOptions | None = None,
    *,
    overwrite: bool | None = None,
) -> Any:
    """Make ``engine`` (a ``DeepSpeedEngine``) save and load its checkpoints with distckpt;
    returns the :class:`DistckptCheckpointEngine` it now uses. Every process calls it."""
    _require_deepspeed()
    if getattr(engine, "use_node_local_storage", lambda: False)():
        raise ValueError(
            "distckpt's DeepSpeed engine writes one checkpoint per save for the whole job; "
            "DeepSpeed's use_node_local_storage (each node writes its own copy) is not supported"
        )
    engine.checkpoint_engine = DistckptCheckpointEngine(options=options, overwrite=overwrite)
    if not getattr(engine.load_checkpoint, GUARDED, False):
        engine.load_checkpoint = _guarded(engine, engine.load_checkpoint)
    return engine.checkpoint_engine


GUARDED = "_distckpt_guarded"


def _guarded(engine: Any, load_checkpoint: Any) -> Any:
    """``engine.load_checkpoint`` refusing, while distckpt's engine is the engine's, the
    one load that bypasses the checkpoint engine: ZeRO stage 3 with
    ``load_optimizer_states=False``, where DeepSpeed rebuilds the model from the files with
    ``torch.load`` (``zero_to_fp32``) and would fail on a folder of distckpt's."""
    signature = inspect.signature(load_checkpoint)

    @functools.wraps(load_checkpoint)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        if (
            isinstance(engine.checkpoint_engine, DistckptCheckpointEngine)
            and engine.zero_optimization_partition_weights()
            and not call.arguments["load_optimizer_states"]
            and not getattr(engine, "has_moe_layers", False)
        ):
            raise distckpt.ConversionError(
                f"{call.arguments['load_dir']}: DeepSpeed loads a ZeRO stage 3 model without "
                "its optimizer states (load_optimizer_states=False) by converting the "
                "checkpoint's files with its zero_to_fp32, which reads them with torch.load, "
                "not through distckpt's checkpoint engine. Load with the optimizer states "
                "(load_optimizer_states=True, the default) on the number of processes that "
                "saved it; to load on another number of processes, save with DeepSpeed's "
                "own engine (engine.checkpoint_engine = TorchCheckpointEngine()) and use "
                "DeepSpeed's universal checkpoint"
            )
        return load_checkpoint(*args, **kwargs)

    setattr(guarded, GUARDED, True)
    return guarded


class DistckptCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    """A DeepSpeed ``CheckpointEngine`` that writes each ``save_checkpoint`` as one
    committed distckpt checkpoint (see the module docstring). ``options`` (a
    :class:`distckpt.CheckpointOptions`) applies to its saves and loads. A tag that already
    holds a committed checkpoint is not saved again (:class:`distckpt.CheckpointExists`)
    unless ``overwrite=True`` (or, when ``overwrite`` is not given, ``options.overwrite``).
    Its saves never build on an earlier checkpoint, so they hash nothing for a later save
    to compare with (``options.incremental`` is not used); checksums are as always."""

    def __init__(
        self,
        config_params: Any = None,
        *,
        options: distckpt.CheckpointOptions | None = None,
        overwrite: bool | None = None,
    ) -> None:
        _require_deepspeed()
        super().__init__(config_params)
        self.name = ENGINE_NAME
        self.options = options or distckpt.CheckpointOptions()
        self.overwrite = overwrite
        self._pending: dict[str, dict[str, Any]] = {}  # checkpoint dir -> {file name: dict}
        self._info: CheckpointCommitInfo | None = None
        # The checkpoint of the last load, with its index's bytes: DeepSpeed loads several
        # files of one tag in a row, and each reuses the index parsed for the first.
        self._source: tuple[str, bytes, StoredCheckpoint] | None = None

    # -- saving --------------------------------------------------------------------------

    def create(self, info: CheckpointCommitInfo) -> None:
        self._info = info
        self._pending = {}

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        path = os.path.abspath(os.fspath(path))
        folder, name = os.path.split(path)
        if self._info is not None:
            expected = os.path.abspath(os.path.join(self._info.save_dir, self._info.tag))
            if folder != expected:
                raise ValueError(
                    f"{path}: distckpt's DeepSpeed engine saves files directly under the "
                    f"checkpoint's folder {expected}"
                )
        files = self._pending.setdefault(folder, {})
        if name in files:
            raise ValueError(f"{path} is saved twice in one checkpoint")
        files[name] = encode(state_dict, name)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Collective: every process writes the files it saved since ``create``, as one
        checkpoint at ``save_dir/tag``."""
        folder = os.path.abspath(os.path.join(info.save_dir, info.tag))
        pending = self._pending.pop(folder, {})
        if self._pending:
            raise ValueError(f"files saved outside {folder}: {sorted(self._pending)}")
        state: dict[str, Any] = {}
        for name, tree in pending.items():
            state[name] = _shards(tree)
            state[name + STRUCTURE_SUFFIX] = trees.structure(tree)
        # DeepSpeed made the folder, empty, for its files: distckpt commits into it. No
        # save of this engine builds on an earlier one (it names no base), so none hashes
        # what it writes for a later save to compare with (``incremental``).
        options = dataclasses.replace(self.options, incremental=False)
        if self.overwrite is not None:
            options = dataclasses.replace(options, overwrite=self.overwrite)
        distckpt.save(state, folder, options=options)
        for name in pending:
            if os.path.exists(os.path.join(folder, name)):
                continue  # the zarr group of the file's tensors
            with open(os.path.join(folder, name), "w") as stub:
                stub.write(STUB.format(checkpoint=folder, name=name))
        self._info = None
        return True

    # -- loading -------------------------------------------------------------------------

    def load(self, path: str, map_location: Any = None) -> Any:
        """The dict saved at ``path``, read by this process alone (DeepSpeed asks each
        process for the files it needs). Tensors are on the CPU, as DeepSpeed's loads
        ask (``map_location`` is otherwise not applied)."""
        folder, name = os.path.split(os.path.abspath(os.fspath(path)))
        comm = SingleComm()
        source = self._checkpoint(folder, comm)
        tree = trees.read_tree(
            source, comm, self.options, name, name + STRUCTURE_SUFFIX, strict=False
        )
        if tree is None:
            raise distckpt.CheckpointNotFoundError(f"{folder} holds no file {name!r}")
        return decode(tree, name)

    def _checkpoint(self, folder: str, comm: SingleComm) -> StoredCheckpoint:
        """The checkpoint at ``folder``, its index parsed once for the loads of a tag: the
        last load's while the index's bytes are the same (a tag saved again has another
        index) and it is not signed (a signed one is checked afresh at every load)."""
        raw = read_index_bytes(open_store(folder))
        if self._source is not None and self._source[:2] == (folder, raw):
            return self._source[2]
        source = StoredCheckpoint(folder, comm, self.options.trusted_keys)
        unsigned = source.index.signed_by is None
        self._source = (folder, raw, source) if unsigned else None
        return source

    def preserves_storage_sharing(self) -> bool:
        # Each tensor is written as its own array: views are not kept as views.
        return False


def _shards(tree: Any) -> Any:
    """``tree`` with each tensor as a :class:`distckpt.Shard` covering the whole of it:
    written by this process alone, under a name no other process saves."""
    if isinstance(tree, torch.Tensor):
        t = tree.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        return distckpt.Shard(t.contiguous(), tuple(t.shape), (0,) * t.dim())
    if isinstance(tree, dict):
        return {k: _shards(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and has_tensor(tree):
        return [_shards(v) for v in tree]
    return tree


__all__ = ["TYPE_TAG", "DistckptCheckpointEngine", "use_distckpt"]
