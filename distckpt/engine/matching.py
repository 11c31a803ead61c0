"""Moved to :mod:`distckpt.pipeline.matching`; this import path works, with a
``DeprecationWarning``, until the next release."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_moved = importlib.import_module("distckpt.pipeline.matching")

warnings.warn(
    f"{__name__} moved to {_moved.__name__}: import it from there "
    "(the old path goes in the next release)",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
