"""One value for the settings of saves and loads: :class:`CheckpointOptions`.

Every entry point (:func:`distckpt.save`, :func:`distckpt.load`,
:class:`~distckpt.Checkpoint`, :class:`~distckpt.CheckpointManager`, the node-local tier
and the Hugging Face functions) takes it as ``options=`` and passes it on whole; each of
its fields may also be given as a keyword argument, which wins over the value's field::

    opts = distckpt.CheckpointOptions(compression="zstd", io_workers=8)
    distckpt.save(state, "run/ckpt-10", options=opts)
    distckpt.save(state, "run/ckpt-11", options=opts, overwrite=True)   # one field changed
    manager = distckpt.CheckpointManager(ckpt, "run", options=opts)

An entry point accepts only the fields that mean something to it (a load has no
``compression``); another one is a :class:`TypeError`, as an unknown keyword is.
:func:`resolve_run` turns the options into what one operation runs with (its store, its
I/O workers), once, where the operation starts.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypedDict

from distckpt.format import codecs, wellformed
from distckpt.format.codecs import Compression
from distckpt.planning.pieces import DEFAULT_INNER_BYTES, DEFAULT_SMALL_BYTES
from distckpt.settings import whole_number
from distckpt.signing.keys import KeySource, TrustSource
from distckpt.storage.backend import Store
from distckpt.storage.registry import is_remote, open_store
from distckpt.transfer import priority
from distckpt.transfer import workers as transfer_workers


@dataclass(frozen=True)
class CheckpointOptions:
    """How a save or a load runs. Each field's default is distckpt's.

    Saving:

    * ``compression``: ``"zstd"``, ``"blosc-zstd"``, ``"blosc-lz4"``, or a mapping of name patterns
      (:mod:`fnmatch`, ``*`` also matches ``/``) to one of them or None; the first pattern
      that matches a name wins, and a name none matches is stored raw (see
      :func:`distckpt.save`). The coordinator's choice is the one used.
    * ``small_bytes``: tensors of at most this many bytes become one plain chunk written
      by one rank (never compressed).
    * ``inner_bytes``: the size of the inner chunks of a shard: the unit of checksums and
      of the reads of a resharded load (at most 64 MiB with compression).
    * ``overwrite``: replace a checkpoint committed at the path (:func:`distckpt.save`).
    * ``incremental``: hash what is written, so a later save can build on it, and build on
      the checkpoint a save names as its ``base`` (:class:`~distckpt.Checkpoint` and the
      manager: the last one this process saved or restored), taking the pieces whose
      bytes did not change from there (:mod:`distckpt.engine.reuse`).
    * ``background_nice``: how much lower than training a background save's threads run
      once its snapshot is taken (niceness added, 0 to 19; also the lowest best-effort I/O
      priority unless 0); ``background_cpus``: the cores they run on (default: the
      process's). See :mod:`distckpt.transfer.priority`.

    Saving and loading:

    * ``allow_pickle``: store objects that are neither tensors nor typed Python values
      pickled, and unpickle them on load. Unpickling runs code from the checkpoint: only
      for checkpoints you trust.
    * ``io_workers``: each rank's I/O threads (default: the cores this rank may use, at
      most 8 for tensors on a GPU, at least 8 against an object store or a network file
      system: :func:`~distckpt.transfer.workers.choose_io_workers`;
      ``$DISTCKPT_IO_WORKERS`` overrides it).

    Loading:

    * ``strict``: a name on one side only is an error (:func:`distckpt.load`).

    Signing (:mod:`distckpt.signing`; the ``sign`` extra):

    * ``signing_key``: a :class:`~distckpt.SigningKey` or its private key file: a save
      hashes every byte it stores and signs the index (default: the file
      ``$DISTCKPT_SIGNING_KEY`` names, else no signature). Every rank must be given it,
      or the variable (only the coordinator reads the key).
    * ``trusted_keys``: a :class:`~distckpt.TrustedKeys`, a signing key (its public
      key) or a trusted-keys file: a load refuses any checkpoint not signed by one of
      them, and checks every byte it reads against its signed hash (default: the file
      ``$DISTCKPT_TRUSTED_KEYS`` names, else no signature is required).
    """

    compression: Compression = None
    small_bytes: int = DEFAULT_SMALL_BYTES
    inner_bytes: int = DEFAULT_INNER_BYTES
    overwrite: bool = False
    incremental: bool = True
    background_nice: int = priority.DEFAULT_NICE
    background_cpus: tuple[int, ...] | None = None
    allow_pickle: bool = False
    io_workers: int | None = None
    strict: bool = True
    signing_key: KeySource = None
    trusted_keys: TrustSource = None

    def __post_init__(self) -> None:
        codecs.check(self.compression)
        if isinstance(self.compression, Mapping):  # a copy: a later edit is not ours
            object.__setattr__(self, "compression", dict(self.compression))
        for name in ("small_bytes", "inner_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value < (0 if name == "small_bytes" else 1):
                raise ValueError(f"{name} must be a whole number of bytes, got {value!r}")
        if self.compression is not None and self.inner_bytes > wellformed.MAX_CODEC_CHUNK:
            raise ValueError(
                f"inner_bytes of {self.inner_bytes} with compression: compressed inner chunks "
                f"are at most {wellformed.MAX_CODEC_CHUNK} bytes (each is decompressed whole)"
            )
        if self.io_workers is not None:
            whole_number(self.io_workers, "io_workers")
        if self.background_cpus is not None:  # a copy, ordered: a later edit is not ours
            object.__setattr__(self, "background_cpus", tuple(sorted(set(self.background_cpus))))
        self.yielding()  # checked now

    def yielding(self) -> priority.Yielding:
        """How a background save with these options yields to training."""
        return priority.Yielding.of(self.background_nice, self.background_cpus)

    def replace(self, **changes: Any) -> CheckpointOptions:
        """These options with ``changes`` (field names) made."""
        return dataclasses.replace(self, **changes)

    def compression_key(self) -> Any:
        """``compression`` as a hashable, ordered value (a cached plan's key)."""
        return compression_key(self.compression)


def compression_key(choices: Any) -> Any:
    """A compression choice, or a mapping of name patterns to choices, as a hashable value
    that keeps the mapping's order (its first matching pattern wins)."""
    if choices is None or isinstance(choices, str):
        return choices
    return tuple(choices.items())


class RestoreKeywords(TypedDict, total=False):
    """The fields of :class:`CheckpointOptions` a restore of an object graph takes as
    keyword arguments (its status replaces ``strict``)."""

    allow_pickle: bool
    io_workers: int | None
    trusted_keys: TrustSource


class LoadKeywords(RestoreKeywords, total=False):
    """The fields a load takes: a restore's, and ``strict``."""

    strict: bool


class WriteKeywords(RestoreKeywords, total=False):
    """The fields a save that never replaces a checkpoint takes (a manager's, a
    :class:`~distckpt.Checkpoint`'s)."""

    compression: Compression
    small_bytes: int
    inner_bytes: int
    incremental: bool
    background_nice: int
    background_cpus: tuple[int, ...] | None
    signing_key: KeySource


class SaveKeywords(WriteKeywords, total=False):
    """The fields :func:`distckpt.save` takes: a write's, and ``overwrite``."""

    overwrite: bool


class HFSaveKeywords(TypedDict, total=False):
    """The fields :func:`distckpt.save_hf` and :func:`distckpt.export_hf` take."""

    overwrite: bool
    io_workers: int | None


class HFLoadKeywords(TypedDict, total=False):
    """The fields :func:`distckpt.load_hf` takes (weights files hold no pickle)."""

    strict: bool
    io_workers: int | None


#: A :class:`~distckpt.CheckpointManager` takes the fields of its saves and restores.
ManagerKeywords = WriteKeywords

SAVE = frozenset(SaveKeywords.__optional_keys__)
WRITE = frozenset(WriteKeywords.__optional_keys__)
LOAD = frozenset(LoadKeywords.__optional_keys__)
RESTORE = frozenset(RestoreKeywords.__optional_keys__)
MANAGER = WRITE
HF_SAVE = frozenset(HFSaveKeywords.__optional_keys__)
HF_LOAD = frozenset(HFLoadKeywords.__optional_keys__)


def merge(
    options: CheckpointOptions | None,
    keywords: Mapping[str, Any],
    accepted: frozenset[str],
    where: str,
) -> CheckpointOptions:
    """``options`` (default: distckpt's) with the ``keywords`` an entry point was given;
    a name that ``where`` does not take is a :class:`TypeError`."""
    if options is not None and not isinstance(options, CheckpointOptions):
        raise TypeError(
            f"{where}(): options must be a distckpt.CheckpointOptions, got {type(options).__name__}"
        )
    unknown = sorted(set(keywords) - accepted)
    if unknown:
        raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}")
    base = options if options is not None else CheckpointOptions()
    return base.replace(**keywords) if keywords else base


def merge_or_refuse(
    options: CheckpointOptions | None,
    keywords: Mapping[str, Any],
    accepted: frozenset[str],
    where: str,
) -> tuple[CheckpointOptions, BaseException | None]:
    """:func:`merge`, or distckpt's defaults and the error when this rank's arguments are
    refused: a collective entry point reports it on every rank instead of raising it
    alone before its first collective."""
    try:
        return merge(options, keywords, accepted, where), None
    except (TypeError, ValueError) as exc:
        return CheckpointOptions(), exc


@dataclass(frozen=True)
class Resolved:
    """What one save or load runs with: its options, its store, and the I/O workers of
    this rank (resolved once, where the operation starts; :meth:`for_tensors` narrows
    them once the tensors are known)."""

    options: CheckpointOptions
    store: Store
    workers: transfer_workers.WorkerChoice
    local: int | None = None  # the ranks on this node, when the start had to find them

    @property
    def io_workers(self) -> int:
        return self.workers.count

    def for_tensors(self, tensors: Iterable[Any]) -> Resolved:
        """The same run, its default worker count chosen for ``tensors`` (at most
        :data:`~distckpt.transfer.workers.DEVICE_WORKERS` when any is on an
        accelerator). Not collective."""
        if self.options.io_workers is not None or not transfer_workers.on_device(tensors):
            return self
        return replace(self, workers=_choose(self.options, self.store, self.local, device=True))


def _choose(
    options: CheckpointOptions, store: Store, local: int | None, *, device: bool = False
) -> transfer_workers.WorkerChoice:
    path = getattr(store, "path", None) if store.capabilities.local_files else None
    return transfer_workers.choose_io_workers(
        options.io_workers, local, network=is_remote(store), device=device, path=path
    )


def resolve_run(
    options: CheckpointOptions, location: str | os.PathLike[str] | Store, comm: Any = None
) -> Resolved:
    """The store at ``location`` and this rank's I/O workers for ``options`` (which may ask
    ``comm`` how many ranks share the node: call it on every rank); at least
    :data:`~distckpt.transfer.workers.NETWORK_WORKERS` against an object store or a
    network file system."""
    store = open_store(location)
    local = transfer_workers.node_ranks_for(options.io_workers, comm)
    return Resolved(options, store, _choose(options, store, local), local)
