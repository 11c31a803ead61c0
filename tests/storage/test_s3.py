"""distckpt on an S3-compatible object store (a real moto server on 127.0.0.1), with real
processes: resharding across launchers, third-party zarr readers, a rank killed
mid-upload, and races (two jobs moving ``latest``, a reader overtaken by
``overwrite=True``, a stalled save whose claim was taken over). What every store does
alike runs on S3 too, over the ``backend`` fixture: the manager's retention and lock
(tests/training/test_manager.py), two saves of one name (tests/commit/test_races.py), a
stopped service (tests/storage/test_s3_deadlines.py), HF weights
(tests/hf/test_hf_stores.py).

The multi-rank work runs in tests/scripts/s3_ranks.py (``CASE``/``FAIL``/``OK`` lines,
see its docstring); the checks of what is left in the bucket are made here.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import distckpt
from distckpt.comm import SingleComm
from distckpt.commit import claim as claim_mod
from distckpt.commit import transaction
from distckpt.engine import load as engine_load
from distckpt.errors import CorruptCheckpointError
from distckpt.format import index as index_mod
from distckpt.format import stored as stored_mod
from distckpt.format.zarr_meta import ZARR_JSON
from distckpt.storage.registry import open_store
from distckpt.storage.s3 import S3Store
from distckpt.tools.runs import COMMITTED, UNCOMMITTED, list_run
from distckpt.training.pointer import PointerConflictError, advance_pointer, read_pointer
from tests.support.launch_util import (
    SCRIPTS,
    assert_all_ok,
    cases,
    load_script,
    needs_mpi,
    output,
    run_mpi_ranks,
    run_ranks,
)
from tests.support.make_golden import assert_same_bits
from tests.support.s3_server import S3Server, use

SCRIPT = SCRIPTS / "s3_ranks.py"
BUCKET = "distckpt"
JOB_ENV = {"DISTCKPT_TIMEOUT": "30"}  # a dead or desynchronised rank fails, never hangs
COMM = SingleComm()


sr = load_script(SCRIPT, "s3_ranks_script")


def job_env(server: S3Server, **extra: str) -> dict[str, str]:
    return {**server.env, **JOB_ENV, **extra}


def keys(server: S3Server, url: str) -> list[str]:
    """Every key under the prefix of ``url`` (relative to it)."""
    prefix = url.removeprefix(f"s3://{BUCKET}/").rstrip("/") + "/"
    return [k[len(prefix) :] for k in server.keys(BUCKET, prefix)]


def uploads(server: S3Server, url: str) -> list[str]:
    prefix = url.removeprefix(f"s3://{BUCKET}/").rstrip("/") + "/"
    response = server.client().list_multipart_uploads(Bucket=BUCKET, Prefix=prefix)  # type: ignore[attr-defined]
    return [u["Key"] for u in response.get("Uploads", [])]


# --------------------------------------------------------------------------- resharding


@pytest.fixture(scope="module")
def saved_on_4(s3_server: S3Server) -> str:
    """``<url>/n4``: saved on 4 ranks under mpiexec; returns ``<url>``."""
    url = f"s3://{BUCKET}/test_s3-resharding"
    proc = run_mpi_ranks(4, SCRIPT, "save", url, timeout=120, env=job_env(s3_server))
    assert_all_ok(proc, 4)
    return url


@pytest.fixture
def in_env(s3_server: S3Server) -> Iterator[S3Server]:
    with use(s3_server.env):
        yield s3_server


@needs_mpi
@pytest.mark.timeout(260)
@pytest.mark.parametrize(
    ("run", "world"), [(run_ranks, 3), (run_mpi_ranks, 2)], ids=["ranks3", "mpiexec2"]
)
def test_save_4_restore_resharded(
    saved_on_4: str, s3_server: S3Server, run: Any, world: int
) -> None:
    proc = run(world, SCRIPT, "restore", saved_on_4, "4", timeout=120, env=job_env(s3_server))
    assert_all_ok(proc, world)
    assert set(cases(proc)) == {"catalog", "resharded", "whole"}


@needs_mpi
@pytest.mark.timeout(200)
def test_layout_and_single_process_restore(saved_on_4: str, in_env: S3Server) -> None:
    """The index says what was stored how; one process reads every tensor whole."""
    path = f"{saved_on_4}/n4"
    variables = index_mod.read_index(path)["variables"]
    assert variables["model/rows"]["layout"] == "regular"
    assert len(stored_mod.Pieces(variables["model/rows"], "model/rows")) == 4
    codecs = {
        name: {p.codec.name if p.codec else None for p in stored_mod.Pieces(variables[name], name)}
        for name in sr.GLOBAL
    }
    assert codecs["opt/m"] == {"zstd"}, codecs  # opt/v: boxes too small to compress
    assert codecs["model/rows"] == codecs["model/cols"] == {None}, codecs
    state: dict[str, Any] = {
        "model": {n: torch.zeros_like(sr.full(f"model/{n}")) for n in ("rows", "cols", "rep")},
        "opt": {n: torch.zeros(sr.OPT) for n in ("m", "v")},
        "small": torch.zeros(3, dtype=torch.float64),
    }
    distckpt.load(state, path, COMM, strict=False)
    for name in sr.GLOBAL:
        group, _, leaf = name.rpartition("/")
        got = state[group][leaf] if group else state[leaf]
        assert torch.equal(got, sr.full(name)), name


def _global(name: str) -> torch.Tensor:
    return sr.full(name)


@needs_mpi
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", ["model/rows", "opt/m"])
def test_zarr_python_reads_global_tensor(saved_on_4: str, s3_server: S3Server, name: str) -> None:
    """zarr-python, through obstore's S3 client, opens the variable as a plain zarr v3
    array and gets the global tensor (``opt/m`` is zstd-compressed)."""
    zarr = pytest.importorskip("zarr")
    obstore_store = pytest.importorskip("obstore.store")
    distckpt.register_zarr_dtypes()
    env = s3_server.env
    store = obstore_store.S3Store(
        BUCKET,
        prefix=f"{saved_on_4.removeprefix(f's3://{BUCKET}/')}/n4",
        endpoint=env["AWS_ENDPOINT_URL"],
        access_key_id=env["AWS_ACCESS_KEY_ID"],
        secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region=env["AWS_DEFAULT_REGION"],
        client_options={"allow_http": True},
    )
    array = zarr.open_array(zarr.storage.ObjectStore(store, read_only=True), path=name, mode="r")
    got = torch.from_numpy(array[...])
    assert torch.equal(got, _global(name))


@needs_mpi
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", ["model/rows", "opt/m"])
def test_tensorstore_reads_global_tensor(saved_on_4: str, in_env: S3Server, name: str) -> None:
    """tensorstore's zarr3 driver on its own S3 kvstore (credentials from the
    environment) gets the global tensor."""
    ts = pytest.importorskip("tensorstore")
    spec = {
        "driver": "zarr3",
        "kvstore": {
            "driver": "s3",
            "bucket": BUCKET,
            "path": f"{saved_on_4.removeprefix(f's3://{BUCKET}/')}/n4/{name}/",
            "endpoint": in_env.env["AWS_ENDPOINT_URL"],
            "aws_region": "us-east-1",
        },
    }
    got = torch.from_numpy(ts.open(spec, read=True).result().read().result())
    assert torch.equal(got, _global(name))


# --------------------------------------------------------------------------- kill


def _load_kill_version(path: str, world: int, version: int) -> None:
    state: dict[str, Any] = {
        "w": torch.zeros(sr.KILL_ROWS * world, sr.KILL_COLS),
        "b": torch.zeros(20),
        "rng": distckpt.PerRank(None),
        "step": None,
    }
    distckpt.load(state, path, COMM)
    assert torch.equal(state["w"], sr.kill_w(version, world))
    want = sr.kill_state(0, world, version)
    assert torch.equal(state["b"], want["b"])
    assert torch.equal(state["rng"].value, want["rng"].value)
    assert state["step"] == version


@needs_mpi
@pytest.mark.timeout(120)
def test_rank_killed_mid_upload(s3: S3Server, tmp_path: Path) -> None:
    """The last of 3 ranks is SIGKILLed after one part of its multipart upload went up
    and the others finished their shards: the previous checkpoint is intact, the torn
    one has no index, is listed as uncommitted, and gc removes it once its claim is
    stale (its keys and the dangling upload)."""
    world = 3
    url = s3.url
    start_time = time.monotonic()
    proc = run_mpi_ranks(
        world,
        SCRIPT,
        "kill",
        url,
        str(tmp_path / "markers"),
        timeout=90,
        env=job_env(s3, DISTCKPT_TIMEOUT="10"),
    )
    out = proc.stdout
    assert proc.returncode != 0 and "COMMITTED" not in out, output(proc)
    assert sorted(int(r) for r in re.findall(r"^WROTE (\d+) ", out, re.M)) == [0, 1], output(proc)
    assert re.search(r"^KILLING 2 w/", out, re.M), output(proc)
    assert time.monotonic() - start_time < 80

    target = f"{url}/target"
    _load_kill_version(f"{url}/prev", world, 1)
    torn = keys(s3, target)
    assert "zarr.json" not in torn and claim_mod.read_claim(open_store(target)) is not None, torn
    assert {"w/c.0.0", "w/c.1.0"} <= set(torn) and "w/c.2.0" not in torn, torn
    assert uploads(s3, target) == ["test_rank_killed_mid_upload/target/w/c.2.0"]
    assert not index_mod.is_committed(target)
    with pytest.raises(distckpt.CheckpointNotFoundError):
        distckpt.load({"step": None}, target, COMM, strict=False)

    listing = list_run(url)
    states = {e.name: e.state for e in listing.entries}
    assert states == {"prev": COMMITTED, "target": UNCOMMITTED}, listing
    assert [e.bytes > 0 for e in listing.entries if e.name == "target"] == [True]
    # The job is gone (the process holding the claim no longer exists on this host): gc
    # removes every key of the torn save and its upload without waiting for the claim
    # to go stale (a live save's claim is left alone: see the stalled-save test).
    assert transaction.collect_garbage(url) == [target]
    assert keys(s3, target) == [] and uploads(s3, target) == []
    assert [e.name for e in list_run(url).entries] == ["prev"]
    _load_kill_version(f"{url}/prev", world, 1)
    # and the name can be saved again
    distckpt.save({"w": torch.arange(6.0), "step": 4}, target, COMM)
    got: dict[str, Any] = {"w": torch.zeros(6), "step": None}
    distckpt.load(got, target, COMM)
    assert torch.equal(got["w"], torch.arange(6.0)) and got["step"] == 4


# --------------------------------------------------------------------------- races

POINTER_NAMES = 8
POINTER_PASSES = 4


def test_two_jobs_advance_latest(s3: S3Server) -> None:
    """Two jobs (threads, each its own requests) advance ``latest`` over ckpt-1..8 (the
    second over the even ones) at once, 4 times (a fresh directory each), while a third
    reads it in a loop: it never moves backwards, a loser gets PointerConflictError, and
    it ends at ckpt-8."""
    store = open_store(s3.url)
    for p in range(POINTER_PASSES):
        for i in range(1, POINTER_NAMES + 1):  # advance_pointer keeps names that exist
            store.write(f"p{p}/ckpt-{i}/data", b"x")
    seen: list[list[tuple[int, int]]] = [[], [], []]  # (pass, number) as each thread saw
    conflicts = [0, 0]
    errors: list[BaseException] = []
    current = [0]
    stop = threading.Event()
    barrier = threading.Barrier(2)

    def number(p: int) -> int:
        pointer = read_pointer(f"{s3.url}/p{p}")
        return 0 if pointer is None else int(pointer.latest.rsplit("-", 1)[1])

    def job(k: int) -> None:
        try:
            for p in range(POINTER_PASSES):
                barrier.wait(30)
                current[0] = p
                # job 0 advances to every name, job 1 to every other one (so the two
                # never write the same pointer document, which S3 cannot tell apart)
                for i in range(1 + k, POINTER_NAMES + 1, 1 + k):
                    seen[k].append((p, number(p)))
                    try:
                        advance_pointer(f"{s3.url}/p{p}/ckpt-{i}")
                    except PointerConflictError:
                        conflicts[k] += 1
                    seen[k].append((p, number(p)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def watch() -> None:
        while not stop.is_set():
            p = current[0]
            seen[2].append((p, number(p)))

    threads = [threading.Thread(target=job, args=(k,)) for k in (0, 1)]
    watcher = threading.Thread(target=watch)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stop.set()
    watcher.join(10)
    assert not errors, errors
    for k, sequence in enumerate(seen):
        for p in range(POINTER_PASSES):
            numbers = [n for q, n in sequence if q == p]
            assert numbers == sorted(numbers), f"thread {k}, pass {p}: latest went {numbers}"
    assert sum(conflicts) > 0, "no job ever lost a race: the test raced nothing"
    for p in range(POINTER_PASSES):
        pointer = read_pointer(f"{s3.url}/p{p}")
        assert pointer is not None and pointer.latest == f"ckpt-{POINTER_NAMES}"
        assert pointer.all == sorted(pointer.all, key=lambda n: int(n.rsplit("-", 1)[1]))


#: How far the overwrite has gone when the reader, holding the old index, reads its data,
#: and what the reader must get.
OVERWRITE_MOMENTS = [
    # the name is claimed, the old checkpoint not yet withdrawn: the old values
    pytest.param("claimed", "old", id="claimed"),
    # the old index and data deleted, the new data not yet written
    pytest.param("withdrawn", CorruptCheckpointError, id="withdrawn"),
    # the new data (and index) under the old index
    pytest.param("committed", CorruptCheckpointError, id="committed"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("moment", "expect"), OVERWRITE_MOMENTS)
def test_overwrite_under_a_reader(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch, moment: str, expect: Any
) -> None:
    """``overwrite=True`` replaces a checkpoint; a load that read the old index before the
    overwrite gets the old values bit for bit (when its data reads come before the old
    checkpoint is withdrawn) or CorruptCheckpointError (after), never the new values
    under the old index.

    The interleaving is fixed with events, not timing: right after the reader (the main
    thread) has read the old index, an overwrite starts on another thread, and the reader
    goes on only once the overwrite has reached ``moment``; the overwrite stays there
    until the reader is done."""
    path = f"{s3.url}/ckpt"
    final = open_store(path)

    def version(v: int) -> dict[str, Any]:
        return {
            "w": sr.generate(("ow", v), (64, 32), torch.float32),
            "z": sr.generate(("oz", v), (4096,), torch.float32),
            "step": v,
        }

    def save(v: int) -> None:
        distckpt.save(version(v), path, COMM, overwrite=True, compression={"z": "zstd"})

    real_read_index = engine_load.read_index_bytes
    real_delete, real_delete_tree = S3Store.delete, S3Store.delete_tree
    reached = threading.Event()  # the overwrite is at ``moment`` (or has failed)
    resume = threading.Event()  # the reader is done: the overwrite may go on
    failures: list[BaseException] = []
    writers: list[threading.Thread] = []
    paused: list[str] = []
    armed: list[bool] = []  # the next index read by the main thread starts the overwrite

    def overwrite() -> None:
        try:
            save(2)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)
        finally:
            reached.set()  # "committed": the whole save is the moment

    def pause(at: str) -> None:
        if moment == at and writers and threading.current_thread() is writers[0]:
            paused.append(at)
            reached.set()
            resume.wait(60)

    def delete(store: S3Store, key: str) -> None:
        if key == ZARR_JSON and store.where(key) == final.where(key):
            pause("claimed")  # the overwrite withdraws the old index first
        real_delete(store, key)

    def delete_tree(store: S3Store, key: str = "") -> None:
        real_delete_tree(store, key)
        if store.where(key) == final.where(""):
            pause("withdrawn")

    def read_index_then_overwrite(store: Any) -> bytes:
        raw = real_read_index(store)
        if armed and threading.current_thread() is threading.main_thread():
            armed.clear()
            writers.append(threading.Thread(target=overwrite, name="overwrite"))
            writers[0].start()
            assert reached.wait(60), f"the overwrite did not reach {moment!r}"
        return raw

    monkeypatch.setattr(S3Store, "delete", delete)
    monkeypatch.setattr(S3Store, "delete_tree", delete_tree)
    # The load reads the index through the name distckpt.engine.load imported.
    monkeypatch.setattr(engine_load, "read_index_bytes", read_index_then_overwrite)
    old = version(1)
    for names in (["w"], ["z"], ["w", "z"]):
        save(1)
        writers.clear()
        paused.clear()
        reached.clear()
        resume.clear()
        state: dict[str, Any] = {n: torch.zeros_like(old[n]) for n in names}
        armed.append(True)
        try:
            if expect == "old":
                distckpt.load(state, path, COMM, strict=False)
                for n in names:
                    assert_same_bits(state[n], old[n], f"{names}: {n}")
            else:
                with pytest.raises(expect):
                    distckpt.load(state, path, COMM, strict=False)
        finally:
            resume.set()
            for writer in writers:
                writer.join(60)
        assert writers and not writers[0].is_alive(), f"{names}: no overwrite ran"
        assert not failures, failures
        assert paused == ([] if moment == "committed" else [moment]), paused
    monkeypatch.undo()
    # The name now holds version 2, whole.
    state = {"w": torch.zeros(64, 32), "z": torch.zeros(4096), "step": None}
    distckpt.load(state, path, COMM)
    want = version(2)
    assert_same_bits(state["w"], want["w"], "w")
    assert_same_bits(state["z"], want["z"], "z")
    assert state["step"] == 2
    assert claim_mod.read_claim(open_store(path)) is None


@pytest.mark.timeout(60)
def test_a_stalled_save_whose_claim_was_taken_over_does_not_commit(s3: S3Server) -> None:
    """A save stalls past its claim's lease; another save takes the claim over. The stalled
    one then refuses to commit and its abort leaves the new owner's claim and data alone."""
    from distckpt.commit.lease import Lease
    from distckpt.errors import CheckpointExists
    from distckpt.format.zarr_meta import ZARR_JSON

    final = open_store(f"{s3.url}/ck")
    txn = transaction.begin(final, "stalled0token000", 1, overwrite=False)
    txn._lease.stop()  # type: ignore[attr-defined]  # the save stalls: no more heartbeats
    final.write("w/c.0", b"stalled data")
    other = Lease(final.parent, claim_mod.claim_key("ck"), "newowner", stale_seconds=0.0)
    other.acquire(lambda info, age: AssertionError(f"not taken over: {info} {age}"))
    final.write("w/c.0", b"new owner's data")
    # A live save (fresh claim, its process alive) is never collected.
    assert claim_mod.collect_garbage(final.parent) == []
    assert final.read("w/c.0") == b"new owner's data"
    with pytest.raises(CheckpointExists, match="lost its claim"):
        txn.commit({}, b'{"zarr_format": 3, "node_type": "group"}')
    txn.abort()
    assert not final.exists(ZARR_JSON)
    assert final.read("w/c.0") == b"new owner's data"
    found = claim_mod.read_claim(final)
    assert found is not None and found[0]["token"] == "newowner"
    other.release()
    assert claim_mod.read_claim(final) is None
