"""How Megatron's ``ShardedTensor`` and ``ShardedObject`` leaves map onto a distckpt state:
the names they are stored under, the one box per rank a save writes of each tensor, and
what a load reads for a leaf (see :mod:`distckpt.integrations.megatron`)."""

from __future__ import annotations

# zipfile decodes a record name that is not flagged UTF-8 as cp437, importing the codec
# the first time: imported here, so that no stored byte decides that an import happens.
import encodings.cp437  # noqa: F401
import io
import math
import os
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import distckpt
from distckpt.items import Branch
from distckpt.naming import join_keys
from distckpt.slices import Box

try:
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        is_main_replica,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "distckpt.integrations.megatron needs megatron-core: pip install 'distckpt[megatron]'"
    ) from exc

#: The backend name Megatron records in ``metadata.json`` for these checkpoints.
BACKEND = "distckpt"
#: The format version of that backend.
VERSION = 1
#: The folder of Megatron's checkpoint directory that holds the distckpt checkpoint.
SUBDIR = "distckpt"

_TENSORS = "tensors"
_OBJECTS = "objects"


def checkpoint_path(checkpoint_dir: str | os.PathLike[str]) -> str:
    """Where the distckpt checkpoint of Megatron's ``checkpoint_dir`` lies."""
    return os.path.join(os.fspath(checkpoint_dir), SUBDIR)


def _inner_shape(sh: ShardedTensor) -> tuple[int, ...]:
    return tuple(sh.global_shape[sh.prepend_axis_num :])


def _inner_offset(sh: ShardedTensor) -> tuple[int, ...]:
    return tuple(sh.global_offset[sh.prepend_axis_num :])


def _stack_index(sh: ShardedTensor) -> str:
    """The name of a stacked tensor's part: its offsets along the prepended axes."""
    return ".".join(str(int(o)) for o in sh.global_offset[: sh.prepend_axis_num])


def _where(tensors: dict[str, Any], sh: ShardedTensor) -> tuple[dict[str, Any], str]:
    """Where ``sh`` is stored: ``tensors[key]``, or for a tensor with prepended axes
    (Megatron's stacked layers, one layer per box along those axes)
    ``tensors[key][<offsets along them>]``, so each layer is a tensor of its own and a rank
    holding several layers holds one box of each."""
    if not sh.prepend_axis_num:
        return tensors, sh.key
    parts = tensors.setdefault(sh.key, Branch())
    if not isinstance(parts, dict):
        raise CheckpointingException(f"{sh.key}: stacked on some ranks and not on others")
    return parts, _stack_index(sh)


def _box(sh: ShardedTensor) -> Box:
    return Box(_inner_offset(sh), tuple(int(n) for n in sh.local_shape))


def _groups(leaves: list[ShardedTensor]) -> list[list[ShardedTensor]]:
    """``leaves`` grouped by the stored tensor they are boxes of (key, and layer when
    stacked).

    A rank may hold several boxes of one tensor: the distributed optimizer's
    ``dp_reshardable`` format gives each parameter's (and each padding's) part of a
    bucket's data-parallel range as a ShardedTensor of the bucket's key."""
    groups: dict[tuple[str, str], list[ShardedTensor]] = {}
    for leaf in leaves:
        stack = _stack_index(leaf) if leaf.prepend_axis_num else ""
        groups.setdefault((leaf.key, stack), []).append(leaf)
    for group in groups.values():
        if len({leaf.prepend_axis_num for leaf in group}) > 1:
            raise CheckpointingException(f"{group[0].key}: stacked by some leaves, not by others")
    return list(groups.values())


def _joined(leaves: list[ShardedTensor]) -> distckpt.Shard:
    """One box of the boxes ``leaves`` hold (distckpt stores one box of a tensor per
    rank): the box itself for one leaf; for several, boxes that follow one another along
    the first axis, copied into one host tensor (one copy, as a save of device tensors
    makes anyway)."""
    first = leaves[0]
    shape = _inner_shape(first)
    if len(leaves) == 1:
        data = first.data.detach().reshape(tuple(first.local_shape))
        return distckpt.Shard(data, shape, _inner_offset(first))
    ordered = sorted(leaves, key=_inner_offset)
    boxes = [_box(leaf) for leaf in ordered]
    for leaf, a, b in zip(ordered[1:], boxes, boxes[1:]):
        if (
            _inner_shape(leaf) != shape
            or b.offsets[0] != a.ends[0]
            or b.offsets[1:] != a.offsets[1:]
            or b.lengths[1:] != a.lengths[1:]
        ):
            raise CheckpointingException(
                f"{first.key}: this rank holds {len(leaves)} boxes of it that do not join "
                f"into one (offsets {list(a.offsets)} size {list(a.lengths)}, then offsets "
                f"{list(b.offsets)} size {list(b.lengths)}); the {BACKEND!r} backend stores "
                "one box of a tensor per rank"
            )
    rows = boxes[-1].ends[0] - boxes[0].offsets[0]
    whole = Box(boxes[0].offsets, (rows, *boxes[0].lengths[1:]))
    data = torch.empty(whole.lengths, dtype=first.dtype)
    for leaf, box in zip(ordered, boxes):
        data[box.relative_to(whole).slices()].copy_(leaf.data.detach().reshape(box.lengths))
    return distckpt.Shard(data, shape, whole.offsets)


def _own_tensor(group: list[ShardedTensor]) -> torch.Tensor | None:
    """The tensor a load reads into in place for a tensor this rank asks one box of: the
    leaf's own data (detached: the same memory), when it has the leaf's dtype and number
    of elements and is contiguous; None otherwise (then a new buffer is read, and cut)."""
    if len(group) != 1:
        return None
    leaf = group[0]
    data = leaf.data
    shape = tuple(int(n) for n in leaf.local_shape)
    if (
        not isinstance(data, torch.Tensor)
        or data.dtype != leaf.dtype
        or data.numel() != math.prod(shape)
        or not data.is_contiguous()
    ):
        return None
    return data.detach().view(shape)


@dataclass
class _Overlap:
    """What a load reads for a leaf with ``allow_shape_mismatch`` whose stored tensor has
    another shape (Megatron-LM pads vocabularies to a multiple that depends on the
    tensor-parallel size): the part of the leaf's box inside the stored tensor (``part``,
    in the leaf's coordinates; None where they do not meet); the rest is zeros, as
    Megatron's own strategies leave it."""

    shard: distckpt.Shard | None
    part: Box | None

    def filled(self, leaf: ShardedTensor) -> torch.Tensor:
        device = leaf.data.device if isinstance(leaf.data, torch.Tensor) else "cpu"
        out = torch.zeros(tuple(leaf.local_shape), dtype=leaf.dtype, device=device)
        if self.shard is not None and self.part is not None:
            out[self.part.slices()] = self.shard.tensor.to(device)
        return out


def _stored_name(sh: ShardedTensor) -> str:
    stack = [_stack_index(sh)] if sh.prepend_axis_num else []
    return join_keys([_TENSORS, sh.key, *stack])


def _stored_shapes(
    leaves: list[ShardedTensor], checkpoint_dir: str | Path
) -> dict[str, tuple[int, ...] | None]:
    """The stored shapes of the tensors, read only when a leaf allows a shape mismatch."""
    if not any(leaf.allow_shape_mismatch for leaf in leaves):
        return {}
    return {v.name: v.shape for v in distckpt.list_variables(checkpoint_path(checkpoint_dir))}


def _overlap(
    group: list[ShardedTensor], stored: dict[str, tuple[int, ...] | None]
) -> _Overlap | None:
    """How to read a group whose leaf allows a shape mismatch and whose stored tensor has
    another shape; None for every other group (read as asked)."""
    first = group[0]
    if not any(leaf.allow_shape_mismatch for leaf in group):
        return None
    shape = stored.get(_stored_name(first))
    if shape is None or tuple(shape) == _inner_shape(first):
        return None
    if len(group) > 1 or len(shape) != len(first.local_shape):
        raise CheckpointingException(
            f"{first.key}: stored with shape {list(shape)}, asked as "
            f"{list(_inner_shape(first))}; the {BACKEND!r} backend loads a tensor of another "
            "shape (allow_shape_mismatch) for one box per rank of the same number of axes"
        )
    box = _box(first)
    inside = box.intersect(Box.full(tuple(shape)))
    if inside is None or inside.empty:
        return _Overlap(None, None)
    buffer = torch.empty(inside.lengths, dtype=first.dtype)
    return _Overlap(distckpt.Shard(buffer, tuple(shape), inside.offsets), inside.relative_to(box))


def _bounds(leaves: list[ShardedTensor]) -> Box:
    """The smallest box holding the boxes of ``leaves``: what a load reads for them."""
    boxes = [_box(leaf) for leaf in leaves]
    low = tuple(min(b.offsets[d] for b in boxes) for d in range(boxes[0].ndim))
    high = tuple(max(b.ends[d] for b in boxes) for d in range(boxes[0].ndim))
    return Box(low, tuple(h - lo for h, lo in zip(high, low)))


def _refuse_flattened(sh: ShardedTensor) -> None:
    if getattr(sh, "flattened_range", None) is not None:
        raise CheckpointingException(
            f"{sh.key}: a ShardedTensor with a flattened_range is not supported by the "
            f"{BACKEND!r} backend; save the distributed optimizer with a reshardable "
            "sharding type (metadata['distrib_optim_sharding_type'] = 'fully_reshardable')"
        )


def _object_bytes(value: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _object_value(data: torch.Tensor, name: str, allow_pickle: bool = False) -> Any:
    """The object a ``ShardedObject`` stored (:func:`_object_bytes`): read by torch's
    ``weights_only`` unpickler (tensors, plain containers and the classes torch and
    megatron-core allow, as Megatron's own backends read theirs), or by the full one with
    ``allow_pickle=True``. Bytes it refuses are a CorruptCheckpointError naming ``name``."""
    raw = data.cpu().numpy().tobytes()
    _check_archive(raw, name)
    try:
        return torch.load(io.BytesIO(raw), weights_only=not allow_pickle, map_location="cpu")
    except pickle.UnpicklingError as exc:
        if allow_pickle:
            raise distckpt.CorruptCheckpointError(f"ShardedObject {name!r}: {exc}") from None
        raise distckpt.UnsupportedValueError(
            f"ShardedObject {name!r} holds what torch.load(weights_only=True) refuses "
            f"({str(exc).splitlines()[0]:.200}); load it with "
            "DistckptLoadStrategy(allow_pickle=True) only if you trust the checkpoint "
            "(unpickling runs code from it)"
        ) from None
    except Exception as exc:  # a damaged archive: zipfile's, torch's or the unpickler's
        raise distckpt.CorruptCheckpointError(
            f"ShardedObject {name!r}: not a readable torch.save archive ({type(exc).__name__})"
        ) from None


def _check_archive(raw: bytes, name: str) -> None:
    """Refuse an archive whose records would take more memory than its bytes hold:
    ``torch.save`` stores every record uncompressed, and a record declared compressed
    (a zip bomb) would be inflated to the size it declares."""
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError):
        raise distckpt.CorruptCheckpointError(
            f"ShardedObject {name!r}: not a torch.save archive"
        ) from None
    for record in records:
        if record.compress_type != zipfile.ZIP_STORED or record.file_size > len(raw):
            raise distckpt.CorruptCheckpointError(
                f"ShardedObject {name!r}: record {record.filename!r:.80} is compressed or "
                f"declares {record.file_size} bytes in an archive of {len(raw)}"
            )


def _leaves(sharded_state_dict: Any) -> list[Any]:
    return list(nested_values(sharded_state_dict))


def save_state(sharded_state_dict: Any) -> dict[str, Any]:
    """This rank's distckpt state for Megatron's ``sharded_state_dict`` (its main replicas
    only)."""
    tensors: dict[str, Any] = Branch()
    objects: dict[str, Any] = Branch()
    main: list[ShardedTensor] = []
    for leaf in _leaves(sharded_state_dict):
        if isinstance(leaf, ShardedTensor):
            _refuse_flattened(leaf)
            if is_main_replica(leaf.replica_id):
                main.append(leaf)
        elif isinstance(leaf, ShardedObject):
            if is_main_replica(leaf.replica_id):
                payload = _object_bytes(leaf.data)
                objects[leaf.unique_key] = distckpt.Shard(payload, (payload.numel(),), (0,))
        else:
            raise CheckpointingException(
                f"the {BACKEND!r} backend saves ShardedTensor and ShardedObject leaves, "
                f"got {type(leaf).__name__}"
            )
    for group in _groups(main):
        where, name = _where(tensors, group[0])
        where[name] = _joined(group)
    return {_TENSORS: tensors, _OBJECTS: objects}
