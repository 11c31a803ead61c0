"""A real S3-compatible server for the tests: moto's stand-alone server, in its own
process on 127.0.0.1 and a free port (never anything beyond loopback).

    with S3Server(buckets=["distckpt"]) as server:
        env = server.env          # AWS_ENDPOINT_URL, test credentials, region
        ...                       # s3://distckpt/... locations now work in child processes

:func:`use` puts ``server.env`` into this process's environment (and takes it out again).
:meth:`S3Server.pause` stops the server process with ``SIGSTOP`` (connections are still
accepted, nothing is answered); :meth:`S3Server.resume` continues it (call it in a
``finally``; leaving the server also continues it).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Iterator
from typing import Any

import pytest

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing-secret-never-printed",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_ALLOW_HTTP": "true",
}


def available() -> bool:
    """Whether moto's server and boto3 are installed (``pip install -e '.[test]'``)."""
    return all(importlib.util.find_spec(m) is not None for m in ("moto", "boto3", "flask"))


def require() -> None:
    if not available():
        pytest.skip("needs moto[server] and boto3 (pip install -e '.[test]')")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """moto's server on 127.0.0.1, with ``buckets`` created."""

    def __init__(self, buckets: Iterable[str] = ("distckpt",)) -> None:
        self.buckets = list(buckets)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> S3Server:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "MOTO_ALLOW_NONEXISTENT_REGION": "true"},
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2).close()
                break
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    raise RuntimeError("the moto server did not start") from None
                time.sleep(0.1)
        try:
            for bucket in self.buckets:
                self.client().create_bucket(Bucket=bucket)
        except BaseException:
            self.__exit__()  # never leave a server behind
            raise
        return self

    @property
    def pid(self) -> int:
        assert self._proc is not None, "the server is not running"
        return self._proc.pid

    def pause(self) -> None:
        """Stop the server process (``SIGSTOP``): connections queue up, nothing answers."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Continue the server process (``SIGCONT``); it answers what queued up."""
        if self._proc is not None:
            os.kill(self._proc.pid, signal.SIGCONT)

    def client(self) -> Any:
        import boto3

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
        )

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every key under ``prefix`` (sorted)."""
        pages = (
            self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        )
        return sorted(o["Key"] for page in pages for o in page.get("Contents", ()))

    def __exit__(self, *exc: object) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)  # a stopped process would not act on SIGTERM
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def use(env: dict[str, str]) -> Iterator[None]:
    """``env`` in this process's environment for the duration."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
