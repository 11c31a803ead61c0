"""``distckpt import``: DCP directories, ``torch.save`` files and safetensors files into a
committed distckpt checkpoint, saved by this one process with :func:`distckpt.save`.

Sources, by what ``src`` is:

* a directory with a ``.metadata`` file: a ``torch.distributed.checkpoint`` (DCP)
  checkpoint. Its metadata (and any non-tensor value in it) is a pickle, and unpickling
  runs code from the file, so it is read only with ``allow_pickle=True``.
* ``.pt``, ``.pth``, ``.bin``: a ``torch.save`` file, read with
  ``torch.load(weights_only=True)`` (tensors and plain containers, no code runs), or
  with ``weights_only=False`` when ``allow_pickle=True``.
* ``.safetensors``: read with the safetensors package (no pickle).

Names: a nested dict is saved as it is, so its keys join with ``/`` (``{"model":
{"l1.weight": t}}`` becomes ``model/l1.weight``; see :mod:`distckpt.naming`). A
safetensors tensor name is taken as a distckpt name: split at ``/`` (so ``a/b`` exported
by ``distckpt export`` comes back as ``a/b``). A safetensors ``__metadata__`` entry becomes
a value: the Python value its string holds when that string is distckpt's typed JSON (as
``distckpt export`` writes them), else the string itself. The whole source is held in
memory while it is saved.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from distckpt.comm import SingleComm
from distckpt.engine.save import SaveResult, save
from distckpt.errors import ConversionError, UnsupportedValueError
from distckpt.values import decode

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
DCP_METADATA = ".metadata"
_ESCAPED = re.compile(r"%(2F|25)", re.IGNORECASE)


def import_checkpoint(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    allow_pickle: bool = False,
    overwrite: bool = False,
) -> SaveResult:
    """Read ``src`` (see the module docstring) and save it as a checkpoint at ``out``::

    import_checkpoint("model.safetensors", "run/ckpt-0")
    """
    source = Path(src)
    state = read_source(source, allow_pickle=allow_pickle)
    return save(state, out, SingleComm(), overwrite=overwrite, allow_pickle=allow_pickle)


def read_source(source: Path, *, allow_pickle: bool = False) -> dict[str, Any]:
    """The state held by ``source``, as a dict ready for :func:`distckpt.save`."""
    if source.is_dir():
        if not (source / DCP_METADATA).is_file():
            raise ConversionError(
                f"{source} is a directory without a {DCP_METADATA} file: not a "
                "torch.distributed.checkpoint directory"
            )
        return _read_dcp(source, allow_pickle)
    if not source.exists():
        raise ConversionError(f"{source} does not exist")
    suffix = source.suffix.lower()
    if suffix == ".safetensors":
        return _read_safetensors(source)
    if suffix in TORCH_SUFFIXES:
        return _read_torch(source, allow_pickle)
    raise ConversionError(
        f"cannot import {source.name!r}: expected a DCP directory, a .safetensors file, "
        "or a torch.save file (" + ", ".join(TORCH_SUFFIXES) + ")"
    )


def _read_dcp(source: Path, allow_pickle: bool) -> dict[str, Any]:
    if not allow_pickle:
        raise ConversionError(
            f"{source} is a torch.distributed.checkpoint directory, whose {DCP_METADATA} is a "
            "pickle: reading it runs code from the file. Pass --allow-pickle if you trust it"
        )
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    try:
        with warnings.catch_warnings():
            # "torch.distributed is unavailable ... assuming a single process": intended.
            warnings.simplefilter("ignore", UserWarning)
            state = _load_state_dict_from_keys(checkpoint_id=str(source))
    except Exception as exc:  # DCP raises CheckpointException and plain errors alike
        raise ConversionError(
            f"{source}: cannot read the DCP checkpoint: {_first_line(exc)}"
        ) from None
    return _as_state(state, source)


def _read_torch(source: Path, allow_pickle: bool) -> dict[str, Any]:
    try:
        state = torch.load(source, map_location="cpu", weights_only=not allow_pickle)
    except pickle.UnpicklingError as exc:
        if allow_pickle:
            raise ConversionError(f"{source}: cannot unpickle: {_first_line(exc)}") from None
        raise ConversionError(
            f"{source}: torch.load(weights_only=True) refused it ({_first_line(exc)}); if you "
            "trust the file, pass --allow-pickle (unpickling runs code from the file)"
        ) from None
    except (RuntimeError, EOFError, ValueError) as exc:
        raise ConversionError(
            f"{source}: not a readable torch.save file: {_first_line(exc)}"
        ) from None
    return _as_state(state, source)


def _read_safetensors(source: Path) -> dict[str, Any]:
    from safetensors import safe_open

    try:
        with safe_open(str(source), framework="pt") as f:
            metadata = f.metadata() or {}
            flat: dict[str, Any] = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except Exception as exc:  # safetensors raises its own SafetensorError, not exported
        raise ConversionError(
            f"{source}: not a readable safetensors file: {_first_line(exc)}"
        ) from None
    for name, text in metadata.items():
        if name in flat:
            raise ConversionError(f"{source}: {name!r} is both a tensor and a metadata entry")
        flat[name] = _metadata_value(text)
    return _nest(flat, source)


def _metadata_value(text: str) -> Any:
    """The value in a metadata string written by ``distckpt export``, else the string."""
    try:
        return decode(json.loads(text))
    except (ValueError, TypeError, KeyError, UnsupportedValueError):
        return text


def _nest(flat: dict[str, Any], source: Path) -> dict[str, Any]:
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
