"""The conformance suite's cases of conditional writes (:meth:`Store.put_new`,
:meth:`Store.put_if`) and of writers racing for them, from threads and from forked
processes. :class:`~distckpt.testing.store_suite.StoreTests` holds them; import it in
tests only.
"""

from __future__ import annotations

import multiprocessing
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import pytest

from distckpt.storage.backend import ConditionFailed, Store
from distckpt.storage.registry import open_store
from distckpt.testing.store_helpers import needs, race


class ConditionalWriteCases:
    """Conditional creates and updates, alone and racing (see the module)."""

    #: Threads in the races of conditional writers.
    racers: ClassVar[int] = 8

    def second_client(self, store: Store) -> Store:
        """Another client of the same location as ``store``, for the races."""
        return open_store(store.url)

    @needs("conditional_create")
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

    @needs("conditional_create", "conditional_update")
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

    @needs("conditional_update")
    def test_versions_change(self, store: Store) -> None:
        store.write("v", b"alpha")
        data1, v1 = store.read_versioned("v")
        store.write("v", b"beta")
        data2, v2 = store.read_versioned("v")
        assert (data1, data2) == (b"alpha", b"beta")
        assert v1 != v2
        store.write("v", b"gamma")
        assert store.read_versioned("v")[1] not in (v1, v2)

    def _race_threads(self, store: Store, write: Callable[[Store, bytes], object]) -> bytes:
        """``racers`` threads (half of them through a second client) write at once; exactly
        one may win. Returns the winner's bytes, which the store must hold."""
        other = self.second_client(store)
        gate = threading.Barrier(self.racers)
        won: list[bytes] = []
        race = uuid.uuid4().hex  # a version may name bytes: each race writes its own

        def one(i: int) -> None:
            data = f"writer {i} of race {race}".encode()
            gate.wait(30)
            try:
                write(other if i % 2 else store, data)
            except ConditionFailed:
                return
            won.append(data)

        with ThreadPoolExecutor(self.racers) as pool:
            list(pool.map(one, range(self.racers)))
        assert len(won) == 1, won
        assert store.read("race") == won[0]
        return won[0]

    @needs("conditional_create")
    def test_put_new_race_threads(self, store: Store) -> None:
        for trial in range(3):
            self._race_threads(store.child(f"t{trial}"), lambda s, d: s.put_new("race", d))

    @needs("conditional_create", "conditional_update")
    def test_put_if_race_threads(self, store: Store) -> None:
        store.put_new("race", b"start")
        for _ in range(3):
            _, version = store.read_versioned("race")

            def replace(s: Store, data: bytes, version: str = version) -> str:
                return s.put_if("race", data, version)

            self._race_threads(store, replace)

    def _race_processes(self, store: Store, op: str, version: str = "") -> None:
        ctx = multiprocessing.get_context("fork")
        gate = ctx.Barrier(4)
        results = ctx.Queue()
        procs = [
            ctx.Process(target=race, args=(store.url, op, i, version, gate, results))
            for i in range(4)
        ]
        for p in procs:
            p.start()
        try:
            outcomes = sorted(results.get(timeout=60) for _ in procs)
        finally:
            for p in procs:
                p.join(30)
                if p.exitcode is None:
                    p.kill()
        assert [p.exitcode for p in procs] == [0] * 4
        winners = [i for i, outcome in outcomes if outcome == "won"]
        assert len(winners) == 1, outcomes
        assert [o for _, o in outcomes].count("lost") == 3, outcomes
        assert store.read("race") == f"process {winners[0]}".encode()

    # No time-out marker: a plug-in author's pytest may lack pytest-timeout (and refuse an
    # unknown marker under --strict-markers); every wait of the race has its own deadline.
    @needs("conditional_create")
    def test_put_new_race_processes(self, store: Store) -> None:
        self._race_processes(store, "create")

    @needs("conditional_create", "conditional_update")
    def test_put_if_race_processes(self, store: Store) -> None:
        version = store.put_new("race", b"start")
        self._race_processes(store, "replace", version)
