"""The megatron-core names the integration uses, imported once here: without megatron-core
:mod:`distckpt.integrations.megatron` still imports, and using it raises an ImportError
that names the extra to install (:func:`require`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

NEEDS_MEGATRON = (
    "distckpt.integrations.megatron needs megatron-core: pip install 'distckpt[megatron]'"
)

MISSING: ImportError | None = None
try:
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        is_main_replica,
    )
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.base import (
        AsyncSaveShardedStrategy,
        LoadShardedStrategy,
        StrategyAction,
        register_default_strategy,
    )
except ImportError as exc:  # the module imports; using it says which extra to install
    MISSING = exc
    if not TYPE_CHECKING:

        class CheckpointingException(Exception):
            """Stands for megatron-core's, which is not installed."""

        class _Absent:
            """Stands for a megatron-core class: nothing is an instance of it."""

        ShardedObject = ShardedTensor = _Absent
        AsyncSaveShardedStrategy = LoadShardedStrategy = object
        dict_list_map_inplace = nested_values = is_main_replica = None
        AsyncRequest = StrategyAction = register_default_strategy = None


def require() -> None:
    """Raise an ImportError naming the extra when megatron-core is not installed."""
    if MISSING is not None:
        raise ImportError(NEEDS_MEGATRON) from MISSING


__all__ = [
    "MISSING",
    "NEEDS_MEGATRON",
    "AsyncRequest",
    "AsyncSaveShardedStrategy",
    "CheckpointingException",
    "LoadShardedStrategy",
    "ShardedObject",
    "ShardedTensor",
    "StrategyAction",
    "dict_list_map_inplace",
    "is_main_replica",
    "nested_values",
    "register_default_strategy",
    "require",
]
