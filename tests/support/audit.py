"""What a process does while it reads a crafted checkpoint, seen through Python's audit
hooks (:func:`sys.addaudithook`): the imports, processes, executed code, pickled globals,
connections and opened files that stored bytes must never cause.

::

    audit.install()                            # once per process (a hook stays)
    with audit.watching(work, named={"os"}) as events:
        read_the_checkpoint()
    assert not events, events

``work`` is where the checkpoint lies (opening a file there is expected); ``named`` are
modules a crafted value names: importing one is always an event. With ``new_imports``
any import of a module not yet loaded is one too (for a process that warmed its readers
up first). Not events: a traceback's reading of source files and its caret anchors
(``compile`` of ``<unknown>``), module code executed by an import, and the pickling of
distckpt's own errors between ranks (:mod:`distckpt.comm.outcome`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

#: Audited events that start a process, look up a pickled global or reach out.
ACTS = ("subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork")
ACTS += ("pickle.find_class", "socket.connect", "ctypes.dlopen")

_state: dict[str, Any] = {"watch": None}


def _installed_dirs() -> list[Path]:
    """Where Python and its packages lie (their files are opened by lazy imports)."""
    found = {Path(p).resolve() for p in sys.path if p and Path(p).is_dir()}
    for key in ("stdlib", "platstdlib", "purelib", "platlib", "data"):
        with contextlib.suppress(KeyError):
            found.add(Path(sysconfig.get_paths()[key]).resolve())
    found.update(Path(p).resolve() for p in (sys.prefix, sys.base_prefix))
    return sorted(found)


class _Watch:
    def __init__(self, work: Path, named: Iterable[str], new_imports: bool, code: bool) -> None:
        self.work = work.resolve()
        self.named = set(named)
        self.new_imports = new_imports
        self.code = code
        self.events: list[str] = []
        self.installed = _installed_dirs()

    def _expected_open(self, where: Path) -> bool:
        if not where.is_absolute():
            where = Path.cwd() / where
        where = Path(os.path.normpath(where))
        if where.is_relative_to(self.work) or str(where).startswith(("/proc/", "/sys/", "/dev/")):
            return True
        return any(where.is_relative_to(d) for d in self.installed)

    def see(self, event: str, args: tuple[Any, ...]) -> None:
        if event == "import":
            module = str(args[0])
            if module in self.named or (self.new_imports and module not in sys.modules):
                self.events.append(f"import {module}")
        elif event in ("exec", "compile") and not self.code:
            return
        elif event == "exec":
            filename = getattr(args[0], "co_filename", "")
            if not (filename.endswith(".py") or filename.startswith("<frozen ")):
                self.events.append(f"exec {filename or args[0]!r:.120}")
        elif event == "compile":
            if args[1] not in ("<unknown>", None) and not str(args[1]).endswith(".py"):
                self.events.append(f"compile {str(args)[:120]}")
        elif event == "pickle.find_class" and args[0] == "distckpt.errors":
            return  # a rank's error made portable, not stored bytes
        elif event.startswith(ACTS):
            self.events.append(f"{event} {str(args)[:120]}")
        elif event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            where = Path(os.fsdecode(args[0]))
            if not self._expected_open(where):
                self.events.append(f"open {where}")


def _hook(event: str, args: tuple[Any, ...]) -> None:
    watch = _state["watch"]
    if watch is None:
        return
    _state["watch"] = None  # what the hook itself does is not watched
    try:
        watch.see(event, args)
    finally:
        _state["watch"] = watch


def install() -> None:
    """Add the hook to this process (once: an audit hook cannot be removed)."""
    if not _state.get("installed"):
        sys.addaudithook(_hook)
        _state["installed"] = True


@contextlib.contextmanager
def watching(
    work: Path, named: Iterable[str] = (), *, new_imports: bool = False, code: bool = True
) -> Iterator[list[str]]:
    """The events seen while the block runs (see the module docstring); ``code=False``
    leaves out code compiled and executed (a process that has not warmed its readers up
    sees the classes libraries make on first use: dataclasses, enums)."""
    install()
    watch = _Watch(work, named, new_imports, code)
    _state["watch"] = watch
    try:
        yield watch.events
    finally:
        _state["watch"] = None
