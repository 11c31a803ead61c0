"""distckpt's errors: one hierarchy rooted at :class:`CheckpointError`.

Each error that has a natural builtin twin also derives from it, so callers can catch
``FileNotFoundError`` or ``ValueError`` as they would for any other library.
An error raised on one rank of a job is raised on every rank (see
:mod:`distckpt.comm`): the exception carries ``rank`` (where it happened) and a note
with that rank's traceback.
"""

from __future__ import annotations

import errno


class CheckpointError(Exception):
    """Base of every error distckpt raises on purpose."""


class ValidationError(CheckpointError, ValueError):
    """The state to save is inconsistent across ranks (shapes, dtypes, coverage, overlaps)."""


class ShapeMismatchError(CheckpointError, ValueError):
    """A restore target's shape or dtype differs from the stored variable."""


class MissingVariablesError(CheckpointError, KeyError):
    """A strict restore found names missing on one side or the other."""

    def __init__(self, message: str, missing: list[str], unexpected: list[str]) -> None:
        super().__init__(message)
        self.missing = missing
        self.unexpected = unexpected

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])

    def __reduce__(self) -> tuple[object, ...]:  # travels between ranks intact
        return (type(self), (self.args[0], self.missing, self.unexpected), self.__dict__)


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The path is not a committed distckpt checkpoint (or it vanished while being read)."""


class CheckpointExists(CheckpointError, FileExistsError):
    """A save targets a path that already holds a committed checkpoint."""


class CorruptCheckpointError(CheckpointError, OSError):
    """Stored bytes fail their checksum, or a file the index names is missing or truncated."""


class UnsafePathError(CorruptCheckpointError):
    """Stored metadata names a path that leaves its checkpoint or run directory (``..``,
    an absolute path, a symbolic link leading out) or an entry that is not a regular file
    (a FIFO, a device, a directory): it is refused before anything is opened or deleted."""


class UntrustedCheckpointError(CheckpointError):
    """A load that requires a signature (trusted keys given) met a checkpoint that is not
    signed, is signed by a key it does not trust, or whose signature or stored hashes do
    not match its bytes (:mod:`distckpt.signing`). The message says which."""


class LocationError(CheckpointError, ValueError):
    """A location names a storage scheme that no store opens (``mirorr://b/c``), or a URL
    that its store cannot parse (``s3://`` without a bucket, or any :class:`ValueError` a
    plug-in's URL parsing raises)."""


class UnsupportedFormatError(CheckpointError):
    """The checkpoint was written by a newer format version than this library reads."""


class UnsupportedValueError(CheckpointError, TypeError):
    """A value in the state cannot be stored (a type, placement or dtype distckpt refuses)."""


class CommTimeoutError(CheckpointError, TimeoutError):
    """A collective did not complete in time: a rank died or stopped participating."""


class RemoteError(CheckpointError):
    """Stands in, on the other ranks, for an exception that could not be sent between ranks."""


class ConversionError(CheckpointError, ValueError):
    """A file cannot be imported or exported as asked: an unknown format, a dtype or value
    the target format cannot hold, or a source that cannot be read safely."""


class StorageError(CheckpointError, OSError):
    """The storage service refused or failed an operation for good (no such bucket, access
    denied, no credentials, retries exhausted); the message names the location and the
    operation, never a credential."""


#: What a file system answers when an entry distckpt made was moved, removed or replaced
#: by another process (a staging directory renamed away, swapped for a link).
_INTERFERENCE = {errno.ENOENT, errno.ENOTDIR, errno.EEXIST, errno.ELOOP, errno.EXDEV}


def interfered(exc: BaseException, where: str) -> BaseException:
    """``exc``, or, when it is a file system's answer to an entry of a save in progress
    being moved or replaced by another process, a :class:`StorageError` that says so (its
    errno and file name kept); other errors (a full disk, no permission) are left as
    they are."""
    if isinstance(exc, CheckpointError) or not isinstance(exc, OSError):
        return exc
    if exc.errno not in _INTERFERENCE:
        return exc
    error = StorageError(
        exc.errno,
        f"{where}: an entry of the save was moved or replaced by another process "
        f"({exc.strerror or exc})",
        exc.filename,
    )
    error.__cause__ = exc
    return error


class ConditionFailed(CheckpointError, FileExistsError):
    """A store's conditional write found the key present (create) or at another version
    (replace); raised by the storage seam (:mod:`distckpt.storage.backend`) and turned
    into the errors above by its callers."""


class DirectoryLockedError(CheckpointError):
    """Another live checkpoint manager holds the run directory's lock, took it over, or
    (in this process) replaced the manager that tries to save."""


class PointerConflictError(CheckpointError):
    """The ``latest`` pointer changed since this job read it: another job writes to the
    same directory. The pointer was left as the other job wrote it."""
