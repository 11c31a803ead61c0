"""distckpt: distributed, sharded checkpoints of PyTorch training state.

Every rank writes its own partitions into one zarr v3 store; a coordinator validates,
writes the index and commits atomically; restore reshards onto any world size::

    import distckpt
    distckpt.save({"model": model.state_dict(), "step": step}, "run/ckpt-100")
    distckpt.load(state, "run/ckpt-100")   # fills ``state`` in place
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distckpt.exports import exports
from distckpt.version import VERSION as __version__  # noqa: F401

if TYPE_CHECKING:
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


#: Where each public name is defined. The names are imported on first use (PEP 562), so
#: that ``import distckpt`` costs nothing until a name is used, and the ``distckpt``
#: command lists, inspects and verifies checkpoints without importing torch.
_WHERE: dict[str, str] = {
    "Variable": "distckpt.engine.inspect",
    "list_variables": "distckpt.engine.inspect",
    "load": "distckpt.engine.load",
    "remove": "distckpt.engine.remove",
    "save": "distckpt.engine.save",
    "CheckpointError": "distckpt.errors",
    "CheckpointExists": "distckpt.errors",
    "CheckpointNotFoundError": "distckpt.errors",
    "CommTimeoutError": "distckpt.errors",
    "ConditionFailed": "distckpt.errors",
    "ConversionError": "distckpt.errors",
    "CorruptCheckpointError": "distckpt.errors",
    "DirectoryLockedError": "distckpt.errors",
    "LocationError": "distckpt.errors",
    "MissingVariablesError": "distckpt.errors",
    "PointerConflictError": "distckpt.errors",
    "RemoteError": "distckpt.errors",
    "ShapeMismatchError": "distckpt.errors",
    "StorageError": "distckpt.errors",
    "UnsafePathError": "distckpt.errors",
    "UnsupportedFormatError": "distckpt.errors",
    "UnsupportedValueError": "distckpt.errors",
    "UntrustedCheckpointError": "distckpt.errors",
    "ValidationError": "distckpt.errors",
    "load_hf": "distckpt.hf",
    "save_hf": "distckpt.hf",
    "PerRank": "distckpt.items",
    "Shard": "distckpt.items",
    "LocalTier": "distckpt.local",
    "AsyncSave": "distckpt.pipeline.background",
    "prepare_async": "distckpt.pipeline.background",
    "CheckpointOptions": "distckpt.pipeline.options",
    "HFLoadKeywords": "distckpt.pipeline.options",
    "HFSaveKeywords": "distckpt.pipeline.options",
    "LoadKeywords": "distckpt.pipeline.options",
    "ManagerKeywords": "distckpt.pipeline.options",
    "RestoreKeywords": "distckpt.pipeline.options",
    "SaveKeywords": "distckpt.pipeline.options",
    "WriteKeywords": "distckpt.pipeline.options",
    "LoadResult": "distckpt.pipeline.results",
    "SaveResult": "distckpt.pipeline.results",
    "SigningKey": "distckpt.signing",
    "TrustedKeys": "distckpt.signing",
    "Box": "distckpt.slices",
    "SliceSpec": "distckpt.slices",
    "export_hf": "distckpt.tools.export_hf",
    "Checkpoint": "distckpt.training",
    "CheckpointManager": "distckpt.training",
    "RNGState": "distckpt.training",
    "SampleCursor": "distckpt.training",
    "latest_checkpoint": "distckpt.training",
    "preemption": "distckpt.training",  # the module, a submodule of distckpt.training
    "before_change": "distckpt.training.lazy",
    "wait_for_snapshot": "distckpt.training.lazy",
    "EXIT_PREEMPTED": "distckpt.training.preemption",
    "PreemptionHandler": "distckpt.training.preemption",
    "default_io_workers": "distckpt.transfer",
    "prepare_staging": "distckpt.transfer",
    "set_staging": "distckpt.transfer",
}


__getattr__, __dir__ = exports(globals(), _WHERE)


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
