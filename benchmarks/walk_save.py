"""How straight a save and a load run through distckpt's modules, counted as they run.

One blocking save and one load of a small state on one process (a SingleComm), traced
with :func:`sys.setprofile`. For each, the distinct module boundaries crossed (a call
from a function of one distckpt module into one of another) and the distinct calls that
*turn back*: into a module that is already on the stack below the caller (the pipeline
calling its kind, a lambda or closure handed down and called from below). Printed per
operation; ``--list`` prints the turning calls.

    python benchmarks/walk_save.py [--list]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

import torch

import distckpt

PACKAGE = Path(distckpt.__file__).resolve().parent


def _module(frame: FrameType) -> str | None:
    path = Path(frame.f_code.co_filename)
    try:
        rel = path.resolve().relative_to(PACKAGE)
    except ValueError:
        return None
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["distckpt", *parts])


class Walk:
    def __init__(self) -> None:
        self.crossings: set[tuple[str, str]] = set()
        self.turns: set[tuple[str, str]] = set()
        self.stack: list[str | None] = []

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            here = _module(frame)
            caller = next((m for m in reversed(self.stack) if m is not None), None)
            if here is not None and caller is not None and here != caller:
                self.crossings.add((caller, here))
                below = self.stack[: len(self.stack) - 1 - self.stack[::-1].index(caller)]
                if here in below:
                    name = f"{here}.{frame.f_code.co_qualname}"
                    self.turns.add((caller, name))
            self.stack.append(here)
        elif event == "return" and self.stack:
            self.stack.pop()


def traced(fn: Any) -> Walk:
    walk = Walk()
    sys.setprofile(walk)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return walk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the calls that turn back")
    args = parser.parse_args()
    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(256, 64), "b": torch.randn(64)}, "step": 3}
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/ckpt"
        distckpt.save(state, f"{tmp}/warm")  # imports and caches out of the way
        distckpt.load(state, f"{tmp}/warm")
        walks = {
            "save": traced(lambda: distckpt.save(state, path)),
            "load": traced(lambda: distckpt.load(state, path)),
        }
    for what, walk in walks.items():
        print(f"{what}: {len(walk.crossings)} module boundaries, {len(walk.turns)} calls turn back")
        if args.list:
            for caller, callee in sorted(walk.turns):
                print(f"    {caller} -> {callee}")


if __name__ == "__main__":
    main()
