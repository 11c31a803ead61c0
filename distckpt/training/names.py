"""Object-graph names: joining edge names, nesting them for the engine, finding them in
an index.

A name is the path of edge names from the root, each escaped with
:func:`distckpt.naming.escape_key` and joined with ``/``: ``net/l1/weight``. The engine
builds the same names from nested dicts, so :func:`nest` turns a flat ``{name: leaf}``
mapping back into the nested dict that :func:`distckpt.save` and :func:`distckpt.load`
take.

The engine stores a sub-dict that holds no tensor as *one* typed value (``sched`` =
``{"last_epoch": 3, ...}``), so a name such as ``sched/last_epoch`` may live inside a
stored value; :func:`descend` finds it there and :func:`expand` lists the names a stored
value holds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

from distckpt.errors import UnsupportedValueError
from distckpt.naming import escape_key
from distckpt.numbering import number, signed

_ESCAPED = re.compile(r"%(25|2F)")

#: What :func:`descend` returns for a part a stored value does not have.
MISSING = object()


def join(prefix: str, key: str | int) -> str:
    """``prefix/key`` with ``key`` escaped; the root's prefix is ``""``."""
    part = escape_key(str(key))
    return f"{prefix}/{part}" if prefix else part


def unescape(part: str) -> str:
    """The key that :func:`distckpt.naming.escape_key` turned into ``part``."""
    return _ESCAPED.sub(lambda m: "%" if m.group(1) == "25" else "/", part)


def parts(name: str) -> list[str]:
    """The unescaped keys of ``name``: ``parts("a/b%2Fc") == ["a", "b/c"]``."""
    return [unescape(p) for p in name.split("/")]


def ancestors(name: str) -> Iterator[str]:
    """The proper prefixes of ``name``, longest first: ``a/b/c`` gives ``a/b``, ``a``."""
    while "/" in name:
        name = name.rsplit("/", 1)[0]
        yield name


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """The nested dict whose engine names are the keys of ``flat``.

    >>> nest({"net/l1/weight": 1, "step": 2})
    {'net': {'l1': {'weight': 1}}, 'step': 2}
    """
    root: dict[str, Any] = {}
    groups = {id(root)}
    for name, leaf in flat.items():
        keys = parts(name)
        node = root
        for key in keys[:-1]:
            if key not in node:
                node[key] = {}
                groups.add(id(node[key]))
            node = node[key]
            if id(node) not in groups:
                raise UnsupportedValueError(f"name {name!r} runs through another variable")
        if keys[-1] in node:
            raise UnsupportedValueError(f"name {name!r} is both a variable and a group")
        node[keys[-1]] = leaf
    return root


def descend(value: Any, keys: Iterable[str]) -> Any:
    """The part of a stored value at ``keys``, or :data:`MISSING`.

    Dicts are entered by key (a string, else the int it spells), lists and tuples by index.
    """
    for key in keys:
        if isinstance(value, dict):
            if key in value:
                value = value[key]
                continue
            as_int = signed(key)
            if as_int is not None and as_int in value:
                value = value[as_int]
                continue
            return MISSING
        index = number(key) if isinstance(value, (list, tuple)) else None
        if index is not None and index < len(value):
            value = value[index]
            continue
        return MISSING
    return value


def is_subtree(value: Any) -> bool:
    """Whether a dict is a subtree of names (non-empty, string keys) rather than a value."""
    return isinstance(value, dict) and bool(value) and all(isinstance(k, str) for k in value)


def expand(name: str, value: Any) -> Iterator[str]:
    """The names held in a stored value: ``expand("s", {"a": 1, "b": {"c": 2}})`` gives
    ``s/a`` and ``s/b/c``. A value that is not a subtree is one name."""
    if is_subtree(value):
        for key, child in value.items():
            yield from expand(join(name, key), child)
    else:
        yield name
