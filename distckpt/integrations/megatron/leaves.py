"""How Megatron's ``ShardedTensor`` and ``ShardedObject`` leaves map onto a distckpt state
when saved: the names they are stored under and the one box per rank a save writes of
each tensor (:mod:`~distckpt.integrations.megatron.layout` says what a load reads), and
the stored form of a ``ShardedObject`` (see :mod:`distckpt.integrations.megatron`)."""

from __future__ import annotations

# zipfile decodes a record name that is not flagged UTF-8 as cp437, importing the codec
# the first time: imported here, so that no stored byte decides that an import happens.
import bisect
import encodings.cp437  # noqa: F401
import io
import math
import os
import pickle
import zipfile
from collections.abc import Collection
from typing import Any

import torch

import distckpt
from distckpt.integrations.megatron.imports import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    is_main_replica,
    nested_values,
    require,
)
from distckpt.integrations.megatron.layout import TENSORS, bounds, layer_name
from distckpt.items import Branch
from distckpt.slices import Box

#: The backend name Megatron records in ``metadata.json`` for these checkpoints.
BACKEND = "distckpt"
#: The format version of that backend.
VERSION = 1
#: The folder of Megatron's checkpoint directory that holds the distckpt checkpoint.
SUBDIR = "distckpt"

_OBJECTS = "objects"


def checkpoint_path(checkpoint_dir: str | os.PathLike[str]) -> str:
    """Where the distckpt checkpoint of Megatron's ``checkpoint_dir`` lies."""
    return os.path.join(os.fspath(checkpoint_dir), SUBDIR)


def full_box(sh: ShardedTensor) -> Box:
    """The box of the global tensor ``sh`` holds, its prepended axes included."""
    lengths = (1,) * sh.prepend_axis_num + tuple(int(n) for n in sh.local_shape)
    return Box(tuple(int(o) for o in sh.global_offset), lengths)


def _cut(sh: ShardedTensor, stacked: int) -> tuple[Box, tuple[int, ...]]:
    """The box of ``sh`` and the global shape, without their first ``stacked`` axes."""
    box = full_box(sh)
    shape = tuple(int(n) for n in sh.global_shape)
    return Box(box.offsets[stacked:], box.lengths[stacked:]), shape[stacked:]


def _tiles(boxes: list[Box], whole: Box) -> bool:
    """Whether ``boxes`` (inside ``whole``) fill ``whole`` without overlapping: counted
    on the grid of their edges, one cell per run of elements no edge cuts."""
    if sum(b.numel for b in boxes) != whole.numel:
        return False
    cuts = [
        sorted({b.offsets[d] for b in boxes} | {b.ends[d] for b in boxes})
        for d in range(whole.ndim)
    ]
    counts = torch.zeros([len(c) - 1 for c in cuts], dtype=torch.int32)
    for b in boxes:
        cells = tuple(
            slice(bisect.bisect_left(c, o), bisect.bisect_left(c, e))
            for c, o, e in zip(cuts, b.offsets, b.ends)
        )
        counts[cells] += 1
    return bool((counts == 1).all())


def _joined(leaves: list[ShardedTensor], stacked: int = 0) -> distckpt.Shard | None:
    """The one box that the boxes ``leaves`` hold make (distckpt stores one box of a
    tensor per rank), without the first ``stacked`` axes: the box itself for one leaf; for
    several that fill a box without overlapping (layers of a stack, the distributed
    optimizer's ``dp_reshardable`` pieces of a bucket), copied into one host tensor (one
    copy, as a save of device tensors makes anyway). None when they make no one box."""
    first = leaves[0]
    box, shape = _cut(first, stacked)
    for leaf in leaves[1:]:
        if _cut(leaf, stacked)[1] != shape:
            raise CheckpointingException(
                f"{first.key}: leaves of one tensor with global shapes "
                f"{list(first.global_shape)} and {list(leaf.global_shape)} on this rank"
            )
    if len(leaves) == 1:
        return distckpt.Shard(first.data.detach().reshape(box.lengths), shape, box.offsets)
    kept = [(leaf, _cut(leaf, stacked)[0]) for leaf in leaves]
    kept = [(leaf, b) for leaf, b in kept if not b.empty]
    boxes = [b for _, b in kept]
    if not boxes:
        return distckpt.Shard(torch.empty(box.lengths, dtype=first.dtype), shape, box.offsets)
    whole = boxes[0]
    for b in boxes[1:]:
        whole = bounds(whole, b)
    if not _tiles(boxes, whole):
        return None
    data = torch.empty(whole.lengths, dtype=first.dtype)
    for leaf, b in kept:
        data[b.relative_to(whole).slices()].copy_(leaf.data.detach().reshape(b.lengths))
    return distckpt.Shard(data, shape, whole.offsets)


def own_tensor(leaf: ShardedTensor) -> torch.Tensor | None:
    """The tensor a load reads into in place: the leaf's own data (detached: the same
    memory), when it has the leaf's dtype and number of elements and is contiguous; None
    otherwise (then a new buffer is read, and cut)."""
    data = leaf.data
    shape = full_box(leaf).lengths
    if (
        not isinstance(data, torch.Tensor)
        or data.dtype != leaf.dtype
        or data.numel() != math.prod(shape)
        or not data.is_contiguous()
    ):
        return None
    return data.detach().view(shape)


def refuse_flattened(sh: ShardedTensor) -> None:
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


def _main_tensors(sharded_state_dict: Any) -> dict[str, list[ShardedTensor]]:
    """This rank's main replicas of ``ShardedTensor`` leaves, by key; refuses a flattened
    range or a leaf of another kind."""
    main: dict[str, list[ShardedTensor]] = {}
    for leaf in _leaves(sharded_state_dict):
        if isinstance(leaf, ShardedTensor):
            refuse_flattened(leaf)
            if is_main_replica(leaf.replica_id):
                main.setdefault(leaf.key, []).append(leaf)
        elif not isinstance(leaf, ShardedObject):
            raise CheckpointingException(
                f"the {BACKEND!r} backend saves ShardedTensor and ShardedObject leaves, "
                f"got {type(leaf).__name__}"
            )
    return main


def unjoined(sharded_state_dict: Any) -> list[str]:
    """The keys of the tensors this rank holds boxes of that make no one box (an
    interleaved pipeline's layers): the keys to store one variable per layer, once every
    rank's answer is known (``save_state(..., layered=...)``)."""
    require()
    out = []
    for key, group in _main_tensors(sharded_state_dict).items():
        boxes = [full_box(leaf) for leaf in group if not full_box(leaf).empty]
        if len(boxes) > 1:
            whole = boxes[0]
            for b in boxes[1:]:
                whole = bounds(whole, b)
            if not _tiles(boxes, whole):
                out.append(key)
    return out


def _layers(key: str, group: list[ShardedTensor]) -> dict[str, Any]:
    """The stored layers of a tensor saved one variable per index along its prepended
    axes (the *layers* layout of :mod:`~distckpt.integrations.megatron.layout`)."""
    stacked = group[0].prepend_axis_num
    if not stacked or any(leaf.prepend_axis_num != stacked for leaf in group):
        raise CheckpointingException(
            f"{key}: this rank holds boxes of it that do not join into one box, and "
            f"prepended axes {sorted({leaf.prepend_axis_num for leaf in group})} to store "
            f"it by; the {BACKEND!r} backend stores one box of a tensor per rank, or of "
            "each index along the prepended axes"
        )
    by_index: dict[tuple[int, ...], list[ShardedTensor]] = {}
    for leaf in group:
        by_index.setdefault(full_box(leaf).offsets[:stacked], []).append(leaf)
    out: dict[str, Any] = Branch()
    for index, layer in sorted(by_index.items()):
        out[layer_name(index)] = _one_box(key, layer, stacked)
    return out


def _one_box(key: str, leaves: list[ShardedTensor], stacked: int = 0) -> distckpt.Shard:
    joined = _joined(leaves, stacked)
    if joined is None:
        boxes = ", ".join(str(_cut(leaf, stacked)[0]) for leaf in leaves[:4])
        raise CheckpointingException(
            f"{key}: this rank holds {len(leaves)} boxes of it that do not join into one "
            f"({boxes}{', ...' if len(leaves) > 4 else ''}); the {BACKEND!r} backend "
            "stores one box of a tensor per rank"
        )
    return joined


def save_state(sharded_state_dict: Any, layered: Collection[str] = ()) -> dict[str, Any]:
    """This rank's distckpt state for Megatron's ``sharded_state_dict`` (its main replicas
    only): each tensor whole, at its global shape with the prepended axes, except the keys
    ``layered`` names (every rank must give the same), stored one variable per index along
    their prepended axes."""
    require()
    tensors: dict[str, Any] = Branch()
    objects: dict[str, Any] = Branch()
    for key, group in _main_tensors(sharded_state_dict).items():
        tensors[key] = _layers(key, group) if key in layered else _one_box(key, group)
    for leaf in _leaves(sharded_state_dict):
        if isinstance(leaf, ShardedObject) and is_main_replica(leaf.replica_id):
            payload = _object_bytes(leaf.data)
            objects[leaf.unique_key] = distckpt.Shard(payload, (payload.numel(),), (0,))
    return {TENSORS: tensors, _OBJECTS: objects}
