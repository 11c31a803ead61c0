"""The storage seam (:mod:`distckpt.storage.backend`): one conformance suite that every
backend passes, run on a directory (PosixStore) and on a prefix of a real S3-compatible
server (S3Store on moto's server, 127.0.0.1), then S3-only cases: multipart uploads
written out of order, errors that name the bucket and never a credential, and faults
injected between the client and the server (tests/fault_proxy.py): throttling answers,
connections dropped before the server saw a request and after it did the work.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import random
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fault_proxy import FaultProxy, Request
from launch_util import check, finish, job_env, output, start
from make_golden import assert_same_bits, assert_same_value
from s3_server import S3Server, use

import distckpt
from distckpt.comm import SingleComm
from distckpt.errors import CheckpointNotFoundError, StorageError
from distckpt.storage import backend, s3_service
from distckpt.storage import s3 as s3_mod
from distckpt.storage.backend import (
    ConditionFailed,
    ReadHandle,
    Store,
    WriteHandle,
    is_remote,
    location,
    resolve,
)
from distckpt.storage.posix import PosixStore
from distckpt.storage.s3 import S3Store

MiB = 1 << 20
COMM = SingleComm()


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


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


def write_out_of_order(
    handle: WriteHandle, data: bytes, rng: random.Random, threads: int = 4
) -> None:
    """Write ``data`` through ``handle`` in random pieces, in random order, from
    ``threads`` threads; some writes are several buffers of several kinds."""
    pieces: list[tuple[int, int]] = []
    at = 0
    while at < len(data):
        n = min(len(data) - at, rng.randint(1, 3 * MiB // 2))
        pieces.append((at, n))
        at += n
    rng.shuffle(pieces)

    def one(piece: tuple[int, int]) -> int:
        start, n = piece
        cut = sorted({start, start + n, *(rng.randint(start, start + n) for _ in range(2))})
        buffers: list[Any] = []
        for k, (a, b) in enumerate(zip(cut, cut[1:])):
            chunk = data[a:b]
            kind = k % 3
            buffers.append(
                chunk
                if kind == 0
                else np.frombuffer(chunk, dtype=np.uint8).copy()
                if kind == 1
                else memoryview(bytearray(chunk))
            )
        return handle.write(buffers, start)

    with ThreadPoolExecutor(threads) as pool:
        written = list(pool.map(one, pieces))
    assert written == [n for _, n in pieces]


# -- the conformance suite -------------------------------------------------------------


class TestStore:
    """What every :class:`~distckpt.storage.backend.Store` does, backend by backend."""

    @pytest.fixture(params=["posix", "s3"])
    def store(self, request: pytest.FixtureRequest, tmp_path: Path) -> Store:
        if request.param == "posix":
            return PosixStore(tmp_path / "store")
        server: S3Server = request.getfixturevalue("s3")
        return S3Store.from_url(server.url)  # type: ignore[attr-defined]

    def test_protocols(self, store: Store) -> None:
        assert isinstance(store, Store)
        assert isinstance(store.create("k"), WriteHandle)
        store.write("k", b"x")
        with store.open("k") as handle:
            assert isinstance(handle, ReadHandle)
        assert is_remote(store) == isinstance(store, S3Store)
        assert is_remote(store.url) == isinstance(store, S3Store)

    def test_round_trip(self, store: Store) -> None:
        data = payload(100_000, seed=1)
        assert not store.exists("a/b/c.bin")
        store.write("a/b/c.bin", data)
        assert store.exists("a/b/c.bin")
        assert store.read("a/b/c.bin") == data
        # any buffer: bytes, bytearray, memoryview, ndarray; replacing
        words = np.arange(5, dtype="<u4")
        buffers: list[tuple[Any, bytes]] = [
            (bytearray(b"one"), b"one"),
            (memoryview(b"two"), b"two"),
            (words, words.tobytes()),
            (b"", b""),
        ]
        for buf, want in buffers:
            store.write("a/b/c.bin", buf)
            assert store.read("a/b/c.bin") == want
        assert store.read_versioned("a/b/c.bin")[0] == b""

    def test_missing(self, store: Store) -> None:
        store.write("there", b"1")
        for fn in (
            lambda: store.read("nope"),
            lambda: store.read_versioned("nope"),
            lambda: store.age("nope"),
            lambda: store.read("dir/nope"),
        ):
            with pytest.raises(FileNotFoundError):
                fn()
        with pytest.raises(FileNotFoundError), store.open("nope") as handle:
            handle.read(0, 1)  # raised when opened, or at the first read
        assert not store.exists("nope")
        assert store.list("nope") == []
        assert store.walk("nope") == []
        assert not store.is_dir("nope")
        store.delete("nope")
        store.delete_tree("nope")
        assert store.read("there") == b"1"

    def test_put_new(self, store: Store) -> None:
        version = store.put_new("d/lock", b"first")
        assert isinstance(version, str) and version
        assert store.read_versioned("d/lock") == (b"first", version)
        with pytest.raises(ConditionFailed) as info:
            store.put_new("d/lock", b"second")
        assert isinstance(info.value, FileExistsError)
        assert store.read_versioned("d/lock") == (b"first", version)
        # an object written plainly counts as present too
        store.write("d/plain", b"p")
        with pytest.raises(ConditionFailed):
            store.put_new("d/plain", b"q")
        assert store.read("d/plain") == b"p"

    def test_put_new_race_threads(self, store: Store) -> None:
        for trial in range(3):
            key = f"race/{trial}"
            gate = threading.Barrier(8)
            won: list[int] = []

            def one(
                i: int, key: str = key, gate: threading.Barrier = gate, won: list[int] = won
            ) -> None:
                gate.wait()
                try:
                    store.put_new(key, f"writer {i}".encode())
                except ConditionFailed:
                    return
                won.append(i)

            with ThreadPoolExecutor(8) as pool:
                list(pool.map(one, range(8)))
            assert len(won) == 1, won
            assert store.read(key) == f"writer {won[0]}".encode()

    @pytest.mark.timeout(120)
    def test_put_new_race_processes(self, store: Store) -> None:
        ctx = multiprocessing.get_context("fork")
        gate = ctx.Barrier(4)
        results = ctx.Queue()
        procs = [
            ctx.Process(target=_race_put_new, args=(store.url, i, gate, results)) for i in range(4)
        ]
        for p in procs:
            p.start()
        outcomes = sorted(results.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        winners = [i for i, outcome in outcomes if outcome == "won"]
        assert len(winners) == 1, outcomes
        assert [o for _, o in outcomes].count("lost") == 3, outcomes
        assert store.read("claim") == f"process {winners[0]}".encode()

    def test_put_if(self, store: Store) -> None:
        v1 = store.put_new("lease", b"one")
        v2 = store.put_if("lease", b"two", v1)
        assert v2 != v1
        assert store.read_versioned("lease") == (b"two", v2)
        with pytest.raises(ConditionFailed):
            store.put_if("lease", b"three", v1)  # a version that is gone
        assert store.read_versioned("lease") == (b"two", v2)
        store.write("lease", b"changed behind our back")
        with pytest.raises(ConditionFailed):
            store.put_if("lease", b"four", v2)
        assert store.read("lease") == b"changed behind our back"
        with pytest.raises(ConditionFailed):
            store.put_if("absent", b"five", v2)  # replacing what is not there
        assert not store.exists("absent")
        _, v3 = store.read_versioned("lease")
        assert store.put_if("lease", b"six", v3) == store.read_versioned("lease")[1]

    def test_versions_change(self, store: Store) -> None:
        store.write("v", b"alpha")
        data1, v1 = store.read_versioned("v")
        store.write("v", b"beta")
        data2, v2 = store.read_versioned("v")
        assert (data1, data2) == (b"alpha", b"beta")
        assert v1 != v2
        store.write("v", b"gamma")
        assert store.read_versioned("v")[1] not in (v1, v2)

    def _tree(self, store: Store) -> dict[str, bytes]:
        tree = {
            "a": b"A",
            "b/c": b"BC" * 10,
            "b/d/e": b"",
            "c/x/y": payload(3000, seed=3),
            "z.json": b"{}",
        }
        for key, data in tree.items():
            store.write(key, data)
        return tree

    def test_list(self, store: Store) -> None:
        assert store.list() == []
        self._tree(store)
        assert store.list() == ["a", "b", "c", "z.json"]
        assert store.list("") == store.list()
        assert store.list("b") == ["c", "d"]
        assert store.list("b/") == ["c", "d"]
        assert store.list("b/d") == ["e"]
        assert store.list("c") == ["x"]
        assert store.list("a") == []  # an object, not a directory
        assert store.list("zz") == []

    def test_walk(self, store: Store) -> None:
        tree = self._tree(store)
        t0 = time.time()
        found = store.walk()
        assert sorted((k, n) for k, n, _ in found) == sorted((k, len(v)) for k, v in tree.items())
        assert all(abs(t0 - mtime) < 120 for _, _, mtime in found)
        assert sorted((k, n) for k, n, _ in store.walk("b")) == [("c", 20), ("d/e", 0)]
        assert sorted(k for k, _, _ in store.walk("c/x")) == ["y"]

    def test_is_dir(self, store: Store) -> None:
        self._tree(store)
        assert store.is_dir("")
        assert store.is_dir("b")
        assert store.is_dir("b/d")
        assert store.is_dir("c/x")
        assert not store.is_dir("a")
        assert not store.is_dir("b/c")
        assert not store.is_dir("nope")

    def test_delete(self, store: Store) -> None:
        tree = self._tree(store)
        store.delete("a")
        assert not store.exists("a")
        store.delete("a")  # absent: nothing happens
        store.delete_tree("b")
        assert not store.is_dir("b")
        assert not store.exists("b/c")
        assert sorted(k for k, _, _ in store.walk()) == ["c/x/y", "z.json"]
        store.delete_tree("b")
        store.delete_tree("nowhere")
        assert store.read("c/x/y") == tree["c/x/y"]
        store.delete_tree()
        assert store.walk() == []
        assert store.list() == []

    def test_age(self, store: Store) -> None:
        store.write("fresh", b"1")
        age = store.age("fresh")
        assert -2.0 < age < 60.0  # object stores keep whole seconds

    def test_names(self, store: Store) -> None:
        store.write("runs/ckpt-1/index.json", b"{}")
        child = store.child("runs").child("ckpt-1")
        assert child == store.child("runs/ckpt-1")
        assert child.name == "ckpt-1"
        assert child.parent == store.child("runs")
        assert child.parent.parent.url == store.url
        assert child.url == store.url + "/runs/ckpt-1"
        assert store.child("") == store
        assert store.where("runs/x") == store.url + "/runs/x"
        assert child.read("index.json") == b"{}"
        assert child.list() == ["index.json"]
        assert store.list("runs") == ["ckpt-1"]
        assert resolve(child.url) == child
        assert resolve(child) is child
        assert location(child) == (child.url if is_remote(child) else Path(child.url))

    def test_open_reads(self, store: Store) -> None:
        data = payload(3 * MiB + 12345, seed=5)
        store.write("big", data)
        for size in (None, len(data)):
            with store.open("big", size) as handle:
                assert handle.size == len(data)
                assert handle.read(0, 10) == data[:10]
                assert handle.read(MiB - 3, 2 * MiB) == data[MiB - 3 : 3 * MiB - 3]
                a, b = bytearray(1000), np.zeros(2000, dtype=np.uint8)
                c = memoryview(bytearray(3000))
                assert handle.readinto([a, b, c], 777) == 6000
                assert bytes(a) + b.tobytes() + bytes(c) == data[777:6777]
                # at the end: short reads, as from a file
                assert handle.read(len(data) - 5, 100) == data[-5:]
                assert handle.read(len(data), 10) == b""
                assert handle.read(len(data) + 100, 10) == b""
                tail = bytearray(64)
                assert handle.readinto([tail], len(data) - 16) == 16
                assert bytes(tail[:16]) == data[-16:]
                assert handle.readinto([], 0) == 0
        with store.open("big") as handle:
            runs = [(100, MiB), (2 * MiB, MiB), (len(data) - 1000, 1000)]
            handle.will_need(runs)
            for offset, length in runs:  # inside the runs, whole and in parts
                assert handle.read(offset, length) == data[offset : offset + length]
                assert handle.read(offset + 7, 100) == data[offset + 7 : offset + 107]
                x, y = bytearray(50), bytearray(60)
                assert handle.readinto([x, y], offset + 1) == 110
                assert bytes(x + y) == data[offset + 1 : offset + 111]
            # outside them, and across their edges
            assert handle.read(0, 200) == data[:200]
            assert handle.read(MiB + 50, MiB) == data[MiB + 50 : 2 * MiB + 50]
            handle.will_need([(len(data) - 10, 100)])  # past the end
            assert handle.read(len(data) - 10, 100) == data[-10:]
        store.write("empty", b"")
        with store.open("empty") as handle:
            assert handle.size == 0
            assert handle.read(0, 10) == b""
            handle.will_need([(0, 10)])
            assert handle.read(0, 10) == b""

    @pytest.mark.parametrize("size", [0, 1000, MiB, 5 * MiB, 10 * MiB, 13 * MiB + 12345])
    def test_create_out_of_order(
        self, store: Store, size: int, monkeypatch: pytest.MonkeyPatch, request: Any
    ) -> None:
        monkeypatch.setattr(s3_mod, "PART_BYTES", 5 * MiB)
        data = payload(size, seed=size)
        store.prepare(["x/piece.bin"])
        handle = store.create("x/piece.bin", size_hint=size)
        write_out_of_order(handle, data, random.Random(size))
        handle.finish()
        store.persist(["x/piece.bin"])
        assert store.read("x/piece.bin") == data
        assert store.walk("x") == [("piece.bin", size, store.walk("x")[0][2])]
        handle.abort()  # after finish: nothing happens, the object stays
        assert store.read("x/piece.bin") == data
        if isinstance(store, S3Store):
            server: S3Server = request.getfixturevalue("s3")
            assert pending_uploads(server, store.prefix) == []
            key = f"{store.prefix}/x/piece.bin"
            etag = admin(server).head_object(Bucket="distckpt", Key=key)["ETag"]
            parts = -(-size // (5 * MiB))
            # one PUT when it fits in one part and no part was sent early, else multipart
            assert etag.strip('"').endswith(f"-{parts}") == (size >= 5 * MiB), etag
            if size >= 5 * MiB:
                # What accepts an upload completed with its answer lost (a retry then
                # finds it gone): the ETag computed from the parts is the server's.
                etags = [handle._etags[k] for k in sorted(handle._etags)]  # type: ignore[attr-defined]
                assert s3_mod.multipart_etag(etags) == etag
                assert handle._landed(etags, size)  # type: ignore[attr-defined]
                assert not handle._landed(etags, size + 1)  # type: ignore[attr-defined]
                assert not handle._landed(etags[:-1], size)  # type: ignore[attr-defined]

    def test_create_sizes_without_hint(self, store: Store) -> None:
        data = payload(2 * MiB + 1, seed=9)
        store.prepare(["nohint"])
        handle = store.create("nohint")
        assert handle.write([data[MiB:]], MiB) == MiB + 1
        assert handle.write([data[:MiB]], 0) == MiB
        handle.finish(durable=False)
        assert store.read("nohint") == data

    def test_abort(self, store: Store, monkeypatch: pytest.MonkeyPatch, request: Any) -> None:
        monkeypatch.setattr(s3_mod, "PART_BYTES", 5 * MiB)
        data = payload(6 * MiB, seed=11)
        store.prepare(["y/piece.bin", "y/never.bin"])
        handle = store.create("y/piece.bin", size_hint=len(data))
        handle.write([data[: 5 * MiB]], 0)  # a whole part: on S3 it is uploaded now
        handle.write([data[5 * MiB + 10 :]], 5 * MiB + 10)
        handle.abort()
        handle.abort()  # idempotent
        with pytest.raises(ValueError):
            handle.write([b"late"], 0)
        store.create("y/never.bin").abort()  # nothing written
        assert not store.exists("y/piece.bin")
        assert not store.exists("y/never.bin")
        assert [k for k, _, _ in store.walk()] == []
        if isinstance(store, S3Store):
            server: S3Server = request.getfixturevalue("s3")
            assert pending_uploads(server, store.prefix) == []

    def test_prepare_persist(self, store: Store) -> None:
        keys = ["p/q/r/one", "p/two", "three"]
        store.prepare(keys)
        for key in keys:
            handle = store.create(key)
            handle.write([key.encode()], 0)
            handle.finish()
        store.persist(keys)
        assert sorted(k for k, _, _ in store.walk()) == sorted(keys)
        assert [store.read(k) for k in keys] == [k.encode() for k in keys]


def _race_put_new(url: str, i: int, gate: Any, results: Any) -> None:
    store = resolve(url)
    gate.wait(30)
    try:
        store.put_new("claim", f"process {i}".encode())
        results.put((i, "won"))
    except ConditionFailed:
        results.put((i, "lost"))
    except Exception as exc:  # reported, so the test fails with it
        results.put((i, f"{type(exc).__name__}: {exc}"))


# -- locations and errors ------------------------------------------------------------


def test_resolve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = resolve("s3://bucket/a/b/")
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, store.url) == ("bucket", "a/b", "s3://bucket/a/b")
    assert store.name == "b" and store.parent == S3Store("bucket", "a")
    root = resolve("s3://bucket")
    assert isinstance(root, S3Store)
    assert (root.bucket, root.prefix, root.url) == ("bucket", "", "s3://bucket")
    assert root.name == "bucket"
    assert root.where("k") == "s3://bucket/k"
    assert S3Store.from_url("s3://bucket/a//b") == S3Store("bucket", "a//b")
    for bad in ("s3://", "s3:///prefix"):
        with pytest.raises(ValueError, match="no bucket"):
            S3Store.from_url(bad)
        with pytest.raises(ValueError, match="no bucket"):
            resolve(bad)
    with pytest.raises(ValueError, match="unsupported storage scheme 'gs'"):
        resolve("gs://bucket/x")
    local = resolve(tmp_path / "d")
    assert isinstance(local, PosixStore) and local.path == tmp_path / "d"
    assert resolve(str(tmp_path / "d")) == local
    assert resolve(f"file://{tmp_path}/d") == local
    monkeypatch.chdir(tmp_path)
    relative = resolve("rel/dir")
    assert isinstance(relative, PosixStore) and relative.path == tmp_path / "rel" / "dir"
    assert relative.path.is_absolute()
    assert not is_remote(tmp_path) and not is_remote(str(tmp_path)) and is_remote("s3://b/p")


PLUGIN = '''
from pathlib import Path

from distckpt.storage.posix import PosixStore


class MirrorStore(PosixStore):
    """mirror://<path>: a directory, reached through a scheme of its own."""

    @classmethod
    def from_url(cls, url: str) -> "MirrorStore":
        return cls(Path(url.removeprefix("mirror://")))

    def where(self, key: str) -> str:
        return f"mirror://{super().where(key)}"
'''

PLUGIN_JOB = """
import sys
import torch
import distckpt
from distckpt.storage.backend import resolve

url = "mirror://" + sys.argv[1] + "/run"
assert type(resolve(url)).__name__ == "MirrorStore", resolve(url)
state = {"w": torch.arange(12.0).reshape(3, 4), "step": 7}
distckpt.save(state, url + "/plain")
got = {"w": torch.zeros(3, 4), "step": None}
distckpt.load(got, url + "/plain")
assert got["step"] == 7 and torch.equal(got["w"], state["w"]), got
ckpt = distckpt.Checkpoint(w=state["w"])
with distckpt.CheckpointManager(ckpt, url, max_to_keep=1) as manager:
    manager.save()
    manager.save()
print("LATEST", distckpt.latest_checkpoint(url))
"""


@pytest.mark.timeout(120)
def test_a_store_plugged_in_through_an_entry_point(tmp_path: Path) -> None:
    """An installed package adds a URL scheme through the ``distckpt.stores`` entry-point
    group (no code run at start-up); save, load and the manager then work on it."""
    site = tmp_path / "site"
    (site / "mirror_store").mkdir(parents=True)
    (site / "mirror_store" / "__init__.py").write_text(PLUGIN)
    info = site / "mirror_store-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mirror-store\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[distckpt.stores]\nmirror = mirror_store:MirrorStore.from_url\n"
    )
    env = job_env({"PYTHONPATH": f"{site}:{Path(__file__).resolve().parent.parent}"})
    proc = finish(start([sys.executable, "-c", PLUGIN_JOB, str(tmp_path)], env), 100)
    check(proc)
    assert f"LATEST mirror://{tmp_path}/run/ckpt-2" in proc.stdout, output(proc)
    assert (tmp_path / "run" / "ckpt-2" / "zarr.json").is_file()
    assert not (tmp_path / "run" / "ckpt-1").exists()  # retention went through the plug-in


def test_register_store_in_process(tmp_path: Path) -> None:
    def opener(url: str) -> PosixStore:
        return PosixStore(tmp_path / url.removeprefix("here://"))

    backend.register_store("here", opener)
    try:
        assert resolve("here://a/b") == PosixStore(tmp_path / "a" / "b")
        assert is_remote("here://a")
    finally:
        backend._openers.pop("here")
    with pytest.raises(ValueError, match="unsupported storage scheme 'here'.*s3://"):
        resolve("here://a")
    for bad in ("file", "no-dash", ""):
        with pytest.raises(ValueError, match="bad storage scheme"):
            backend.register_store(bad, opener)


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
        assert not store.exists("nope")
        assert proxy.faults == 0
        assert proxy.counts["forward"] == 5
        assert [(m, k) for m, _, k in proxy.log] == [
            ("PUT", "forward"),
            ("GET", "forward"),
            ("GET", "forward"),
            ("GET", "forward"),
            ("HEAD", "forward"),
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
def test_store_under_faults(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3_mod, "PART_BYTES", 5 * MiB)
    store = S3Store.from_url(s3.url)  # type: ignore[attr-defined]
    rng = random.Random(7)
    with faulty(s3, seed=7, error=0.1, drop_before=0.05, drop_after=0.05) as proxy:
        for i in range(20):
            data = payload(rng.randint(0, 3000), seed=i)
            store.write(f"small/{i}", data)
            assert store.read(f"small/{i}") == data
        assert store.list("small") == sorted(str(i) for i in range(20))
        version = store.put_new("lease", b"mine")
        version = store.put_if("lease", b"mine again", version)
        assert store.read_versioned("lease") == (b"mine again", version)
        big = payload(13 * MiB + 5, seed=13)
        handle = store.create("big", size_hint=len(big))
        write_out_of_order(handle, big, rng)
        handle.finish()
        with store.open("big") as reader:
            reader.will_need([(0, 6 * MiB), (7 * MiB, 6 * MiB + 5)])
            assert reader.read(0, 6 * MiB) + reader.read(6 * MiB, len(big)) == big
        store.delete_tree("small")
        assert store.list() == ["big", "lease"]
        assert proxy.faults >= 3, proxy.counts
    assert store.read("big") == big


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
            from fault_proxy import read_request

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
