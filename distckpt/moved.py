"""Import paths that moved: the old module stays, for one release, as an alias that warns.

An old module is two lines::

    from distckpt.moved import alias

    __getattr__ = alias(__name__, "distckpt.pipeline.options")

Importing it warns once (``DeprecationWarning``, naming the new path); every name read
from it is the new module's own object.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def alias(old: str, new: str) -> Callable[[str], Any]:
    """Warn that ``old`` moved to ``new``; return the ``__getattr__`` that makes ``old``
    hand out ``new``'s names."""
    target = importlib.import_module(new)
    warnings.warn(
        f"{old} moved to {new}: import it from there (the old path goes in the next release)",
        DeprecationWarning,
        stacklevel=3,
    )

    def __getattr__(name: str) -> Any:
        return getattr(target, name)

    return __getattr__
