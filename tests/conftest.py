"""Shared fixtures: a real S3-compatible server (moto's, on loopback) for the object-store
tests; they skip when moto is not installed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from s3_server import S3Server, require, use


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One server for the session, with bucket ``distckpt``; its environment is in
    ``os.environ`` only inside tests that use :func:`s3`."""
    require()
    with S3Server(buckets=["distckpt", "other"]) as server:
        yield server


@pytest.fixture
def s3(s3_server: S3Server, request: pytest.FixtureRequest) -> Iterator[S3Server]:
    """The server, its environment set, and a fresh prefix: ``s3.url`` is
    ``s3://distckpt/<test name>``."""
    name = request.node.name.replace("[", "-").replace("]", "").replace("/", "-")
    s3_server.url = f"s3://distckpt/{name}"  # type: ignore[attr-defined]
    with use(s3_server.env):
        yield s3_server
