"""distckpt on Azure Blob Storage (``az://``, against Azurite, Microsoft's emulator, on
127.0.0.1) and what of Google Cloud Storage (``gs://``) runs without a server. Both go
through one obstore-backed store (:mod:`distckpt.storage.cloud`): what Azurite proves of
its code proves it for GCS but for the service's own answers (docs/storage/object-storage.md
says what is tested where).

On Azure: the conformance suite (with faults injected between client and service), a
3-rank save restored on 2 ranks, a forked child. What every store does alike runs on
Azure too, over the ``backend`` fixture: the manager's retention and lock
(tests/training/test_manager.py), racing committers (tests/commit/test_races.py), a
stopped service (tests/storage/test_s3_deadlines.py), HF weights
(tests/hf/test_hf_stores.py).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import distckpt
from distckpt.comm import SingleComm
from distckpt.errors import StorageError
from distckpt.storage import cloud
from distckpt.storage.backend import Store
from distckpt.storage.cloud import CloudStore
from distckpt.storage.registry import open_store
from distckpt.testing import StoreTests
from tests.storage.multipart import MultipartTests
from tests.support.fault_proxy import FaultProxy
from tests.support.launch_util import (
    SCRIPTS,
    assert_all_ok,
    cases,
    needs_mpi,
    run_mpi_ranks,
    run_ranks,
)
from tests.support.s3_server import use

SCRIPT = SCRIPTS / "s3_ranks.py"
JOB_ENV = {"DISTCKPT_TIMEOUT": "30"}
COMM = SingleComm()
MiB = 1 << 20


def job_env(server: Any, **extra: str) -> dict[str, str]:
    return {**server.env, **JOB_ENV, **extra}


# --------------------------------------------------------------------------- the suite


class TestAzureStore(MultipartTests, StoreTests):
    capabilities = CloudStore.capabilities
    # obstore's runtime does not survive a fork; the racing processes of
    # test_two_jobs_save_one_name are started afresh instead.
    process_races = False

    @pytest.fixture
    def store(self, azure: Any, monkeypatch: pytest.MonkeyPatch) -> Store:
        monkeypatch.setattr(cloud, "PART_BYTES", 5 * MiB)  # multipart from 5 MiB on
        self.server = azure
        return open_store(azure.url)

    @contextlib.contextmanager
    def _faults(self) -> Iterator[Callable[[], int]]:
        with (
            FaultProxy(self.server.endpoint, seed=7, error=0.1, drop_before=0.05) as proxy,
            use({**self.server.env, "AZURITE_BLOB_STORAGE_URL": proxy.endpoint}),
        ):
            yield lambda: proxy.faults

    def faults(self, store: Store) -> contextlib.AbstractContextManager[Callable[[], int]]:
        return self._faults()


# --------------------------------------------------------------------------- real jobs


def _forked_child(url: str, queue: Any) -> None:
    try:
        open_store(url).exists("x")
        queue.put("no error")
    except StorageError as exc:
        queue.put(str(exc))


def test_forked_child_fails_fast(azure: Any) -> None:
    """A process forked after its parent used az:// gets a clear error, not a hang."""
    import multiprocessing

    open_store(azure.url).exists("x")
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_forked_child, args=(azure.url, queue))
    child.start()
    try:
        assert "forked" in queue.get(timeout=60)
    finally:
        child.join(30)


@needs_mpi
@pytest.mark.timeout(240)
def test_save_3_restore_2(azure_server: Any) -> None:
    """Saved by 3 torchrun ranks on Azure, restored resharded by 2 mpiexec ranks."""
    url = "az://distckpt/test_cloud-resharding"
    assert_all_ok(run_ranks(3, SCRIPT, "save", url, timeout=120, env=job_env(azure_server)), 3)
    proc = run_mpi_ranks(2, SCRIPT, "restore", url, "3", timeout=120, env=job_env(azure_server))
    assert_all_ok(proc, 2)
    assert set(cases(proc)) == {"catalog", "resharded", "whole"}


# --------------------------------------------------------------------------- GCS


def test_gcs_locations() -> None:
    store = open_store("gs://bucket/runs/a")
    assert isinstance(store, CloudStore) and store.capabilities.conditional_create
    assert (store.bucket, store.prefix, store.url) == ("bucket", "runs/a", "gs://bucket/runs/a")
    assert store.child("ckpt-1").where("zarr.json") == "gs://bucket/runs/a/ckpt-1/zarr.json"
    assert store.parent.url == "gs://bucket/runs"
    with pytest.raises(ValueError, match="no bucket named"):
        open_store("gs:///x")
    with pytest.raises(ValueError, match="no container named"):
        open_store("az:///x")


@contextlib.contextmanager
def _refusing_service() -> Iterator[str]:
    """A loopback port that answers every request with 503 and counts them."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    stop = threading.Event()

    def serve() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        sock.close()


def test_gcs_failing_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GCS's code path up to the service: a service account naming a loopback endpoint
    that answers 503 makes a save raise StorageError naming the gs:// location, within
    the deadline, and commits nothing."""
    with _refusing_service() as endpoint:
        account = tmp_path / "service-account.json"
        account.write_text(
            json.dumps(
                {
                    "disable_oauth": True,
                    "client_email": "",
                    "private_key": "",
                    "private_key_id": "",
                    "gcs_base_url": endpoint,
                }
            )
        )
        monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT", str(account))
        monkeypatch.setenv("DISTCKPT_S3_TIMEOUT", "3")
        monkeypatch.setenv("DISTCKPT_CLOUD_ALLOW_HTTP", "1")
        began = time.monotonic()
        expected = r"gs://bucket: .* gs://bucket/run.* failed after .*503"
        with pytest.raises(StorageError, match=expected):
            distckpt.save({"w": torch.ones(4)}, "gs://bucket/run/ckpt", COMM)
        assert time.monotonic() - began < 30
