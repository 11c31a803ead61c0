"""distckpt: distributed, sharded checkpoints of PyTorch training state.

Every rank writes its own partitions into one zarr v3 store; a coordinator validates,
writes the index and commits atomically; restore reshards onto any world size::

    import distckpt
    distckpt.save({"model": model.state_dict(), "step": step}, "run/ckpt-100")
    distckpt.load(state, "run/ckpt-100")   # fills ``state`` in place
"""

from __future__ import annotations

from distckpt import comm
from distckpt.engine.inspect import Variable, list_variables
from distckpt.engine.load import load
from distckpt.engine.remove import remove
from distckpt.engine.save import save
from distckpt.errors import (
    CheckpointError,
    CheckpointExists,
    CheckpointNotFoundError,
    CommTimeoutError,
    ConditionFailed,
    ConversionError,
    CorruptCheckpointError,
    DirectoryLockedError,
    LocationError,
    MissingVariablesError,
    PointerConflictError,
    RemoteError,
    ShapeMismatchError,
    StorageError,
    UnsafePathError,
    UnsupportedFormatError,
    UnsupportedValueError,
    UntrustedCheckpointError,
    ValidationError,
)
from distckpt.hf import load_hf, save_hf
from distckpt.items import PerRank, Shard
from distckpt.local import LocalTier
from distckpt.pipeline.background import (
    AsyncSave,
    prepare_async,
)
from distckpt.pipeline.options import (
    CheckpointOptions,
    HFLoadKeywords,
    HFSaveKeywords,
    LoadKeywords,
    ManagerKeywords,
    RestoreKeywords,
    SaveKeywords,
    WriteKeywords,
)
from distckpt.pipeline.results import LoadResult, SaveResult
from distckpt.signing import SigningKey, TrustedKeys
from distckpt.slices import Box, SliceSpec
from distckpt.tools.export_hf import export_hf
from distckpt.training import (
    Checkpoint,
    CheckpointManager,
    RNGState,
    SampleCursor,
    latest_checkpoint,
    preemption,
)
from distckpt.training.lazy import before_change, wait_for_snapshot
from distckpt.training.preemption import EXIT_PREEMPTED, PreemptionHandler
from distckpt.transfer import default_io_workers, prepare_staging, set_staging
from distckpt.version import VERSION as __version__  # noqa: F401


def register_zarr_dtypes() -> None:
    """Teach zarr-python the ``bfloat16`` and ``float8_*`` data type names distckpt writes.

    Call it before opening a checkpoint's arrays with zarr-python::

        distckpt.register_zarr_dtypes()
        weight = zarr.open_array("run/ckpt-10/net/l1.weight")[...]

    tensorstore knows these names already.
    """
    from distckpt.format.zarr_dtypes import register

    register()


__all__ = [
    "before_change",
    "wait_for_snapshot",
    "EXIT_PREEMPTED",
    "PreemptionHandler",
    "preemption",
    "AsyncSave",
    "Box",
    "Checkpoint",
    "CheckpointError",
    "CheckpointExists",
    "CheckpointManager",
    "CheckpointOptions",
    "CheckpointNotFoundError",
    "CommTimeoutError",
    "ConditionFailed",
    "ConversionError",
    "CorruptCheckpointError",
    "DirectoryLockedError",
    "HFLoadKeywords",
    "HFSaveKeywords",
    "LoadKeywords",
    "LoadResult",
    "LocalTier",
    "LocationError",
    "ManagerKeywords",
    "MissingVariablesError",
    "PerRank",
    "PointerConflictError",
    "RNGState",
    "RemoteError",
    "RestoreKeywords",
    "SampleCursor",
    "SaveKeywords",
    "SaveResult",
    "Shard",
    "ShapeMismatchError",
    "SigningKey",
    "SliceSpec",
    "StorageError",
    "TrustedKeys",
    "UnsafePathError",
    "UnsupportedFormatError",
    "UnsupportedValueError",
    "UntrustedCheckpointError",
    "ValidationError",
    "Variable",
    "WriteKeywords",
    "comm",
    "default_io_workers",
    "export_hf",
    "latest_checkpoint",
    "list_variables",
    "load",
    "load_hf",
    "prepare_async",
    "prepare_staging",
    "register_zarr_dtypes",
    "remove",
    "save",
    "save_hf",
    "set_staging",
]
