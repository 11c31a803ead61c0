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
from distckpt.comm import Communicator

DATA = "data"
STRUCTURE = "structure"
TENSOR = "tensor"
VALUE = "value"


def _holds_tensor(obj: object) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_holds_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensor(v) for v in obj)
    return False


def structure(obj: Any, root: bool = True) -> Any:
    """The structure of ``obj`` as distckpt names it (see the module docstring): a dict is
    ``("dict", [(key, child), ...])``, a list or tuple ``("list" | "tuple", [child, ...])``,
    a tensor ``"tensor"`` and any other leaf ``"value"`` (stored whole, typed)."""
    if isinstance(obj, dict) and (root or _holds_tensor(obj)):
        return ("dict", [(k, structure(v, False)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)) and _holds_tensor(obj):
        kind = "tuple" if isinstance(obj, tuple) else "list"
        return (kind, [structure(v, False) for v in obj])
    return TENSOR if isinstance(obj, torch.Tensor) else VALUE


def save_tree(
    tree: dict[str, Any],
    path: str | os.PathLike[str],
    comm: Communicator | None = None,
    **keywords: Any,
) -> distckpt.SaveResult:
    """Save ``tree`` (a framework's checkpoint dict) and its structure at ``path``;
    ``keywords`` are :func:`distckpt.save`'s (``options``, ``overwrite``, ...)."""
    state = {DATA: tree, STRUCTURE: structure(tree)}
    return distckpt.save(state, path, comm, **keywords)


def load_tree(
    path: str | os.PathLike[str],
    comm: Communicator | None = None,
    *,
    max_bytes: int | None = None,
    **keywords: Any,
) -> dict[str, Any]:
    """The dict :func:`save_tree` saved at ``path``, its tensors on the CPU.

    The tensors are allocated from the shapes the index declares, whose total is checked
    first against ``max_bytes`` (default: this machine's memory). ``keywords`` are
    :func:`distckpt.load`'s (``options``, ``allow_pickle``, ``io_workers``).
    """
    head: dict[str, Any] = {STRUCTURE: None}
    keywords.pop("strict", None)
    distckpt.load(head, path, comm, strict=False, **keywords)
    if head[STRUCTURE] is None:
        raise distckpt.CheckpointError(
            f"{path} was not written by distckpt.integrations (it has no {STRUCTURE!r} value); "
            "load it with distckpt.load and a state of your own"
        )
    shapes = {
        v.name: (v.shape, v.dtype) for v in distckpt.list_variables(path) if v.shape is not None
    }
    limit = _memory() if max_bytes is None else max_bytes
    declared = sum(
        math.prod(shape) * _dtype(dtype, name).itemsize for name, (shape, dtype) in shapes.items()
    )
    if declared > limit:
        raise distckpt.CheckpointError(
            f"{path} declares {declared} bytes of tensors, more than the {limit} allowed "
            "(max_bytes, default this machine's memory)"
        )
    target = _target(head[STRUCTURE], DATA, shapes, 0)
    state = {DATA: target, STRUCTURE: None}
    distckpt.load(state, path, comm, strict=True, **keywords)
    return _rebuild(state[DATA], head[STRUCTURE])  # type: ignore[no-any-return]


def _memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def _dtype(name: str, variable: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise distckpt.CorruptCheckpointError(f"variable {variable!r}: unknown dtype {name!r}")
    return dtype


def _malformed(name: str, what: str) -> distckpt.CorruptCheckpointError:
    return distckpt.CorruptCheckpointError(f"{STRUCTURE!r} at {name!r}: {what}")


def _target(node: Any, name: str, shapes: dict[str, Any], depth: int) -> Any:
    """Mutable containers (tuples as lists: a load replaces values in place) holding an
    empty tensor for every tensor leaf and None for every value."""
    if node == TENSOR:
        if name not in shapes:
            raise _malformed(name, "names a tensor the index does not hold")
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
            out[key] = _target(child, f"{name}/{_escape(str(key))}", shapes, depth + 1)
        return out
    if kind in ("list", "tuple"):
        return [_target(c, f"{name}/{i}", shapes, depth + 1) for i, c in enumerate(children)]
    raise _malformed(name, f"unknown container {kind!r:.40}")


def _escape(key: str) -> str:
    # as distckpt names a key (distckpt.naming): "/" and "%" percent-encoded
    return key.replace("%", "%25").replace("/", "%2F")


def _rebuild(value: Any, node: Any) -> Any:
    """``value`` (from :func:`_target`, loaded) with the tuples of ``node`` restored."""
    if not isinstance(node, tuple):
        return value
    kind, children = node
    if kind == "dict":
        return {key: _rebuild(value[key], child) for key, child in children}
    items = [_rebuild(v, c) for v, c in zip(value, children)]
    return tuple(items) if kind == "tuple" else items
