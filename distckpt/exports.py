"""A package's public names, imported when first read (PEP 562).

A package lists where each of its names is defined and imports nothing until a name is
read, so that importing it is cheap and a part that needs no torch (the ``distckpt``
command listing, inspecting or verifying a checkpoint) does not import torch::

    __getattr__, __dir__ = exports(globals(), {"save": "distckpt.engine.save"})

The type checkers read the same names from an ``if TYPE_CHECKING:`` block of imports
(``tests/docs/test_structure.py`` checks that the two agree, and agree with
``__all__``).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from typing import Any


def exports(
    namespace: dict[str, Any],
    where: Mapping[str, str],
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of the package whose globals are ``namespace``:
    ``where`` maps a name to the module that defines it; any other name of a submodule is
    that submodule (``import distckpt`` then ``distckpt.training.RNGState`` works, as it
    did when the package imported its parts eagerly). A name read once is kept in
    ``namespace``."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        if name in where:
            value = getattr(importlib.import_module(where[name]), name)
        elif not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}"):
            value = importlib.import_module(f"{package}.{name}")  # as an eager import had it
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value  # later reads do not come here
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *where})

    return __getattr__, __dir__
