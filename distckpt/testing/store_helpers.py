"""What the conformance suite (:mod:`distckpt.testing.store_suite`) writes with: payloads,
writes out of order from threads, keys that lead outside, and the forked racer. Import it
in tests only.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from distckpt.storage.backend import Capabilities, ConditionFailed, WriteHandle
from distckpt.storage.registry import open_store

#: Bytes in a mebibyte.
MiB = 1 << 20
F = TypeVar("F", bound=Callable[..., Any])

#: Keys that lead outside a store (or are no keys): every method refuses them.
HOSTILE_KEYS = ("..", "../x", "a/../../x", "/abs", "a//b", "./a", "a/./b", "a/..", "a\0b")


def needs(*flags: str) -> Callable[[F], F]:
    """Mark a case as one for the stores that declare every one of ``flags``."""
    unknown = set(flags) - set(Capabilities.__dataclass_fields__)
    if unknown:
        raise ValueError(f"no such capabilities: {sorted(unknown)}")

    def mark(case: F) -> F:
        case._needs = flags  # type: ignore[attr-defined]
        return case

    return mark


def payload(n: int, seed: int = 0) -> bytes:
    """``n`` random bytes, the same for the same ``seed``."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


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
    cuts = {
        p: sorted({p[0], sum(p), *(rng.randint(p[0], sum(p)) for _ in range(2))}) for p in pieces
    }

    def one(piece: tuple[int, int]) -> int:
        cut = cuts[piece]
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
        return handle.write(buffers, piece[0])

    with ThreadPoolExecutor(threads) as pool:
        written = list(pool.map(one, pieces))
    assert written == [n for _, n in pieces]


def race(url: str, op: str, i: int, version: str, gate: Any, results: Any) -> None:
    """One forked racer: open the store from ``url``, wait for the others, then write."""
    try:
        store = open_store(url)
        gate.wait(30)
        data = f"process {i}".encode()
        if op == "create":
            store.put_new("race", data)
        else:
            store.put_if("race", data, version)
        results.put((i, "won"))
    except ConditionFailed:
        results.put((i, "lost"))
    except BaseException as exc:  # reported, so the test fails with it
        results.put((i, f"{type(exc).__name__}: {exc}"))
