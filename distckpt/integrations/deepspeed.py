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
``torch.dtype``, ``torch.device``, enums (``zero_stage``), dataclasses
(``fragment_address``) and loss scalers -- are stored as typed values naming their class,
and rebuilt only for these torch types and classes of the ``deepspeed`` package. Anything
else is refused unless the engine is made with
``options=CheckpointOptions(allow_pickle=True)``. ``OrderedDict`` comes back as ``dict``.

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
a load on another number of processes is not supported: DeepSpeed then reads the files
itself with ``torch.load`` (``zero_to_fp32``), not through the checkpoint engine; the same
goes for DeepSpeed's ``zero_to_fp32.py`` script and its universal-checkpoint conversion.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import os
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)

import distckpt
from distckpt.comm.single import SingleComm
from distckpt.integrations import trees
from distckpt.items import has_tensor
from distckpt.training.session import StoredCheckpoint

STRUCTURE_SUFFIX = ".structure"
TYPE_TAG = "__distckpt_type__"
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
    if getattr(engine, "use_node_local_storage", lambda: False)():
        raise ValueError(
            "distckpt's DeepSpeed engine writes one checkpoint per save for the whole job; "
            "DeepSpeed's use_node_local_storage (each node writes its own copy) is not supported"
        )
    engine.checkpoint_engine = DistckptCheckpointEngine(options=options, overwrite=overwrite)
    return engine.checkpoint_engine


class DistckptCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    """A DeepSpeed ``CheckpointEngine`` that writes each ``save_checkpoint`` as one
    committed distckpt checkpoint (see the module docstring). ``options`` (a
    :class:`distckpt.CheckpointOptions`) applies to its saves and loads. A tag that already
    holds a committed checkpoint is not saved again (:class:`distckpt.CheckpointExists`)
    unless ``overwrite=True`` (or, when ``overwrite`` is not given, ``options.overwrite``)."""

    def __init__(
        self,
        config_params: Any = None,
        *,
        options: distckpt.CheckpointOptions | None = None,
        overwrite: bool | None = None,
    ) -> None:
        super().__init__(config_params)
        self.name = ENGINE_NAME
        self.options = options or distckpt.CheckpointOptions()
        self.overwrite = overwrite
        self._pending: dict[str, dict[str, Any]] = {}  # checkpoint dir -> {file name: dict}
        self._info: CheckpointCommitInfo | None = None

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
        files[name] = _encode(state_dict)

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
        # DeepSpeed made the folder, empty, for its files: distckpt commits into it.
        options = self.options
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
        source = StoredCheckpoint(folder, comm)
        tree = trees.read_tree(
            source, comm, self.options, name, name + STRUCTURE_SUFFIX, strict=False
        )
        if tree is None:
            raise distckpt.CheckpointNotFoundError(f"{folder} holds no file {name!r}")
        return _decode(tree)

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


def _qualname(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _encode(obj: Any) -> Any:
    """``obj`` with DeepSpeed's objects (``torch.Size``, enums, dataclasses, loss scalers
    of the ``deepspeed`` package) as typed dicts that :func:`_decode` turns back."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, torch.Size):
        return {TYPE_TAG: "torch.Size", "value": list(obj)}
    if isinstance(obj, torch.dtype):
        return {TYPE_TAG: "torch.dtype", "value": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {TYPE_TAG: "torch.device", "value": str(obj)}
    if isinstance(obj, dict):
        return {k: _encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        items = [_encode(v) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    cls = type(obj)
    if cls.__module__.split(".")[0] != "deepspeed":
        return obj  # plain values, or what distckpt refuses unless allow_pickle
    if isinstance(obj, enum.Enum):
        return {TYPE_TAG: _qualname(cls), "enum": _encode(obj.value)}
    if dataclasses.is_dataclass(obj):
        fields = {f.name: _encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {TYPE_TAG: _qualname(cls), "fields": fields}
    if hasattr(obj, "__dict__"):
        return {TYPE_TAG: _qualname(cls), "attributes": _encode(dict(vars(obj)))}
    return obj


def _class(name: str) -> Any:
    module, _, qualname = name.partition(":")
    if module.split(".")[0] != "deepspeed" or not qualname:
        raise distckpt.CorruptCheckpointError(f"{TYPE_TAG} {name!r}: not a class of deepspeed")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    if not isinstance(found, type):
        raise distckpt.CorruptCheckpointError(f"{TYPE_TAG} {name!r}: not a class")
    return found


def _decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        tag = obj.get(TYPE_TAG)
        if isinstance(tag, str):
            try:
                return _typed(tag, obj)
            except distckpt.CorruptCheckpointError:
                raise
            except (
                LookupError,
                TypeError,
                ValueError,
                AttributeError,
                RuntimeError,
                ImportError,
            ) as exc:
                raise distckpt.CorruptCheckpointError(
                    f"{TYPE_TAG} {tag!r}: the stored value does not make one "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_decode(v) for v in obj)
    return obj


def _typed(tag: str, obj: dict[str, Any]) -> Any:
    """The object a typed value (``tag`` and its dict, as read from storage) stands for."""
    if tag == "torch.Size":
        return torch.Size(obj["value"])
    if tag == "torch.dtype":
        dtype = getattr(torch, str(obj["value"]), None)
        if not isinstance(dtype, torch.dtype):
            raise distckpt.CorruptCheckpointError(f"not a torch dtype: {obj['value']!r}")
        return dtype
    if tag == "torch.device":
        return torch.device(obj["value"])
    cls = _class(tag)
    if "enum" in obj:
        return cls(_decode(obj["enum"]))
    if "fields" in obj:
        return cls(**{k: _decode(v) for k, v in obj["fields"].items()})
    made = cls.__new__(cls)
    made.__dict__.update({k: _decode(v) for k, v in obj["attributes"].items()})
    return made


__all__ = ["DistckptCheckpointEngine", "use_distckpt"]
