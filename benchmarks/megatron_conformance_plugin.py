"""pytest plugin of benchmarks/megatron_conformance.py: Megatron-LM's
``tests/unit_tests/dist_checkpointing`` on CPU ranks, with megatron-core's default save
strategy swapped for distckpt's (``MLMCONF_MODE=distckpt``) or left alone
(``MLMCONF_MODE=torch_dist``).

Loaded in every rank (``torchrun ... -m pytest -p megatron_conformance_plugin``), it makes
the suite, written for 8 GPUs with NCCL, run on CPU ranks:

* **gloo for NCCL**: ``init_process_group`` / ``new_group`` asked for ``nccl`` get
  ``gloo`` (NCCL's options and ``device_id`` dropped); ``barrier`` drops ``device_ids``;
  ``destroy_model_parallel`` destroys the groups ``initialize_model_parallel`` made (as
  gloo groups, each has threads of its own).
* **CUDA on the CPU**: a torch function mode, entered for the whole process, turns every
  CUDA device given to a torch function or tensor method (``device="cuda"``, an int,
  ``.cuda()``, ``.to("cuda")``) into the CPU and makes ``pin_memory`` a no-op;
  ``torch.cuda``'s device calls answer as for ``WORLD_SIZE`` devices (``set_device``,
  ``synchronize``, ``empty_cache`` do nothing, ``current_device`` is 0) and its random
  number generator is the CPU's (megatron-core's RNG tracker too). Megatron's persistent
  async worker, a process it spawns, imports this plugin too (its target is a function
  of this module).
* **megatron.training**: absent from the megatron-core wheel, it is a stub package whose
  every name, when called, skips the test ("needs megatron.training").
* **the swap** (``distckpt`` mode): megatron-core's registry answers
  ``("torch_dist", 1)`` with distckpt's strategies
  (:mod:`distckpt.integrations.megatron`), for saves and loads: what
  ``get_default_save_sharded_strategy()`` returns, what ``save`` uses when given no
  strategy, and what ``get_default_strategy(..., "torch_dist", 1)`` returns. A
  ``TorchDistSaveShardedStrategy`` a test makes itself stays torch_dist's; checkpoints
  carry the backend that wrote them in ``metadata.json``, so a load without a strategy
  reads each with its own.

``MLMCONF_DONE``, if set, names a file of test ids to leave out. Written to
``MLMCONF_OUT`` (a folder), one JSON line per event, per rank: every test's
outcome per phase (``outcomes-<rank>.jsonl``) and, on rank 0, every sharded save and load
with the strategy class that ran it (``strategies.jsonl``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

MODE = os.environ.get("MLMCONF_MODE", "torch_dist")
OUT = Path(os.environ.get("MLMCONF_OUT", "."))
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
_current_test = ""


def _write(name: str, record: dict[str, Any]) -> None:
    with (OUT / name).open("a", encoding="utf-8") as out:
        out.write(json.dumps(record) + "\n")


# --- gloo for NCCL -------------------------------------------------------------------


def _gloo(function: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], str) and "nccl" in args[0]:  # init_process_group
            args = ("gloo", *args[1:])
        if "nccl" in str(kwargs.get("backend")):
            kwargs["backend"] = "gloo"
        kwargs.pop("pg_options", None)
        kwargs.pop("device_id", None)
        return function(*args, **kwargs)

    return wrapper


def _install_gloo() -> None:
    dist.init_process_group = _gloo(dist.init_process_group)
    dist.new_group = _gloo(dist.new_group)
    barrier = dist.barrier

    def no_device_barrier(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("device_ids", None)
        return barrier(*args, **kwargs)

    dist.barrier = no_device_barrier


def _alive_groups() -> list[Any]:
    return list(dist.distributed_c10d._world.pg_map)


def _install_group_release() -> None:
    """``destroy_model_parallel`` destroys every group ``initialize_model_parallel`` made:
    megatron-core destroys only its gloo groups and leaves the NCCL ones to NCCL, but here
    they are gloo groups too, each with threads of its own: the suite's hundreds of
    initialisations left thousands of threads per rank, spinning."""
    from megatron.core import parallel_state

    made: list[Any] = []
    initialize, destroy = (
        parallel_state.initialize_model_parallel,
        parallel_state.destroy_model_parallel,
    )

    def initialize_model_parallel(*args: Any, **kwargs: Any) -> Any:
        before = set(_alive_groups())
        try:
            return initialize(*args, **kwargs)
        finally:
            made.extend(group for group in _alive_groups() if group not in before)

    def destroy_model_parallel(*args: Any, **kwargs: Any) -> Any:
        result = destroy(*args, **kwargs)
        alive = set(_alive_groups())
        for group in made:
            if group in alive and group is not dist.group.WORLD:
                dist.destroy_process_group(group)
        made.clear()
        return result

    parallel_state.initialize_model_parallel = initialize_model_parallel
    parallel_state.destroy_model_parallel = destroy_model_parallel


# --- CUDA on the CPU -----------------------------------------------------------------


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class CpuForCuda(TorchFunctionMode):
    """Every CUDA device a torch function or tensor method is given becomes the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        kwargs.pop("non_blocking", None) if func is torch.Tensor.to else None
        return func(*args, **kwargs)


def _install_cuda() -> None:
    cuda = torch.cuda
    cuda.device_count = lambda: max(WORLD, 1)
    cuda.current_device = lambda: 0
    for name in ("set_device", "synchronize", "empty_cache", "reset_peak_memory_stats"):
        setattr(cuda, name, lambda *args, **kwargs: None)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved"):
        setattr(cuda, name, lambda *args, **kwargs: 0)
    cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    # torch.manual_seed seeds CUDA too (through cuda.manual_seed_all): the CPU generator alone
    cuda.manual_seed = cuda.manual_seed_all = torch.default_generator.manual_seed  # type: ignore[assignment]
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    CpuForCuda().__enter__()  # for the whole process (the mode stack is per thread)


# --- Megatron's persistent async worker -------------------------------------------------


def _worker_loop(*args: Any, **kwargs: Any) -> Any:
    """``PersistentAsyncCaller.async_loop`` in the worker process megatron-core spawns: a
    fresh interpreter, which imports this module (and so its CUDA-on-the-CPU) when it
    unpickles this function as the process's target."""
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    return PersistentAsyncCaller.__dict__["_conformance_loop"](*args, **kwargs)


def _install_worker() -> None:
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    if "_conformance_loop" not in PersistentAsyncCaller.__dict__:
        PersistentAsyncCaller._conformance_loop = PersistentAsyncCaller.async_loop  # type: ignore[attr-defined]
        PersistentAsyncCaller.async_loop = staticmethod(_worker_loop)  # type: ignore[assignment]


# --- no Transformer Engine ------------------------------------------------------------


def _install_no_te() -> None:
    """``is_te_min_version`` answers False (it fails on ``None`` without TE)."""
    from megatron.core import utils

    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        from packaging.version import Version

        utils.get_te_version = lambda: Version("0")


# --- megatron.training ---------------------------------------------------------------


class _Missing:
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        pytest.skip(f"needs megatron.training ({self.name})")

    def __getattr__(self, name: str) -> _Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self.name}.{name}")


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self.__name__}.{name}")


class _TrainingStubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``megatron.training`` and its submodules: stub modules."""

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname == "megatron.training" or fullname.startswith("megatron.training."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):  # type: ignore[no-untyped-def]
        return None


def _install_training_stubs() -> None:
    try:
        import megatron.training  # noqa: F401
    except ImportError:
        sys.meta_path.insert(0, _TrainingStubs())


# --- the swap, and what each test used -------------------------------------------------


def _recorded(cls: type, method: str, action: str) -> None:
    original = getattr(cls, method)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if RANK == 0:
            record = {"test": _current_test, "action": action, "strategy": type(self).__name__}
            _write("strategies.jsonl", record)
        return original(self, *args, **kwargs)

    setattr(cls, method, wrapper)


def _install_strategies() -> None:
    from megatron.core.dist_checkpointing.strategies import base
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategies

    import distckpt.integrations.megatron as bridge

    for cls in (torch_strategies.TorchDistSaveShardedStrategy, bridge.DistckptSaveStrategy):
        _recorded(cls, "save", "save")
        _recorded(cls, "async_save", "save")
    for cls in (torch_strategies.TorchDistLoadShardedStrategy, bridge.DistckptLoadStrategy):
        _recorded(cls, "load", "load")
    if MODE != "distckpt":
        return
    register = torch_strategies.register_default_torch_strategies

    def register_distckpt_as_torch_dist() -> None:
        register()
        base.register_default_strategy(
            base.StrategyAction.SAVE_SHARDED, "torch_dist", 1, bridge.DistckptSaveStrategy()
        )
        base.register_default_strategy(
            base.StrategyAction.LOAD_SHARDED, "torch_dist", 1, bridge.DistckptLoadStrategy()
        )

    # get_default_strategy imports this name from the module on every call.
    torch_strategies.register_default_torch_strategies = register_distckpt_as_torch_dist
    register_distckpt_as_torch_dist()


# --- pytest hooks ----------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    OUT.mkdir(parents=True, exist_ok=True)


# On import, not in pytest_configure: the suite's conftest files import megatron.training
# and initialise process groups, and are loaded before pytest_configure runs.
_install_gloo()
_install_group_release()
_install_cuda()
_install_worker()
_install_no_te()
_install_training_stubs()
_install_strategies()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leaves out the tests an earlier run of the same file started (``MLMCONF_DONE``: a
    file of node ids, one a line): a run goes on after a test that brought its ranks down."""
    done_file = os.environ.get("MLMCONF_DONE")
    if not done_file or not os.path.exists(done_file):
        return
    done = set(Path(done_file).read_text(encoding="utf-8").splitlines())
    kept = [item for item in items if item.nodeid not in done]
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
    items[:] = kept


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    global _current_test
    _current_test = nodeid
    _write(f"outcomes-{RANK}.jsonl", {"test": nodeid, "when": "start", "outcome": ""})


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module skipped or failed while collected: one record for the module."""
    if report.failed or report.skipped:
        pytest_runtest_logreport(report)  # type: ignore[arg-type]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    message = ""
    if report.failed or report.skipped:
        crash = getattr(report.longrepr, "reprcrash", None)
        if crash is not None:
            message = crash.message
        elif isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
            message = str(report.longrepr[2])
        else:
            message = str(report.longrepr)[-2000:]
    when = getattr(report, "when", "collect")
    record = {"test": report.nodeid, "when": when, "outcome": report.outcome}
    record["duration"] = round(getattr(report, "duration", 0.0) or 0.0, 3)
    if message:
        record["message"] = message[:2000]
    _write(f"outcomes-{RANK}.jsonl", record)
