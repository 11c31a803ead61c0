"""Naming the tensors of an ``nn.Module`` by attribute path, as TensorFlow's object graph.

``net.l1.weight`` is ``net/l1/weight``: the module's own edges (submodules, parameters,
persistent buffers) joined with ``/``. Wrappers that do not change the model do not
change names either: ``torch.compile``'s ``OptimizedModule`` (``_orig_mod``) and
``DistributedDataParallel`` / ``DataParallel`` (``module``) are stepped through wherever
they sit in the tree. FSDP2 (``fully_shard``) keeps the module tree and makes the
parameters DTensors, which pass through as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter

from distckpt.training.names import join


def unwrap(module: nn.Module) -> nn.Module:
    """``module`` without compile / DDP / DataParallel wrappers around it."""
    while True:
        inner = getattr(module, "_orig_mod", None)
        if isinstance(inner, nn.Module) and type(module).__name__ == "OptimizedModule":
            module = inner
        elif isinstance(module, (DistributedDataParallel, DataParallel)):
            module = module.module
        else:
            return module


@dataclass
class ModuleTensor:
    """A parameter or persistent buffer: its graph name and the module attribute holding it."""

    name: str
    owner: nn.Module
    attr: str
    buffer: bool

    @property
    def tensor(self) -> torch.Tensor:
        table = self.owner._buffers if self.buffer else self.owner._parameters
        value = table[self.attr]
        assert value is not None
        return value


def module_tensors(module: nn.Module, prefix: str) -> Iterator[ModuleTensor]:
    """Every parameter and persistent buffer under ``module``, named from ``prefix``.

    A tensor reachable by two paths (tied weights, a shared submodule) is yielded under
    each name; the caller keeps the first and records the others as aliases.
    """
    module = unwrap(module)
    for attr, param in module._parameters.items():
        if param is not None:
            yield ModuleTensor(join(prefix, attr), module, attr, False)
    skip = module._non_persistent_buffers_set
    for attr, buf in module._buffers.items():
        if buf is not None and attr not in skip:
            yield ModuleTensor(join(prefix, attr), module, attr, True)
    for attr, child in module._modules.items():
        if child is not None:
            yield from module_tensors(child, join(prefix, attr))


def is_uninitialized(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a lazy module's parameter or buffer not yet materialized."""
    return isinstance(tensor, (UninitializedParameter, UninitializedBuffer))
