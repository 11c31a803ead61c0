"""Shared fixtures: a real S3-compatible server (moto's, on loopback, ``s3``) and
Azurite (``azure``) for the object-store tests, which skip when moto or Azurite is not
installed; ``backend``, one test per store (a directory, S3, Azure) for what every store
must do alike.

Under ``CI=true`` a skip is a failure, except for the tests that need a CUDA GPU (CI has
none): tests/engine/test_cuda.py and tests marked ``gpu``. A test that skips because SLURM,
shellcheck, mpiexec or a test dependency is missing there would otherwise pass unseen;
the run lists each such skip with its reason and exits with 1. ``$DISTCKPT_CI_WITHOUT``
names optional frameworks left out on purpose (``deepspeed``: .ci/run first runs the
suite as a fresh clone has it, without DeepSpeed, then DeepSpeed's tests with it): a
skip whose reason names one of them is allowed.
"""

from __future__ import annotations

import compileall
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.backends import BACKENDS, Backend
from tests.support.s3_server import S3Server, require, use

#: Test files whose skips CI allows (they need a CUDA GPU).
GPU_FILES = frozenset({"test_cuda.py"})
#: At most this many workers for ``-n auto`` (pytest-xdist; the README runs the suite with
#: ``--dist loadfile``, so that a file's module-scoped setup runs once): each test may
#: start several processes.
MAX_WORKERS = 4

_unexpected_skips: list[tuple[str, str]] = []  # (node id, reason) of this session


def left_out() -> tuple[str, ...]:
    """The optional frameworks ``$DISTCKPT_CI_WITHOUT`` leaves out on purpose."""
    names = os.environ.get("DISTCKPT_CI_WITHOUT", "").lower().replace(",", " ").split()
    return tuple(names)


def in_ci() -> bool:
    """``$CI`` says this is a CI run (``true``, as CI services set it, or ``1``)."""
    return os.environ.get("CI", "").strip().lower() in {"true", "1"}


def _compile_once(config: pytest.Config) -> None:
    """Every process the suite starts imports distckpt and the rank scripts; where
    ``PYTHONDONTWRITEBYTECODE`` is set (as on some CI images) each one compiles them
    again, some 0.3 s of CPU a process. Compile them once, here, into their
    ``__pycache__`` (ignored by git); a changed source is recompiled on import as ever."""
    if hasattr(config, "workerinput") or not sys.dont_write_bytecode:
        return  # a pytest-xdist worker (its controller compiled), or Python writes them
    root = Path(__file__).resolve().parents[1]
    for folder in ("distckpt", "tests", "examples"):
        compileall.compile_dir(root / folder, quiet=1)


def pytest_configure(config: pytest.Config) -> None:
    _compile_once(config)
    config.addinivalue_line(
        "markers",
        "gpu: needs a CUDA GPU; may skip under CI=true, as tests/engine/test_cuda.py does",
    )
    _unexpected_skips.clear()


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's: unknown to a run without it
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per core, at most :data:`MAX_WORKERS`."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


def _skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr: Any = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _note_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    if not report.skipped or hasattr(report, "wasxfail") or not in_ci():
        return
    gpu = "gpu" in getattr(report, "keywords", {})  # a collect report has no keywords
    if Path(report.nodeid.split("::")[0]).name in GPU_FILES or gpu:
        return
    reason = _skip_reason(report)
    if any(name in reason.lower() for name in left_out()):
        return
    _unexpected_skips.append((report.nodeid, reason))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _note_skip(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _note_skip(report)  # a module that skips as a whole (importorskip)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _unexpected_skips:
        terminalreporter.section("skips not allowed under CI=true", sep="=", red=True)
        for nodeid, reason in _unexpected_skips:
            terminalreporter.line(f"SKIPPED {nodeid}: {reason}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _unexpected_skips and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One server for the session, with bucket ``distckpt``; its environment is in
    ``os.environ`` only inside tests that use :func:`s3`."""
    require()
    with S3Server(buckets=["distckpt", "other"]) as server:
        yield server


def _fresh_prefix(server: Any, scheme: str, request: pytest.FixtureRequest) -> Iterator[Any]:
    """``server`` with its environment set and ``url`` a prefix named after the test."""
    name = request.node.name.replace("[", "-").replace("]", "").replace("/", "-")
    server.url = f"{scheme}://distckpt/{name}"
    with use(server.env):
        yield server


@pytest.fixture
def s3(s3_server: S3Server, request: pytest.FixtureRequest) -> Iterator[S3Server]:
    """The server, its environment set, and a fresh prefix: ``s3.url`` is
    ``s3://distckpt/<test name>``."""
    yield from _fresh_prefix(s3_server, "s3", request)


@pytest.fixture(scope="session")
def azure_server() -> Iterator[Any]:
    """One Azurite blob service for the session, with container ``distckpt``; its
    environment is in ``os.environ`` only inside tests that use :func:`azure`."""
    from tests.support.azure_server import AzureServer

    with AzureServer(containers=["distckpt", "other"]) as server:
        yield server


@pytest.fixture
def azure(azure_server: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    """The Azurite service, its environment set, and a fresh prefix: ``azure.url`` is
    ``az://distckpt/<test name>``."""
    yield from _fresh_prefix(azure_server, "az", request)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """One store per parameter (tests/support/backends.py): a directory, or a fresh
    prefix of the S3 or Azure server (with its environment set, as :func:`s3` and
    :func:`azure` do, and skipping as they do)."""
    if request.param == "posix":
        return Backend("posix", str(tmp_path / "store"))
    server = request.getfixturevalue(request.param)
    return Backend(request.param, server.url, dict(server.env), server)
