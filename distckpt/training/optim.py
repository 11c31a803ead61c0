"""Optimizer state keyed by parameter names, never by integer ids.

``optimizer.state_dict()`` numbers parameters in the order of its param groups, which
changes whenever the model or the optimizer is built differently. distckpt stores it
under the names the object graph gives the parameters instead, so the state survives
re-creating model and optimizer and reshards with the parameters:

* ``<opt>/state/<parameter name>/<slot>``: each slot (``step``, ``exp_avg``,
  ``exp_avg_sq``, ``momentum_buffer`` ...) of the parameter named e.g. ``net/l1/weight``
  is ``optimizer/state/net/l1/weight/exp_avg``. Zarr arrays cannot have children, so the
  slots live in the optimizer's own ``state/`` subtree and not under the parameter.
  A slot that is a tensor is a variable (a DTensor slot is stored sharded); others are
  typed values.
* ``<opt>/param_groups``: the hyperparameters of every group as one typed value, each
  group's ``params`` being the list of its parameter names.

A parameter that no module (or tensor) in the graph names is an error: add the module
that owns it to the Checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from distckpt.errors import CheckpointError, ShapeMismatchError
from distckpt.training.names import parts

NameOf = Callable[[torch.Tensor], str]


def optimizer_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters in ``state_dict()`` order (its integer ids are indices in this)."""
    return [p for group in opt.param_groups for p in group["params"]]


def named_state(opt: torch.optim.Optimizer, name_of: NameOf) -> dict[str, Any]:
    """``opt.state_dict()`` with parameter names in place of integer ids.

    ``state`` is nested by the parts of each parameter name, so the names of its leaves
    are ``state/net/l1/weight/exp_avg``.
    """
    sd = opt.state_dict()
    params = optimizer_params(opt)
    state: dict[str, Any] = {}
    for index, slots in sd["state"].items():
        node = state
        keys = parts(name_of(params[index]))
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = dict(slots)
    groups = []
    for group in sd["param_groups"]:
        named = {k: v for k, v in group.items() if k != "params"}
        named["params"] = [name_of(params[i]) for i in group["params"]]
        groups.append(named)
    return {"state": state, "param_groups": groups}


def indexed_state(
    opt: torch.optim.Optimizer, named: dict[str, Any], name_of: NameOf, where: str
) -> dict[str, Any]:
    """The ``load_state_dict`` argument for ``opt`` from a :func:`named_state` layout.

    Saved param groups are matched to the optimizer's groups by position; their
    hyperparameters are restored, their ``params`` become the optimizer's own ids.
    """
    params = optimizer_params(opt)
    ids = {id(p): i for i, p in enumerate(params)}
    state: dict[int, Any] = {}
    for p in params:
        node: Any = named["state"]
        for key in parts(name_of(p)):
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            state[ids[id(p)]] = node
    saved, current = named["param_groups"], opt.param_groups
    if len(saved) != len(current):
        raise ShapeMismatchError(
            f"optimizer {where!r}: the checkpoint has {len(saved)} param groups, the optimizer "
            f"has {len(current)}"
        )
    groups = []
    for k, (group, mine) in enumerate(zip(saved, current)):
        names = [name_of(p) for p in mine["params"]]
        if sorted(group.get("params", [])) != sorted(names):
            raise ShapeMismatchError(
                f"optimizer {where!r}: param group {k} holds {group.get('params')} in the "
                f"checkpoint but {names} in the optimizer"
            )
        restored = {key: v for key, v in group.items() if key != "params"}
        restored["params"] = [ids[id(p)] for p in mine["params"]]
        groups.append(restored)
    return {"state": state, "param_groups": groups}


def init_state(opt: torch.optim.Optimizer, params: list[torch.Tensor], where: str) -> None:
    """Create ``opt``'s state for ``params`` that have none, with the optimizer's own code.

    As ``torch.distributed.checkpoint.state_dict`` does: one ``step()`` with zero
    gradients and learning rate 0, for those parameters only (every other parameter's
    gradient is set to None for the step, so its state and value are left alone). The
    parameters do not change; their gradients and the learning rates are put back. The
    state's values are then overwritten by the restore.
    """
    todo = {id(p) for p in params if not opt.state.get(p)}
    if not todo:
        return
    everything = optimizer_params(opt)
    grads = [p.grad for p in everything]
    lrs = [group.get("lr") for group in opt.param_groups]
    try:
        for p in everything:
            p.grad = torch.zeros_like(p) if id(p) in todo else None
        for group in opt.param_groups:
            if "lr" in group:
                lr = group["lr"]
                group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
        opt.step()
    except Exception as exc:
        raise CheckpointError(
            f"optimizer {where!r}: could not create the state of {type(opt).__name__} to "
            f"restore into (a step with zero gradients failed: {exc})"
        ) from exc
    finally:
        for p, grad in zip(everything, grads):
            p.grad = grad
        for group, lr in zip(opt.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
