"""The shipped conformance suite runs under a plug-in author's plain pytest: no
pytest-timeout, ``--strict-markers`` (an unknown marker fails collection there), no
conftest of distckpt's. The suite's waits carry their own deadlines instead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

AUTHORS_TEST = """
import pytest

from distckpt.storage.posix import PosixStore
from distckpt.testing import StoreTests


class TestMyStore(StoreTests):
    capabilities = PosixStore.capabilities

    @pytest.fixture
    def store(self, tmp_path):
        return PosixStore(tmp_path / "store")
"""


@pytest.mark.timeout(600)
def test_store_suite_needs_no_pytest_plugin(tmp_path: Path) -> None:
    (tmp_path / "test_my_store.py").write_text(AUTHORS_TEST)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    env.pop("PYTEST_ADDOPTS", None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--strict-markers",
            "-W",
            "error::pytest.PytestUnknownMarkWarning",
            "test_my_store.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "timeout" not in done.stdout.lower()
