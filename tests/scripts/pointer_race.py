"""Real processes racing on the ``latest`` pointer of a POSIX run directory.

``pointer_race.py lock DIR``: this process (the contender) and a second one (the holder,
``pointer_race.py hold DIR``) move one pointer. The holder takes the pointer's lock as
the library does, and keeps it until the contender is seen waiting for it in
``/proc/locks`` (or has returned: a library that does not lock). It then moves the
pointer and lets go. The contender had read the pointer before and moves it from that
version (``put_if``): it must get ``ConditionFailed``, and the pointer must be the
holder's. Prints ``OK`` or ``VIOLATION <what>``. Nothing here depends on timing: the
holder acts on events (the waiter, the return), each with a deadline.

``pointer_race.py advance DIR K N PASSES``: job K of two advances ``latest`` over
``ckpt-1..N`` of ``DIR/p<pass>`` (job 0 every name, job 1 every other) after reading a
line on stdin for each pass. Prints ``SEEN pass before after outcome`` per advance.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import distckpt
from distckpt.errors import PointerConflictError
from distckpt.storage import posix
from distckpt.storage.backend import ConditionFailed
from distckpt.storage.fsutil import atomic_write
from distckpt.training.pointer import POINTER_FILE, Pointer, advance_pointer, read_pointer

DEADLINE = 60.0


def _waiter_on(path: Path) -> bool:
    """Whether a process waits for a lock on ``path`` (a ``->`` line of /proc/locks)."""
    inode = os.stat(path).st_ino
    with open("/proc/locks") as f:
        return any("->" in line and re.search(rf":{inode}\s", line) is not None for line in f)


def hold(directory: Path) -> None:
    pointer = directory / POINTER_FILE
    returned = threading.Event()

    def listen() -> None:
        for line in sys.stdin:
            if line.strip() == "returned":
                returned.set()

    threading.Thread(target=listen, daemon=True).start()
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    with posix._locked(str(pointer), fd, pointer.name):
        print("held", flush=True)
        lock = pointer.with_name(f".{pointer.name}.lock")
        deadline = time.monotonic() + DEADLINE
        while not returned.is_set() and not _waiter_on(lock):
            if time.monotonic() > deadline:
                raise SystemExit("the contender neither waited for the lock nor returned")
            time.sleep(0.005)
        atomic_write(pointer, Pointer("holder", ["holder"]).to_json())
    print("moved", flush=True)


def lock(directory: Path) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    store = posix.PosixStore(directory)
    version = store.put_new(POINTER_FILE, Pointer("first", ["first"]).to_json())
    holder = subprocess.Popen(
        [sys.executable, __file__, "hold", str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        if holder.stdout.readline().strip() != "held":
            print("VIOLATION the holder did not start")
            return 1
        outcome: list[str] = []

        def contend() -> None:
            try:
                store.put_if(POINTER_FILE, Pointer("contender", ["contender"]).to_json(), version)
                outcome.append("moved")
            except ConditionFailed:
                outcome.append("refused")
            assert holder.stdin is not None
            holder.stdin.write("returned\n")
            holder.stdin.flush()

        thread = threading.Thread(target=contend)
        thread.start()
        thread.join(DEADLINE)
        holder.wait(DEADLINE)
    finally:
        holder.kill()
    latest = read_pointer(directory)
    if outcome != ["refused"]:
        what = outcome[0] if outcome else "hung"
        print(f"VIOLATION the contender's put_if {what} while the holder held the lock")
        return 1
    if latest is None or latest.latest != "holder":
        print(f"VIOLATION the pointer is {latest}, not the holder's")
        return 1
    print("OK")
    return 0


def advance(directory: Path, k: int, names: int, passes: int) -> None:
    for p in range(passes):
        sys.stdin.readline()  # the start of pass p, given to both jobs at once
        run = directory / f"p{p}"
        for i in range(1 + k, names + 1, 1 + k):
            before = read_pointer(run)
            try:
                advance_pointer(run / f"ckpt-{i}")
                outcome = "ok"
            except PointerConflictError:
                outcome = "conflict"
            after = read_pointer(run)
            print(
                f"SEEN {p} {_number(before)} {_number(after)} {outcome} {i}",
                flush=True,
            )
        print(f"PASS {p}", flush=True)


def _number(pointer: Pointer | None) -> int:
    return 0 if pointer is None else int(pointer.latest.rsplit("-", 1)[1])


if __name__ == "__main__":
    mode, where = sys.argv[1], Path(sys.argv[2])
    if mode == "hold":
        hold(where)
    elif mode == "lock":
        print(f"library {distckpt.__file__}", flush=True)
        sys.exit(lock(where))
    else:
        advance(where, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
