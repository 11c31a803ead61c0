"""The conformance suite of :class:`~distckpt.storage.backend.Store`: what every backend
does, proven the same way for the repository's own (``tests/storage/test_storage.py``) and for
any other. Import it in tests only: it needs pytest.

A backend's test module subclasses :class:`StoreTests`, says what its store declares, and
provides a fresh, empty store::

    class TestMyStore(StoreTests):
        capabilities = MyStore.capabilities

        @pytest.fixture
        def store(self, tmp_path: Path) -> Store:
            return MyStore(tmp_path / "store")

The store's URL must open it again (``open_store(store.url)``: its scheme registered). The
cases that its capabilities do not call for are not collected (rather than skipped), nor
are those of a hook the subclass leaves out:

* :meth:`StoreTests.second_client`: another client of the same location, for the races
  (default: ``open_store(store.url)``);
* :attr:`StoreTests.process_races`: the conditional writers also race as forked
  processes, each opening the store from its URL (default True);
* :meth:`StoreTests.faults`: a context in which the store's requests meet injected
  faults it must ride out (default: none).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from distckpt.commit import transaction
from distckpt.errors import UnsafePathError
from distckpt.storage.backend import (
    Capabilities,
    ConditionFailed,
    CopyingStore,
    ReadHandle,
    RenamingStore,
    Store,
    SyncingStore,
    WriteHandle,
)
from distckpt.storage.registry import is_remote, location, open_store
from distckpt.testing.conditional_cases import ConditionalWriteCases
from distckpt.testing.store_helpers import (
    HOSTILE_KEYS,
    MiB,
    needs,
    payload,
    write_out_of_order,
)


class StoreTests(ConditionalWriteCases):
    """What every :class:`~distckpt.storage.backend.Store` does (see the module)."""

    #: What the backend's store declares (``MyStore.capabilities``); selects the cases.
    capabilities: ClassVar[Capabilities]
    #: Whether conditional writers also race as forked processes (see the module).
    process_races: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Leave out the cases that ``capabilities`` and the hooks do not call for."""
        super().__init_subclass__(**kwargs)
        caps = getattr(cls, "capabilities", None)
        if not isinstance(caps, Capabilities):
            return  # an intermediate class: its subclasses say
        hooks = {
            "test_faults": cls.faults is not StoreTests.faults,
            "test_put_new_race_processes": cls.process_races,
            "test_put_if_race_processes": cls.process_races,
        }
        for name in dir(StoreTests):
            if not name.startswith("test_") or name in vars(cls):
                continue  # not a case, or the subclass's own (None: left out by it)
            case = next(vars(k)[name] for k in cls.__mro__[1:] if vars(k).get(name) is not None)
            applies = all(getattr(caps, f) for f in getattr(case, "_needs", ()))
            setattr(cls, name, case if applies and hooks.get(name, True) else None)

    # -- what a subclass provides ----------------------------------------------------

    @pytest.fixture
    def store(self) -> Store:
        """A fresh, empty store (the subclass's fixture)."""
        raise NotImplementedError("a StoreTests subclass provides the store fixture")

    def faults(self, store: Store) -> AbstractContextManager[Callable[[], int]] | None:
        """A context in which requests of ``store`` meet injected faults (errors, dropped
        connections) that it must ride out; it yields a function that counts the faults
        injected so far. None: the backend has no fault injector."""
        return None

    # -- the protocol, names and locations -------------------------------------------

    def test_protocols(self, store: Store) -> None:
        assert isinstance(store, Store)
        assert store.capabilities == self.capabilities
        strategy = transaction.declared(store)
        lacking = [flag for flag in strategy.requires if not getattr(store.capabilities, flag)]
        assert not lacking, f"its commit strategy {strategy.name!r} needs {lacking}"
        if store.capabilities.renames:
            assert isinstance(store, RenamingStore)
        writer = store.create("k")
        assert isinstance(writer, WriteHandle)
        writer.abort()
        store.write("k", b"x")
        with store.open("k") as reader:
            assert isinstance(reader, ReadHandle)
        assert is_remote(store) == (not store.capabilities.local_files)

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
        assert open_store(child.url) == child
        assert open_store(child) is child
        assert is_remote(child.url) == is_remote(child)
        local = child.capabilities.local_files
        assert location(child) == (Path(child.url) if local else child.url)

    def test_hostile_keys(self, store: Store) -> None:
        caps = store.capabilities
        ops: list[Callable[[str], object]] = [
            store.read,
            store.read_versioned,
            lambda k: store.open(k).read(0, 1),
            lambda k: store.write(k, b"x"),
            lambda k: store.create(k).finish(),
            store.exists,
            store.is_dir,
            store.age,
            store.list,
            store.walk,
            store.delete,
            store.delete_tree,
            store.child,
            lambda k: store.prepare([k]),
            lambda k: store.persist([k]),
        ]
        if caps.conditional_create:
            ops.append(lambda k: store.put_new(k, b"x"))
        if caps.conditional_update:
            ops.append(lambda k: store.put_if(k, b"x", "v"))
        for key in HOSTILE_KEYS:
            for op in ops:
                with pytest.raises(UnsafePathError):
                    op(key)
        assert store.walk() == []

    # -- objects -----------------------------------------------------------------------

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
        assert not store.exists("there/nope")  # below an object: nothing, not an error
        assert not store.is_dir("there/nope")
        assert store.list("nope") == []
        assert store.walk("nope") == []
        assert not store.is_dir("nope")
        store.delete("nope")
        store.delete_tree("nope")
        assert store.read("there") == b"1"

    def test_age(self, store: Store) -> None:
        store.write("fresh", b"1")
        age = store.age("fresh")
        assert -2.0 < age < 60.0  # object stores keep whole seconds

    # -- listing and deleting ----------------------------------------------------------

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
        assert store.exists("b/d") and -2.0 < store.age("b/d") < 60.0  # a prefix is there too
        assert not store.is_dir("a")
        assert not store.is_dir("b/c")
        assert not store.is_dir("nope")

    def test_delete(self, store: Store) -> None:
        tree = self._tree(store)
        store.delete("a")
        assert not store.exists("a")
        store.delete("a")  # absent: nothing happens
        store.delete_tree("b")
        assert not store.is_dir("b") and not store.exists("b")
        assert not store.exists("b/c")
        assert sorted(k for k, _, _ in store.walk()) == ["c/x/y", "z.json"]
        store.delete_tree("b")
        store.delete_tree("nowhere")
        assert store.read("c/x/y") == tree["c/x/y"]
        store.delete_tree()
        assert store.walk() == []
        assert store.list() == []

    # -- reads and writes at offsets ---------------------------------------------------

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

    @needs("parallel_writes")
    @pytest.mark.parametrize("size", [0, 1000, MiB, 5 * MiB, 10 * MiB, 13 * MiB + 12345])
    def test_create_out_of_order(self, store: Store, size: int) -> None:
        data = payload(size, seed=size)
        store.prepare(["x/piece.bin"])
        handle = store.create("x/piece.bin", size_hint=size)
        write_out_of_order(handle, data, random.Random(size))
        handle.finish()
        store.persist(["x/piece.bin"])
        assert store.read("x/piece.bin") == data
        assert [(k, n) for k, n, _ in store.walk("x")] == [("piece.bin", size)]
        handle.abort()  # after finish: nothing happens, the object stays
        assert store.read("x/piece.bin") == data

    @needs("parallel_writes")
    def test_create_sizes_without_hint(self, store: Store) -> None:
        data = payload(2 * MiB + 1, seed=9)
        store.prepare(["nohint"])
        handle = store.create("nohint")
        assert handle.write([data[MiB:]], MiB) == MiB + 1
        assert handle.write([data[:MiB]], 0) == MiB
        handle.finish(durable=False)
        assert store.read("nohint") == data

    def test_abort(self, store: Store) -> None:
        data = payload(6 * MiB, seed=11)
        store.prepare(["y/piece.bin", "y/never.bin"])
        handle = store.create("y/piece.bin", size_hint=len(data))
        handle.write([data[: 5 * MiB]], 0)
        handle.write([data[5 * MiB :]], 5 * MiB)
        handle.abort()
        handle.abort()  # idempotent
        with pytest.raises(ValueError):
            handle.write([b"late"], 0)
        store.create("y/never.bin").abort()  # nothing written
        assert not store.exists("y/piece.bin")
        assert not store.exists("y/never.bin")
        assert [k for k, _, _ in store.walk()] == []

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

    # -- what some stores have -----------------------------------------------------------

    @needs("renames")
    def test_rename_exchange_touch(self, store: Store) -> None:
        assert isinstance(store, RenamingStore)
        store.write("a/x", b"1")
        store.write("b/y", b"2")
        store.rename("a", "c")
        assert not store.exists("a") and store.read("c/x") == b"1"
        with pytest.raises(OSError):
            store.rename("c", "b")  # b holds entries: never replaced
        assert store.read("c/x") == b"1" and store.read("b/y") == b"2"
        with pytest.raises(FileNotFoundError):
            store.rename("nope", "d")
        if store.exchange("b", "c"):
            assert store.read("b/x") == b"1" and store.read("c/y") == b"2"
        else:  # the store cannot: nothing happened
            assert store.read("c/x") == b"1" and store.read("b/y") == b"2"
        store.write("beat", b"")
        store.touch("beat")
        assert -2.0 < store.age("beat") < 60.0
        with pytest.raises(FileNotFoundError):
            store.touch("nope")

    @needs("copies")
    def test_copy(self, store: Store) -> None:
        """A copy from another store of the same kind (a sibling checkpoint) holds the same
        bytes and outlives its source; a source gone, or not the version stamped, is
        refused and leaves nothing behind; a write makes a new stamp."""
        source, target = store.child("base"), store.child("new")
        assert isinstance(source, CopyingStore) and isinstance(target, CopyingStore)
        data = payload(3 * MiB + 5, seed=7)
        source.write("piece", data)
        stamp = source.stamp("piece")
        target.prepare(["piece", "again", "stale"])
        target.copy(source, "piece", "piece", expect=stamp)
        target.persist(["piece"])
        assert target.read("piece") == data
        target.copy(source, "piece", "again")
        source.delete("piece")  # the copies stand alone
        assert target.read("piece") == data and target.read("again") == data
        with pytest.raises(FileNotFoundError):
            target.copy(source, "piece", "gone")
        assert not target.exists("gone")
        source.write("piece", payload(3 * MiB + 5, seed=8))  # written again
        if stamp is not None:
            assert source.stamp("piece") != stamp
            with pytest.raises(ConditionFailed):
                target.copy(source, "piece", "stale", expect=stamp)
            assert not target.exists("stale")

    @needs("syncs")
    def test_sync(self, store: Store) -> None:
        """Files finished without durability are whole once synced together, in nested
        directories too; a store that cannot sync where it is says so."""
        assert isinstance(store, SyncingStore)
        keys = ["s/a", "s/b/c"]
        store.prepare(keys)
        for n, key in enumerate(keys):
            handle = store.create(key, 10 + n)
            handle.write([payload(10 + n, seed=n)], 0)
            handle.finish(durable=False)
        if store.can_sync():
            store.sync(keys)
        else:
            store.persist(keys)
        for n, key in enumerate(keys):
            assert store.read(key) == payload(10 + n, seed=n)

    @needs("local_files")
    def test_local_files(self, store: Store) -> None:
        store.write("d/f", b"bytes")
        assert Path(store.where("d/f")).read_bytes() == b"bytes"
        assert location(store) == Path(store.url)
        # Links inside the store are never followed, wherever they lead.
        outside = Path(store.url).parent / f"{Path(store.url).name}.outside"
        (outside / "sub").mkdir(parents=True)
        (outside / "f").write_bytes(b"outside")
        os.symlink(outside / "f", store.where("link"))
        os.symlink(outside / "sub", store.where("ldir"))
        for op in (
            lambda: store.read("link"),
            lambda: store.open("link").read(0, 1),
            lambda: store.read("ldir/f"),
            lambda: store.write("ldir/g", b"x"),
            lambda: store.list("ldir"),
            lambda: store.walk("ldir"),
        ):
            with pytest.raises(UnsafePathError):
                op()
        store.delete_tree("ldir")
        store.delete("link")
        assert (outside / "f").read_bytes() == b"outside" and (outside / "sub").is_dir()
        assert sorted(p.name for p in outside.iterdir()) == ["f", "sub"]

    def test_faults(self, store: Store) -> None:
        injector = self.faults(store)
        assert injector is not None
        caps = store.capabilities
        rng = random.Random(7)
        with injector as injected:
            for i in range(20):
                data = payload(rng.randint(0, 3000), seed=i)
                store.write(f"small/{i}", data)
                assert store.read(f"small/{i}") == data
            assert store.list("small") == sorted(str(i) for i in range(20))
            if caps.conditional_create:
                version = store.put_new("lease", b"mine")
                if caps.conditional_update:
                    version = store.put_if("lease", b"mine again", version)
                    assert store.read_versioned("lease") == (b"mine again", version)
            big = payload(13 * MiB + 5, seed=13)
            handle = store.create("big", size_hint=len(big))
            if caps.parallel_writes:
                write_out_of_order(handle, big, rng)
            else:
                handle.write([big], 0)
            handle.finish()
            with store.open("big") as reader:
                reader.will_need([(0, 6 * MiB), (7 * MiB, 6 * MiB + 5)])
                assert reader.read(0, 6 * MiB) + reader.read(6 * MiB, len(big)) == big
            store.delete_tree("small")
            assert "small" not in store.list()
            assert injected() >= 3, "too few faults were injected to prove anything"
        assert store.read("big") == big
