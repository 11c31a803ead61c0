#!/usr/bin/env python
"""DeepSpeed conformance: DeepSpeed's own checkpoint tests (``tests/unit/checkpoint``), run
with DeepSpeed's checkpoint engine and with distckpt's
(:mod:`distckpt.integrations.deepspeed`) in its place, on DeepSpeed's CPU accelerator.

The tests are not part of distckpt: take them from a DeepSpeed checkout at the tag of the
installed DeepSpeed (``pip show deepspeed``; for 0.19.8, ``v0.19.8``)::

    git clone --branch v0.19.8 --depth 1 https://github.com/deepspeedai/DeepSpeed
    python benchmarks/deepspeed_conformance.py DeepSpeed
    python benchmarks/deepspeed_conformance.py DeepSpeed test_zero_optimizer.py \\
        test_latest_checkpoint.py --json results.json -k "not offload" --timeout 900

The checkout may also be given as ``DEEPSPEED_REPO`` in the environment. Tests (after the
checkout): files under ``tests/unit/checkpoint`` (default: every ``test_*.py`` there).
Only the tests are used: the DeepSpeed tested is the installed one. They are copied into a
temporary directory with what they import beside their folder (``tests/conftest.py``,
``tests/pytest.ini`` and the modules and data files of ``tests/unit``).

Modes (``--mode``, repeatable; default both):

* ``torch``: DeepSpeed's own engine, as its config makes it (``TorchCheckpointEngine``
  unless a test configures another): the baseline.
* ``distckpt``: every ``DeepSpeedEngine`` (the pipeline engine too) gets distckpt's
  engine right after DeepSpeed made its own, by
  :func:`distckpt.integrations.deepspeed.use_distckpt` with its defaults, as a user calls
  it after ``deepspeed.initialize``.

DeepSpeed's tests run each test's ranks in processes of their own (a ``forkserver``
pool), so the swap is made in every process: a ``sitecustomize.py`` on ``PYTHONPATH``
calls ``benchmarks/deepspeed_conformance_plugin.py``'s ``install()``, which patches
``DeepSpeedEngine`` when it is imported, in both modes alike: in mode ``torch`` it only
records every ``save_checkpoint`` / ``load_checkpoint`` with the class of the checkpoint
engine that ran it. Nothing makes a GPU-only feature work on the CPU: a test that needs
CUDA, NCCL or an op DeepSpeed did not build skips (or fails) the same way in both modes.

Each file runs in its own pytest process per mode (``-p no:cacheprovider``, a per-test
``--timeout`` from pytest-timeout and DeepSpeed's own ``DS_UNITTEST_TIMEOUT``, a JUnit XML
report for the outcomes) with ``DS_ACCELERATOR=cpu``, ``LOCAL_SIZE`` the number of CPU
"devices" the accelerator reports (``--devices``, default 4: a test of more ranks skips
for want of devices), ``DS_DISABLE_REUSE_DIST_ENV=1`` (a fresh pool of ranks per test),
``OMP_NUM_THREADS=1``, ``GLOO_SOCKET_IFNAME=lo``, ``TMPDIR`` a fresh folder, and this
checkout first on ``PYTHONPATH``; ``--env NAME=VALUE`` sets more. ``TORCH_EXTENSIONS_DIR``
is passed on as it is set (DeepSpeed builds its CPU communication op there at the first
start). Printed: per file, the tests passed / failed / skipped in each mode (an error
counts as failed), then every test whose outcome differs from mode ``torch`` with the
first meaningful line of its error and the checkpoint engines that saved and loaded in
it. ``--json FILE`` writes all of it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness as h
from harness import FileRun

MODES = ("torch", "distckpt")
CHECKOUT = Path(__file__).resolve().parents[1]
SUITE = Path("unit/checkpoint")
PLUGIN = "deepspeed_conformance_plugin"
SITECUSTOMIZE_SOURCE = f'''\
"""Written by benchmarks/deepspeed_conformance.py: the swap in every process of the run."""

import {PLUGIN}

{PLUGIN}.install()
'''
# Run in each mode's environment before its tests: the swap in place, distckpt this one.
PREFLIGHT = """\
import json, os
import deepspeed, distckpt
from deepspeed.runtime.engine import DeepSpeedEngine
code = DeepSpeedEngine._configure_checkpointing.__code__
print(json.dumps({"deepspeed": deepspeed.__version__,
                  "distckpt": os.path.dirname(distckpt.__file__),
                  "patched": os.path.basename(code.co_filename)}))
"""


@dataclass
class TestOutcome(h.TestOutcome):
    engines: list[str] = field(default_factory=list)  # "save:TorchCheckpointEngine", ...


def read_events(path: Path) -> dict[str, set[str]]:
    """Per test: what its ranks did with which checkpoint engine."""
    seen: dict[str, set[str]] = defaultdict(set)
    for event in h.json_lines(path):
        seen[event["test"]].add(f"{event['action']}:{event['engine']}")
    return seen


@dataclass
class Setup:
    python: str
    root: Path
    deepspeed: Path
    files: list[Path]
    timeout: float
    file_timeout: float
    keyword: str | None
    devices: int
    extra_env: dict[str, str] = field(default_factory=dict)

    def prepare(self) -> None:
        """The tests and what they import from ``tests/``, copied; the swap's modules."""
        site = self.root / "site"
        site.mkdir(parents=True)
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE_SOURCE, encoding="utf-8")
        source, tree = self.deepspeed / "tests", self.root / "tests"
        (tree / "unit").mkdir(parents=True)
        for name in ("conftest.py", "pytest.ini"):
            shutil.copy2(source / name, tree / name)
        for path in (source / "unit").iterdir():
            if path.is_file():
                shutil.copy2(path, tree / "unit" / path.name)
        shutil.copytree(source / SUITE, tree / SUITE)

    def env(self, mode: str, tmpdir: Path, events: Path, current: Path) -> dict[str, str]:
        paths = [CHECKOUT, CHECKOUT / "benchmarks", self.root / "site"]
        extra = {
            "DS_ACCELERATOR": "cpu",
            "LOCAL_SIZE": str(self.devices),
            "DS_DISABLE_REUSE_DIST_ENV": "1",
            "DS_UNITTEST_TIMEOUT": f"{self.timeout:.0f}",
            **self.extra_env,
            "DSCONF_MODE": mode,
            "DSCONF_EVENTS": str(events),
            "DSCONF_CURRENT": str(current),
        }
        return h.conformance_env(paths, tmpdir, extra)

    def preflight(self, mode: str) -> dict[str, Any]:
        scratch = self.root / "work" / f"preflight-{mode}"
        scratch.mkdir(parents=True)
        env = self.env(mode, scratch, scratch / "events.jsonl", scratch / "current.txt")
        done = subprocess.run(
            [self.python, "-c", PREFLIGHT],
            env=env,
            cwd=scratch,
            capture_output=True,
            text=True,
            timeout=3600,  # a busy machine imports DeepSpeed slowly
        )
        if done.returncode != 0:
            raise SystemExit(f"mode {mode}: the tests' environment is not ready:\n{done.stderr}")
        found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        if Path(found["distckpt"]).resolve() != (CHECKOUT / "distckpt").resolve():
            raise SystemExit(
                f"mode {mode}: distckpt comes from {found['distckpt']}, not {CHECKOUT}"
            )
        if found["patched"] != f"{PLUGIN}.py":
            raise SystemExit(
                f"mode {mode}: DeepSpeedEngine is not patched (sitecustomize.py did not run?)"
            )
        return found

    def run(self, mode: str, index: int, rel: Path) -> FileRun:
        work = self.root / "work" / f"{mode}-{index}"
        tmpdir = work / "tmp"
        tmpdir.mkdir(parents=True)
        events, current = work / "events.jsonl", work / "current.txt"
        run = h.run_pytest_file(
            self.python,
            SUITE / rel,
            cwd=self.root / "tests",
            env=self.env(mode, tmpdir, events, current),
            work=work,
            timeout=self.timeout,
            file_timeout=self.file_timeout,
            keyword=self.keyword,
            options=["-p", PLUGIN, "--rootdir", str(self.root / "tests")],
            make=TestOutcome,
        )
        run.tests = {short(test): outcome for test, outcome in run.tests.items()}
        for test, engines in read_events(events).items():
            if short(test) in run.tests:
                run.tests[short(test)].engines = sorted(engines)
        shutil.rmtree(tmpdir, ignore_errors=True)
        return run


def short(test: str) -> str:
    """A test's id relative to the suite's folder."""
    return test.removeprefix(f"{SUITE.as_posix()}/")


def find_files(deepspeed: Path, names: list[str]) -> list[Path]:
    suite = deepspeed / "tests" / SUITE
    if not suite.is_dir():
        raise SystemExit(f"{suite}: not a folder; give the root of a DeepSpeed checkout")
    found: list[Path] = []
    for name in names or ["."]:
        path = suite / name
        if path.is_file():
            found.append(path.relative_to(suite))
        elif path.is_dir():
            found += [p.relative_to(suite) for p in sorted(path.rglob("test_*.py"))]
        else:
            raise SystemExit(f"{path}: no such test file or folder")
    return list(dict.fromkeys(found))


def print_report(setup: Setup, modes: list[str], runs: dict[str, dict[str, FileRun]]) -> None:
    h.print_file_table([rel.as_posix() for rel in setup.files], modes, runs)
    if "torch" not in modes or len(modes) == 1:
        return
    differences = list(h.find_differences("torch", modes, runs))
    print()
    if not differences:
        print("every test has the outcome it has in mode torch")
        return
    print("outcomes that differ from mode torch:")
    for item in differences:
        print(f"  {item['test']}: {item['torch']} -> {item['outcome']}")
        if item["error"]:
            print(f"      {item['error']}")
        print(f"      engines: {', '.join(item['engines']) or 'no save or load'}")


def to_json(
    setup: Setup, modes: list[str], runs: dict[str, dict[str, FileRun]], found: dict[str, Any]
) -> dict[str, Any]:
    tests: dict[str, dict[str, Any]] = defaultdict(dict)
    for mode in modes:
        for run in runs[mode].values():
            for test, outcome in run.tests.items():
                tests[test][mode] = {
                    "outcome": outcome.outcome,
                    "error": outcome.error,
                    "engines": outcome.engines,
                }
    files = []
    for rel in setup.files:
        files.append({"file": rel.as_posix(), "runs": h.file_runs(rel.as_posix(), modes, runs)})
    return {
        "command": [sys.executable, *sys.argv],
        "python": setup.python,
        "deepspeed": found.get("deepspeed"),
        "checkout": str(CHECKOUT),
        "deepspeed_tests": str(setup.deepspeed / "tests" / SUITE),
        "modes": modes,
        "devices": setup.devices,
        "env": setup.extra_env,
        "per_test_timeout_s": setup.timeout,
        "files": files,
        "tests": dict(sorted(tests.items())),
        "differences": list(h.find_differences("torch", modes, runs)) if "torch" in modes else [],
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="DeepSpeed's checkpoint tests with its own engine and with distckpt's.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "deepspeed",
        nargs="?",
        default=os.environ.get("DEEPSPEED_REPO"),
        help="a DeepSpeed checkout (default: $DEEPSPEED_REPO)",
    )
    parser.add_argument("tests", nargs="*", help="files or folders under tests/unit/checkpoint")
    parser.add_argument("--mode", action="append", choices=MODES, help="torch, distckpt")
    h.conformance_args(parser)
    parser.add_argument(
        "--devices", type=int, default=4, help="CPU devices the accelerator reports (default 4)"
    )
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="set in every process"
    )
    args = parser.parse_args(argv)
    if not args.deepspeed:
        parser.error("give a DeepSpeed checkout, or set DEEPSPEED_REPO")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    deepspeed = Path(args.deepspeed).resolve()
    modes = list(dict.fromkeys(args.mode or MODES))
    files = find_files(deepspeed, args.tests)
    with h.work_dir("deepspeed_conformance-", args.keep) as root:
        setup = Setup(
            python=args.python,
            root=root,
            deepspeed=deepspeed,
            files=files,
            timeout=args.timeout,
            file_timeout=args.file_timeout,
            keyword=args.keyword,
            devices=args.devices,
            extra_env=dict(item.split("=", 1) for item in args.env),
        )
        setup.prepare()
        found: dict[str, Any] = {}
        for mode in modes:
            found = setup.preflight(mode) or found
        print(f"deepspeed {found.get('deepspeed')}, distckpt from {CHECKOUT}")
        print(f"tests from {deepspeed / 'tests' / SUITE}, work directory: {root}", flush=True)
        runs: dict[str, dict[str, FileRun]] = {mode: {} for mode in modes}
        for index, (rel, mode) in enumerate((r, m) for r in files for m in modes):
            run = setup.run(mode, index, rel)
            runs[mode][rel.as_posix()] = run
            note = f"  {run.note}" if run.note else ""
            print(
                f"[{mode}] {rel.as_posix()}: p/f/s {run.cell()} in {run.seconds:.0f} s{note}",
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
