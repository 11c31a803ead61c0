"""The storage seam (:mod:`distckpt.storage.backend`): the shipped conformance suite
(:class:`distckpt.testing.StoreTests`) run on a directory (PosixStore) and on a prefix of
a real S3-compatible server (S3Store on moto's server, 127.0.0.1, with faults injected
between the client and the server by tests/support/fault_proxy.py); then what only S3 does
(multipart uploads, errors that name the bucket and never a credential, saves and loads
under throttling answers and connections dropped before the server saw a request or
after it did the work), and what the seam itself decides: URL schemes, capabilities
asked before a save, the commit strategy a store declares.
"""

from __future__ import annotations

import contextlib
import random
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import distckpt
from distckpt.comm import SingleComm
from distckpt.commit import transaction
from distckpt.commit.claim import CLAIM
from distckpt.commit.lease import Lease
from distckpt.commit.staging import RENAME
from distckpt.errors import CheckpointNotFoundError, StorageError
from distckpt.storage import beneath, registry, s3_service
from distckpt.storage import s3 as s3_mod
from distckpt.storage.backend import Capabilities, ConditionFailed, Store
from distckpt.storage.posix import PosixStore
from distckpt.storage.registry import is_remote, location, open_store
from distckpt.storage.s3 import S3Store
from distckpt.testing import MiB, StoreTests, payload
from tests.storage.multipart import MultipartTests
from tests.support.fault_proxy import FaultProxy, Request
from tests.support.launch_util import job_env
from tests.support.make_golden import assert_same_bits, assert_same_value
from tests.support.s3_server import S3Server, use

COMM = SingleComm()

_admin: dict[str, Any] = {}


def admin(server: S3Server) -> Any:
    """A client of ``server`` of the test's own (made once: making one takes a while)."""
    if server.endpoint not in _admin:
        _admin[server.endpoint] = server.client()
    return _admin[server.endpoint]


def pending_uploads(server: S3Server, prefix: str) -> list[str]:
    """Keys of the multipart uploads started and neither completed nor aborted."""
    response = admin(server).list_multipart_uploads(Bucket="distckpt", Prefix=prefix)
    return sorted(u["Key"] for u in response.get("Uploads", ()))


# -- the conformance suite, on the repository's backends ------------------------------


class TestPosixStore(StoreTests):
    capabilities = PosixStore.capabilities

    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return PosixStore(tmp_path / "store")


class TestPosixStoreWithoutOpenat2(TestPosixStore):
    """Where the kernel (or a seccomp filter) refuses openat2, paths are walked one
    directory descriptor at a time: the same store."""

    @pytest.fixture
    def store(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
        monkeypatch.setattr(beneath, "openat2", None)
        return PosixStore(tmp_path / "store")


class TestS3Store(MultipartTests, StoreTests):
    capabilities = S3Store.capabilities

    @pytest.fixture
    def store(self, s3: S3Server, monkeypatch: pytest.MonkeyPatch, fast_retries: None) -> Store:
        monkeypatch.setattr(s3_mod, "PART_BYTES", 5 * MiB)  # multipart from 5 MiB on
        self.server = s3
        return S3Store.from_url(s3.url)  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def _faults(self) -> Iterator[Callable[[], int]]:
        with faulty(self.server, seed=7, error=0.1, drop_before=0.05, drop_after=0.05) as proxy:
            yield lambda: proxy.faults

    def faults(self, store: Store) -> contextlib.AbstractContextManager[Callable[[], int]]:
        return self._faults()

    # What only S3 does: multipart uploads.

    def check_upload(self, store: S3Store, handle: Any, size: int) -> None:
        assert pending_uploads(self.server, store.prefix) == []
        key = f"{store.prefix}/x/piece.bin"
        etag = admin(self.server).head_object(Bucket="distckpt", Key=key)["ETag"]
        parts = -(-size // (5 * MiB))
        # one PUT when it fits in one part and no part was sent early, else multipart
        assert etag.strip('"').endswith(f"-{parts}") == (size >= 5 * MiB), etag
        if size >= 5 * MiB:
            # What accepts an upload completed with its answer lost (a retry then finds
            # it gone): the ETag computed from the parts is the server's.
            etags = [handle._sent[k] for k in sorted(handle._sent)]  # type: ignore[attr-defined]
            assert s3_mod.multipart_etag(etags) == etag
            assert store.landed(key, etags, size)
            assert not store.landed(key, etags, size + 1)
            assert not store.landed(key, etags[:-1], size)

    def test_abort_leaves_no_upload(self, store: S3Store) -> None:
        data = payload(6 * MiB, seed=11)
        handle = store.create("y/piece.bin", size_hint=len(data))
        handle.write([data[: 5 * MiB]], 0)  # a whole part: uploaded now
        handle.write([data[5 * MiB + 10 :]], 5 * MiB + 10)
        assert pending_uploads(self.server, store.prefix) == [f"{store.prefix}/y/piece.bin"]
        handle.abort()
        assert pending_uploads(self.server, store.prefix) == []
        assert not store.exists("y/piece.bin")


# -- what the seam decides --------------------------------------------------------------


class _Declares(PosixStore):
    """A directory store that declares what a test says (and commits as it says)."""

    capabilities = PosixStore.capabilities
    commit_strategy = "rename"

    def child(self, key: str) -> PosixStore:
        found = super().child(key)
        return found if found is self else type(self)(found.path)

    @property
    def parent(self) -> PosixStore:
        return type(self)(self.path.parent)


def declaring(strategy: Any = RENAME, **flags: bool) -> type[PosixStore]:
    caps = Capabilities(**{**vars(PosixStore.capabilities), **flags})
    return type("Declares", (_Declares,), {"capabilities": caps, "commit_strategy": strategy})


def test_a_save_asks_the_store_before_a_byte_is_written(tmp_path: Path) -> None:
    state = {"w": torch.arange(6.0)}
    cases: list[tuple[type[PosixStore], str]] = [
        (declaring(parallel_writes=False), "parallel_writes"),
        (declaring(renames=False), "commit by rename.*renames"),
        (declaring(CLAIM, conditional_update=False), "commit by claim.*conditional_update"),
    ]
    for cls, words in cases:
        store = cls(tmp_path / "run" / "ck")
        with pytest.raises(StorageError, match=words) as info:
            distckpt.save(state, store, COMM)
        assert store.url in str(info.value)
        assert not (tmp_path / "run").exists() or list((tmp_path / "run").iterdir()) == []
    lease = Lease(declaring(conditional_create=False)(tmp_path / "run"), "lock", "token")
    with pytest.raises(StorageError, match="lease lock.*conditional_create"):
        lease.acquire(lambda info, age: AssertionError("busy"))


def test_the_commit_is_the_stores_not_its_types(tmp_path: Path) -> None:
    """A directory store that declares the claim strategy saves, loads, lists, retires and
    collects as an object store does: the index last, no staging directory, a claim
    beside the name while it saves."""
    store = declaring(CLAIM)(tmp_path / "run")
    assert (
        transaction.strategy(store) is CLAIM
        and transaction.strategy(PosixStore(tmp_path)) is RENAME
    )
    final = store.child("ck")
    assert transaction.save_root(final, "0123abcd") == final
    txn = transaction.begin(final, "0123abcd", 1, overwrite=False)
    assert store.list() == [".ck.distckpt-save"]
    assert transaction.leftovers(store) == [store.where("ck")]
    txn.abort()
    assert store.list() == [] and transaction.pending(store) == []
    want = torch.arange(12.0).reshape(3, 4)
    distckpt.save({"w": want}, final, COMM)
    assert sorted(store.list()) == ["ck"]
    got = {"w": torch.zeros(3, 4)}
    distckpt.load(got, final, COMM)
    assert_same_bits(got["w"], want, "w")
    transaction.retire(final)
    assert store.list() == [] and not transaction.retiring(final)
    # and the rename strategy on the same directory: a staging directory beside the name
    renamed = declaring(RENAME)(tmp_path / "run")
    assert transaction.save_root(renamed.child("ck"), "0123abcd").name == ".ck.staging-0123abcd"


NO_PYTEST = """
import importlib, pkgutil, sys
sys.modules["pytest"] = None  # any import of it fails
import distckpt
for module in pkgutil.walk_packages(distckpt.__path__, "distckpt."):
    if not module.name.startswith(("distckpt.testing", "distckpt.__main__")):
        importlib.import_module(module.name)
try:
    import distckpt.testing
except ImportError as exc:
    print("TESTING NEEDS", exc)
"""


def test_only_the_shipped_suite_needs_pytest() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", NO_PYTEST],
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    assert "TESTING NEEDS" in proc.stdout and "pytest" in proc.stdout, proc.stdout


# -- locations -----------------------------------------------------------------------


def test_resolve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store("s3://bucket/a/b/")
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, store.url) == ("bucket", "a/b", "s3://bucket/a/b")
    assert store.name == "b" and store.parent == S3Store("bucket", "a")
    root = open_store("s3://bucket")
    assert isinstance(root, S3Store)
    assert (root.bucket, root.prefix, root.url) == ("bucket", "", "s3://bucket")
    assert root.name == "bucket"
    assert root.where("k") == "s3://bucket/k"
    assert S3Store.from_url("s3://bucket/a//b") == S3Store("bucket", "a//b")
    for bad in ("s3://", "s3:///prefix"):
        with pytest.raises(ValueError, match="no bucket"):
            S3Store.from_url(bad)
        with pytest.raises(ValueError, match="no bucket"):
            open_store(bad)
    with pytest.raises(ValueError, match=r"unsupported storage scheme 'hdfs' \(known: .*gs://"):
        open_store("hdfs://bucket/x")
    local = open_store(tmp_path / "d")
    assert isinstance(local, PosixStore) and local.path == tmp_path / "d"
    assert open_store(str(tmp_path / "d")) == local
    assert open_store(f"file://{tmp_path}/d") == local
    assert location(local) == tmp_path / "d" and location(store) == "s3://bucket/a/b"
    monkeypatch.chdir(tmp_path)
    relative = open_store("rel/dir")
    assert isinstance(relative, PosixStore) and relative.path == tmp_path / "rel" / "dir"
    assert relative.path.is_absolute()
    assert not is_remote(tmp_path) and not is_remote(str(tmp_path)) and is_remote("s3://b/p")


def test_register_store_in_process(tmp_path: Path) -> None:
    """A scheme registered for one process; whether it is remote is the store's to say."""

    def opener(url: str) -> PosixStore:
        return PosixStore(tmp_path / url.removeprefix("here://"))

    registry.register_store("here", opener)
    try:
        assert open_store("here://a/b") == PosixStore(tmp_path / "a" / "b")
        assert not is_remote("here://a")  # a directory, whatever its scheme
        assert registry.child_location("here://a", "b") == str(tmp_path / "a" / "b")
    finally:
        registry._openers.pop("here")
    with pytest.raises(ValueError, match="unsupported storage scheme 'here'.*s3://"):
        open_store("here://a")
    for bad in ("file", "no-dash", ""):
        with pytest.raises(ValueError, match="bad storage scheme"):
            registry.register_store(bad, opener)


def _assert_clean_error(exc: BaseException, *words: str, secret: str) -> None:
    """``exc`` names each of ``words`` and no credential, in its message and traceback."""
    assert isinstance(exc, StorageError), repr(exc)
    text = str(exc)
    for word in words:
        assert word in text, f"{word!r} not in {text!r}"
    shown = "".join(traceback.format_exception(exc)) + repr(exc)
    assert secret not in shown


def test_missing_bucket(s3: S3Server) -> None:
    secret = s3.env["AWS_SECRET_ACCESS_KEY"]
    store = S3Store("no-such-bucket-distckpt", "run/ckpt")
    ops: list[tuple[str, Callable[[], object]]] = [
        ("read", lambda: store.read("k")),
        ("write", lambda: store.write("k", b"1")),
        ("create", lambda: store.put_new("k", b"1")),
        ("list", lambda: store.list()),
        ("list", lambda: store.walk()),
        ("read", lambda: store.open("k", size=10).read(0, 10)),
    ]
    for op, fn in ops:
        t0 = time.monotonic()
        with pytest.raises(StorageError) as info:
            fn()
        assert time.monotonic() - t0 < 10, f"{op}: not retried as a transient failure"
        _assert_clean_error(
            info.value, "s3://no-such-bucket-distckpt", op, "no such bucket", secret=secret
        )
    handle = store.create("piece")
    handle.write([b"abc"], 0)
    with pytest.raises(StorageError) as info:
        handle.finish()
    _assert_clean_error(info.value, "no-such-bucket-distckpt", "write", secret=secret)


@contextlib.contextmanager
def _auth_enforced(server: S3Server) -> Iterator[None]:
    """moto checks credentials (it knows none of ours) until the block ends."""

    def post(value: bytes) -> None:
        req = urllib.request.Request(
            f"{server.endpoint}/moto-api/reset-auth",
            data=value,
            method="POST",
            headers={"Content-Type": "text/plain"},  # not a form: moto reads the raw body
        )
        urllib.request.urlopen(req, timeout=10).close()

    post(b"0")
    try:
        yield
    finally:
        post(b"inf")


def test_bad_credentials(s3: S3Server) -> None:
    secret = s3.env["AWS_SECRET_ACCESS_KEY"]
    store = S3Store.from_url(s3.url)  # type: ignore[attr-defined]
    store.write("k", b"before")
    with _auth_enforced(s3):
        for op, fn in [
            ("read", lambda: store.read("k")),
            ("write", lambda: store.write("k", b"2")),
            ("list", lambda: store.list()),
            ("replace", lambda: store.put_if("k", b"3", "v")),
        ]:
            with pytest.raises(StorageError) as info:
                fn()
            _assert_clean_error(info.value, "s3://distckpt", op, "not valid", secret=secret)
    assert store.read("k") == b"before"


def test_no_credentials(s3: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(s3_service, "_clients", {})  # a client made now, without credentials
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    store = S3Store.from_url(s3.url)  # type: ignore[attr-defined]
    with pytest.raises(StorageError) as info:
        store.read("k")
    _assert_clean_error(info.value, "s3://distckpt", "no AWS credentials", secret="testing")


# -- faults between the client and the server ----------------------------------------


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore's retries with milliseconds of backoff instead of seconds (the faults are
    the point here, not the waiting)."""
    from botocore.retries import standard

    def delay(self: object, context: Any) -> float:
        return 0.005 * random.random() * 2 ** min(context.attempt_number, 6)

    monkeypatch.setattr(standard.ExponentialBackoff, "delay_amount", delay)


@contextlib.contextmanager
def faulty(server: S3Server, **faults: Any) -> Iterator[FaultProxy]:
    """A fault proxy in front of ``server``, and this process's endpoint pointing at it."""
    with (
        FaultProxy(server.endpoint, **faults) as proxy,
        use({**server.env, "AWS_ENDPOINT_URL": proxy.endpoint}),
    ):
        yield proxy


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "big": torch.randn(1600, 1000, generator=g),  # 6.4 MB: two parts of 5 MiB
            "half": torch.randn(700, 1000, generator=g).to(torch.bfloat16),
            "ids": torch.randint(0, 2**62, (5000,), generator=g),
            "tiny": torch.tensor([seed, -0.0, float("inf")]),
        },
        "step": seed,
        "name": f"run-{seed}",
    }


def _targets(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "step": None,
        "name": None,
    }


def _assert_loads(url: str, want: dict[str, Any]) -> None:
    got = _targets(want)
    distckpt.load(got, url, COMM)
    for k, v in want["model"].items():
        assert_same_bits(got["model"][k], v, k)
    assert_same_value(got["step"], want["step"])
    assert_same_value(got["name"], want["name"])


@pytest.mark.usefixtures("fast_retries")
def test_proxy_relays(s3: S3Server) -> None:
    """The proxy itself: it relays requests and answers untouched, and counts."""
    store = S3Store.from_url(s3.url)  # type: ignore[attr-defined]
    data = payload(2 * MiB, seed=2)
    with faulty(s3, seed=0) as proxy:
        store.write("k", data)
        assert store.read("k") == data
        with store.open("k") as handle:
            assert handle.read(MiB, 10) == data[MiB : MiB + 10]
        assert store.list() == ["k"]
        assert not store.exists("nope")  # no object, nor a prefix: a HEAD and a listing
        assert proxy.faults == 0
        assert proxy.counts["forward"] == 6
        assert [(m, k) for m, _, k in proxy.log] == [
            ("PUT", "forward"),
            ("GET", "forward"),
            ("GET", "forward"),
            ("GET", "forward"),
            ("HEAD", "forward"),
            ("GET", "forward"),
        ]
        proxy.set(error=1.0)
        t0 = time.monotonic()
        with pytest.raises(StorageError, match="SlowDown"):
            store.read("k")
        assert proxy.counts["error"] == s3_mod.MAX_ATTEMPTS
        assert time.monotonic() - t0 < 30
        proxy.set(error=0.0, drop_before=1.0, limit=2)  # two drops, then calm
        assert store.read("k") == data
        assert proxy.counts["drop_before"] == 2
        proxy.calm()
        assert store.read("k") == data


@pytest.mark.usefixtures("fast_retries")
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("seed", "rates"),
    [(1, (0.1, 0.05, 0.05)), (2, (0.05, 0.05, 0.15))],
    ids=["throttled", "answers-lost"],
)
def test_save_load_under_faults(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch, seed: int, rates: tuple[float, float, float]
) -> None:
    monkeypatch.setattr(s3_mod, "PART_BYTES", 5 * MiB)
    run = s3.url  # type: ignore[attr-defined]
    before, after, other = _state(10 * seed), _state(10 * seed + 1), _state(10 * seed + 2)
    distckpt.save(before, f"{run}/ckpt-1", COMM)  # committed before any fault
    distckpt.save(before, f"{run}/ckpt-2", COMM)
    error, drop_before, drop_after = rates
    outcomes: dict[str, bool] = {}
    with faulty(
        s3, seed=seed, error=error, drop_before=drop_before, drop_after=drop_after
    ) as proxy:
        for name, state, overwrite in (
            ("ckpt-3", other, False),  # a new checkpoint
            ("ckpt-2", after, True),  # replacing a committed one
        ):
            try:
                distckpt.save(state, f"{run}/{name}", COMM, overwrite=overwrite)
                outcomes[name] = True
            except StorageError:  # failing cleanly is allowed; corrupting is not
                outcomes[name] = False
        # loads under faults: whole and exact, or a clean failure
        with contextlib.suppress(StorageError):
            _assert_loads(f"{run}/ckpt-1", before)
        if outcomes["ckpt-3"]:
            with contextlib.suppress(StorageError):
                _assert_loads(f"{run}/ckpt-3", other)
        assert proxy.faults > 0, proxy.counts
        assert any("uploads" in target for _, target, _ in proxy.log)  # multipart was used
    _assert_loads(f"{run}/ckpt-1", before)
    if outcomes["ckpt-3"]:
        _assert_loads(f"{run}/ckpt-3", other)
    else:
        with pytest.raises(CheckpointNotFoundError):
            _assert_loads(f"{run}/ckpt-3", other)
    if outcomes["ckpt-2"]:
        _assert_loads(f"{run}/ckpt-2", after)
    else:  # an object store withdraws the old one first: the old one, or none, never a mix
        with contextlib.suppress(CheckpointNotFoundError):
            _assert_loads(f"{run}/ckpt-2", before)


def _conditional_create(request: Request) -> bool:
    return request.method == "PUT" and "if-none-match" in request.headers


def test_conditional_create_answer_lost(s3: S3Server) -> None:
    store = S3Store.from_url(s3.url)  # type: ignore[attr-defined]
    with faulty(s3, drop_after=1.0, when=_conditional_create, limit=1) as proxy:
        version = store.put_new("claim", b"ours")
        assert proxy.counts["drop_after"] == 1
        # the first try landed; its retry failed the condition; the bytes are ours
        puts = [kind for method, _, kind in proxy.log if method == "PUT"]
        assert puts == ["drop_after", "forward"]
        assert store.read_versioned("claim") == (b"ours", version)
        # a real conflict is still one
        with pytest.raises(ConditionFailed):
            store.put_new("claim", b"theirs")
        # the same for a replace whose answer was lost
        proxy.set(
            drop_after=1.0,
            when=lambda r: r.method == "PUT" and "if-match" in r.headers,
            limit=1,
        )
        new = store.put_if("claim", b"ours, renewed", version)
        assert proxy.counts["drop_after"] == 2
        assert store.read_versioned("claim") == (b"ours, renewed", new)
        with pytest.raises(ConditionFailed):
            store.put_if("claim", b"stale", version)


@pytest.mark.usefixtures("fast_retries")
def test_save_commit_answer_lost(s3: S3Server) -> None:
    """Every conditional create of a save (its claim, its commit) loses its first answer."""
    state = _state(5)
    url = f"{s3.url}/ckpt"  # type: ignore[attr-defined]
    seen: set[str] = set()

    def first_time(request: Request) -> bool:
        if not _conditional_create(request) or request.path in seen:
            return False
        seen.add(request.path)
        return True

    with faulty(s3, drop_after=1.0, when=first_time) as proxy:
        distckpt.save(state, url, COMM)
        assert proxy.counts["drop_after"] >= 1
    _assert_loads(url, state)


def test_missing_bucket_save_fails_fast(s3: S3Server) -> None:
    state = _state(3)
    with faulty(s3, seed=3, error=0.0) as proxy:
        t0 = time.monotonic()
        with pytest.raises(StorageError, match="no-such-bucket-distckpt") as info:
            distckpt.save(state, "s3://no-such-bucket-distckpt/run/ckpt", COMM)
        with pytest.raises(StorageError, match="no such bucket"):
            distckpt.load(_targets(state), "s3://no-such-bucket-distckpt/run/ckpt", COMM)
        assert time.monotonic() - t0 < 15
        assert s3.env["AWS_SECRET_ACCESS_KEY"] not in str(info.value)
        assert proxy.counts["forward"] < 10  # not retried


def test_fault_proxy_framing() -> None:
    """The proxy parses chunked bodies and answers 100-continue (not used by botocore
    for bytes bodies, so tested here on a raw socket)."""
    import socket
    import socketserver

    got: list[bytes] = []

    class Echo(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            from tests.support.fault_proxy import read_request

            while True:
                try:
                    request = read_request(self.rfile)
                except Exception:
                    return
                got.append(request.raw)
                body = b"ok " + request.method.encode()
                self.wfile.write(
                    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                    + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
                )

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with FaultProxy(f"http://127.0.0.1:{server.server_address[1]}") as proxy:
            port = int(proxy.endpoint.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                f = sock.makefile("rb")
                sock.sendall(
                    b"PUT /b/k HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                    b"3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\nx-trailer: 1\r\n\r\n"
                )
                assert f.readline() == b"HTTP/1.1 200 OK\r\n"
                assert f.readline() == b"Transfer-Encoding: chunked\r\n"
                assert f.readline() == b"\r\n"
                assert f.readline() == b"6\r\n" and f.readline() == b"ok PUT\r\n"
                assert f.readline() == b"0\r\n" and f.readline() == b"\r\n"
                sock.sendall(
                    b"PUT /b/k2 HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                    b"Content-Length: 4\r\n\r\n"
                )
                assert f.readline() == b"HTTP/1.1 100 Continue\r\n" and f.readline() == b"\r\n"
                sock.sendall(b"wxyz")
                assert f.readline() == b"HTTP/1.1 200 OK\r\n"
            assert proxy.counts["forward"] == 2
        assert got[0].endswith(b"3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\nx-trailer: 1\r\n\r\n")
        assert b"expect" not in got[1].lower() and got[1].endswith(b"\r\n\r\nwxyz")
    finally:
        server.shutdown()
        server.server_close()
