#!/usr/bin/env python
"""Megatron conformance: Megatron-LM's own ``tests/unit_tests/dist_checkpointing`` suite,
run with megatron-core's default save strategy (``torch_dist``) and with distckpt's
(:mod:`distckpt.integrations.megatron`) in its place.

The tests are not part of distckpt: take them from a Megatron-LM checkout at the tag of
the installed megatron-core (``pip show megatron-core``; for 0.16.1, ``core_v0.16.1``)::

    git clone --branch core_v0.16.1 --depth 1 https://github.com/NVIDIA/Megatron-LM
    python benchmarks/megatron_conformance.py Megatron-LM
    python benchmarks/megatron_conformance.py Megatron-LM test_serialization.py \\
        test_fully_parallel.py --json results.json -k "not async" --timeout 900

The checkout may also be given as ``MEGATRON_LM`` in the environment. Tests (after the
checkout): files or folders relative to ``tests/unit_tests/dist_checkpointing`` (default:
every ``test_*.py`` there, ``models/`` included). Only the tests are used: the
megatron-core tested is the installed one. They are copied into a temporary directory
with the conftest files and helpers they import (Megatron's download of test data
replaced by a stub that does not reach the network).

Each file runs once per mode (``--mode``, repeatable; default both) on ``--ranks`` CPU
ranks (default 8, as the suite expects), ``torchrun --standalone -m pytest`` with the
plugin ``benchmarks/megatron_conformance_plugin.py`` loaded in every rank: gloo for NCCL,
CUDA devices as the CPU, a stub ``megatron.training`` (absent from the megatron-core
wheel: the tests that call it skip), and in mode ``distckpt`` distckpt's strategies
registered as ``("torch_dist", 1)``. ``OMP_NUM_THREADS=1``, ``GLOO_SOCKET_IFNAME=lo``,
``TMPDIR`` a fresh folder, this checkout (or ``--distckpt PATH``) first on
``PYTHONPATH``; ``--env NAME=VALUE`` sets more (``DISTCKPT_EXCHANGE=0``, say). A test's
outcome gathers its ranks': failed if it failed on any rank, else passed if it passed on
any. A test that leaves the ranks in different collectives hangs them all until one
reaches ``--timeout`` and torchrun stops the rest; the test is ``killed``, and the file
runs again without the tests already started.

Printed: per test, its outcome in each mode and the strategies that saved in mode
distckpt (``-`` when the test saved nothing through megatron-core's strategies: its
distckpt outcome says nothing about distckpt), the counts, and every test whose outcome
differs from mode torch_dist with the first failing rank's error. ``--json FILE`` writes
all of it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import harness as h
from harness import FileRun, json_lines

MODES = ("torch_dist", "distckpt")
CHECKOUT = Path(__file__).resolve().parents[1]
SUITE = Path("tests/unit_tests/dist_checkpointing")
# What the suite imports beside its own folder (from tests/).
HELPERS: tuple[str, ...] = ("__init__.py", "unit_tests/__init__.py", "unit_tests/conftest.py")
HELPERS += ("unit_tests/test_utilities.py",)
DOWNLOAD_STUB = '''\
"""Written by benchmarks/megatron_conformance.py: the conformance run reaches no network."""


def download_and_extract_asset(assets_dir):
    raise RuntimeError("test data is not downloaded in a conformance run")
'''
PYTEST_INI = """\
[pytest]
markers =
    internal: a test of private functions
    flaky: flaky
    flaky_in_dev: flaky in development
filterwarnings = ignore
"""
RANK_OUTCOMES = {"failed": 3, "error": 3, "killed": 2, "passed": 1, "skipped": 0}


@dataclass
class TestOutcome(h.TestOutcome):
    rank: int | None = None  # the first rank that failed
    strategies: list[str] = field(default_factory=list)
    seconds: float = 0.0  # setup, call and teardown, on the slowest rank


def rank_outcomes(path: Path) -> tuple[dict[str, tuple[str, str]], dict[str, float]]:
    """One rank's outcome of each test from the plugin's records, (outcome, message), and
    the seconds its phases took."""
    outcomes: dict[str, tuple[str, str]] = {}
    seconds: dict[str, float] = defaultdict(float)
    for record in json_lines(path):
        test, when, outcome = record["test"], record["when"], record["outcome"]
        message = record.get("message", "")
        seconds[test] += record.get("duration", 0.0)
        if when == "start":
            outcomes.setdefault(test, ("killed", "started, never finished"))
        elif outcome == "failed":
            if outcomes.get(test, ("",))[0] not in ("failed", "error"):
                outcomes[test] = ("error" if when in ("setup", "collect") else "failed", message)
        elif outcome == "skipped":
            outcomes[test] = ("skipped", message)
        elif when == "call":
            outcomes[test] = ("passed", "")
    return outcomes, seconds


def gather(folder: Path) -> dict[str, TestOutcome]:
    """Each test's outcome over the ranks, and the strategies that saved and loaded in it."""
    per_rank: dict[str, dict[int, tuple[str, str]]] = defaultdict(dict)
    took: dict[str, float] = defaultdict(float)
    for path in sorted(folder.glob("outcomes-*.jsonl")):
        rank = int(path.stem.rsplit("-", 1)[1])
        outcomes, seconds = rank_outcomes(path)
        for test, pair in outcomes.items():
            per_rank[test][rank] = pair
            took[test] = max(took[test], seconds[test])
    tests: dict[str, TestOutcome] = {}
    for test, ranks in per_rank.items():
        rank, (outcome, message) = max(
            sorted(ranks.items()), key=lambda item: RANK_OUTCOMES[item[1][0]]
        )
        failing = outcome in ("failed", "error", "killed")
        tests[test] = TestOutcome(outcome, message, rank if failing else None, seconds=took[test])
    strategies: dict[str, set[str]] = defaultdict(set)
    for record in json_lines(folder / "strategies.jsonl"):
        strategies[record["test"]].add(f"{record['action']}:{record['strategy']}")
    for test, used in strategies.items():
        if test in tests:
            tests[test].strategies = sorted(used)
    return tests


def first_line(message: str) -> str:
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return h.clip(lines[0] if lines else "", 240)


@dataclass
class Setup:
    python: str
    root: Path
    megatron: Path
    ranks: int
    timeout: float
    file_timeout: float
    keyword: str | None
    distckpt: Path = CHECKOUT
    extra_env: dict[str, str] = field(default_factory=dict)

    def prepare(self) -> Path:
        """The suite and its helpers, copied into the work directory; returns its root."""
        tree = self.root / "tree"
        source = self.megatron / "tests"
        for helper in HELPERS:
            target = tree / "tests" / helper
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / helper, target)
        shutil.copytree(self.megatron / SUITE, tree / SUITE)
        stub = tree / "tests/test_utils/python_scripts/download_unit_tests_dataset.py"
        stub.parent.mkdir(parents=True)
        stub.write_text(DOWNLOAD_STUB, encoding="utf-8")
        (tree / "pytest.ini").write_text(PYTEST_INI, encoding="utf-8")
        return tree

    def env(self, mode: str, out: Path, tmpdir: Path) -> dict[str, str]:
        extra = {**self.extra_env, "MLMCONF_MODE": mode, "MLMCONF_OUT": str(out)}
        return h.conformance_env([self.distckpt, CHECKOUT / "benchmarks"], tmpdir, extra)

    def run(self, mode: str, index: int, rels: list[Path]) -> FileRun:
        """The tests of the files ``rels``, in one pytest session per attempt, in ``mode``.
        A test that brings the ranks down (one rank's time-out ends them all) ends an
        attempt: the next leaves out the tests started."""
        work = self.root / "work" / f"{mode}-{index}"
        out, tmpdir, done = work / "out", work / "tmp", work / "done.txt"
        tmpdir.mkdir(parents=True)
        started, deadline, note = time.monotonic(), time.monotonic() + self.file_timeout, ""
        returncode: int | None = None
        for attempt in range(1, 1000):
            before = started_tests(out)
            done.write_text("".join(f"{test}\n" for test in sorted(before)), encoding="utf-8")
            returncode = self.attempt(mode, rels, work, attempt, deadline - time.monotonic())
            if returncode is None:
                note = f"killed after {self.file_timeout:g} s"
                break
            if started_tests(out) == before or not unfinished_tests(out):
                break
        seconds = time.monotonic() - started
        tests = gather(out) if out.exists() else {}
        if not tests and not note:
            note = f"no test reported (exit code {returncode}); see {work}/output-*.txt"
        shutil.rmtree(tmpdir, ignore_errors=True)
        return FileRun(returncode, seconds, tests, note)

    def attempt(
        self, mode: str, rels: list[Path], work: Path, attempt: int, limit: float
    ) -> int | None:
        """One torchrun of the files' tests not yet started; its exit code (None: killed)."""
        command = [self.python, "-m", "torch.distributed.run", "--standalone"]
        command += [f"--nproc-per-node={self.ranks}", "--log-dir", str(work / f"logs-{attempt}")]
        command += ["--redirects", "3", "-m", "pytest", "-p", "megatron_conformance_plugin"]
        command += ["-p", "no:cacheprovider", "-q", f"--timeout={self.timeout:g}"]
        # One module that fails to import (test_fp8.py without Transformer Engine) must not
        # stop the session's other files.
        command += ["--continue-on-collection-errors"]
        command += ["--timeout-method=thread", *(str(SUITE / rel) for rel in rels)]
        if self.keyword:
            command += ["-k", self.keyword]
        env = self.env(mode, work / "out", work / "tmp")
        env["MLMCONF_DONE"] = str(work / "done.txt")
        # torchrun stops its ranks on SIGTERM (they run in sessions of their own).
        log = work / f"output-{attempt}.txt"
        return h.run_logged(
            command, cwd=self.root / "tree", env=env, log=log, timeout=limit, grace=60
        )


def records(out: Path) -> list[tuple[int, dict[str, Any]]]:
    """The plugin's outcome records of every rank: (rank, record)."""
    found = []
    for path in sorted(out.glob("outcomes-*.jsonl")):
        rank = int(path.stem.rsplit("-", 1)[1])
        found += [(rank, record) for record in json_lines(path)]
    return found


def started_tests(out: Path) -> set[str]:
    return {record["test"] for _, record in records(out) if record["when"] == "start"}


def unfinished_tests(out: Path) -> set[tuple[int, str]]:
    """(rank, test) of the tests a rank started and never tore down."""
    seen = {(rank, record["test"]) for rank, record in records(out) if record["when"] == "start"}
    ended = {(rank, r["test"]) for rank, r in records(out) if r["when"] == "teardown"}
    return seen - ended


def split(run: FileRun, rels: list[Path]) -> dict[str, FileRun]:
    """A run of several files as one run per file: each file's tests, and the seconds they
    took (the session's start-up, shared, is left out)."""
    if len(rels) == 1:
        return {rels[0].as_posix(): run}
    runs = {}
    for rel in rels:
        module = (SUITE / rel).as_posix()
        tests = {t: o for t, o in run.tests.items() if t.split("::", 1)[0] == module}
        seconds = sum(outcome.seconds for outcome in tests.values())
        note = run.note or ("" if tests else "no test reported")
        runs[rel.as_posix()] = FileRun(run.returncode, seconds, tests, note)
    return runs


def find_files(megatron: Path, names: list[str]) -> list[Path]:
    suite = megatron / SUITE
    if not suite.is_dir():
        raise SystemExit(f"{suite}: not a folder; give the root of a Megatron-LM checkout")
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


def short(test: str) -> str:
    """A test's id relative to the suite's folder."""
    return test.removeprefix(f"{SUITE.as_posix()}/")


def counts(runs: dict[str, FileRun]) -> dict[str, int]:
    total = dict.fromkeys(RANK_OUTCOMES, 0)
    for run in runs.values():
        for test in run.tests.values():
            total[test.outcome] += 1
    return total


def print_report(modes: list[str], runs: dict[str, dict[str, FileRun]]) -> None:
    tests = sorted({test for mode in modes for run in runs[mode].values() for test in run.tests})
    outcomes = {
        mode: {t: o for run in runs[mode].values() for t, o in run.tests.items()} for mode in modes
    }
    width = max([len(short(test)) for test in tests] + [4])
    header = f"{'test':<{width}}  " + "  ".join(f"{mode:>10}" for mode in modes)
    print("\n" + header + "  saved by (distckpt mode)")
    for test in tests:
        cells = [outcomes[mode].get(test) for mode in modes]
        row = "  ".join(f"{cell.outcome if cell else '-':>10}" for cell in cells)
        used = outcomes.get("distckpt", {}).get(test)
        saved = [s.split(":", 1)[1] for s in (used.strategies if used else []) if "save:" in s]
        print(f"{short(test):<{width}}  {row}  {', '.join(saved) or '-'}")
    print()
    for mode in modes:
        total = counts(runs[mode])
        print(f"{mode}: " + ", ".join(f"{n} {what}" for what, n in total.items() if n))
        for name, run in runs[mode].items():
            if run.note:
                print(f"  ! {name}: {run.note}")
    if "torch_dist" not in modes or len(modes) == 1:
        return
    print("\noutcomes that differ from mode torch_dist:")
    for test in tests:
        before, after = outcomes["torch_dist"].get(test), outcomes["distckpt"].get(test)
        if before and after and before.outcome != after.outcome:
            print(f"  {short(test)}: {before.outcome} -> {after.outcome}")
            shown = after if after.error else before
            if shown.error:
                print(f"      rank {shown.rank}: {first_line(shown.error)}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Megatron-LM's dist_checkpointing tests with torch_dist and with distckpt.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "megatron",
        nargs="?",
        default=os.environ.get("MEGATRON_LM"),
        help="a Megatron-LM checkout (default: $MEGATRON_LM)",
    )
    parser.add_argument(
        "tests", nargs="*", help="files or folders under tests/unit_tests/dist_checkpointing"
    )
    parser.add_argument("--mode", action="append", choices=MODES, help="repeatable")
    parser.add_argument("--ranks", type=int, default=8, help="CPU ranks (default 8)")
    h.conformance_args(parser)
    parser.add_argument(
        "--distckpt",
        type=Path,
        default=CHECKOUT,
        help="the distckpt checkout tested (default: this one)",
    )
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="set in every rank"
    )
    parser.add_argument(
        "--per-file",
        action="store_true",
        help="one pytest session per file (default: one per mode for all the files, as "
        "Megatron-LM's CI runs the folder: each session starts 8 ranks that import torch "
        "and megatron-core, minutes on a small machine)",
    )
    args = parser.parse_args(argv)
    if not args.megatron:
        parser.error("give a Megatron-LM checkout, or set MEGATRON_LM")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    megatron = Path(args.megatron).resolve()
    modes = list(dict.fromkeys(args.mode or MODES))
    files = find_files(megatron, args.tests)
    with h.work_dir("megatron_conformance-", args.keep) as root:
        setup = Setup(
            args.python, root, megatron, args.ranks, args.timeout, args.file_timeout, args.keyword
        )
        setup.distckpt = args.distckpt.resolve()
        setup.extra_env = dict(item.split("=", 1) for item in args.env)
        setup.prepare()
        print(f"distckpt from {setup.distckpt}, tests from {megatron / SUITE}, {args.ranks} ranks")
        print(f"work directory: {root}", flush=True)
        runs: dict[str, dict[str, FileRun]] = {mode: {} for mode in modes}
        groups = [[rel] for rel in files] if args.per_file else [files]
        for index, (group, mode) in enumerate((g, m) for g in groups for m in modes):
            whole = setup.run(mode, index, group)
            if len(group) > 1:
                print(f"[{mode}] {len(group)} files in one session: {whole.seconds:.0f} s")
            for name, run in split(whole, group).items():
                runs[mode][name] = run
                total = dict.fromkeys(RANK_OUTCOMES, 0)
                for test in run.tests.values():
                    total[test.outcome] += 1
                summary = ", ".join(f"{n} {what}" for what, n in total.items() if n) or "nothing"
                note = f"  {run.note}" if run.note else ""
                print(f"[{mode}] {name}: {summary} in {run.seconds:.0f} s{note}", flush=True)
        print_report(modes, runs)
        if args.json:
            document = {
                "command": [sys.executable, *sys.argv],
                "distckpt": str(setup.distckpt),
                "env": setup.extra_env,
                "megatron_lm": str(megatron),
                "ranks": args.ranks,
                "modes": modes,
                "runs": {
                    mode: {name: asdict(run) for name, run in runs[mode].items()} for mode in modes
                },
            }
            args.json.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
            print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
