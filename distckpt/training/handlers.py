"""Per kind of tracked object: the named leaves it saves, and how it is restored.

Saving walks the graph (:func:`~distckpt.training.tracking.walk`) and asks each object
for its leaves; a tensor met again under another name (tied weights, a module tracked
twice) is saved once, under the first name, and the other names are recorded as
aliases. Restoring asks each object for its :class:`~distckpt.training.plan.Slot` s and
finalizers; nodes are bound to the restore so children added later are restored too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from distckpt.errors import UnsupportedValueError
from distckpt.items import PerRank, Shard
from distckpt.training import optim, stateful
from distckpt.training.modules import ModuleTensor, is_uninitialized, module_tensors
from distckpt.training.names import join
from distckpt.training.plan import Plan, Slot
from distckpt.training.tracking import ObjectGraphError, Position, RestoreTarget, Visit, walk
from distckpt.values import encode


class Restoring(RestoreTarget, Protocol):
    """What the planners here use of a restore
    (:class:`distckpt.training.session.RestoreSession`)."""

    pending: set[str]
    claimed: set[str]

    def find(self, name: str) -> object | None: ...
    def has_under(self, name: str) -> bool: ...
    def tensor_names(self) -> TensorNames: ...
    def execute(self, plan: Plan) -> None: ...


Leaves = Iterator[tuple[str, Any]]


class TensorNames:
    """The graph name of every parameter, buffer and tracked tensor, by identity."""

    def __init__(self, root: Any) -> None:
        self._names: dict[int, str] = {}
        for visit in walk(root):
            if visit.kind == "module":
                for mt in module_tensors(visit.obj, visit.name):
                    self._names.setdefault(id(mt.tensor), mt.name)
            elif visit.kind == "tensor":
                self._names.setdefault(id(visit.obj), visit.name)

    def name_of(self, tensor: torch.Tensor) -> str:
        name = self._names.get(id(tensor))
        if name is None:
            raise ObjectGraphError(
                f"an optimizer holds a parameter of shape {list(tensor.shape)} that no module or "
                "tensor in the Checkpoint names; track the model that owns it, e.g. "
                "Checkpoint(model=model, optimizer=optimizer)"
            )
        return name


# ---------------------------------------------------------------- saving


def _save_module(visit: Visit, names: TensorNames, existing_only: bool) -> Leaves:
    for mt in module_tensors(visit.obj, visit.name):
        tensor = mt.tensor
        if is_uninitialized(tensor):
            if existing_only:
                continue
            raise UnsupportedValueError(
                f"variable {mt.name!r} is an uninitialized parameter of a lazy module; run a "
                "forward pass before saving"
            )
        yield mt.name, tensor


def _save_optimizer(visit: Visit, names: TensorNames, existing_only: bool) -> Leaves:
    named = optim.named_state(visit.obj, names.name_of)
    for name, _, leaf in stateful.leaves(named, visit.name):
        yield name, leaf


def _save_stateful(visit: Visit, names: TensorNames, existing_only: bool) -> Leaves:
    for name, _, leaf in stateful.leaves(visit.obj.state_dict(), visit.name):
        yield name, leaf


def _save_leaf(visit: Visit, names: TensorNames, existing_only: bool) -> Leaves:
    yield visit.name, visit.obj


_SAVERS: dict[str, Callable[[Visit, TensorNames, bool], Leaves]] = {
    "module": _save_module,
    "optimizer": _save_optimizer,
    "stateful": _save_stateful,
    "tensor": _save_leaf,
    "per_rank": _save_leaf,
    "value": _save_leaf,
}


def collect(
    root: Any,
    *,
    existing_only: bool = False,
    allow_pickle: bool = False,
    stable: set[str] | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """``({name: leaf}, {alias: name})`` for everything the graph under ``root`` saves.

    ``existing_only`` skips what does not exist yet (lazy parameters) instead of failing;
    ``allow_pickle`` lets objects that are not tensors or typed values through (the engine
    stores them pickled). ``stable``, if given, receives the names of the tensors that only
    ``optimizer.step()`` changes: module parameters and optimizer state (a lazy save
    copies them in the background).
    """
    names = TensorNames(root)
    leaves: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}
    for visit in walk(root):
        saver = _SAVERS.get(visit.kind)
        if saver is None:
            continue
        for name, leaf in saver(visit, names, existing_only):
            if isinstance(leaf, (torch.Tensor, Shard)):
                if id(leaf) in first:
                    aliases[name] = first[id(leaf)]
                    continue
                first[id(leaf)] = name
                if stable is not None and (
                    visit.kind == "optimizer"
                    or (visit.kind == "module" and isinstance(leaf, torch.nn.Parameter))
                ):
                    stable.add(name)
            elif not existing_only and not isinstance(leaf, PerRank):
                # refuse what cannot be stored, under its own name
                encode(leaf, name, allow_pickle=allow_pickle)
            leaves[name] = leaf
    return leaves, aliases


# ---------------------------------------------------------------- restoring


def _in_place(leaf: Any) -> Any:
    return leaf if isinstance(leaf, (torch.Tensor, Shard)) else None


def _plan_node(visit: Visit, plan: Plan, session: Restoring) -> None:
    visit.obj._bind(Position(session, visit.name))


def _plan_module(visit: Visit, plan: Plan, session: Restoring) -> None:
    lazy: dict[int, list[ModuleTensor]] = {}
    for mt in module_tensors(visit.obj, visit.name):
        if is_uninitialized(mt.tensor):
            lazy.setdefault(id(mt.owner), []).append(mt)
        else:
            plan.slots.append(Slot(mt.name, mt.tensor))
    for waiting in lazy.values():
        _restore_when_materialized(waiting, session)


def _restore_when_materialized(waiting: list[ModuleTensor], session: Restoring) -> None:
    """Restore a lazy module's parameters right after its first forward creates them.

    The hook runs after the module's own initializing pre-hook (registered in its
    ``__init__``), so the first forward already computes with the restored values. The
    read is collective: in SPMD code every rank runs that first forward.
    """
    names = [mt.name for mt in waiting if session.find(mt.name) is not None]
    if not names:
        return
    session.pending.update(names)
    owner = waiting[0].owner
    handle: list[Any] = []

    def hook(module: Any, args: Any) -> None:
        if any(is_uninitialized(mt.tensor) for mt in waiting):
            return
        handle[0].remove()
        session.pending.difference_update(names)
        if session.active:
            session.execute(Plan([Slot(mt.name, mt.tensor) for mt in waiting]))

    handle.append(owner.register_forward_pre_hook(hook))


def _plan_optimizer(visit: Visit, plan: Plan, session: Restoring) -> None:
    opt, name = visit.obj, visit.name
    names = session.tensor_names()
    state = join(name, "state")
    wanted = [
        p
        for p in optim.optimizer_params(opt)
        if not is_uninitialized(p) and session.has_under(f"{state}/{names.name_of(p)}")
    ]
    optim.init_state(opt, wanted, name)
    named = optim.named_state(opt, names.name_of)
    found: dict[stateful.Path, Any] = {}
    for leaf_name, path, leaf in stateful.leaves(named, name):
        plan.slots.append(Slot(leaf_name, _in_place(leaf), stateful.collector(found, path)))

    def finish() -> None:
        if found:
            rebuilt = stateful.rebuild(named, found)
            opt.load_state_dict(optim.indexed_state(opt, rebuilt, names.name_of, name))

    plan.finalizers.append(finish)


def _plan_stateful(visit: Visit, plan: Plan, session: Restoring) -> None:
    obj = visit.obj
    template = obj.state_dict()
    found: dict[stateful.Path, Any] = {}
    for leaf_name, path, leaf in stateful.leaves(template, visit.name):
        plan.slots.append(Slot(leaf_name, _in_place(leaf), stateful.collector(found, path)))

    def finish() -> None:
        if found:
            obj.load_state_dict(stateful.rebuild(template, found))

    plan.finalizers.append(finish)


def _plan_tensor(visit: Visit, plan: Plan, session: Restoring) -> None:
    plan.slots.append(Slot(visit.name, visit.obj))


def _plan_per_rank(visit: Visit, plan: Plan, session: Restoring) -> None:
    holder = visit.obj
    plan.slots.append(Slot(visit.name, None, lambda v: setattr(holder, "value", v)))


def _plan_value(visit: Visit, plan: Plan, session: Restoring) -> None:
    parent, key = visit.parent, visit.key
    if parent is None:
        raise ObjectGraphError(f"{visit.name!r}: a restore root must be a Checkpoint")
    plan.slots.append(Slot(visit.name, None, lambda v: parent._replace(key, v)))


_PLANNERS: dict[str, Callable[[Visit, Plan, Restoring], None]] = {
    "node": _plan_node,
    "module": _plan_module,
    "optimizer": _plan_optimizer,
    "stateful": _plan_stateful,
    "tensor": _plan_tensor,
    "per_rank": _plan_per_rank,
    "value": _plan_value,
}


def plan_restore(
    obj: Any, name: str, parent: Any, key: Any, session: Restoring, plan: Plan
) -> None:
    """Add to ``plan`` what restores ``obj`` (and everything under it) from ``name``."""
    for visit in walk(obj, name, parent, key):
        session.claimed.add(visit.name)
        _PLANNERS[visit.kind](visit, plan, session)
