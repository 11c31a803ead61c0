"""How Hugging Face tensor names meet the names of a distckpt state.

A state's names are its keys joined by ``/`` (:mod:`distckpt.naming`): for
``{"net": model.state_dict()}`` they are ``net/model.embed_tokens.weight`` ..., while the
weights call that tensor ``model.embed_tokens.weight``. Either give ``prefix="net/"``,
which loading prepends and saving strips (saving leaves out the state's names without
it), or ``rename``, a function in the direction of the copy: when loading, from the
weights' name to the state's; when saving, from the state's name to the weights'. It
returns None for a tensor to leave out.
"""

from __future__ import annotations

from collections.abc import Callable

Rename = Callable[[str], "str | None"]


def _check(prefix: str, rename: Rename | None) -> None:
    if prefix and rename is not None:
        raise ValueError("give prefix= or rename=, not both")


def for_loading(prefix: str = "", rename: Rename | None = None) -> Rename:
    """Weights name -> state name (or None: not loaded)."""
    _check(prefix, rename)
    if rename is not None:
        return rename
    return lambda name: prefix + name


def for_saving(prefix: str = "", rename: Rename | None = None) -> Rename:
    """State name -> weights name (or None: not saved)."""
    _check(prefix, rename)
    if rename is not None:
        return rename
    return lambda name: name[len(prefix) :] if name.startswith(prefix) else None
