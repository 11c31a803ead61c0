#!/usr/bin/env python
"""DCP conformance: PyTorch's own ``torch.distributed.checkpoint`` (DCP) tests, run with
DCP's storage swapped for distckpt's bridge (:mod:`distckpt.integrations.dcp`).

The test files are not part of distckpt: take them from a PyTorch checkout (those under
``test/distributed/checkpoint/``) into a directory of your own, then::

    python benchmarks/dcp_conformance.py PATH_TO_TESTS_DIR
    python benchmarks/dcp_conformance.py PATH_TO_TESTS_DIR --mode dcp --mode compat \\
        --json results.json -k "not async" --timeout 900

``PATH_TO_TESTS_DIR`` (or several; a file is taken as it is): every ``test_*.py`` under it
(folders whose name starts with ``_`` or ``.`` are passed over), copied into a temporary
directory with their paths relative to the deepest folder holding them all. The helpers
they import (``torch.testing._internal``) ship with torch; they need ``expecttest`` (and
the ZStandard cases ``zstandard``) importable, e.g. on ``PYTHONPATH``.

Modes (``--mode``, repeatable; default all three, in this order):

* ``dcp``: the files unchanged, DCP's ``FileSystemWriter`` / ``FileSystemReader``: the
  baseline.
* ``bridge``: the storage swapped for the bridge, with the bridge's defaults.
* ``compat``: as ``bridge``, with DCP-compatible settings: every writer made with
  ``overwrite=True`` (DCP's ``FileSystemWriter`` replaces a checkpoint by default) and
  ``ignore_extensions=True`` (a stream extension other than ZStandard is not applied) and
  every reader with ``allow_pickle=True`` (DCP stores every non-tensor pickled), unless the
  test passes them itself.

What ``bridge`` and ``compat`` swap:

* **explicit**: every use of the names ``FileSystemWriter`` / ``FileSystemReader`` in the
  test code (``FileSystemWriter(...)``, ``dcp.FileSystemWriter(...)``, ...; import statements
  and strings are left alone) is rewritten to ``DistckptWriter`` / ``DistckptReader``,
  imported at the top of the file from a generated module, ``_dcpconf_swap``.
* **implicit**: DCP's default storage (``dcp.save(sd, checkpoint_id=path)`` / ``dcp.load``
  without a ``storage_writer`` / ``storage_reader``, resolved in
  ``torch.distributed.checkpoint._storage_utils``) and the names ``FileSystemWriter`` /
  ``FileSystemReader`` of the ``torch.distributed.checkpoint`` package are replaced, in
  every process (the pytest one and the ranks it spawns), by a ``sitecustomize.py`` on
  ``PYTHONPATH`` that calls ``_dcpconf_swap.install()``.

``_dcpconf_swap``'s classes are thin subclasses of distckpt's ``DistckptWriter`` /
``DistckptReader``: they record which swap made them (``explicit`` or ``implicit``) for the
test that runs, and pass ``FileSystemWriter`` / ``FileSystemReader``'s constructor
arguments to the bridge as the test gave them (the bridge takes them itself).
``--adapt`` passes on only ``path``, ``overwrite`` and ``thread_count`` (as
``io_workers``) and drops the others (``single_file_per_rank``, ``sync_files``,
``per_thread_copy_ahead``, ``cache_staged_state_dict``, ``_extensions``,
``serialization_format``, ``_extension_registry``), recording them as dropped for the
test.

Each file runs in its own pytest process per mode (``-p no:cacheprovider``, a per-test
``--timeout`` from pytest-timeout, a JUnit XML report for the outcomes) with
``OMP_NUM_THREADS=1``, ``GLOO_SOCKET_IFNAME=lo``, ``TMPDIR`` a fresh folder,
``DISTRIBUTED_TESTS_DEFAULT_TIMEOUT`` (the limit of torch's multi-process tests, 300 s of
its own) nine tenths of ``--timeout`` unless it is set already, and this
checkout first on ``PYTHONPATH`` (so the distckpt tested is this checkout's, in the ranks
the tests spawn too). Tests that need CUDA skip themselves. Printed: per file, the tests
passed / failed / skipped in each mode (an error counts as failed), then every test whose
outcome differs from mode ``dcp`` with the first meaningful line of its error (an
exception's type and message) and the swaps it went through. ``--json FILE`` writes every
test's outcome, error line, swaps and dropped arguments per mode.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness as h
from harness import FileRun

MODES = ("dcp", "bridge", "compat")
NAMES = {"FileSystemWriter": "DistckptWriter", "FileSystemReader": "DistckptReader"}
SWAP_MODULE = "_dcpconf_swap"
CHECKOUT = Path(__file__).resolve().parents[1]

# The module the swapped modes import in every process (sitecustomize) and in the rewritten
# test files. It runs inside the tests: keep it to the standard library, torch and distckpt.
SWAP_SOURCE = '''\
"""Written by benchmarks/dcp_conformance.py: DCP's storage swapped for distckpt's bridge."""

import inspect
import json
import os

import torch.distributed.checkpoint as _dcp
from torch.distributed.checkpoint import _storage_utils
from torch.distributed.checkpoint.filesystem import FileSystemReader as _FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystemWriter as _FileSystemWriter

from distckpt.integrations import dcp as _bridge

MODE = os.environ.get("DCPCONF_MODE", "bridge")
ADAPT = os.environ.get("DCPCONF_ADAPT", "1") == "1"
EVENTS = os.environ.get("DCPCONF_EVENTS", "")
# FileSystemWriter / FileSystemReader arguments the bridge has a counterpart for.
WRITER_ARGUMENTS = {"path": "path", "overwrite": "overwrite", "thread_count": "io_workers"}
READER_ARGUMENTS = {"path": "path"}


def _record(swap, role, dropped):
    if not EVENTS:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    line = json.dumps({"test": test, "swap": swap, "role": role, "dropped": dropped})
    with open(EVENTS, "a", encoding="utf-8") as out:
        out.write(line + "\\n")


def _adapt(original, known, args, kwargs):
    """(args, kwargs) for the bridge from those given to ``original``, and what was dropped."""
    if not ADAPT:
        return args, dict(kwargs), []
    try:
        bound = inspect.signature(original.__init__).bind(None, *args, **kwargs)
    except TypeError:  # not the signature of DCP's class: passed on as given
        return args, dict(kwargs), []
    given = {}
    for name, value in list(bound.arguments.items())[1:]:
        if bound.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            given.update(value)
        else:
            given[name] = value
    adapted = {known[name]: value for name, value in given.items() if name in known}
    return (), adapted, sorted(name for name in given if name not in known)


# Per role: the bridge's class, the DCP class it stands in for, the arguments passed on,
# and the DCP-compatible settings of mode compat.
ROLES = {
    "writer": (
        _bridge.DistckptWriter,
        _FileSystemWriter,
        WRITER_ARGUMENTS,
        {"overwrite": True, "ignore_extensions": True},
    ),
    "reader": (_bridge.DistckptReader, _FileSystemReader, READER_ARGUMENTS, {"allow_pickle": True}),
}


def _swapped(role, swap):
    """The bridge's class for ``role``, recording that ``swap`` made it."""
    base, original, known, compatible = ROLES[role]

    def __init__(self, *args, **kwargs):
        args, kwargs, dropped = _adapt(original, known, args, kwargs)
        if MODE == "compat":
            for name, value in compatible.items():
                kwargs.setdefault(name, value)
        _record(swap, role, dropped)
        base.__init__(self, *args, **kwargs)

    return type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__})


# The names the rewritten test files import.
DistckptWriter = _swapped("writer", "explicit")
DistckptReader = _swapped("reader", "explicit")
ImplicitWriter = _swapped("writer", "implicit")
ImplicitReader = _swapped("reader", "implicit")


def install():
    """DCP's default storage and its package's FileSystemWriter/Reader names: the bridge."""
    for module in (_dcp, _storage_utils):
        module.FileSystemWriter = ImplicitWriter
        module.FileSystemReader = ImplicitReader
'''

SITECUSTOMIZE_SOURCE = f'''\
"""Written by benchmarks/dcp_conformance.py: the swap in every process of a swapped mode."""

import os

if os.environ.get("DCPCONF_MODE") in ("bridge", "compat"):
    import {SWAP_MODULE}

    {SWAP_MODULE}.install()
'''

# Run in each mode's environment before its tests: what the tests need, and the swap in place.
PREFLIGHT = """\
import json, os, sys
import expecttest, torch, distckpt
import torch.distributed.checkpoint._storage_utils as s
print(json.dumps({"torch": torch.__version__, "distckpt": os.path.dirname(distckpt.__file__),
                  "default_writer": s.FileSystemWriter.__module__}))
"""

# Exceptions that only carry another one (the one worth showing comes later in the text).
WRAPPERS = (
    re.compile(r"^(?:[\w.]*\.)?CheckpointException\b"),
    re.compile(r"^RuntimeError: Process \d+ (?:exited with error code|terminated or timed out)"),
)


@dataclass
class TestOutcome(h.TestOutcome):
    swaps: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)


def find_tests(paths: list[Path]) -> tuple[Path, list[Path]]:
    """The deepest folder holding every test file, and their paths relative to it."""
    files: list[Path] = []
    for path in paths:
        path = path.resolve()
        if path.is_file():
            files.append(path)
            continue
        for found in sorted(path.rglob("test_*.py")):
            inner = found.relative_to(path).parts[:-1]
            if not any(part.startswith(("_", ".")) for part in inner):
                files.append(found)
    if not files:
        raise SystemExit(f"no test_*.py under {', '.join(map(str, paths))}")
    base = Path(os.path.commonpath([str(f.parent) for f in files]))
    return base, sorted({f.relative_to(base) for f in files})


def rewrite(source: str) -> tuple[str, int]:
    """``source`` with every use of FileSystemWriter/Reader (a name or an attribute, outside
    import statements) renamed to the bridge's class, and the import of those added."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    sites: list[tuple[int, int, int, int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in NAMES:
            site: ast.expr = node
            name = node.id
        elif isinstance(node, ast.Attribute) and node.attr in NAMES:
            site, name = node, node.attr
        else:
            continue
        assert site.end_lineno is not None and site.end_col_offset is not None
        sites.append(
            (site.lineno, site.col_offset, site.end_lineno, site.end_col_offset, NAMES[name])
        )
    if not sites:
        return source, 0
    # Offsets are of UTF-8 bytes; replace from the last so the earlier ones stay valid.
    encoded = [line.encode() for line in lines]
    for start_line, start_col, end_line, end_col, new in sorted(sites, reverse=True):
        head = encoded[start_line - 1][:start_col]
        tail = encoded[end_line - 1][end_col:]
        encoded[start_line - 1 : end_line] = [head + new.encode() + tail]
    text = b"".join(encoded).decode()
    # The import goes after a docstring and any ``from __future__`` imports.
    after = 0
    for index, statement in enumerate(tree.body):
        docstring = (
            index == 0
            and isinstance(statement, ast.Expr)
            and isinstance(statement.value, ast.Constant)
            and isinstance(statement.value.value, str)
        )
        future = isinstance(statement, ast.ImportFrom) and statement.module == "__future__"
        if not (docstring or future):
            break
        assert statement.end_lineno is not None
        after = statement.end_lineno
    # (A site spanning lines shortens the text only after it: none precede ``after``.)
    out = text.splitlines(keepends=True)
    added = f"from {SWAP_MODULE} import DistckptReader, DistckptWriter  # dcp_conformance\n"
    out.insert(after, added)
    return "".join(out), len(sites)


def read_events(path: Path) -> dict[str, tuple[set[str], set[str]]]:
    """Per test: the swaps its bridge objects came through, and the arguments dropped."""
    seen: dict[str, tuple[set[str], set[str]]] = defaultdict(lambda: (set(), set()))
    for event in h.json_lines(path):
        swaps, dropped = seen[event["test"]]
        swaps.add(f"{event['swap']} {event['role']}")
        dropped.update(event["dropped"])
    return seen


@dataclass
class Setup:
    python: str
    root: Path
    base: Path
    files: list[Path]
    timeout: float
    file_timeout: float
    keyword: str | None
    adapt: bool
    explicit_sites: dict[str, int] = field(default_factory=dict)

    def env(self, mode: str, tmpdir: Path, events: Path) -> dict[str, str]:
        paths = [CHECKOUT] + ([self.root / "site"] if mode != "dcp" else [])
        extra = {
            "PYTORCH_PRINT_REPRO_ON_FAILURE": "0",
            "DCPCONF_MODE": mode,
            "DCPCONF_ADAPT": "1" if self.adapt else "0",
            "DCPCONF_EVENTS": str(events),
        }
        env = h.conformance_env(paths, tmpdir, extra)
        # torch's multi-process tests stop a test after their own limit (300 s unless
        # DISTRIBUTED_TESTS_DEFAULT_TIMEOUT says otherwise), whatever --timeout says: on a
        # loaded machine every mode then fails them alike. Theirs ends a little before
        # pytest-timeout's, so the report is torch's.
        env.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", str(max(1, int(self.timeout * 0.9))))
        return env

    def prepare(self) -> None:
        """The copies of the test files (unchanged for dcp, rewritten for the others) and
        the swap's modules."""
        site = self.root / "site"
        site.mkdir(parents=True)
        (site / f"{SWAP_MODULE}.py").write_text(SWAP_SOURCE, encoding="utf-8")
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE_SOURCE, encoding="utf-8")
        for kind in ("dcp", "swapped"):
            folder = self.root / "tests" / kind
            folder.mkdir(parents=True)
            (folder / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
            for rel in self.files:
                target = folder / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                source = (self.base / rel).read_text(encoding="utf-8")
                if kind == "swapped":
                    source, sites = rewrite(source)
                    self.explicit_sites[rel.as_posix()] = sites
                target.write_text(source, encoding="utf-8")

    def preflight(self, mode: str) -> dict[str, Any]:
        scratch = self.root / "work" / f"preflight-{mode}"
        scratch.mkdir(parents=True)
        env = self.env(mode, scratch, scratch / "events.jsonl")
        done = subprocess.run(
            [self.python, "-c", PREFLIGHT],
            env=env,
            cwd=scratch,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0:
            raise SystemExit(f"mode {mode}: the tests' environment is not ready:\n{done.stderr}")
        found = json.loads(done.stdout.strip().splitlines()[-1])
        if Path(found["distckpt"]).resolve() != (CHECKOUT / "distckpt").resolve():
            raise SystemExit(
                f"mode {mode}: distckpt comes from {found['distckpt']}, not {CHECKOUT}"
            )
        expected = "torch.distributed.checkpoint.filesystem" if mode == "dcp" else SWAP_MODULE
        if found["default_writer"] != expected:
            raise SystemExit(
                f"mode {mode}: DCP's default writer is from {found['default_writer']}, "
                f"not {expected} (sitecustomize.py did not run?)"
            )
        return found

    def run(self, mode: str, index: int, rel: Path) -> FileRun:
        folder = self.root / "tests" / ("dcp" if mode == "dcp" else "swapped")
        work = self.root / "work" / f"{mode}-{index}"
        tmpdir = work / "tmp"
        tmpdir.mkdir(parents=True)
        events = work / "events.jsonl"
        run = h.run_pytest_file(
            self.python,
            rel,
            cwd=folder,
            env=self.env(mode, tmpdir, events),
            work=work,
            timeout=self.timeout,
            file_timeout=self.file_timeout,
            keyword=self.keyword,
            options=["--rootdir", str(folder)],
            make=TestOutcome,
            wrappers=WRAPPERS,
        )
        tests = run.tests
        for test, (swaps, dropped) in read_events(events).items():
            if test in tests:
                tests[test].swaps = sorted(swaps)
                tests[test].dropped = sorted(dropped)
        shutil.rmtree(tmpdir, ignore_errors=True)
        return run


def print_report(setup: Setup, modes: list[str], runs: dict[str, dict[str, FileRun]]) -> None:
    h.print_file_table([rel.as_posix() for rel in setup.files], modes, runs)
    if "dcp" not in modes:
        return
    differences = list(h.find_differences("dcp", modes, runs))
    print()
    if not differences:
        print("every test has the outcome it has in mode dcp")
        return
    print("outcomes that differ from mode dcp:")
    for item in differences:
        print(f"  [{item['mode']}] {item['test']}: {item['dcp']} -> {item['outcome']}")
        if item["error"]:
            print(f"      {item['error']}")
        swaps = ", ".join(item["swaps"]) or "no bridge object made"
        dropped = f"; dropped: {', '.join(item['dropped'])}" if item["dropped"] else ""
        print(f"      swaps: {swaps}{dropped}")


def to_json(
    setup: Setup,
    modes: list[str],
    runs: dict[str, dict[str, FileRun]],
    found: dict[str, Any],
) -> dict[str, Any]:
    tests: dict[str, dict[str, Any]] = defaultdict(dict)
    for mode in modes:
        for run in runs[mode].values():
            for test, outcome in run.tests.items():
                tests[test][mode] = {
                    "outcome": outcome.outcome,
                    "error": outcome.error,
                    "swaps": outcome.swaps,
                    "dropped": outcome.dropped,
                }
    files = []
    for rel in setup.files:
        name = rel.as_posix()
        entry: dict[str, Any] = {
            "file": name,
            "explicit_sites": setup.explicit_sites.get(name, 0),
            "runs": h.file_runs(name, modes, runs),
        }
        files.append(entry)
    return {
        "command": [sys.executable, *sys.argv],
        "python": setup.python,
        "torch": found.get("torch"),
        "checkout": str(CHECKOUT),
        "tests_dir": str(setup.base),
        "modes": modes,
        "adapt_arguments": setup.adapt,
        "per_test_timeout_s": setup.timeout,
        "files": files,
        "tests": dict(sorted(tests.items())),
        "differences": list(h.find_differences("dcp", modes, runs)) if "dcp" in modes else [],
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="PyTorch's DCP tests with the storage swapped for distckpt's bridge.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("tests", nargs="+", type=Path, help="a folder of test_*.py, or files")
    parser.add_argument(
        "--mode", action="append", choices=MODES, help="dcp, bridge, compat (repeatable)"
    )
    h.conformance_args(parser)
    parser.add_argument(
        "--adapt",
        action="store_true",
        help="pass on only path, overwrite and thread_count of FileSystemWriter/Reader's "
        "arguments (the others dropped and recorded)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    modes = list(dict.fromkeys(args.mode or MODES))
    base, files = find_tests(args.tests)
    with h.work_dir("dcp_conformance-", args.keep) as root:
        setup = Setup(
            python=args.python,
            root=root,
            base=base,
            files=files,
            timeout=args.timeout,
            file_timeout=args.file_timeout,
            keyword=args.keyword,
            adapt=args.adapt,
        )
        setup.prepare()
        found: dict[str, Any] = {}
        for mode in modes:
            found = setup.preflight(mode) or found
        print(f"torch {found.get('torch')}, distckpt from {CHECKOUT}, tests from {base}")
        print(f"work directory: {root}")
        runs: dict[str, dict[str, FileRun]] = {mode: {} for mode in modes}
        index = 0
        for mode in modes:
            for rel in files:
                index += 1
                run = setup.run(mode, index, rel)
                runs[mode][rel.as_posix()] = run
                print(
                    f"[{mode}] {rel.as_posix()}: p/f/s {run.cell()} "
                    f"in {run.seconds:.0f} s{'  ' + run.note if run.note else ''}",
                    flush=True,
                )
        print_report(setup, modes, runs)
        if args.json:
            document = to_json(setup, modes, runs, found)
            args.json.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
            print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
