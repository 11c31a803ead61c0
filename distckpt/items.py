"""What can be saved, and how a nested state becomes a flat list of named leaves.

A *state* is a nested structure of dicts, lists and tuples whose leaves are:

* ``torch.Tensor``: replicated, the same value on every rank (checked when saving);
* a DTensor with Shard / Replicate placements: each rank holds its box;
* :class:`Shard`: a hand-partitioned box of a global tensor;
* :class:`PerRank`: a tensor or value that differs by rank, stored per rank;
* small Python values (None, bool, int, float, str, and lists, tuples, dicts of them),
  kept in the index with their types.

A dict, list or tuple that contains any tensor is a *container*: its entries become
named leaves (``opt/state/0/exp_avg``). One that contains no tensor is a *value* and is
stored whole, so ``param_groups`` keeps its exact shape and types.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from distckpt import dtypes
from distckpt.errors import UnsupportedValueError
from distckpt.naming import escape_key
from distckpt.slices import Box, chunk_bounds
from distckpt.values import encode, is_value


@dataclass
class Shard:
    """This rank's box of a tensor partitioned by hand.

    ``tensor`` holds the elements ``offsets[d] <= i < offsets[d] + tensor.shape[d]`` of a
    global tensor of ``global_shape``: a tensor-parallel slice of a weight, or a flat range
    of an optimizer buffer::

        # rank r of 4 holds rows 256*r .. 256*r+255 of a (1024, 512) weight
        state = {"w": distckpt.Shard(local, global_shape=(1024, 512), offsets=(256 * r, 0))}
    """

    tensor: torch.Tensor
    global_shape: Sequence[int]
    offsets: Sequence[int]

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(n) for n in self.global_shape)
        self.offsets = tuple(int(o) for o in self.offsets)
        if not isinstance(self.tensor, torch.Tensor):
            raise UnsupportedValueError(f"Shard needs a tensor, got {type(self.tensor).__name__}")
        if len(self.offsets) != self.tensor.dim() or len(self.global_shape) != self.tensor.dim():
            raise UnsupportedValueError(
                f"Shard of a {self.tensor.dim()}-d tensor needs {self.tensor.dim()} offsets and "
                f"global dims, got offsets {list(self.offsets)}, global shape "
                f"{list(self.global_shape)}"
            )


@dataclass
class PerRank:
    """State that differs by rank (RNG states, per-rank iterator positions).

    Saved once per rank; restored on the same world size to the same rank. On another
    world size rank ``r`` receives what rank ``r % saved_world_size`` saved, with a warning.
    """

    value: Any


@dataclass
class Leaf:
    """One named thing of a flattened state, on this rank."""

    name: str
    kind: str  # "tensor" | "value" | "per_rank"
    tensor: torch.Tensor | None = None  # local data (tensor, per-rank tensor)
    shape: tuple[int, ...] = ()  # global shape
    box: Box | None = None  # this rank's box of it
    replicated: bool = False  # a plain tensor: same value on every rank
    value: Any = None
    # Where the leaf sits, so restore can replace values in place.
    parent: Any = field(default=None, repr=False)
    key: Any = None

    @property
    def dtype(self) -> str:
        assert self.tensor is not None
        return dtypes.zarr_name(self.tensor.dtype, self.name)


class Branch(dict):  # type: ignore[type-arg]
    """A dict whose entries are named leaves even where it holds no tensor on this rank
    (another rank holds tensors under it), so each entry is named as it is there. A plain
    dict without a tensor would be stored whole, as one value."""


class BranchList(list):  # type: ignore[type-arg]
    """A list whose items are named leaves, as :class:`Branch` for a dict."""


def is_dtensor(obj: object) -> bool:
    # A DTensor can only exist once its module is imported; importing it costs a second.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(obj, module.DTensor)


def dense(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """``tensor``, once it is seen to be one distckpt stores: dense and strided (a sparse,
    nested or quantized tensor has no one block of elements to store)."""
    if tensor.layout is not torch.strided or tensor.is_nested or tensor.is_quantized:
        kind = "nested" if tensor.is_nested else "quantized" if tensor.is_quantized else "sparse"
        kind = f"a {kind} ({tensor.layout}, {tensor.dtype})"
        raise UnsupportedValueError(
            f"variable {name!r}: cannot store {kind} tensor; distckpt stores dense tensors "
            "(save tensor.to_dense(), or the parts it is made of)"
        )
    return tensor


def _key_name(k: Any, name: str) -> str:
    """The name part of a state's key ``k``: a str or an int, in text a path can hold."""
    if not isinstance(k, (str, int)) or isinstance(k, bool):
        raise UnsupportedValueError(
            f"{name or 'state'}: key {k!r} must be a str or an int to name a variable"
        )
    text = str(k)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsupportedValueError(
            f"{name or 'state'}: key {k!r} is not text (a lone surrogate), so names no variable"
        ) from None
    return text


def has_tensor(obj: object) -> bool:
    if isinstance(obj, (torch.Tensor, Shard, PerRank, Branch, BranchList)):
        return True
    if isinstance(obj, dict):
        return any(has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(has_tensor(v) for v in obj)
    return False


def dtensor_box(dt: Any, name: str) -> tuple[torch.Tensor, tuple[int, ...], Box]:
    """(local tensor, global shape, this rank's box) of a DTensor.

    Shard placements split a dimension as ``torch.chunk`` does; several mesh dimensions that
    shard the same tensor dimension split it in mesh order (DTensor's own rule). Partial
    and strided placements are refused: they are not boxes of the global value.
    """
    from torch.distributed.tensor.placement_types import Replicate
    from torch.distributed.tensor.placement_types import Shard as DShard

    mesh = dt.device_mesh
    shape = tuple(int(n) for n in dt.shape)
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not part of the mesh: it holds nothing
        return dt.to_local(), shape, Box((0,) * len(shape), (0,) * len(shape))
    offsets = [0] * len(shape)
    lengths = list(shape)
    for mesh_dim, placement in enumerate(dt.placements):
        if type(placement) is Replicate:
            continue
        if type(placement) is not DShard:
            raise UnsupportedValueError(
                f"variable {name!r}: DTensor placement {placement} is not supported; "
                "distckpt saves Shard and Replicate placements (redistribute Partial values, "
                "e.g. dt.redistribute(placements=[Replicate()]), before saving)"
            )
        d = placement.dim
        start, size = chunk_bounds(lengths[d], mesh.size(mesh_dim), coord[mesh_dim])
        offsets[d] += start
        lengths[d] = size
    local = dt.to_local()
    box = Box(tuple(offsets), tuple(lengths))
    if tuple(local.shape) != box.lengths:
        raise UnsupportedValueError(
            f"variable {name!r}: DTensor local shape {list(local.shape)} does not match its "
            f"placements {dt.placements} (expected {list(box.lengths)})"
        )
    return local, shape, box


def flatten(state: Any, prefix: tuple[str, ...] = (), *, allow_pickle: bool = False) -> list[Leaf]:
    """Every leaf of ``state`` with its name, in a deterministic order.

    With ``allow_pickle``, an object distckpt cannot store natively becomes a value leaf
    (stored pickled) instead of an error."""
    if not isinstance(state, dict):
        raise UnsupportedValueError(
            f"a state to save or load is a dict of named things, got {type(state).__name__}"
        )
    return list(_walk(state, prefix, None, None, allow_pickle))


def _walk(
    obj: Any, path: tuple[str, ...], parent: Any, key: Any, allow_pickle: bool
) -> Iterator[Leaf]:
    name = "/".join(escape_key(p) for p in path)
    if isinstance(obj, dict) and (has_tensor(obj) or not path):
        for k, v in obj.items():
            yield from _walk(v, (*path, _key_name(k, name)), obj, k, allow_pickle)
        return
    if isinstance(obj, (list, tuple)) and has_tensor(obj):
        for i, v in enumerate(obj):
            yield from _walk(v, (*path, str(i)), obj, i, allow_pickle)
        return
    if not name:
        raise UnsupportedValueError("a state to save or load is a dict of named things")
    if is_dtensor(obj):
        local, shape, box = dtensor_box(obj, name)
        yield Leaf(
            name, "tensor", tensor=dense(local, name), shape=shape, box=box, parent=parent, key=key
        )
    elif isinstance(obj, torch.Tensor):
        shape = tuple(dense(obj, name).shape)
        yield Leaf(
            name,
            "tensor",
            tensor=obj,
            shape=shape,
            box=Box.full(shape),
            replicated=True,
            parent=parent,
            key=key,
        )
    elif isinstance(obj, Shard):
        shape = tuple(obj.global_shape)
        box = Box(tuple(obj.offsets), tuple(dense(obj.tensor, name).shape))
        if not Box.full(shape).contains(box):
            raise UnsupportedValueError(
                f"variable {name!r}: Shard box {box} lies outside the global shape {list(shape)}"
            )
        yield Leaf(
            name,
            "tensor",
            tensor=obj.tensor,
            shape=shape,
            box=box,
            parent=parent,
            key=key,
        )
    elif isinstance(obj, PerRank):
        inner = obj.value
        if isinstance(inner, torch.Tensor) and not is_dtensor(inner):
            shape = tuple(dense(inner, name).shape)
            yield Leaf(
                name,
                "per_rank",
                tensor=inner,
                shape=shape,
                box=Box.full(shape),
                parent=obj,
                key=key,
            )
        elif (is_value(inner) or allow_pickle) and not has_tensor(inner):
            yield Leaf(name, "per_rank", value=inner, parent=obj, key=key)
        else:
            raise UnsupportedValueError(
                f"variable {name!r}: PerRank holds a tensor or a small Python value, "
                f"got {type(inner).__name__}"
            )
    elif is_value(obj) or allow_pickle:
        yield Leaf(name, "value", value=obj, parent=parent, key=key)
    else:
        hint = " (pass allow_pickle=True to store it pickled)"
        if hasattr(obj, "state_dict"):
            hint = " (pass obj.state_dict(), or use distckpt.Checkpoint)"
        raise UnsupportedValueError(
            f"variable {name!r}: cannot store a {type(obj).__module__}.{type(obj).__qualname__}"
            f"{hint}"
        )


def gather_leaves(state: dict[str, Any], allow_pickle: bool) -> tuple[list[Leaf], dict[str, Any]]:
    """Flatten ``state`` and encode its Python values (typed JSON) now: they may change."""
    leaves = flatten(state, allow_pickle=allow_pickle)
    values = {
        leaf.name: encode(leaf.value, leaf.name, allow_pickle=allow_pickle)
        for leaf in leaves
        if leaf.tensor is None
    }
    return leaves, values
