"""State dicts as named leaves, and back.

An object with ``state_dict()`` / ``load_state_dict()`` is stored as its state dict:
string-keyed dicts become name segments (``sched/last_epoch``), tensors are tensors
(DTensors keep their shards), :class:`distckpt.PerRank` stays per rank, and everything
else is a typed value (a tuple stays a tuple, a dict with int keys keeps its int keys).
A list or tuple, or a dict with int keys, that holds tensors is entered too (``0``,
``1``, ...) so each tensor is its own variable.

Restoring walks the object's *current* state dict as a template, fills the leaves found
in the checkpoint and passes the rebuilt dict to ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from distckpt.items import has_tensor
from distckpt.training.names import is_subtree, join

Path = tuple[Any, ...]


def _entered(obj: Any) -> bool:
    if is_subtree(obj):
        return True
    if isinstance(obj, dict):
        keys_ok = all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in obj)
        return keys_ok and has_tensor(obj)
    return isinstance(obj, (list, tuple)) and has_tensor(obj)


def leaves(state: Any, name: str, path: Path = ()) -> Iterator[tuple[str, Path, Any]]:
    """``(name, path in state, leaf)`` for every leaf of ``state``.

    >>> [(n, leaf) for n, _, leaf in leaves({"a": 1, "b": {"c": (2, 3)}}, "obj")]
    [('obj/a', 1), ('obj/b/c', (2, 3))]
    """
    if _entered(state):
        items = state.items() if isinstance(state, dict) else enumerate(state)
        for key, value in items:
            yield from leaves(value, join(name, key), (*path, key))
    else:
        yield name, path, state


def rebuild(template: Any, found: dict[Path, Any], path: Path = ()) -> Any:
    """``template`` with the leaf at each path in ``found`` replaced by its value."""
    if path in found:
        return found[path]
    if not _entered(template):
        return template
    if isinstance(template, dict):
        items = {k: rebuild(v, found, (*path, k)) for k, v in template.items()}
        try:
            return type(template)(items)
        except TypeError:  # a dict subclass with another constructor (defaultdict)
            return items
    rebuilt = [rebuild(v, found, (*path, i)) for i, v in enumerate(template)]
    return tuple(rebuilt) if isinstance(template, tuple) else rebuilt


def collector(found: dict[Path, Any], path: Path) -> Callable[[Any], None]:
    """A callback that records a restored leaf under ``path``."""

    def record(value: Any) -> None:
        found[path] = value

    return record
