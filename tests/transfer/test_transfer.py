"""A rank's data path, in one process: I/O workers, staging slabs, the parallel writer and
reader.

CPU tensors that cannot be read or written in place (transposed and strided views,
conjugate and negative views) take the staging path that GPU tensors take, so these
tests run it on any machine: tiny slabs and tasks make every save and load cross many
slab and task boundaries. Values are compared bit for bit.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import distckpt
from distckpt.commit.staging import leftovers
from distckpt.errors import CorruptCheckpointError
from distckpt.format import codecs, shard_io, zarr_meta
from distckpt.format.piece_reader import PieceReader
from distckpt.planning.layout import inner_chunks
from distckpt.slices import Box, c_order_bands
from distckpt.storage.posix import PosixStore, PosixWriter
from distckpt.transfer import jobs as jobs_mod
from distckpt.transfer import reader as reader_mod
from distckpt.transfer import slabs, workers
from distckpt.transfer import writer as writer_mod
from distckpt.transfer.arrays import numpy_view
from distckpt.transfer.slabs import SlabPool
from distckpt.transfer.sources import HostData
from distckpt.transfer.workers import TaskGroup
from tests.engine.test_single_process import load1, random_tensor, save1, snapshot
from tests.support.make_golden import assert_same_bits

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Slabs of 4 KiB (3 of them) and tasks of 2 KiB: every path crosses boundaries."""
    monkeypatch.setattr(jobs_mod, "TASK_BYTES", 2048)
    monkeypatch.setattr(reader_mod, "TASK_BYTES", 2048)
    distckpt.set_staging(slab_bytes=4096, slabs=3)
    yield
    distckpt.set_staging()


# --------------------------------------------------------------------------- pure parts


def _flat_index(box: Box, shape: tuple[int, ...]) -> np.ndarray:
    grid = np.arange(math.prod(shape)).reshape(shape)
    return np.ascontiguousarray(grid[box.slices()]).reshape(-1)


@pytest.mark.parametrize("seed", range(40))
def test_chunk_parts_partition_the_data(seed: int) -> None:
    """Every element of the data is in exactly one part; with the planner's inner chunks
    the parts are consecutive runs of the data's bytes, in order."""
    rng = random.Random(seed)
    ndim = rng.randint(1, 3)
    block = tuple(rng.randint(1, 9) for _ in range(ndim))
    data = tuple(rng.randint(1, b) for b in block)
    itemsize = rng.choice([1, 2, 4, 8])
    planned = inner_chunks(block, itemsize, rng.choice([itemsize, 16, 64, 4096]))
    arbitrary = tuple(rng.choice([d for d in range(1, b + 1) if b % d == 0]) for b in block)
    for inner in (planned, arbitrary):
        parts = shard_io.chunk_parts(data, block, inner, itemsize)
        boxes = [Box(p.offsets, p.lengths) for p in parts]
        seen = np.concatenate([_flat_index(b, data) for b in boxes])
        assert sorted(seen.tolist()) == list(range(math.prod(data)))
        for p, box in zip(parts, boxes, strict=True):
            assert p.whole == (p.lengths == inner)
            assert p.linear == np.ravel_multi_index(
                tuple(o // i for o, i in zip(p.offsets, inner)),
                tuple(b // i for b, i in zip(block, inner)),
            )
            flat = _flat_index(box, data)
            contiguous = bool(np.all(np.diff(flat) == 1))
            assert (p.start is not None) == contiguous or box.numel == 1
            if p.start is not None:
                assert p.start == flat[0] * itemsize
        if inner == planned:
            offsets = [p.start for p in parts]
            assert None not in offsets
            ends = [p.end for p in parts]
            assert offsets[1:] == ends[:-1] and offsets[0] == 0


@pytest.mark.parametrize(
    "shape,itemsize,limit",
    [((7, 5, 3), 4, 64), ((7, 5, 3), 4, 4), ((1000,), 2, 300), ((3, 4), 8, 10**6), ((), 4, 8)],
)
def test_bands_cover_in_c_order(shape: tuple[int, ...], itemsize: int, limit: int) -> None:
    bands = list(c_order_bands(shape, itemsize, limit))
    flat = np.concatenate([_flat_index(b, shape) for b in bands]) if shape else np.arange(1)
    assert flat.tolist() == list(range(math.prod(shape)))  # in order, each once
    for b in bands:
        assert b.numel * itemsize <= max(limit, itemsize)
        assert bool(np.all(np.diff(_flat_index(b, shape)) == 1)) if shape else True


# --------------------------------------------------------------------------- workers


def test_default_io_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (workers.ENV, *workers.LOCAL_SIZE_VARS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert workers.default_io_workers() == 16  # one rank: all cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert workers.default_io_workers() == 4  # four ranks share them
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert workers.default_io_workers() == 2  # bound to two cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    assert workers.default_io_workers() == 1  # never fewer than one
    monkeypatch.setenv(workers.ENV, "6")
    assert workers.default_io_workers() == 6 and workers.resolve_io_workers(None) == 6
    assert workers.resolve_io_workers(3) == 3  # the keyword wins
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(256)))
    monkeypatch.setattr(os, "cpu_count", lambda: 256)
    monkeypatch.delenv(workers.ENV)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert workers.default_io_workers() == workers.MAX_DEFAULT
    for bad in ("zero", "0", "-2"):
        monkeypatch.setenv(workers.ENV, bad)
        with pytest.raises(ValueError, match=workers.ENV):
            workers.resolve_io_workers(None)
    with pytest.raises(ValueError, match="io_workers"):
        workers.resolve_io_workers(0)


def test_the_worker_count_is_chosen_for_the_tensors_and_the_storage(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Device tensors: at most DEVICE_WORKERS; a network file system or an object store:
    at least NETWORK_WORKERS; a count the user gives wins; each choice says why."""
    for name in (workers.ENV, *workers.LOCAL_SIZE_VARS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    host = workers.choose_io_workers(None)
    assert (host.count, host.reason) == (16, "16 cores")
    device = workers.choose_io_workers(None, device=True)
    assert device.count == workers.DEVICE_WORKERS == 8 and device.reason.startswith(
        "at most 8 for device tensors"
    )
    shared = workers.choose_io_workers(None, 8, device=True)
    assert (shared.count, shared.reason) == (2, "16 cores shared by 8 ranks")
    assert workers.choose_io_workers(None, 8, network=True).count == workers.NETWORK_WORKERS
    monkeypatch.setattr(workers, "filesystem_type", lambda path: "lustre")
    lustre = workers.choose_io_workers(None, 16, path=tmp_path)
    assert lustre.count == 8 and lustre.reason.startswith("at least 8 for lustre")
    assert str(workers.choose_io_workers(3, path=tmp_path)) == "3 I/O workers: io_workers="
    monkeypatch.setenv(workers.ENV, "5")
    assert workers.choose_io_workers(None, device=True) == workers.WorkerChoice(
        5, f"${workers.ENV}"
    )


def test_the_file_system_type_comes_from_the_mount_table(tmp_path: Path) -> None:
    if not os.path.exists("/proc/self/mountinfo"):
        pytest.skip("no /proc/self/mountinfo (not Linux)")
    with open("/proc/self/mountinfo") as f:
        root_type = next(line.split(" - ")[1].split()[0] for line in f if line.split()[4] == "/")
    assert workers.filesystem_type("/") == root_type
    assert workers.filesystem_type(tmp_path / "not" / "yet") == workers.filesystem_type(tmp_path)
    if os.path.ismount("/dev/shm"):
        assert workers.filesystem_type("/dev/shm/any") == "tmpfs"


def test_a_save_and_a_load_report_their_workers(tmp_path: Path) -> None:
    state = {"w": torch.arange(12.0)}
    saved = distckpt.save(state, tmp_path / "c", io_workers=3)
    assert (saved.io_workers, saved.io_workers_reason) == (3, "io_workers=")
    loaded = distckpt.load({"w": torch.zeros(12)}, tmp_path / "c")
    chosen = workers.choose_io_workers(None, path=tmp_path)
    assert (loaded.io_workers, loaded.io_workers_reason) == (chosen.count, chosen.reason)


def test_bad_io_workers_fails_save_and_load(tmp_path: Path) -> None:
    state = {"w": torch.arange(10.0)}
    with pytest.raises(ValueError, match="io_workers must be at least 1"):
        save1(state, tmp_path / "ck", io_workers=0)
    assert not (tmp_path / "ck").exists() and leftovers(tmp_path) == []
    save1(state, tmp_path / "ck")
    with pytest.raises(ValueError, match="io_workers"):
        load1(state, tmp_path / "ck", io_workers="many")  # type: ignore[arg-type]


def test_task_group_skips_after_a_failure_and_releases_everything() -> None:
    group = TaskGroup(2)
    gate = threading.Event()
    released: list[int] = []
    ran: list[int] = []

    def task(i: int) -> int:
        if i == 0:
            gate.wait(5)
        if i == 1:
            raise RuntimeError("task 1 failed")
        ran.append(i)
        return 10

    for i in range(8):
        group.submit(task, i, release=lambda i=i: released.append(i))
    # Task 1 fails while task 0 still runs (on the other worker): only then may task 0
    # end, so that the tasks queued behind the failure cannot start on its worker.
    assert group.cancelled.wait(10), "task 1 did not fail"
    gate.set()
    with pytest.raises(RuntimeError, match="task 1 failed"):
        group.wait()
    assert sorted(released) == list(range(8))  # every task let go of what it held
    assert ran == [0]  # the tasks queued behind the failure were skipped
    group.wait()  # nothing left


class _WatchedCondition(threading.Condition):
    """A slab pool's condition that tells when a thread waits on it: a test then knows
    that a take() blocks, instead of hoping that it got there within a sleep."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


def test_slab_pool_packs_blocks_and_waits_for_fences() -> None:
    pool = SlabPool(256, 2, pinned=False)
    a, b = pool.take(100), pool.take(100)  # packed into slab 0
    assert a.tensor.data_ptr() + 128 == b.tensor.data_ptr()
    c = pool.take(200)  # slab 1
    big = pool.take(1000)  # bigger than a slab: a buffer of its own
    assert big.nbytes == 1000 and pool.allocated_bytes == 512

    class Fence:
        def __init__(self) -> None:
            self.synced = False

        def synchronize(self) -> None:
            self.synced = True

    fence = Fence()
    got: list[Any] = []
    pool._cond = waits = _WatchedCondition()
    waiter = threading.Thread(target=lambda: got.append(pool.take(200)))
    waiter.start()  # needs slab 0 again: waits for a and b
    assert waits.waiting.wait(10), "take() did not wait"
    a.release(fence)
    assert not got and waiter.is_alive()  # b still holds slab 0
    b.release()
    waiter.join(5)
    assert got and fence.synced and got[0].tensor.data_ptr() == a.tensor.data_ptr()
    for region in (c, got[0], big):
        region.release()


def test_an_interrupted_wait_still_waits_for_the_running_tasks() -> None:
    """Ctrl-C while a save waits for its workers: the tasks not started are skipped, the
    running ones finish before the interruption is raised (so no file is closed, and no
    buffer reused, under a worker).

    Ordered by events, not by timing. A real SIGINT is sent once both workers run a task
    and the main thread is blocked inside wait(): in its first call of futures.wait,
    replaced by a sleep that only the interruption ends. (Inside the real one, a
    KeyboardInterrupt raised between two of its lock operations leaves a future's lock
    held, and a signal that lands just before a thread blocks is only handled once it
    wakes: so the signal is resent until its handler has run, and the handler raises
    once.) The running tasks go on only once wait() has seen the interruption (it then
    skips the rest), and each checks that wait() has not returned yet (it gives it 0.5 s
    to: a wait() that did not wait for them is seen)."""
    import signal

    group = TaskGroup(2)
    running = threading.Semaphore(0)
    waiting = threading.Event()  # the main thread is inside wait(), about to block
    delivered = threading.Event()  # the SIGINT handler has raised KeyboardInterrupt
    returned = threading.Event()  # wait() has raised
    finished: list[tuple[int, bool]] = []
    real_wait = workers.futures.wait

    def task(i: int) -> int:
        running.release()
        assert group.cancelled.wait(30), "wait() did not see the interruption"
        finished.append((i, returned.wait(0.5)))
        return 0

    def blocked_until_interrupted(*args: Any, **kwargs: Any) -> Any:
        if delivered.is_set():
            return real_wait(*args, **kwargs)
        waiting.set()
        time.sleep(60)  # the handler's KeyboardInterrupt ends it
        raise AssertionError("no interruption within 60 s")

    def interrupt(signum: int, frame: Any) -> None:
        if not delivered.is_set():  # once: a signal resent meanwhile is dropped
            delivered.set()
            raise KeyboardInterrupt

    def send() -> None:
        if running.acquire(timeout=30) and running.acquire(timeout=30) and waiting.wait(30):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                signal.pthread_kill(main, signal.SIGINT)
                if delivered.wait(0.05):
                    break

    main = threading.main_thread().ident
    assert main is not None
    submitted = [group.submit(task, i) for i in range(6)]
    sender = threading.Thread(target=send)
    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(workers.futures, "wait", blocked_until_interrupted)
            sender.start()
            with pytest.raises(KeyboardInterrupt):
                group.wait()
            returned.set()
    finally:
        if sender.is_alive():
            sender.join(30)  # no signal is sent after this
        signal.signal(signal.SIGINT, previous)
    # the two running ones ended before wait() did, and saw it still waiting
    assert sorted(finished) == [(0, False), (1, False)]
    # the other four were skipped (never ran), and none is left to run after wait()
    assert all(f.done() for f in submitted)


def test_groups_of_other_sizes_do_not_stop_each_other() -> None:
    first = TaskGroup(2)
    second = TaskGroup(3)  # another size while the first is in use
    assert first.submit(lambda: 1).result() == 1
    assert second.submit(lambda: 2).result() == 2
    first.wait()
    second.wait()
    third = TaskGroup(2)  # once unused, other sizes may go; this one still runs
    assert third.submit(lambda: 3).result() == 3
    third.wait()


def test_a_failing_staged_checksum_frees_its_slabs(monkeypatch: pytest.MonkeyPatch) -> None:
    from distckpt.transfer.sources import StagedData

    distckpt.set_staging(slab_bytes=4096, slabs=2)
    try:
        data = StagedData(random_tensor(torch.float32, (64, 64), 1).t(), "w")
        real = slabs.Region.typed
        calls = itertools.count()

        def typed(self: Any, *a: Any) -> Any:
            if next(calls) == 2:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return real(self, *a)

        monkeypatch.setattr(slabs.Region, "typed", typed)
        with pytest.raises(RuntimeError, match="illegal memory access"):
            data.crc()
        monkeypatch.undo()
        pool = slabs.pool(pinned=False)
        assert [s.holders for s in pool._slabs] == [0, 0]
        want = shard_io.crc32c(data.tensor.contiguous().numpy())
        assert data.crc() == want  # and the next one does not wait forever
        distckpt.set_staging(slab_bytes=4096, slabs=1)
        assert StagedData(data.tensor, "w").crc() == want  # one slab: no overlap, no wait
    finally:
        distckpt.set_staging()


def test_only_one_region_larger_than_a_slab_at_a_time() -> None:
    pool = SlabPool(256, 2, pinned=False)
    first = pool.take(1000)
    got: list[Any] = []
    pool._cond = waits = _WatchedCondition()
    waiter = threading.Thread(target=lambda: got.append(pool.take(2000)))
    waiter.start()
    assert waits.waiting.wait(10), "take() did not wait"
    assert not got and waiter.is_alive()  # waits for the first
    first.release()
    waiter.join(5)
    assert got and got[0].nbytes == 2000
    got[0].release()


def test_an_absent_chunk_in_a_shard_index_is_reported_as_corruption(
    tmp_path: Path, tiny: None
) -> None:
    w = random_tensor(torch.float32, (64, 64), 4)
    save1({"w": w}, tmp_path / "ck", small_bytes=0, inner_bytes=512)
    files = (tmp_path / "ck" / "w").rglob("*")
    (shard,) = [p for p in files if p.is_file() and p.name != "zarr.json"]
    data = bytearray(shard.read_bytes())
    nchunks = 32
    index = np.frombuffer(data[-(nchunks * 16 + 4) : -4], dtype="<u8").copy().reshape(-1, 2)
    index[3] = (shard_io.EMPTY, shard_io.EMPTY)  # chunk 3 absent, the index itself valid
    raw = index.tobytes()
    data[-(nchunks * 16 + 4) :] = raw + shard_io.crc32c(raw).to_bytes(4, "little")
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"inner chunk \(3, 0\) is missing"):
        load1({"w": torch.zeros(64, 64)}, tmp_path / "ck", io_workers=2)


# --------------------------------------------------------------------------- round trips


def _views(seed: int) -> dict[str, torch.Tensor]:
    """Tensors a save must read through staging, and plain ones, of every kind of dtype."""
    base = random_tensor(torch.float32, (48, 40), seed)
    cplx = random_tensor(torch.complex64, (24, 16), seed + 1)
    return {
        "plain": random_tensor(torch.bfloat16, (64, 33), seed + 2),
        "transposed": base.t(),
        "strided": random_tensor(torch.float64, (30, 64), seed + 3)[::3, 1::2],
        "conj": cplx.conj(),
        "neg": torch._neg_view(random_tensor(torch.float32, (40, 8), seed + 4)),
        "f8": random_tensor(torch.float8_e4m3fn, (7, 300), seed + 5)[:, 1:],
        "bool": random_tensor(torch.bool, (90, 31), seed + 6).t(),
        "i64": random_tensor(torch.int64, (17, 19), seed + 7),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 5),
    }


@pytest.mark.parametrize("io_workers", [1, 3])
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_round_trip_through_staging(
    tmp_path: Path, tiny: None, io_workers: int, compression: str | None
) -> None:
    state = _views(1)
    want = {k: v.resolve_conj().resolve_neg().clone() for k, v in state.items()}
    kw = {"small_bytes": 256, "inner_bytes": 512, "compression": compression}
    save1(state, tmp_path / "ck", io_workers=io_workers, **kw)
    # contiguous targets (read in place) and views (read through slabs, band by band)
    flat = {k: torch.full_like(v, 7) if v.dtype != torch.bool else ~v for k, v in want.items()}
    load1(flat, tmp_path / "ck", io_workers=io_workers)
    holders = {k: torch.zeros(v.shape[::-1], dtype=v.dtype) for k, v in want.items()}
    views = {k: h.permute(tuple(reversed(range(h.dim())))) for k, h in holders.items()}
    load1(views, tmp_path / "ck", io_workers=io_workers)
    for k, v in want.items():
        assert_same_bits(flat[k], v, k)
        assert_same_bits(views[k].contiguous(), v, k)


def test_load_into_conj_and_sliced_targets(tmp_path: Path, tiny: None) -> None:
    w = random_tensor(torch.complex128, (20, 12), 5)
    save1({"w": w, "x": torch.arange(600.0)}, tmp_path / "ck", small_bytes=64, inner_bytes=256)
    base = torch.zeros(20, 12, dtype=torch.complex128)
    bigger = torch.zeros(2, 700)
    load1({"w": base.conj(), "x": bigger[1, 50:650]}, tmp_path / "ck")
    assert_same_bits(base.conj().resolve_conj(), w)
    assert_same_bits(bigger[1, 50:650].clone(), torch.arange(600.0))
    assert not bigger[0].any() and not bigger[1, :50].any() and not bigger[1, 650:].any()


def test_parallel_shards_with_edges_open_in_zarr(tmp_path: Path, tiny: None) -> None:
    """Shards narrower than their block (the last one of an uneven partition), written by
    several workers, raw and compressed (chunks then land in the order they finish):
    distckpt and zarr-python read the same values."""
    zarr = pytest.importorskip("zarr")
    distckpt.register_zarr_dtypes()
    full = numpy_view(random_tensor(torch.bfloat16, (13, 37), 9))
    block, inner = (8, 37), (2, 37)
    for choice in (None, "zstd", "blosc-lz4"):
        root = tmp_path / str(choice)
        codec = codecs.make(choice, 2)
        compressor = None if codec is None else codec.to_json()
        meta = zarr_meta.array_meta((13, 37), "bfloat16", block, inner, compressor=compressor)
        root.mkdir()
        (root / "zarr.json").write_bytes(zarr_meta.dumps(meta))
        rows = [(0, 8), (8, 13)]
        jobs = [
            writer_mod.PieceJob(
                i, zarr_meta.chunk_key((i, 0)), HostData(full[a:b]), block, inner, codec
            )
            for i, (a, b) in enumerate(rows)
        ]
        store = PosixStore(root)
        store.prepare(job.key for job in jobs)
        written = writer_mod.write_pieces(store, jobs, workers=3)
        got = np.asarray(zarr.open_array(str(root), mode="r")[...])
        assert got.tobytes() == full.tobytes(), choice
        for job, (a, b) in zip(jobs, rows, strict=True):
            size, crc = written[job.id][:2]
            assert size == os.path.getsize(root / job.key)
            out = np.zeros((b - a, 37), dtype=full.dtype)
            PieceReader("w", store, job.key, full.dtype, crc, codec).read_sharded(
                block, inner, Box.full(out.shape), out
            )
            assert out.tobytes() == full[a:b].tobytes()


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize("staged", [False, True])
def test_a_failing_worker_stops_the_save_and_loses_nothing(
    tmp_path: Path, tiny: None, monkeypatch: pytest.MonkeyPatch, staged: bool
) -> None:
    w = random_tensor(torch.float32, (64, 64), 3)
    save1({"w": w}, tmp_path / "ck", small_bytes=0, inner_bytes=512)
    before = snapshot(tmp_path)
    real = PosixWriter.write
    calls = itertools.count()

    def write(self: Any, buffers: Any, offset: int) -> int:  # the disk fills up
        if next(calls) == 5:
            raise OSError(28, "No space left on device")
        return real(self, buffers, offset)

    monkeypatch.setattr(PosixWriter, "write", write)
    new = (w + 1).t().contiguous().t() if staged else w + 1
    with pytest.raises(OSError, match="No space left"):
        save1(
            {"w": new},
            tmp_path / "ck",
            overwrite=True,
            small_bytes=0,
            inner_bytes=512,
            io_workers=3,
        )
    assert snapshot(tmp_path) == before and leftovers(tmp_path) == []
    monkeypatch.undo()
    got = {"w": torch.zeros(64, 64)}
    load1(got, tmp_path / "ck")
    assert_same_bits(got["w"], w)


@pytest.mark.parametrize("staged", [False, True])
def test_a_corrupted_chunk_fails_a_parallel_load(tmp_path: Path, tiny: None, staged: bool) -> None:
    w = random_tensor(torch.float32, (64, 64), 4)
    save1({"w": w}, tmp_path / "ck", small_bytes=0, inner_bytes=512)
    (shard,) = [
        p for p in (tmp_path / "ck" / "w").rglob("*") if p.is_file() and p.name != "zarr.json"
    ]
    data = bytearray(shard.read_bytes())
    data[32 * 4 + 3 * 516 + 100] ^= 0x40  # inside inner chunk 3 (of 32, 2 rows each)
    shard.write_bytes(bytes(data))
    target = torch.zeros(64, 64)
    with pytest.raises(CorruptCheckpointError, match=r"'w'.*inner chunk \(3, 0\)"):
        load1({"w": target.t().t() if not staged else target.t()}, tmp_path / "ck", io_workers=3)


# --------------------------------------------------------------------------- bounded memory

_MEMORY_SCRIPT = """
import resource, sys, torch, distckpt
from distckpt.comm import SingleComm

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

distckpt.set_staging(slab_bytes=4 << 20, slabs=4)
base = torch.randn(8192, 8192)                     # 256 MiB
state = {"w": base.t()}                             # not readable in place: staged
distckpt.save({"w": torch.zeros(4, 4).t()}, sys.argv[1] + "/warm", SingleComm())
before = peak()
distckpt.save(state, sys.argv[1] + "/ck", SingleComm(), io_workers=2)
saved = peak()
target = torch.empty(8192, 8192)
target.fill_(0)
before_load = peak()
distckpt.load({"w": target.t()}, sys.argv[1] + "/ck", SingleComm(), io_workers=2)
loaded = peak()
assert torch.equal(target.t(), base.t())
print((saved - before) >> 20, (loaded - before_load) >> 20)
"""


def test_staged_save_and_load_stay_within_the_slabs(tmp_path: Path) -> None:
    """Saving a 256 MiB view that needs a copy, and loading into one, add about the slabs
    (4 x 4 MiB) to the peak memory, not the tensor's size."""
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    save_mib, load_mib = (int(x) for x in out.stdout.split())
    assert save_mib < 64 and load_mib < 64, out.stdout


# --------------------------------------------------------------------------- prepare


def test_prepare_async_allocates_the_snapshot_buffers(tmp_path: Path) -> None:
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    ckpt = distckpt.Checkpoint(model=model, optimizer=opt)
    with distckpt.CheckpointManager(ckpt, tmp_path, prepare_async=True) as manager:
        from distckpt.pipeline import background as save_mod

        params = (64 * 32 + 32) * 4
        assert manager.prepare_async() >= 3 * params  # parameters and both Adam moments
        before = dict(save_mod._POOL._buffers)
        handle = manager.save(async_save=True)
        manager.sync()
        after = save_mod._POOL._buffers
        assert after and all(before[k] is v for k, v in after.items())  # none allocated
        assert handle.path.endswith("ckpt-1")
    state = {"w": torch.arange(6.0), "n": 3}
    assert distckpt.prepare_async(state) >= 24


# --------------------------------------------------------------------------- fork


def _save_and_load_in_child(path: str) -> None:
    state = {"w": torch.arange(4096.0).reshape(64, 64).t()}  # staged, on the workers
    save1(state, Path(path), small_bytes=0, inner_bytes=1024, io_workers=2)
    got = {"w": torch.zeros(64, 64)}
    load1(got, Path(path), io_workers=2)
    os._exit(0 if torch.equal(got["w"], state["w"]) else 3)


def test_a_forked_child_saves_with_fresh_workers(tmp_path: Path) -> None:
    """A process forked after a save (a data loader worker, a forked evaluation) has none
    of its parent's I/O threads: its saves and loads start their own, and do not hang."""
    import multiprocessing

    save1({"w": torch.ones(64, 64)}, tmp_path / "parent", small_bytes=0, io_workers=2)
    child = multiprocessing.get_context("fork").Process(
        target=_save_and_load_in_child, args=(str(tmp_path / "child"),)
    )
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung in its save or load")
    assert child.exitcode == 0
