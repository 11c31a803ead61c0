"""Moved to :mod:`distckpt.pipeline.clock`; this import path works, with a
``DeprecationWarning``, until the next release."""

from distckpt.moved import alias

__getattr__ = alias(__name__, "distckpt.pipeline.clock")
