"""How variable names map to paths in the zarr store.

A variable's *name* is the path of keys that leads to it in the nested state, joined
with ``/``: ``{"net": {"l1.weight": t}}`` stores ``t`` as ``net/l1.weight``. A key that
itself contains ``/`` or ``%`` has those characters percent-encoded (``%2F``, ``%25``),
so names stay unambiguous.

The zarr path of a name escapes, per component, what zarr v3 or distckpt reserves:
a component that is empty, ``.`` or ``..``, starts with ``.`` (distckpt's staging and
owner files) or ``__`` (reserved by the zarr v3 spec), or is ``zarr.json``, gets its
first character percent-encoded. Every other name is its own path, so
``zarr.open_array(ckpt / "net/l1.weight")`` finds the tensor.
"""

from __future__ import annotations

from collections.abc import Iterable

_RESERVED_EXACT = {"", ".", "..", "zarr.json"}


def escape_key(key: str) -> str:
    """One key of the nested state, made safe to join with ``/``."""
    return key.replace("%", "%25").replace("/", "%2F")


def unescape_key(name: str) -> str:
    """A key as the state named it, from its escaped form (:func:`escape_key`'s inverse)."""
    return name.replace("%2F", "/").replace("%25", "%")


def join_keys(keys: Iterable[str]) -> str:
    return "/".join(escape_key(k) for k in keys)


def _escape_component(component: str) -> str:
    if component in _RESERVED_EXACT or component.startswith((".", "__")):
        if not component:
            return "%00"
        return f"%{ord(component[0]):02X}{component[1:]}"
    return component


def zarr_path(name: str) -> str:
    """The path, relative to the checkpoint root, of the zarr node holding ``name``."""
    return "/".join(_escape_component(c) for c in name.split("/"))
