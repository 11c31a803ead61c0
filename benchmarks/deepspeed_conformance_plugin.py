"""The swap of benchmarks/deepspeed_conformance.py, in every process of DeepSpeed's tests:
DeepSpeed's checkpoint engine left alone (``DSCONF_MODE=torch``) or replaced by distckpt's
(``DSCONF_MODE=distckpt``), and every ``save_checkpoint`` / ``load_checkpoint`` recorded.

DeepSpeed's tests run each test's ranks in processes of their own (a ``forkserver`` pool),
so the swap cannot be made by the pytest process alone: a ``sitecustomize.py`` written by
the conformance script calls :func:`install` at the start of every Python process of the
run. :func:`install` imports nothing heavy: it waits for ``deepspeed.runtime.engine`` to be
imported (an import hook) and then wraps three methods of ``DeepSpeedEngine`` (so the
pipeline engine, its subclass, too):

* ``_configure_checkpointing``, where DeepSpeed makes the engine's ``checkpoint_engine``
  from its config: in mode ``distckpt`` it is followed by
  :func:`distckpt.integrations.deepspeed.use_distckpt`, as a user calls it after
  ``deepspeed.initialize`` (the engine DeepSpeed made is replaced, the ZeRO stage 3 load
  guard installed); in mode ``torch`` it is left as it is;
* ``save_checkpoint`` and ``load_checkpoint``: recorded with the class of the checkpoint
  engine that ran them, for the test that runs.

Both modes get the same treatment otherwise: nothing here makes a GPU-only feature work on
the CPU. Loaded by the pytest process too (``-p deepspeed_conformance_plugin``), it writes
the id of the test that starts to ``DSCONF_CURRENT``, where the ranks (forked from a
server started at the first test, with that test's environment) read it. Records go to
``DSCONF_EVENTS``, one JSON line each.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import json
import os
import sys
from typing import Any

MODE = os.environ.get("DSCONF_MODE", "torch")
EVENTS = os.environ.get("DSCONF_EVENTS", "")
CURRENT = os.environ.get("DSCONF_CURRENT", "")
TARGET = "deepspeed.runtime.engine"


def current_test() -> str:
    if not CURRENT:
        return ""
    try:
        with open(CURRENT, encoding="utf-8") as file:
            return file.read().strip()
    except OSError:
        return ""


def record(**fields: Any) -> None:
    if not EVENTS:
        return
    line = json.dumps({"test": current_test(), "rank": os.environ.get("RANK", ""), **fields})
    with open(EVENTS, "a", encoding="utf-8") as out:
        out.write(line + "\n")


def _engine_name(engine: Any) -> str:
    return type(getattr(engine, "checkpoint_engine", None)).__name__


def patch(module: Any) -> None:
    """Wrap ``DeepSpeedEngine``'s checkpoint methods in ``module`` (deepspeed.runtime.engine)."""
    cls = module.DeepSpeedEngine
    configure = cls._configure_checkpointing

    @functools.wraps(configure)
    def _configure_checkpointing(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = configure(self, *args, **kwargs)
        if MODE == "distckpt":
            from distckpt.integrations.deepspeed import use_distckpt

            replaced = _engine_name(self)
            use_distckpt(self)
            record(action="swap", engine=_engine_name(self), replaced=replaced)
        return result

    def recorded(method: Any, action: str) -> Any:
        @functools.wraps(method)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            record(action=action, engine=_engine_name(self))
            return method(self, *args, **kwargs)

        return wrapper

    cls._configure_checkpointing = _configure_checkpointing
    cls.save_checkpoint = recorded(cls.save_checkpoint, "save")
    cls.load_checkpoint = recorded(cls.load_checkpoint, "load")


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``deepspeed.runtime.engine`` as the path finder does, to patch it once run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader)
        return spec


def install() -> None:
    """Patch ``DeepSpeedEngine`` when it is imported (now, if it already is)."""
    if TARGET in sys.modules:
        patch(sys.modules[TARGET])
    elif not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


# -- pytest hooks, in the pytest process ------------------------------------------------


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    if CURRENT:
        with open(CURRENT, "w", encoding="utf-8") as file:
            file.write(nodeid + "\n")
