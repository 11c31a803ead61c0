"""Crash-state scenarios of the POSIX store (see tests/support/crash_states.py).

Each scenario records what distckpt does on the file system, builds every state a crash
could leave, and returns the violations of distckpt's promises found in them:

* ``manager``: a CheckpointManager (max_to_keep=1) saves ckpt-1, then ckpt-2 (the
  ``latest`` pointer created, then moved under its lock; ckpt-1 retired). In every
  state, what the pointer names loads bit-exact, with distckpt and with zarr-python
  (its arrays' own metadata survive too); a save that returned is never lost;
  a manager opened on the state (its recovery, then ``restore_or_initialize``) restores
  one of the saves bit-exact, the newest that returned or a newer one.
* ``incremental``: the same, where save 2 changes one variable only: it takes the others
  from ckpt-1 (hard links), then retention retires ckpt-1. The same promises hold in
  every state; ckpt-2 must have taken them (its index says), or the scenario tests
  nothing.
* ``overwrite``: ``save(..., overwrite=True)`` replaces a committed checkpoint: in every
  state the name holds the old or the new checkpoint, bit-exact, with distckpt and with
  zarr-python (the new one once the
  save returned), before recovery and after it.
* ``overwrite-fallback``: the same where the file system has no RENAME_EXCHANGE (two
  renames): the name may be missing between them, so only what the directory holds after
  recovery (``collect_garbage``, which every manager and save runs) is checked.

Run as a script (``crash_scenarios.py SCENARIO DIR [first]``) it prints the violations
as JSON, one per line (with ``first``, only the first found), and ``states N`` with the
number of states checked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import zarr

import distckpt  # noqa: E402
from distckpt.commit.transaction import collect_garbage  # noqa: E402
from distckpt.storage import posix  # noqa: E402
from distckpt.training.lock import LOCK_FILE  # noqa: E402
from tests.support.crash_states import each_state, recording  # noqa: E402

distckpt.register_zarr_dtypes()

SCENARIOS = ("manager", "incremental", "overwrite", "overwrite-fallback")

#: Stop at the first state that breaks a promise (``first`` on the command line).
FIRST = False


#: In the ``incremental`` scenario save 2 changes ``w`` alone (see :func:`values`).
INCREMENTAL = False


def values(version: int) -> dict[str, torch.Tensor]:
    """The variables of save ``version`` by name: distinct bits in every element,
    several dtypes, a nested group (:data:`INCREMENTAL`: save 2 changes ``w`` alone)."""
    if INCREMENTAL and version == 2:
        return {**values(1), "w": torch.randn(6, 5, generator=torch.Generator().manual_seed(2))}
    g = torch.Generator().manual_seed(version)
    return {
        "w": torch.randn(6, 5, generator=g),
        "net/b": torch.randn(7, generator=g).to(torch.bfloat16),
        "net/n": torch.randint(-(2**40), 2**40, (3,), generator=g),
    }


def nest(flat: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``{"net/b": t}`` as ``{"net": {"b": t}}`` (the tensors themselves)."""
    out: dict[str, Any] = {}
    for name, tensor in flat.items():
        *groups, leaf = name.split("/")
        at = out
        for group in groups:
            at = at.setdefault(group, {})
        at[leaf] = tensor
    return out


def blank() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in values(0).items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit for bit (the flat views of the states loaded into)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and a[k].contiguous().view(torch.uint8).equal(b[k].contiguous().view(torch.uint8))
        for k in a
    )


def which(state: dict[str, torch.Tensor], versions: range) -> int | None:
    return next((v for v in versions if same(state, values(v))), None)


#: zarr-python's verdict on each checkpoint seen, by its bytes: many crash states hold the
#: same checkpoint (they differ elsewhere), and the same bytes read the same.
_ZARR_VERDICTS: dict[tuple[int, bytes], str | None] = {}


def zarr_differs(path: Path | str, version: int) -> str | None:
    """Why zarr-python does not read save ``version`` at ``path`` (None: it does). A
    checkpoint is a zarr v3 store, so its arrays' own metadata must survive too."""
    key = (version, _contents(Path(path)))
    if key not in _ZARR_VERDICTS:
        _ZARR_VERDICTS[key] = _zarr_differs(path, version)
    return _ZARR_VERDICTS[key]


def _contents(path: Path) -> bytes:
    """A digest of every name and byte under ``path`` (a directory of plain files)."""
    h = hashlib.blake2b(digest_size=16)
    for item in sorted(path.rglob("*")):
        h.update(str(item.relative_to(path)).encode() + b"\0")
        if item.is_symlink():
            h.update(b"link:" + os.readlink(item).encode())
        elif item.is_file():
            h.update(b"file:" + item.read_bytes())
    return h.digest()


def _zarr_differs(path: Path | str, version: int) -> str | None:
    try:
        group = zarr.open_group(str(path), mode="r")
        for name, want in values(version).items():
            array: Any = group
            for part in name.split("/"):  # through each group's own metadata
                array = array[part]
            got = array[...]
            if array.shape != tuple(want.shape) or got.tobytes() != _bytes(want):
                return f"zarr reads other values of {name!r}"
    except Exception as exc:  # noqa: BLE001 - any failure to read is the finding
        return f"zarr cannot read it: {type(exc).__name__}: {exc}"
    return None


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


class Violations(list[dict[str, Any]]):
    def add(self, where: Any, what: str) -> None:
        self.append({"prefix": where.prefix, "marks": where.marks, "violation": what})


def _saved(marks: list[str]) -> int:
    """The newest save that had returned when the crash came (0: none)."""
    return max((int(m.split("-")[1]) for m in marks if m.startswith("saved-")), default=0)


# --------------------------------------------------------------------------- manager


def _managed(flat: dict[str, torch.Tensor]) -> distckpt.Checkpoint:
    return distckpt.Checkpoint(**nest(flat))


def manager(root: Path, states: Path) -> tuple[Violations, int]:
    run = root / "run"
    run.mkdir()
    tensors = values(1)
    ckpt = _managed(tensors)
    with (
        recording(run) as rec,
        distckpt.CheckpointManager(ckpt, run, max_to_keep=1, io_workers=1) as mgr,
    ):
        mgr.save()
        rec.mark("saved-1")
        for k, v in values(2).items():
            tensors[k].copy_(v)
        second = mgr.save()
        rec.mark("saved-2")
    found = Violations()
    taken = "reused" in (Path(second) / "zarr.json").read_text()
    if taken != INCREMENTAL:
        found.append({"prefix": 0, "marks": [], "violation": f"save 2 took pieces: {taken}"})
    count = 0
    for state, where in each_state(rec, states):
        if FIRST and found:
            break
        count += 1
        newest = _saved(state.marks)
        # Raw: what the pointer names.
        try:
            latest = distckpt.latest_checkpoint(where)
        except distckpt.CheckpointError as exc:
            found.add(state, f"the pointer is unusable: {exc}")
            continue
        if latest is None:
            if newest:
                found.add(state, f"no pointer, though save {newest} had returned")
        else:
            got = blank()
            try:
                distckpt.load(nest(got), latest, strict=False)  # and save_counter
                version = which(got, range(1, 3))
                if version is None:
                    found.add(state, f"{latest} loads values of no save")
                elif version < newest:
                    found.add(state, f"the pointer names save {version}; {newest} had returned")
                elif (why := zarr_differs(latest, version)) is not None:
                    found.add(state, f"the pointer names {latest}: {why}")
            except distckpt.CheckpointError as exc:
                found.add(state, f"the pointer names {latest}, which does not load: {exc}")
        # Recovered: a manager opened on the state restores the newest save.
        lock = where / LOCK_FILE
        if lock.exists():
            os.utime(lock, (0, 0))  # the crashed job's lease, long expired
        restored = blank()
        try:
            with distckpt.CheckpointManager(_managed(restored), where, max_to_keep=1) as again:
                path = again.restore_or_initialize()
        except distckpt.CheckpointError as exc:
            found.add(state, f"a manager opened after the crash fails: {exc}")
            continue
        version = which(restored, range(1, 3)) if path else 0
        if path and version is None:
            found.add(state, f"the manager restored {path}, values of no save")
        elif version is not None and version < newest:
            found.add(state, f"the manager restored save {version}; {newest} had returned")
    return found, count


# --------------------------------------------------------------------------- overwrite


def overwrite(root: Path, states: Path, *, fallback: bool = False) -> tuple[Violations, int]:
    target = root / "d" / "ck"
    distckpt.save(nest(values(1)), target)
    real_exchange = posix.exchange
    if fallback:
        posix.exchange = lambda *names, **dir_fds: False  # type: ignore[assignment]
    try:
        with recording(root / "d") as rec:
            distckpt.save(nest(values(2)), target, overwrite=True, io_workers=1)
            rec.mark("saved-2")
    finally:
        posix.exchange = real_exchange
    found = Violations()
    count = 0
    for state, where in each_state(rec, states):
        if FIRST and found:
            break
        count += 1
        newest = _saved(state.marks)
        for when in ("recovered",) if fallback else ("before recovery", "recovered"):
            if when == "recovered":
                collect_garbage(where)
            got = blank()
            try:
                distckpt.load(nest(got), where / "ck")
            except distckpt.CheckpointError as exc:
                found.add(state, f"{when}: the name holds no checkpoint: {exc}")
                continue
            version = which(got, range(1, 3))
            if version is None:
                found.add(state, f"{when}: the name holds values of no save")
            elif version < newest:
                found.add(state, f"{when}: the name holds save 1; save 2 had returned")
            elif (why := zarr_differs(where / "ck", version)) is not None:
                found.add(state, f"{when}: {why}")
    return found, count


def run(scenario: str, root: Path, states: Path | None = None) -> tuple[Violations, int]:
    """Record ``scenario``'s saves under ``root``, then check every crash state, each
    made in turn under ``states`` (default: ``root/states``; memory is faster: each state
    is written, checked and removed)."""
    global INCREMENTAL
    INCREMENTAL = scenario == "incremental"
    states = states if states is not None else root / "states"
    if scenario in ("manager", "incremental"):
        return manager(root, states)
    return overwrite(root, states, fallback=scenario == "overwrite-fallback")


if __name__ == "__main__":
    logging.getLogger("distckpt").setLevel(logging.ERROR)  # the recoveries it reports
    print(f"library {distckpt.__file__}", flush=True)
    FIRST = sys.argv[3:] == ["first"]
    violations, states = run(sys.argv[1], Path(sys.argv[2]))
    for v in violations:
        print(json.dumps(v))
    print(f"states {states}")
