"""distckpt on Azure Blob Storage (``az://``, against Azurite, Microsoft's emulator, on
127.0.0.1) and what of Google Cloud Storage (``gs://``) runs without a server. Both go
through one obstore-backed store (:mod:`distckpt.storage.cloud`): what Azurite proves of
its code proves it for GCS but for the service's own answers (see the README's section on
object stores for what is tested where).

On Azure: the conformance suite (with faults injected between client and service), a
3-rank save restored on 2 ranks, the manager with retention, racing committers.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import distckpt
from distckpt.comm import SingleComm
from distckpt.commit import claim as claim_mod
from distckpt.errors import StorageError
from distckpt.format import index as index_mod
from distckpt.storage import cloud
from distckpt.storage.backend import Store
from distckpt.storage.cloud import CloudStore
from distckpt.storage.registry import open_store
from distckpt.testing import StoreTests
from distckpt.testing.store_helpers import payload, write_out_of_order
from distckpt.training.pointer import read_pointer
from tests.support.fault_proxy import FaultProxy
from tests.support.launch_util import (
    SCRIPTS,
    assert_all_ok,
    cases,
    finish,
    load_script,
    needs_mpi,
    run_mpi,
    run_torchrun,
    start,
)
from tests.support.s3_server import use

SCRIPT = SCRIPTS / "s3_ranks.py"
JOB_ENV = {"DISTCKPT_TIMEOUT": "30"}
COMM = SingleComm()
MiB = 1 << 20

sr = load_script(SCRIPT, "s3_ranks_script")


def job_env(server: Any, **extra: str) -> dict[str, str]:
    return {**server.env, **JOB_ENV, **extra}


def keys(url: str) -> list[str]:
    return sorted(k for k, _, _ in open_store(url).walk())


# --------------------------------------------------------------------------- the suite


class TestAzureStore(StoreTests):
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

    @pytest.mark.parametrize("size", [1000, 5 * MiB, 13 * MiB + 12345])
    def test_multipart_out_of_order(self, store: CloudStore, size: int) -> None:
        data = payload(size, seed=size)
        handle = store.create("x/piece.bin", size_hint=size)
        write_out_of_order(handle, data, random.Random(size))
        handle.finish()
        assert store.read("x/piece.bin") == data
        with store.open("x/piece.bin", size) as reader:
            runs = [(0, 10), (size - 7, 7), (size // 2, 4096)]
            reader.will_need(runs)
            for offset, length in runs:
                assert reader.read(offset, length) == data[offset : offset + length]
            assert reader.read(size - 3, 100) == data[-3:]  # a short read at the end
            assert reader.read(size + 5, 10) == b""


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
    assert_all_ok(run_torchrun(3, SCRIPT, "save", url, timeout=120, env=job_env(azure_server)), 3)
    proc = run_mpi(2, SCRIPT, "restore", url, "3", timeout=120, env=job_env(azure_server))
    assert_all_ok(proc, 2)
    assert set(cases(proc)) == {"catalog", "resharded", "whole"}


@needs_mpi
@pytest.mark.timeout(120)
def test_manager_retention(azure: Any) -> None:
    """A 2-rank job: max_to_keep=2 over 4 saves (the last in the background), a locked
    directory refused; a new manager in this process restores the newest."""
    run, locked = f"{azure.url}/run", f"{azure.url}/locked"
    holder = distckpt.CheckpointManager(distckpt.Checkpoint(x=torch.zeros(2)), locked, comm=COMM)
    try:
        proc = run_mpi(2, SCRIPT, "manager", run, locked, timeout=90, env=job_env(azure))
    finally:
        holder.close()
    assert_all_ok(proc, 2)
    found = cases(proc)
    assert {r["type"] for r in found["manager-locked"].values()} == {"DirectoryLockedError"}
    left = keys(run)
    assert not [k for k in left if k.startswith(("ckpt-1/", "ckpt-2/"))], left
    for name in ("ckpt-3", "ckpt-4"):
        assert f"{name}/zarr.json" in left and index_mod.is_committed(f"{run}/{name}")
    assert not [k for k in left if claim_mod.SUFFIX in k or ".distckpt-lock" in k], left
    assert keys(locked) == []
    assert read_pointer(run).all == ["ckpt-3", "ckpt-4"]  # type: ignore[union-attr]
    ckpt, net = sr.manager_checkpoint()
    with distckpt.CheckpointManager(ckpt, run, max_to_keep=2, comm=COMM) as manager:
        assert manager.restore_or_initialize() == f"{run}/ckpt-4"
    step, w, params = sr.manager_values(4)
    assert torch.equal(ckpt.step, step) and torch.equal(ckpt.w, w)
    assert torch.equal(net.weight.detach(), params["weight"])


@pytest.mark.timeout(120)
def test_two_jobs_save_one_name(azure: Any, tmp_path: Path) -> None:
    """Two single-process jobs save different states to one name at the same moment,
    4 times: exactly one commits each time, and the name holds the winner's state."""
    rounds = 4
    args = ["race", azure.url, "{who}", str(rounds), str(tmp_path / "markers")]
    procs = [
        start([sys.executable, str(SCRIPT), *(a.format(who=who) for a in args)], job_env(azure))
        for who in (0, 1)
    ]
    results: dict[int, dict[int, str]] = {}
    for proc in [finish(p, 100) for p in procs]:
        assert re.search(r"^OK \d$", proc.stdout, re.M), proc.stdout + proc.stderr
        for r, who, outcome in re.findall(r"^RESULT (\d+) (\d+) (\S+)$", proc.stdout, re.M):
            results.setdefault(int(r), {})[int(who)] = outcome
    for r in range(rounds):
        outcomes = results.get(r, {})
        assert sorted(outcomes.values()) == ["committed", "exists"], (r, outcomes)
        winner = next(w for w, o in outcomes.items() if o == "committed")
        state: dict[str, Any] = {"a": torch.zeros(300, 50), "b": torch.zeros(7, dtype=torch.int64)}
        state["who"] = None
        distckpt.load(state, f"{azure.url}/race-{r}", COMM)
        want = sr.race_state(winner, r)
        assert state["who"] == winner
        assert torch.equal(state["a"], want["a"]) and torch.equal(state["b"], want["b"])


def test_stopped_service_fails_within_deadline(azure: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A service that stops answering: a save raises StorageError naming the location
    within the deadline, and a later save commits once it answers again."""
    monkeypatch.setenv("DISTCKPT_S3_TIMEOUT", "4")
    state = {"w": torch.arange(1000.0)}
    azure.pause()
    try:
        began = time.monotonic()
        with pytest.raises(StorageError, match=r"az://distckpt/"):
            distckpt.save(state, f"{azure.url}/a", COMM)
        assert time.monotonic() - began < 30
    finally:
        azure.resume()
    distckpt.save(state, f"{azure.url}/b", COMM)
    got = {"w": torch.zeros(1000)}
    distckpt.load(got, f"{azure.url}/b", COMM)
    assert torch.equal(got["w"], state["w"])


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


# --------------------------------------------------------------------------- HF weights


def _hf_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "embed.weight": torch.randn(300, 64, generator=g).to(torch.bfloat16),
        "layers.0.w": torch.randn(64, 640, generator=g),
        "layers.1.w": torch.randn(64, 640, generator=g),
        "norm.bias": torch.randn(64, generator=g).to(torch.float16),
    }


@pytest.mark.parametrize("service", ["s3", "azure"])
def test_load_hf_from_store(service: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Hugging Face weights written to a bucket by save_hf (an index and three files)
    are the files it writes to a directory, byte for byte; they load from its URL bit for
    bit, resharded boxes included; existing weights are refused, or replaced with
    ``overwrite=True`` (the old files the new save does not name removed); a hostile index
    or header in the bucket is refused with a message naming it."""
    server = request.getfixturevalue("s3" if service == "s3" else "azure")
    want = _hf_state()
    local = tmp_path / "hf"
    distckpt.save_hf(want, local, COMM, max_shard_size=200_000)
    files = sorted(p.name for p in local.iterdir())
    assert "model.safetensors.index.json" in files and len(files) >= 4
    store = open_store(f"{server.url}/hf")
    distckpt.save_hf(want, store.url, COMM, max_shard_size=200_000)
    assert store.list() == files
    for name in files:
        assert store.read(name) == (local / name).read_bytes(), name
    with pytest.raises(distckpt.CheckpointExists, match="already holds weights"):
        distckpt.save_hf(want, store.url, COMM)
    again = open_store(f"{server.url}/again")
    distckpt.save_hf(want, again.url, COMM, max_shard_size=200_000)
    distckpt.save_hf(want, again.url, COMM, options=distckpt.CheckpointOptions(overwrite=True))
    distckpt.save_hf(want, tmp_path / "whole", COMM)
    assert again.list() == ["model.safetensors"]
    assert again.read("model.safetensors") == (tmp_path / "whole/model.safetensors").read_bytes()

    got: dict[str, Any] = {k: torch.zeros_like(v) for k, v in want.items()}
    result = distckpt.load_hf(got, f"{server.url}/hf", COMM)
    assert sorted(result.loaded) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
    # A box of a tensor (as a rank of a sharded job reads it): only its bytes.
    box = distckpt.Shard(torch.zeros(64, 100), global_shape=(64, 640), offsets=(0, 300))
    distckpt.load_hf({"layers.1.w": box}, f"{server.url}/hf", COMM, strict=False)
    assert torch.equal(box.tensor, want["layers.1.w"][:, 300:400])
    # `distckpt import` from the bucket: a checkpoint of the same tensors.
    proc = subprocess.run(
        [sys.executable, "-m", "distckpt", "import", f"{server.url}/hf", str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    back: dict[str, Any] = {k: torch.zeros_like(v) for k, v in want.items()}
    distckpt.load(back, tmp_path / "ck", COMM)
    for k, v in want.items():
        assert torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)), k
    # One object named directly.
    single = open_store(f"{server.url}/one")
    distckpt.save_hf({"x": want["norm.bias"]}, tmp_path / "one", COMM)
    single.write("model.safetensors", (tmp_path / "one" / "model.safetensors").read_bytes())
    x = {"x": torch.zeros(64, dtype=torch.float16)}
    distckpt.load_hf(x, f"{server.url}/one/model.safetensors", COMM)
    assert torch.equal(x["x"], want["norm.bias"])

    hostile = open_store(f"{server.url}/hostile")
    hostile.write(
        "model.safetensors.index.json",
        json.dumps({"weight_map": {"a": "../hf/model-00001-of-00003.safetensors"}}).encode(),
    )
    with pytest.raises(distckpt.CorruptCheckpointError, match="names the file"):
        distckpt.load_hf({"a": torch.zeros(1)}, hostile.url, COMM)
    huge = open_store(f"{server.url}/huge")
    huge.write("model.safetensors", (1 << 60).to_bytes(8, "little") + b"{}")
    with pytest.raises(distckpt.CorruptCheckpointError, match="header length"):
        distckpt.load_hf({"a": torch.zeros(1)}, huge.url, COMM)
