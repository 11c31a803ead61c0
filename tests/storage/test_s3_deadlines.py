"""Deadlines on every request to an object store: a service that stops answering fails a
save, a load, ``distckpt ls`` and ``gc`` with :class:`~distckpt.StorageError` within
twice ``DISTCKPT_S3_TIMEOUT`` (README, "Object storage", Failures), on every rank, and
leaves the previous checkpoint and the ``latest`` pointer as they were; once it answers
again, the next save succeeds.

The silence is a fault proxy that holds every request from a chosen one on
(tests/support/fault_proxy.py, :meth:`FaultProxy.stall`), or the server itself stopped
with ``SIGSTOP``: moto at a chosen request (2 ranks under torchrun,
tests/scripts/s3_silent.py), and moto or Azurite under a save of one process.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator

import pytest
import torch

import distckpt
from distckpt import cli
from distckpt.comm import SingleComm
from distckpt.commit.lease import Lease
from distckpt.errors import StorageError
from distckpt.format import index as index_mod
from distckpt.storage import s3 as s3_mod
from distckpt.storage.registry import open_store
from distckpt.testing.hostile import reseal
from tests.support.backends import OBJECT_STORES, Backend
from tests.support.fault_proxy import FaultProxy, Request
from tests.support.launch_util import SCRIPTS, assert_all_ok, cases, output, run_ranks
from tests.support.s3_server import S3Server, use

#: DISTCKPT_S3_TIMEOUT here; the README's bound is twice it.
TIMEOUT = 6.0
BOUND = 2 * TIMEOUT
COMM = SingleComm()


@contextlib.contextmanager
def silenceable(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """A proxy in front of ``server`` that :meth:`FaultProxy.stall` silences, this
    process's endpoint pointing at it, and the deadline of these tests."""
    monkeypatch.setenv(s3_mod.TIMEOUT_ENV, str(TIMEOUT))
    with (
        FaultProxy(server.endpoint) as proxy,
        use({**server.env, "AWS_ENDPOINT_URL": proxy.endpoint}),
    ):
        yield proxy


def assert_clean(error: BaseException, where: str, server: S3Server) -> None:
    """One line naming the bucket, the operation and a key under ``where``; no secret."""
    text = str(error)
    assert "\n" not in text, text
    assert text.startswith("s3://distckpt: "), text
    assert any(f" {op} {where}" in text for op in ("read", "write", "upload", "create")), text
    assert server.env["AWS_SECRET_ACCESS_KEY"] not in text


def resume(proxy: FaultProxy) -> None:
    proxy.resume()
    assert s3_mod.answering(30), "the service did not answer again"


def values(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {"big": torch.randn(1600, 1000, generator=g), "b": torch.randn(7, generator=g)}


def put_under(prefix: str) -> Callable[[Request], bool]:
    """Whether a request writes under the checkpoint ``prefix``/ (its data)."""
    return lambda r: r.method in ("PUT", "POST") and f"/{prefix}/" in r.path


#: Where a save of ckpt-2 stops getting answers: at the first part of its multipart
#: upload (the parts go out from the I/O workers), or at its commit (the index, created
#: only if absent).
STALLS: dict[str, Callable[[Request], bool]] = {
    "part": lambda r: "/ckpt-2/" in r.path and "partNumber=" in r.query,
    "commit": lambda r: r.path.endswith("/ckpt-2/zarr.json") and "if-none-match" in r.headers,
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("at", sorted(STALLS))
def test_a_silent_service_fails_a_managed_save_in_time(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch, at: str
) -> None:
    """A CheckpointManager's save whose service stops answering: StorageError within the
    bound; ckpt-1, the pointer and the manager's lock unharmed; the next save, once the
    service answers, commits and moves the pointer."""
    monkeypatch.setattr(s3_mod, "PART_BYTES", 5 << 20)  # "big" is a 2-part upload
    run = f"{s3.url}/run"  # type: ignore[attr-defined]
    with silenceable(s3, monkeypatch) as proxy:
        state = values(1)
        ckpt = distckpt.Checkpoint(**state)
        with distckpt.CheckpointManager(ckpt, run, comm=COMM) as manager:
            assert manager.save(1) == f"{run}/ckpt-1"
            index = open_store(f"{run}/ckpt-1").read_versioned("zarr.json")
            pointer = open_store(run).read_versioned("latest")

            proxy.stall(after=STALLS[at])
            for name, tensor in values(2).items():
                state[name].copy_(tensor)
            t0 = time.monotonic()
            with pytest.raises(StorageError) as info:
                manager.save(2)
            took = time.monotonic() - t0
            assert proxy.stalled.is_set()
            assert took < BOUND, f"{took:.1f} s: {info.value}"
            assert_clean(info.value, f"{run}/ckpt-2/", s3)

            # The requests held meanwhile now reach the server, as after a SIGCONT: the
            # parts of ckpt-2, or its index (then ckpt-2 exists, but nothing points to it).
            resume(proxy)
            assert open_store(f"{run}/ckpt-1").read_versioned("zarr.json") == index
            assert open_store(run).read_versioned("latest") == pointer
            assert distckpt.latest_checkpoint(run) == f"{run}/ckpt-1"
            if at == "part":
                assert not index_mod.is_committed(f"{run}/ckpt-2")
            for name, tensor in values(3).items():
                state[name].copy_(tensor)
            assert manager.save(3) == f"{run}/ckpt-3"
        assert distckpt.latest_checkpoint(run) == f"{run}/ckpt-3"
        for i in (1, 3):
            got = {k: torch.zeros_like(v) for k, v in values(i).items()}
            distckpt.load(got, f"{run}/ckpt-{i}", COMM, strict=False)  # not save_counter
            assert all(torch.equal(got[k], v) for k, v in values(i).items())


@pytest.mark.timeout(120)
def test_a_silent_service_fails_a_load_ls_and_gc_in_time(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A load whose ranged reads get no answer, then ``distckpt ls`` from its first
    request on, then ``gc`` while the service is still silent (it fails at once)."""
    run = f"{s3.url}/run"  # type: ignore[attr-defined]
    url = f"{run}/ckpt-1"
    with silenceable(s3, monkeypatch) as proxy:
        distckpt.save(values(1), url, COMM)
        got = {k: torch.zeros_like(v) for k, v in values(1).items()}

        proxy.stall(after=lambda r: "range" in r.headers)  # the first chunk read
        t0 = time.monotonic()
        with pytest.raises(StorageError) as info:
            distckpt.load(got, url, COMM)
        took = time.monotonic() - t0
        assert proxy.stalled.is_set()
        assert took < BOUND, f"{took:.1f} s: {info.value}"
        assert_clean(info.value, f"{url}/", s3)
        assert " read " in str(info.value)
        resume(proxy)

        proxy.stall()
        t0 = time.monotonic()
        assert cli.main(["ls", run]) != 0
        assert cli.main(["gc", run]) != 0
        took = time.monotonic() - t0
        assert took < BOUND, f"{took:.1f} s"
        errors = capsys.readouterr().err.splitlines()
        assert [line.split(":", 1)[0] for line in errors] == ["distckpt ls", "distckpt gc"]
        assert all("s3://distckpt" in line for line in errors), errors
        assert s3.env["AWS_SECRET_ACCESS_KEY"] not in "".join(errors)
        resume(proxy)

        distckpt.load(got, url, COMM)
        assert all(torch.equal(got[k], v) for k, v in values(1).items())
        assert cli.main(["ls", run]) == 0


@pytest.mark.timeout(60)
def test_a_renewal_that_lands_late_keeps_the_lease(s3: S3Server) -> None:
    """A renewal that got no answer but reached the store later (as queued requests do
    once a stopped server continues) leaves our token there: the lease adopts that
    version instead of taking itself for taken over."""
    store = open_store(s3.url)  # type: ignore[attr-defined]
    lease = Lease(store, "lease", "token-1", heartbeat_seconds=0.02)
    lease.acquire(lambda info, age: RuntimeError("busy"))
    try:
        late = {**json.loads(store.read("lease")), "beat": 1.0}
        store.write("lease", reseal(json.dumps(late).encode()))  # not the version the lease holds
        deadline = time.monotonic() + 30
        while json.loads(store.read("lease"))["beat"] == 1.0:  # until a renewal replaced it
            assert not lease.lost and time.monotonic() < deadline
            time.sleep(0.02)
        assert not lease.lost and lease.ours()
    finally:
        lease.release()
    assert not store.exists("lease")


@pytest.mark.timeout(180)
def test_a_stopped_server_fails_every_rank_with_storage_error(s3: S3Server) -> None:
    """2 ranks under torchrun; the moto server is stopped (SIGSTOP) when the first data
    object of their second save reaches it. Every rank raises StorageError (not
    CommTimeoutError, which would come after DISTCKPT_TIMEOUT) within the bound; rank 0
    continues the server, and the next save commits."""
    run = f"{s3.url}/run"  # type: ignore[attr-defined]
    stopped: list[Request] = []

    def observe(request: Request) -> None:
        if not stopped and put_under("ckpt-2")(request):
            stopped.append(request)
            s3.pause()

    env = {
        **s3.env,
        s3_mod.TIMEOUT_ENV: str(TIMEOUT),
        "DISTCKPT_TIMEOUT": "90",
        "MOTO_PID": str(s3.pid),
    }
    try:
        with FaultProxy(s3.endpoint, observe=observe) as proxy:
            env["AWS_ENDPOINT_URL"] = proxy.endpoint
            proc = run_ranks(2, SCRIPTS / "s3_silent.py", run, timeout=150, env=env)
    finally:
        s3.resume()
    assert stopped, output(proc)
    assert_all_ok(proc, 2)
    found = cases(proc)["silent-save"]
    assert sorted(found) == [0, 1], output(proc)
    for rank, record in found.items():
        assert record["type"] == "StorageError", (rank, record)
        assert record["took"] < BOUND, (rank, record)
        assert record["message"].startswith("s3://distckpt: "), record
        assert "\n" not in record["message"]
        assert s3.env["AWS_SECRET_ACCESS_KEY"] not in record["message"]
    with use(s3.env):
        assert distckpt.latest_checkpoint(run) == f"{run}/ckpt-3"
        assert not index_mod.is_committed(f"{run}/ckpt-2")


@pytest.mark.parametrize("backend", OBJECT_STORES, indirect=True)
def test_a_stopped_service_fails_a_save_within_the_deadline(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service itself stopped (``SIGSTOP``), in one process: a save raises
    StorageError naming the location within the deadline, and a later save commits
    once it answers again (on S3 once ``answering()`` says so)."""
    monkeypatch.setenv("DISTCKPT_S3_TIMEOUT", "4")
    state = {"w": torch.arange(1000.0)}
    scheme = backend.url.split("://", 1)[0]
    backend.server.pause()
    try:
        began = time.monotonic()
        with pytest.raises(StorageError, match=rf"{scheme}://distckpt/"):
            distckpt.save(state, f"{backend.url}/a", COMM)
        assert time.monotonic() - began < 30
    finally:
        backend.server.resume()
    if backend.name == "s3":  # S3 requests fail at once until the library sees an answer
        assert s3_mod.answering(30), "the service did not answer again"
    distckpt.save(state, f"{backend.url}/b", COMM)
    got = {"w": torch.zeros(1000)}
    distckpt.load(got, f"{backend.url}/b", COMM)
    assert torch.equal(got["w"], state["w"])
