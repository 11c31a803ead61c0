"""``distckpt import``: DCP directories, ``torch.save`` files, safetensors files and
Hugging Face weights directories into a committed distckpt checkpoint, saved by this one
process.

Sources, by what ``src`` is:

* a directory with a ``.metadata`` file: a ``torch.distributed.checkpoint`` (DCP)
  checkpoint. Its metadata (and any non-tensor value in it) is a pickle, and unpickling
  runs code from the file, so it is read only with ``allow_pickle=True``. It is read with
  DCP's public API (``FileSystemReader.read_metadata`` and ``dcp.load`` into tensors made
  from the metadata) and held in memory while it is saved.
* a directory of ``*.safetensors`` files (Hugging Face weights, with or without
  ``model.safetensors.index.json``), or one ``.safetensors`` file: parsed by distckpt
  (:mod:`distckpt.hf.safetensors`; no pickle) and **streamed**: each tensor's bytes go from
  the file through the staging slabs into the checkpoint as the writer asks for them, so
  memory stays within the slab pool (4 x 64 MiB by default) whatever the model's size.
* ``.pt``, ``.pth``, ``.bin``, ``.ckpt`` (Lightning's): a ``torch.save`` file, read with
  ``torch.load(weights_only=True)`` (tensors and plain containers, no code runs), or
  with ``weights_only=False`` when ``allow_pickle=True``; memory-mapped where the file's
  format allows (then its pages are the page cache's, not the process's own memory).

Names: a nested dict is saved as it is, so its keys join with ``/`` (``{"model":
{"l1.weight": t}}`` becomes ``model/l1.weight``; see :mod:`distckpt.naming`). A
safetensors tensor name is taken as a distckpt name: split at ``/`` (so ``a/b`` exported
by ``distckpt export`` comes back as ``a/b``). A single safetensors file's
``__metadata__`` entries become values: the Python value a string holds when it is
distckpt's typed JSON (as ``distckpt export`` writes them), else the string itself.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import stat
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distckpt import dtypes
from distckpt.comm import SingleComm
from distckpt.engine.save import save_from
from distckpt.errors import CheckpointError, ConversionError
from distckpt.hf.directory import is_stored, open_weights
from distckpt.pipeline.results import SaveResult
from distckpt.storage.beneath import open_resolved
from distckpt.storage.fsutil import file_kind
from distckpt.tools.loaded import checked_tensors
from distckpt.transfer.sources import FileData, Source, source_for
from distckpt.values import decode

#: The suffixes of the files read as ``torch.save`` files.
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
#: The file that makes a directory a ``torch.distributed.checkpoint`` one.
DCP_METADATA = ".metadata"
_ESCAPED = re.compile(r"%(2F|25)", re.IGNORECASE)


def import_checkpoint(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    allow_pickle: bool = False,
    overwrite: bool = False,
    prefix: str = "",
) -> SaveResult:
    """Read ``src`` (see the module docstring) and save it as a checkpoint at ``out``,
    every name under ``prefix`` (``"net/"``: restorable by ``Checkpoint(net=model)``)::

        import_checkpoint("model.safetensors", "run/ckpt-0")
        import_checkpoint("Llama-3.2-1B/", "run/ckpt-0", prefix="net/")
    """
    files: dict[int, FileData] = {}
    if is_stored(src):  # Hugging Face weights in a store (s3://, az://, gs://, ...)
        state = _read_safetensors(str(src), files, metadata=str(src).endswith(".safetensors"))
    else:
        state = read_source(Path(src), allow_pickle=allow_pickle, files=files)
    for key in reversed([k for k in prefix.split("/") if k]):
        state = {key: state}

    def source_of(tensor: torch.Tensor, name: str) -> Source:
        found = files.get(id(tensor))
        return found if found is not None else source_for(tensor, name)

    return save_from(
        state, out, source_of, SingleComm(), overwrite=overwrite, allow_pickle=allow_pickle
    )


def read_source(
    source: Path, *, allow_pickle: bool = False, files: dict[int, FileData] | None = None
) -> dict[str, Any]:
    """The state held by ``source``, as a dict ready for :func:`distckpt.save`. With
    ``files``, safetensors tensors are left in their files: the state holds meta tensors
    and ``files`` maps each one's ``id`` to where its bytes are."""
    if source.is_dir():
        if (source / DCP_METADATA).is_file():
            return _read_dcp(source, allow_pickle)
        if any(source.glob("*.safetensors")):
            return _read_safetensors(source, files, metadata=False)
        raise ConversionError(
            f"{source} is a directory without a {DCP_METADATA} file or *.safetensors files: "
            "not a torch.distributed.checkpoint or Hugging Face weights directory"
        )
    if not source.exists():
        raise ConversionError(f"{source} does not exist")
    suffix = source.suffix.lower()
    if suffix == ".safetensors":
        return _read_safetensors(source, files, metadata=True)
    if suffix in TORCH_SUFFIXES:
        return _read_torch(source, allow_pickle)
    raise ConversionError(
        f"cannot import {source.name!r}: expected a DCP directory, a Hugging Face weights "
        "directory, a .safetensors file, or a torch.save file (" + ", ".join(TORCH_SUFFIXES) + ")"
    )


def _read_dcp(source: Path, allow_pickle: bool) -> dict[str, Any]:
    if not allow_pickle:
        raise ConversionError(
            f"{source} is a torch.distributed.checkpoint directory, whose {DCP_METADATA} is a "
            "pickle: reading it runs code from the file. Pass --allow-pickle if you trust it"
        )
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        reader = dcp.FileSystemReader(str(source))
        metadata = reader.read_metadata()
        # The state DCP saved, rebuilt from its metadata: tensors of the stored shapes and
        # dtypes to load into, placeholders for the other values (DCP replaces them).
        state: dict[str, Any] = {}
        paths = metadata.planner_data or {}
        for key, meta in metadata.state_dict_metadata.items():
            value: Any = meta
            if isinstance(meta, TensorStorageMetadata):
                value = torch.empty(meta.size, dtype=meta.properties.dtype)
            _set_path(state, tuple(paths.get(key, (key,))), value)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=reader, no_dist=True)
    except ConversionError:
        raise
    except Exception as exc:  # DCP raises CheckpointException and plain errors alike
        raise ConversionError(
            f"{source}: cannot read the DCP checkpoint: {_first_line(exc)}"
        ) from None
    return _as_state(state, source)


def _set_path(state: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """``state[path[0]][path[1]]... = value``, creating dicts (lists for int keys) on the
    way: the containers DCP flattened."""
    node: Any = state
    for key, nxt in zip(path[:-1], path[1:], strict=True):
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            if node[key] is None:
                node[key] = [] if isinstance(nxt, int) else {}
            node = node[key]
        else:
            node = node.setdefault(key, [] if isinstance(nxt, int) else {})
    if isinstance(node, list):
        while len(node) <= path[-1]:
            node.append(None)
    node[path[-1]] = value


def _read_torch(source: Path, allow_pickle: bool) -> dict[str, Any]:
    # The file you named, through your links, once it is seen to be a regular file: a
    # FIFO would block torch.load forever, a device feed it without end.
    mode = os.stat(source).st_mode
    if not stat.S_ISREG(mode):
        raise ConversionError(f"{source} is {file_kind(mode)}, not a regular file")
    os.close(open_resolved(os.path.realpath(source)))  # (and not one swapped in since)
    try:
        with warnings.catch_warnings():  # one line of output: what went wrong, or nothing
            warnings.simplefilter("ignore")
            state = _torch_load(source, allow_pickle)
    except pickle.UnpicklingError as exc:
        if allow_pickle:
            raise ConversionError(f"{source}: cannot unpickle: {_reason(exc)}") from None
        raise ConversionError(
            f"{source}: torch.load(weights_only=True) refused it ({_reason(exc)}); if you "
            "trust the file, pass --allow-pickle (allow_pickle=True from Python; unpickling "
            "runs code from the file)"
        ) from None
    except Exception as exc:  # noqa: BLE001 - torch's parser of a damaged file raises anything
        raise ConversionError(
            f"{source}: not a readable torch.save file: {type(exc).__name__}: {_first_line(exc)}"
        ) from None
    return checked_tensors(_as_state(state, source), source)


def _torch_load(source: Path, allow_pickle: bool) -> Any:
    try:  # memory-mapped: the tensors stay in the page cache
        return torch.load(source, map_location="cpu", weights_only=not allow_pickle, mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise
        return torch.load(source, map_location="cpu", weights_only=not allow_pickle)


def _read_safetensors(
    source: Path | str, files: dict[int, FileData] | None, *, metadata: bool
) -> dict[str, Any]:
    """The tensors of a safetensors file or weights directory: meta tensors noted in
    ``files`` (streamed when saved), or read whole when ``files`` is None."""
    weights = open_weights(source)
    flat: dict[str, Any] = {}
    for name, stored in weights.tensors.items():
        data = FileData(stored.path, stored.offset, stored.shape, stored.dtype, name, weights.store)
        dtype = dtypes.torch_dtype(stored.dtype)
        if files is None:
            raw = torch.from_numpy(data.host().reshape(-1).view(np.uint8))
            flat[name] = raw.view(dtype).reshape(stored.shape)
        else:
            flat[name] = torch.empty(stored.shape, dtype=dtype, device="meta")
            files[id(flat[name])] = data
    for name, text in (weights.metadata if metadata else {}).items():
        if name in flat:
            raise ConversionError(f"{source}: {name!r} is both a tensor and a metadata entry")
        flat[name] = _metadata_value(text)
    return _nest(flat, source)


def _metadata_value(text: str) -> Any:
    """The value in a metadata string written by ``distckpt export``, else the string."""
    try:
        return decode(json.loads(text))
    except (ValueError, TypeError, KeyError, RecursionError, CheckpointError):
        return text


def _nest(flat: dict[str, Any], source: Path | str) -> dict[str, Any]:
    """``{"a/b": x}`` as ``{"a": {"b": x}}``, each component unescaped (see
    :mod:`distckpt.naming`), so the saved names are the given ones."""
    root: dict[str, Any] = {}
    for name in sorted(flat):
        keys = [_ESCAPED.sub(lambda m: chr(int(m[1], 16)), k) for k in name.split("/")]
        node = root
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ConversionError(f"{source}: {name!r} lies under another entry's name")
            node = child
        if keys[-1] in node:
            raise ConversionError(f"{source}: {name!r} is also the prefix of other names")
        node[keys[-1]] = flat[name]
    return root


def _as_state(state: Any, source: Path) -> dict[str, Any]:
    if isinstance(state, torch.Tensor):
        raise ConversionError(
            f"{source} holds a single tensor, not a dict of named tensors; import "
            "{'name': tensor} instead"
        )
    if not isinstance(state, dict):
        raise ConversionError(
            f"{source} holds a {type(state).__name__}, not a dict of named tensors"
        )
    return state


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _first_line(exc: BaseException) -> str:
    text = _ANSI.sub("", str(exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _reason(exc: BaseException) -> str:
    """What torch's unpickler refused (its "WeightsUnpickler error" line names the
    class), else the first line of its message; without terminal escapes."""
    for line in _ANSI.sub("", str(exc)).splitlines():
        if "WeightsUnpickler error" in line or "Unsupported global" in line:
            return line.split(". Please use")[0].strip()  # not torch's advice: ours follows
    return _first_line(exc)
