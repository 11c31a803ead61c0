"""What a :class:`~distckpt.training.Checkpoint` tracks, and the walk over its object graph.

Every tracked object has a *kind* that says how it is saved and restored:

==============  ==========================================================================
``node``        a Checkpoint, or a list or dict assigned to one (:class:`TrackedList`,
                :class:`TrackedDict`): named edges to more objects
``module``      ``nn.Module``: its parameters and persistent buffers by attribute path
``optimizer``   ``torch.optim.Optimizer``: slot state keyed by parameter names
``tensor``      a tensor, Parameter, DTensor or :class:`distckpt.Shard`: filled in place
``per_rank``    :class:`distckpt.PerRank`: a value that differs by rank
``stateful``    anything with ``state_dict()`` and ``load_state_dict()``
``value``       None, bool, int, float, str and tuples of them: replaced on restore
==============  ==========================================================================

Anything else is refused when it is assigned, with an error naming the attribute.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, SupportsIndex

import torch
from torch import nn

from distckpt.errors import CheckpointError, UnsupportedValueError
from distckpt.items import PerRank, Shard
from distckpt.training.names import join
from distckpt.values import SCALARS


class ObjectGraphError(CheckpointError, ValueError):
    """The object graph cannot be saved or restored as built (a cycle, a parameter that no
    module in the graph names, an attribute name a Checkpoint reserves)."""


class RestoreTarget(Protocol):
    """What a node needs of a restore in progress to apply it to children added later."""

    active: bool

    def restore_object(self, obj: Any, name: str, parent: Node, key: Any) -> None: ...


@dataclass
class Position:
    """Where a node sits in a restore: values under ``name`` apply to its new children."""

    session: RestoreTarget
    name: str


class Node:
    """An object-graph node: named edges to children, and delayed restore of new ones.

    A node bound to a restore (``_positions``) restores every child assigned to it later,
    the moment it arrives, from the checkpoint that restore reads.
    """

    _positions: list[Position]

    def _children(self) -> list[tuple[Any, Any]]:
        """``(key, child)`` for every edge, in order."""
        raise NotImplementedError

    def _replace(self, key: Any, value: Any) -> None:
        """Set a child without triggering a delayed restore (the restore itself calls it)."""
        raise NotImplementedError

    def _bind(self, position: Position) -> None:
        self._positions = [p for p in self._positions if p.session.active]
        self._positions.append(position)

    def _arrived(self, key: Any, child: Any) -> None:
        live = [p for p in self._positions if p.session.active]
        self._positions = live
        for position in live:
            position.session.restore_object(child, join(position.name, key), self, key)


def _is_plain_value(obj: Any) -> bool:
    if isinstance(obj, SCALARS):
        return True
    if isinstance(obj, (tuple, list)):
        return all(_is_plain_value(v) for v in obj)
    if isinstance(obj, dict):
        return all(_is_plain_value(k) and _is_plain_value(v) for k, v in obj.items())
    return False


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


_KINDS: tuple[tuple[Callable[[Any], bool], str], ...] = (
    (lambda o: isinstance(o, Node), "node"),
    (lambda o: isinstance(o, nn.Module), "module"),
    (lambda o: isinstance(o, torch.optim.Optimizer), "optimizer"),
    (lambda o: isinstance(o, (torch.Tensor, Shard)), "tensor"),
    (lambda o: isinstance(o, PerRank), "per_rank"),
    (_is_stateful, "stateful"),
    (_is_plain_value, "value"),
)


def kind_of(obj: Any) -> str:
    """The kind of ``obj`` (see the module docstring), or ``"unsupported"``."""
    for test, kind in _KINDS:
        if test(obj):
            return kind
    return "unsupported"


def track(value: Any, where: str) -> Any:
    """``value`` as a Checkpoint tracks it: plain lists and dicts become tracked wrappers.

    Raises :class:`~distckpt.errors.UnsupportedValueError` for what cannot be saved.
    """
    if type(value) is list:
        return TrackedList(value)
    if type(value) is dict:
        return TrackedDict(value)
    if kind_of(value) == "unsupported":
        raise UnsupportedValueError(
            f"{where!r}: cannot track a {type(value).__module__}.{type(value).__qualname__}; a "
            "Checkpoint tracks modules, optimizers, tensors, objects with state_dict() and "
            "load_state_dict(), lists and dicts of them, distckpt.PerRank, and None, bool, "
            "int, float, str and tuples of them (a tuple holding tensors: use a list)"
        )
    return value


class TrackedList(Node, list):  # type: ignore[type-arg]
    """A list assigned to a Checkpoint attribute, tracked like TensorFlow's ListWrapper.

    Entries are named by index (``layers/0``). After a restore, entries that arrive by
    ``append``, ``extend``, ``+=`` or ``lst[i] = v`` are restored at once from the
    checkpoint; ``insert`` shifts the names of the entries after it and restores nothing.
    """

    def __init__(self, items: Iterable[Any] = ()) -> None:
        self._positions = []
        list.__init__(self, [track(v, f"[{i}]") for i, v in enumerate(items)])

    def _children(self) -> list[tuple[Any, Any]]:
        return list(enumerate(self))

    def _replace(self, key: Any, value: Any) -> None:
        list.__setitem__(self, int(key), value)

    def append(self, value: Any) -> None:
        value = track(value, f"[{len(self)}]")
        list.append(self, value)
        self._arrived(len(self) - 1, value)

    def extend(self, values: Iterable[Any]) -> None:
        for value in values:
            self.append(value)

    def __iadd__(self, values: Iterable[Any]) -> TrackedList:  # type: ignore[override,misc]
        self.extend(values)
        return self

    def insert(self, index: SupportsIndex, value: Any) -> None:
        list.insert(self, index, track(value, f"[{int(index)}]"))

    def __setitem__(self, index: Any, value: Any) -> None:
        if isinstance(index, slice):
            list.__setitem__(self, index, [track(v, "[slice]") for v in value])
            return
        value = track(value, f"[{index}]")
        list.__setitem__(self, index, value)
        self._arrived(int(index) % len(self), value)


class TrackedDict(Node, dict):  # type: ignore[type-arg]
    """A dict assigned to a Checkpoint attribute, tracked like TensorFlow's DictWrapper.

    Keys (str or int) name the entries (``heads/cls``). After a restore, entries inserted
    with ``d[k] = v``, ``update`` or ``setdefault`` are restored at once.
    """

    def __init__(self, items: Any = ()) -> None:
        self._positions = []
        dict.__init__(self)
        for key, value in dict(items).items():
            self[key] = value

    def _children(self) -> list[tuple[Any, Any]]:
        return list(self.items())

    def _replace(self, key: Any, value: Any) -> None:
        dict.__setitem__(self, key, value)

    def __setitem__(self, key: Any, value: Any) -> None:
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise UnsupportedValueError(f"tracked dict key {key!r} must be a str or an int")
        value = track(value, f"[{key!r}]")
        dict.__setitem__(self, key, value)
        self._arrived(key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]


@dataclass
class Visit:
    """One object met by :func:`walk`: its name, kind, and the node edge that holds it."""

    name: str
    obj: Any
    kind: str
    parent: Node | None
    key: Any


def walk(obj: Any, name: str = "", parent: Node | None = None, key: Any = None) -> Iterator[Visit]:
    """Every object reachable from ``obj``, nodes included, parents before children.

    An object reachable by two paths is visited under both names (its tensors are then
    saved once, see :func:`distckpt.training.handlers.collect`); a cycle is an error.
    """
    yield from _walk(obj, name, parent, key, set())


def _walk(obj: Any, name: str, parent: Node | None, key: Any, path: set[int]) -> Iterator[Visit]:
    kind = kind_of(obj)
    if kind == "unsupported":
        track(obj, name)  # raises with the message
    yield Visit(name, obj, kind, parent, key)
    if kind != "node":
        return
    if id(obj) in path:
        raise ObjectGraphError(f"{name!r}: the object graph has a cycle through here")
    path.add(id(obj))
    for child_key, child in obj._children():
        yield from _walk(child, join(name, child_key), obj, child_key, path)
    path.discard(id(obj))
