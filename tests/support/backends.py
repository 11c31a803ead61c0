"""The stores a behaviour that every backend shares is tested on, once per test.

The ``backend`` fixture (tests/conftest.py) is parametrised by :data:`BACKENDS`: a
directory (POSIX), a prefix of the session's moto server (S3) and one of its Azurite
service (Azure Blob). The object stores skip as their own fixtures do (``s3``,
``azure``), and under ``CI=true`` such a skip fails the run. A test about object stores
alone narrows the list::

    @pytest.mark.parametrize("backend", OBJECT_STORES, indirect=True)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from distckpt.storage.registry import open_store

BACKENDS = ("posix", "s3", "azure")
OBJECT_STORES = ("s3", "azure")


@dataclass
class Backend:
    """A fresh location of one store for one test: ``url`` (a directory, an ``s3://``
    or an ``az://`` prefix), the environment a process needs to reach it (``env``: this
    process has it while the test runs) and the server behind it (None for POSIX)."""

    name: str
    url: str
    env: dict[str, str] = field(default_factory=dict)
    server: Any = None

    def keys(self, url: str | None = None) -> list[str]:
        """Every key under ``url`` (the test's location by default), relative to it; in a
        directory not the ``.<name>.lock`` files that the store's conditional updates
        lock (``lockf``), which stay: they are the store's, not a checkpoint's."""
        found = sorted(k for k, _, _ in open_store(url or self.url).walk())
        if self.name == "posix":
            found = [k for k in found if not _POSIX_LOCK.search(k)]
        return found


_POSIX_LOCK = re.compile(r"(^|/)\.[^/]+\.lock$")
