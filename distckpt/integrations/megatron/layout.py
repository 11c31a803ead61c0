"""Where the elements of a Megatron tensor are stored, and what a load reads for this
rank's leaves of it: pure planning, no I/O (see :mod:`distckpt.integrations.megatron`).

A key names one global tensor, its prepended (stacked) axes included: Megatron's
``global_shape``, of which a ``ShardedTensor`` holds the box at ``global_offset`` of
lengths ``(1,) * prepend_axis_num + local_shape``. It is stored in one of two layouts:

* *whole*: one variable ``tensors/<key>`` of the global shape, each rank's box at its
  offset. A save writes this.
* *layers*: one variable per index along the first ``stacked`` axes, ``tensors/<key>/<i>``
  (``<i>.<j>`` for two axes), each of the remaining shape. Saves before the whole layout
  wrote every stacked tensor so, and a save still writes a key so when some rank holds
  boxes of it that do not make one box (an interleaved pipeline's layers).

A load maps each leaf's box onto the stored layout, whatever the stacking of either job:
plain to stacked, stacked to plain, or another number of prepended axes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from distckpt import dtypes
from distckpt.errors import CorruptCheckpointError
from distckpt.format import wellformed
from distckpt.naming import join_keys, unescape_key
from distckpt.slices import Box, grid_points

#: The group of the stored names that hold tensors.
TENSORS = "tensors"


def layer_name(index: tuple[int, ...]) -> str:
    """The name of a layer of the layers layout: its offsets along the stacked axes."""
    return ".".join(str(i) for i in index)


def stored_name(path: tuple[str, ...]) -> str:
    """The variable's name of a :class:`Part`'s ``path``."""
    return join_keys([TENSORS, *path])


@dataclass(frozen=True)
class Part:
    """Where some elements of a leaf are stored: the variable (``path``: the key, and the
    layer's name in the layers layout; :func:`stored_name` makes the variable's name), the
    elements' box in the tensor's coordinates (``where``) and in the variable's
    (``stored``)."""

    path: tuple[str, ...]
    where: Box
    stored: Box


@dataclass(frozen=True)
class Layout:
    """How a key's tensor of global ``shape`` is stored: whole (``stacked`` 0) or one
    variable per index along its first ``stacked`` axes (``names``: the stored layers'
    names, by index)."""

    shape: tuple[int, ...]
    dtype: str
    stacked: int = 0
    names: Mapping[tuple[int, ...], str] = field(default_factory=dict)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape of each stored variable."""
        return self.shape[self.stacked :]

    def parts(self, key: str, box: Box) -> list[Part]:
        """The stored parts of ``box`` (elements outside the tensor have none)."""
        inside = box.intersect(Box.full(self.shape))
        if inside is None:
            return []
        q = self.stacked
        inner = Box(inside.offsets[q:], inside.lengths[q:])
        ranges = [range(inside.offsets[d], inside.ends[d]) for d in range(q)]
        return [
            Part(
                (key, self.names.get(index) or layer_name(index)) if q else (key,),
                Box((*index, *inner.offsets), (1,) * q + inner.lengths),
                inner,
            )
            for index in grid_points(ranges)
        ]


def layouts(variables: Iterable[Any]) -> dict[str, Layout]:
    """The layout of every stored tensor, by key, from the checkpoint's variables
    (``distckpt.list_variables``'s). A layer's name that is not its offsets along the
    stacked axes, layers naming different numbers of axes, or a number of layers no
    tensor can have, are a :class:`~distckpt.CorruptCheckpointError` naming the
    variable."""
    found: dict[str, Layout] = {}
    layers: dict[str, dict[tuple[int, ...], Any]] = {}
    for variable in variables:
        parts = variable.name.split("/")
        if parts[0] != TENSORS or variable.shape is None or len(parts) not in (2, 3):
            continue
        key = unescape_key(parts[1])
        if len(parts) == 2:
            found[key] = Layout(tuple(variable.shape), variable.dtype)
            continue
        numbers = parts[2].split(".")
        if not all(n.isascii() and n.isdigit() for n in numbers):
            raise CorruptCheckpointError(
                f"{variable.name}: a stacked tensor's layer is named by its offsets along "
                "the stacked axes (like 0 or 1.2)"
            )
        held = layers.setdefault(key, {})
        index = tuple(int(n) for n in numbers)
        if held and len(next(iter(held))) != len(index):
            raise CorruptCheckpointError(
                f"{variable.name}: the layers of {key!r} name different numbers of stacked axes"
            )
        held[index] = variable
    for key, held in layers.items():
        q = len(next(iter(held)))
        outer = tuple(max(index[d] for index in held) + 1 for d in range(q))
        first = next(iter(held.values()))
        # The layers' names say how many there are: a shape storage may declare.
        itemsize = dtypes.torch_dtype(first.dtype).itemsize
        shape = wellformed.shape_of({"shape": [*outer, *first.shape]}, first.name, itemsize)
        names = {index: v.name.rsplit("/", 1)[1] for index, v in held.items()}
        found[key] = Layout(tuple(shape), first.dtype, q, names)
    return found


@dataclass
class Plan:
    """What a load reads for this rank's leaves of one key: each stored variable once, as
    the smallest box holding every part asked of it (``reads``: a part's ``path`` to the
    variable's shape as asked and that box), the parts of each leaf (``parts``, in the
    leaves' order), and whether the leaves start as zeros (some elements are outside the
    stored tensor, for leaves that allow a shape mismatch). ``problem``: why the leaves
    cannot be read."""

    reads: dict[tuple[str, ...], tuple[tuple[int, ...], Box]] = field(default_factory=dict)
    parts: list[list[Part]] = field(default_factory=list)
    zeros: bool = False
    problem: str | None = None


def plan(
    key: str,
    shape: tuple[int, ...],
    boxes: list[Box],
    layout: Layout | None,
    allow_shape_mismatch: bool = False,
) -> Plan:
    """The reads of the ``boxes`` of the tensor ``key`` of global ``shape`` (prepended axes
    included) this rank asks for, from its stored ``layout`` (None: not stored).

    A tensor stored whole with another shape, or not stored, is asked as it is wanted: the
    load then names the mismatch or the missing variable. With ``allow_shape_mismatch`` the
    leaves get the elements the stored tensor holds, and zeros elsewhere."""
    if layout is not None and layout.shape != shape:
        if len(layout.shape) != len(shape) and (allow_shape_mismatch or layout.stacked):
            return Plan(
                problem=f"{key}: stored with {len(layout.shape)} axes {list(layout.shape)}, "
                f"asked with {len(shape)} axes {list(shape)}"
            )
        if not allow_shape_mismatch and layout.stacked:
            return Plan(
                problem=f"{key}: stored with shape {list(layout.shape)} (one variable per "
                f"index of its first {layout.stacked} axes), asked as {list(shape)}"
            )
    if layout is None or (layout.shape != shape and not allow_shape_mismatch):
        layout = Layout(shape, "")  # as wanted: the load checks it against what is stored
    out = Plan(zeros=layout.shape != shape)
    for box in boxes:
        parts = layout.parts(key, box)
        out.parts.append(parts)
        for part in parts:
            held = out.reads.get(part.path)
            stored = part.stored if held is None else bounds(held[1], part.stored)
            out.reads[part.path] = (layout.stored_shape, stored)
    return out


def bounds(a: Box, b: Box) -> Box:
    """The smallest box holding ``a`` and ``b``."""
    low = tuple(min(x, y) for x, y in zip(a.offsets, b.offsets))
    high = tuple(max(x, y) for x, y in zip(a.ends, b.ends))
    return Box(low, tuple(h - lo for h, lo in zip(high, low)))
