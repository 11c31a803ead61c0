"""A framework's checkpoint dict saved as is, and loaded back without a target.

:func:`distckpt.load` fills a state the caller built; a framework that asks for "the
checkpoint at this path" (Lightning's ``CheckpointIO.load_checkpoint``) has none. So
:func:`save_tree` stores, beside the dict, its *structure*: a typed value that records
each container distckpt names through (dicts that hold tensors, with their keys as they
were, ``int`` or ``str``; lists and tuples that hold tensors) and marks each leaf as a
tensor or a value. :func:`load_tree` builds the target from that structure and the shapes
and dtypes of the index, loads into it, and gives back the dict with its key types and
tuples as saved::

    save_tree({"state_dict": model.state_dict(), "epoch": 3}, "run/epoch=3.ckpt")
    checkpoint = load_tree("run/epoch=3.ckpt")

The dict is stored under ``data/`` (``data/state_dict/l1.weight`` is a zarr array that
plain zarr readers open) and the structure as the value ``structure``. Everything else
is refused unless ``allow_pickle=True`` is passed (as :func:`distckpt.save` does).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

import distckpt
from distckpt import dtypes
from distckpt.comm import Communicator
from distckpt.engine.inspect import index_variables
from distckpt.format.backed import check_stored
from distckpt.format.index import pieces_of
from distckpt.items import has_tensor, is_dtensor
from distckpt.naming import escape_key
from distckpt.pipeline.clock import communicator
from distckpt.pipeline.options import LOAD, merge
from distckpt.training.session import StoredCheckpoint

DATA = "data"
STRUCTURE = "structure"
TENSOR = "tensor"
VALUE = "value"


def structure(obj: Any, root: bool = True) -> Any:
    """The structure of ``obj`` as distckpt names it (see the module docstring): a dict is
    ``("dict", [(key, child), ...])``, a list or tuple ``("list" | "tuple", [child, ...])``,
    a tensor ``"tensor"`` and any other leaf ``"value"`` (stored whole, typed)."""
    if isinstance(obj, dict) and (root or has_tensor(obj)):
        return ("dict", [(k, structure(v, False)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)) and has_tensor(obj):
        kind = "tuple" if isinstance(obj, tuple) else "list"
        return (kind, [structure(v, False) for v in obj])
    return TENSOR if isinstance(obj, torch.Tensor) else VALUE


def save_tree(
    tree: dict[str, Any],
    path: str | os.PathLike[str],
    comm: Communicator | None = None,
    *,
    whole: bool = True,
    **keywords: Any,
) -> distckpt.SaveResult:
    """Save ``tree`` (a framework's checkpoint dict) and its structure at ``path``;
    ``keywords`` are :func:`distckpt.save`'s (``options``, ``overwrite``, ...).

    Collective over ``comm``. A sharded framework (Lightning's ModelParallel) holds the
    same dict on every rank but for its DTensors, and keeps what is not sharded from one
    rank: that rank passes ``whole=True``, the others ``whole=False`` and contribute only
    their DTensor shards (under the same names).
    """
    state = {DATA: tree, STRUCTURE: structure(tree)} if whole else {DATA: _shards(tree) or {}}
    return distckpt.save(state, path, comm, **keywords)


def _shards(obj: Any) -> Any:
    """The DTensors of ``obj`` where distckpt names them (lists as int-keyed dicts, which
    name their entries alike); None where there are none."""
    if is_dtensor(obj):
        return obj
    items: Any = ()
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    kept = {k: part for k, v in items if (part := _shards(v)) is not None}
    return kept or None


def load_tree(
    path: str | os.PathLike[str],
    comm: Communicator | None = None,
    *,
    max_bytes: int | None = None,
    targets: dict[str, Any] | None = None,
    **keywords: Any,
) -> dict[str, Any]:
    """The dict :func:`save_tree` saved at ``path``, its tensors on the CPU.

    The tensors are allocated from the shapes the index declares, whose total is checked
    first against ``max_bytes`` (default: this machine's memory). ``targets`` (a part of
    the dict, nested alike) gives tensors of its own for some names, DTensors of the
    job's layout among them: those are filled in place (each rank reads its shards) and
    are what the returned dict holds there. ``keywords`` are :func:`distckpt.load`'s
    (``options``, ``allow_pickle``, ``io_workers``).
    """
    keywords.pop("strict", None)
    options = merge(keywords.pop("options", None), keywords, LOAD, "load_tree")
    comm = communicator(comm)
    source = StoredCheckpoint(path, comm, options.trusted_keys)
    tree = read_tree(source, comm, options, DATA, STRUCTURE, max_bytes=max_bytes, targets=targets)
    if tree is None:
        raise distckpt.CheckpointError(
            f"{path} was not written by distckpt.integrations (it has no {STRUCTURE!r} value); "
            "load it with distckpt.load and a state of your own"
        )
    return tree  # type: ignore[no-any-return]


def read_tree(
    source: StoredCheckpoint,
    comm: Communicator,
    options: distckpt.CheckpointOptions,
    data: str,
    structure_key: str,
    *,
    strict: bool = True,
    max_bytes: int | None = None,
    targets: Any = None,
) -> Any:
    """Collective: the tree stored under the key ``data`` of ``source``, with its
    structure under ``structure_key``; None when the checkpoint has no such structure.
    Two loads from the index ``source`` read once: the structure, then the tensors, into
    tensors allocated from the shapes the index declares (their total checked first
    against ``max_bytes``, default this machine's memory, and each against what its files
    hold: :func:`~distckpt.format.backed.check_stored`) or into ``targets``' own.
    ``strict``: every stored name must be the tree's or its structure's."""
    head: dict[str, Any] = {structure_key: None}
    source.load(head, comm, options.replace(strict=False))
    node = head[structure_key]
    if node is None:
        return None
    prefix = escape_key(data)
    shapes = {
        v.name: (v.shape, v.dtype)
        for v in index_variables(source.index)
        if v.shape is not None and v.name.startswith(prefix + "/")
    }
    limit = _memory() if max_bytes is None else max_bytes
    given = _given_names(targets, prefix)
    declared = sum(
        math.prod(shape) * _dtype(dtype, name).itemsize
        for name, (shape, dtype) in shapes.items()
        if name not in given
    )
    if declared > limit:
        raise distckpt.CheckpointError(
            f"{source.path} declares {declared} bytes of tensors under {data!r}, more than "
            f"the {limit} allowed (max_bytes, default this machine's memory)"
        )
    for name in shapes.keys() - given:  # each allocated only once its files can fill it
        check_stored(source.store, pieces_of(source.index, source.index["variables"][name], name))
    state = {data: _target(node, prefix, shapes, targets), structure_key: None}
    source.load(state, comm, options.replace(strict=strict))
    return _rebuild(state[data], node)


def _memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def _dtype(name: str, variable: str) -> torch.dtype:
    """The torch dtype of a stored variable, from distckpt's one table of them."""
    try:
        return dtypes.torch_dtype(name)
    except distckpt.UnsupportedValueError:
        raise distckpt.CorruptCheckpointError(
            f"variable {variable!r}: unknown dtype {name!r}"
        ) from None


def _malformed(name: str, what: str) -> distckpt.CorruptCheckpointError:
    return distckpt.CorruptCheckpointError(f"{STRUCTURE!r} at {name!r}: {what}")


def _given_names(targets: Any, name: str) -> set[str]:
    if isinstance(targets, torch.Tensor):
        return {name}
    items: Any = ()
    if isinstance(targets, dict):
        items = targets.items()
    elif isinstance(targets, (list, tuple)):
        items = enumerate(targets)
    return {n for k, v in items for n in _given_names(v, f"{name}/{escape_key(str(k))}")}


def _child(given: Any, key: Any) -> Any:
    if isinstance(given, dict):
        return given.get(key)
    if isinstance(given, (list, tuple)) and isinstance(key, int) and 0 <= key < len(given):
        return given[key]
    return None


def _target(node: Any, name: str, shapes: dict[str, Any], given: Any) -> Any:
    """Mutable containers (tuples as lists: a load replaces values in place) holding an
    empty tensor (or the one ``given``) for every tensor leaf and None for every value."""
    if node == TENSOR:
        if name not in shapes:
            raise _malformed(name, "names a tensor the index does not hold")
        if isinstance(given, torch.Tensor):
            return given  # distckpt.load checks its shape and dtype against the index
        shape, dtype = shapes[name]
        return torch.empty(shape, dtype=_dtype(dtype, name))
    if node == VALUE:
        return None
    if not (isinstance(node, tuple) and len(node) == 2 and isinstance(node[1], list)):
        raise _malformed(name, f"not a container description: {node!r:.80}")
    kind, children = node
    if kind == "dict":
        out: dict[Any, Any] = {}
        for entry in children:
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise _malformed(name, "a dict entry is not a (key, child) pair")
            key, child = entry
            if not isinstance(key, (str, int)) or isinstance(key, bool) or key in out:
                raise _malformed(name, f"key {key!r:.80} is not a unique str or int")
            out[key] = _target(child, f"{name}/{escape_key(str(key))}", shapes, _child(given, key))
        return out
    if kind in ("list", "tuple"):
        return [_target(c, f"{name}/{i}", shapes, _child(given, i)) for i, c in enumerate(children)]
    raise _malformed(name, f"unknown container {kind!r:.40}")


def _rebuild(value: Any, node: Any) -> Any:
    """``value`` (from :func:`_target`, loaded) with the tuples of ``node`` restored."""
    if not isinstance(node, tuple):
        return value
    kind, children = node
    if kind == "dict":
        return {key: _rebuild(value[key], child) for key, child in children}
    items = [_rebuild(v, c) for v, c in zip(value, children)]
    return tuple(items) if kind == "tuple" else items
