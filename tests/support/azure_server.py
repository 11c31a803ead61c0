"""A real Azure Blob service for the tests: Azurite, Microsoft's own emulator (from the
npm registry: ``npm install azurite``, which ``.ci/run`` does), in its own process on
127.0.0.1 and a free port, keeping its blobs in memory.

    with AzureServer(containers=["distckpt"]) as server:
        env = server.env          # what obstore reads: the emulator's URL and account
        ...                       # az://distckpt/... locations now work in child processes

The account is the emulator's well-known development account; containers are made with
one signed request each (Shared Key, as the Blob REST API defines it).
"""

from __future__ import annotations

import base64
import contextlib
import email.utils
import hashlib
import hmac
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path

import pytest

from tests.support.s3_server import free_port

ACCOUNT = "devstoreaccount1"
# The development account's key, published in Azurite's documentation.
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
#: Where ``.ci/run`` installs Azurite when it is not on ``PATH``.
INSTALLED = Path(
    os.environ.get("DISTCKPT_AZURITE_PREFIX", Path.home() / ".cache" / "distckpt" / "azurite")
)


def executable() -> str | None:
    """Azurite's blob service: on ``PATH``, or where ``.ci/run`` puts it."""
    found = shutil.which("azurite-blob")
    if found:
        return found
    local = INSTALLED / "node_modules" / ".bin" / "azurite-blob"
    return str(local) if local.exists() else None


def require() -> str:
    found = executable()
    if found is None:
        pytest.skip(f"needs Azurite (npm install --prefix {INSTALLED} azurite)")
    try:
        import obstore  # noqa: F401
    except ImportError:
        pytest.skip("needs obstore (pip install -e '.[test]')")
    return found


class AzureServer:
    """Azurite's blob service on 127.0.0.1, with ``containers`` made."""

    def __init__(self, containers: Iterable[str] = ("distckpt",)) -> None:
        self.containers = list(containers)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {
            "AZURE_STORAGE_USE_EMULATOR": "true",
            "AZURITE_BLOB_STORAGE_URL": self.endpoint,
            "AZURE_STORAGE_ACCOUNT_NAME": ACCOUNT,
            "AZURE_STORAGE_ACCOUNT_KEY": KEY,
        }
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> AzureServer:
        command = [
            require(),
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(self.port),
            "--inMemoryPersistence",
            "--skipApiVersionCheck",
            "--silent",
        ]
        self._proc = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        try:
            self._make(self.containers[0], deadline=time.monotonic() + 60)
            for container in self.containers[1:]:
                self._make(container, deadline=time.monotonic() + 10)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _make(self, container: str, deadline: float) -> None:
        """Create ``container`` (retrying until the server answers, or ``deadline``)."""
        while True:
            try:
                urllib.request.urlopen(self._signed("PUT", container), timeout=5).close()
                return
            except urllib.error.HTTPError as exc:
                if exc.code == 409:  # it exists
                    return
                raise
            except OSError:
                assert self._proc is not None
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("Azurite did not start") from None
                time.sleep(0.1)

    def _signed(self, method: str, container: str) -> urllib.request.Request:
        """A Shared Key signed request on ``container`` (``?restype=container``)."""
        headers = {
            "x-ms-date": email.utils.formatdate(usegmt=True),
            "x-ms-version": "2021-08-06",
            "Content-Length": "0",
        }
        signed = sorted((k, v) for k, v in headers.items() if k.startswith("x-ms-"))
        canonical = "".join(f"{k}:{v}\n" for k, v in signed)
        resource = f"/{ACCOUNT}/{ACCOUNT}/{container}\nrestype:container"
        to_sign = f"{method}\n\n\n\n\n\n\n\n\n\n\n\n{canonical}{resource}"
        digest = hmac.new(base64.b64decode(KEY), to_sign.encode(), hashlib.sha256).digest()
        headers["Authorization"] = f"SharedKey {ACCOUNT}:{base64.b64encode(digest).decode()}"
        return urllib.request.Request(
            f"{self.endpoint}/{ACCOUNT}/{container}?restype=container",
            method=method,
            headers=headers,
        )

    def pause(self) -> None:
        """Stop the server (``SIGSTOP``): connections queue up, nothing answers."""
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is not None:
            os.kill(self._proc.pid, signal.SIGCONT)

    def __exit__(self, *exc: object) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
