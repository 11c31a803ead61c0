"""The version of distckpt (pyproject.toml reads it from here)."""

VERSION = "0.1.0"
