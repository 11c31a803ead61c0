"""Every ``DISTCKPT_*`` environment variable distckpt reads: its name, default and meaning.

This module is the only one that reads them. Each is a :class:`Setting`; a caller asks
for its value when it needs it, so a test or a launcher may set it late (only the two
part sizes are read once, when their store's module is imported). A value that does not
parse is a :class:`ValueError` that names the variable. :func:`table` renders them as
the table in the documentation; the tests check that the table there is this one and
that no other module reads a ``DISTCKPT_*`` variable.

Keyword arguments and :class:`~distckpt.pipeline.options.CheckpointOptions` win over the
environment wherever both exist; the environment wins over the built-in defaults.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")

#: Bytes in a mebibyte.
MiB = 1 << 20


def whole_number(raw: object, what: str, minimum: int = 1) -> int:
    """``raw`` as a whole number of at least ``minimum``; :class:`ValueError` naming
    ``what`` otherwise."""
    try:
        n = int(str(raw).strip())
    except ValueError:
        raise ValueError(f"{what}={raw!r} is not a whole number") from None
    if n < minimum:
        raise ValueError(f"{what} must be at least {minimum}, got {n}")
    return n


def seconds(raw: str, what: str, minimum: float = 0.0) -> float:
    """``raw`` as seconds, more than 0 and at least ``minimum``."""
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{what}={raw!r} is not a number of seconds") from None
    if not (value > 0 and value >= minimum):
        least = f"at least {minimum:g}" if minimum else "positive"
        raise ValueError(f"{what} must be {least} seconds, got {raw}")
    return value


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable: ``parse(raw)`` turns its text (stripped, not empty) into
    a value; unset or empty means :attr:`default`, or, where that is None, the default
    :attr:`default_text` describes, computed where it is used."""

    name: str
    parse: Callable[[str], T]
    default: T | None
    meaning: str
    default_text: str = ""

    def raw(self) -> str:
        """The variable's text, stripped ('' when unset)."""
        return os.environ.get(self.name, "").strip()

    def get(self) -> T | None:
        """Its value, or None when it is unset or empty."""
        raw = self.raw()
        return self.parse(raw) if raw else None

    @property
    def built_in(self) -> T:
        """Its fixed default (a setting whose default is computed where it is used has
        none: :class:`LookupError`)."""
        if self.default is None:
            raise LookupError(f"{self.name} has no fixed default ({self.default_text})")
        return self.default

    def value(self) -> T:
        """Its value, or its fixed default."""
        found = self.get()
        return self.built_in if found is None else found

    def is_set(self) -> bool:
        return bool(self.raw())


def _whole(name: str, minimum: int = 1) -> Callable[[str], int]:
    return lambda raw: whole_number(raw, name, minimum)


def _seconds(name: str, minimum: float = 0.0) -> Callable[[str], float]:
    return lambda raw: seconds(raw, name, minimum)


def _on_unless_zero(raw: str) -> bool:
    return raw != "0"


def _yes(raw: str) -> bool:
    return raw.lower() in {"1", "true"}


def _text(raw: str) -> str:
    return raw


TIMEOUT: Setting[float] = Setting(
    "DISTCKPT_TIMEOUT",
    _seconds("DISTCKPT_TIMEOUT"),
    300.0,
    "Seconds a collective waits for a missing rank before every rank fails "
    "(the communicators' `timeout=` wins).",
)
IO_WORKERS: Setting[int] = Setting(
    "DISTCKPT_IO_WORKERS",
    _whole("DISTCKPT_IO_WORKERS"),
    None,
    "I/O threads per rank (`io_workers=` wins).",
    "the rank's share of the cores, at most 32; at most 8 for GPU tensors; at least 8 "
    "against an object store or a network file system",
)
SLAB_MIB: Setting[int] = Setting(
    "DISTCKPT_SLAB_MIB",
    _whole("DISTCKPT_SLAB_MIB"),
    64,
    "Size in MiB of each pinned staging slab for device tensors (`set_staging` wins).",
)
SLABS: Setting[int] = Setting(
    "DISTCKPT_SLABS",
    _whole("DISTCKPT_SLABS"),
    4,
    "Number of pinned staging slabs per rank (`set_staging` wins).",
)
EXCHANGE: Setting[bool] = Setting(
    "DISTCKPT_EXCHANGE",
    _on_unless_zero,
    True,
    "`0`: every rank reads what it needs itself instead of one rank per group reading "
    "a replicated piece and broadcasting it (off if any rank says 0).",
)
REPLICA_CHECK: Setting[int] = Setting(
    "DISTCKPT_REPLICA_CHECK",
    _whole("DISTCKPT_REPLICA_CHECK", 0),
    8,
    "Check that replicated values agree across ranks on every k-th save "
    "(`1`: every save, `0`: only when a plan is made).",
)
S3_TIMEOUT: Setting[float] = Setting(
    "DISTCKPT_S3_TIMEOUT",
    _seconds("DISTCKPT_S3_TIMEOUT", 2.0),
    None,
    "Seconds an object-store request may take, its retries included (at least 2).",
    "a third of `DISTCKPT_TIMEOUT`, at least 30",
)
S3_PART_BYTES: Setting[int] = Setting(
    "DISTCKPT_S3_PART_BYTES",
    _whole("DISTCKPT_S3_PART_BYTES"),
    8 * MiB,
    "Bytes per part of an S3 multipart upload (read when the store module is imported).",
)
CLOUD_PART_BYTES: Setting[int] = Setting(
    "DISTCKPT_CLOUD_PART_BYTES",
    _whole("DISTCKPT_CLOUD_PART_BYTES"),
    8 * MiB,
    "Bytes per part of an Azure / GCS multipart upload (read when the store module is imported).",
)
CLOUD_ALLOW_HTTP: Setting[bool] = Setting(
    "DISTCKPT_CLOUD_ALLOW_HTTP",
    _yes,
    False,
    "`1` or `true`: let the Azure / GCS store use plain HTTP (an emulator such as Azurite).",
)
NODE: Setting[str] = Setting(
    "DISTCKPT_NODE",
    _text,
    None,
    "This process's node, for the node-local tier's placement of copies.",
    "`$SLURM_NODEID`, else the host name",
)
PREEMPTED_FILE: Setting[str] = Setting(
    "DISTCKPT_PREEMPTED_FILE",
    _text,
    None,
    "A path rank 0 writes (JSON: step, checkpoint, signal) after a preemption save, so "
    "a batch script can tell preemption from failure.",
    "unset: no file",
)
PROGRESS: Setting[bool] = Setting(
    "DISTCKPT_PROGRESS",
    _on_unless_zero,
    True,
    "`0`: no progress bar (otherwise shown on rank 0, on a terminal, for large transfers).",
)

SIGNING_KEY: Setting[str] = Setting(
    "DISTCKPT_SIGNING_KEY",
    _text,
    None,
    "A private key file (PEM or OpenSSH, Ed25519): saves that are given no `signing_key` "
    "sign with it (see [signed checkpoints](../reference/signing.md)).",
    "unset: saves are not signed",
)
SIGNING_HASH: Setting[str] = Setting(
    "DISTCKPT_SIGNING_HASH",
    _text,
    None,
    "`blake3` or `sha256`: the hash a signed save records of every stored byte.",
    "`blake3` where the blake3 package is installed (the `sign` extra), else `sha256`",
)
TRUSTED_KEYS: Setting[str] = Setting(
    "DISTCKPT_TRUSTED_KEYS",
    _text,
    None,
    "A file of trusted public keys (PEM blocks or `ssh-ed25519` lines): loads that are "
    "given no `trusted_keys` refuse any checkpoint not signed by one of them.",
    "unset: no signature is required",
)

#: Every setting, in the order of the table.
ALL: tuple[Setting[Any], ...] = (
    TIMEOUT,
    IO_WORKERS,
    SLAB_MIB,
    SLABS,
    EXCHANGE,
    REPLICA_CHECK,
    S3_TIMEOUT,
    S3_PART_BYTES,
    CLOUD_PART_BYTES,
    CLOUD_ALLOW_HTTP,
    NODE,
    PREEMPTED_FILE,
    PROGRESS,
    SIGNING_KEY,
    SIGNING_HASH,
    TRUSTED_KEYS,
)


def _shown(setting: Setting[Any]) -> str:
    if setting.default_text:
        return setting.default_text
    value = setting.default
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int) and value >= MiB and value % MiB == 0:
        return f"{value // MiB} MiB"
    if isinstance(value, float) and value.is_integer():
        return f"{value:.0f}"
    return str(value)


def table() -> str:
    """The settings as a Markdown table (variable, default, meaning)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    rows += [f"| `{s.name}` | {_shown(s)} | {s.meaning} |" for s in ALL]
    return "\n".join(rows) + "\n"
