"""Racing saves of one name, on every store (``backend``: a directory, S3, Azure): a
save that finds the name taken raises CheckpointExists, whichever commit the store uses
(a rename, or a claim and the index last), and never leaves the loser's bytes under it.
(On a directory this is not yet so: see :data:`RACERS`.)

The racers are tests/scripts/s3_ranks.py ``race``, whose values are pure functions of
who saved and when.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import distckpt
from distckpt.comm import SingleComm
from distckpt.commit import claim as claim_mod
from distckpt.storage.registry import open_store
from tests.support.backends import OBJECT_STORES, Backend
from tests.support.launch_util import SCRIPTS, check, finish, load_script, output, start

SCRIPT = SCRIPTS / "s3_ranks.py"
COMM = SingleComm()
RACE_ROUNDS = 6

sr = load_script(SCRIPT, "s3_ranks_script")


#: A directory store too, where the loser of the race can get the rename's own error: it
#: checks that the name is free, then renames its staging directory onto it, and when the
#: other save renamed in between, rename(2) fails with ENOTEMPTY (an OSError, not
#: CheckpointExists; nothing is overwritten). Expected to fail until the rename commit
#: (distckpt/commit/staging.py) turns that into CheckpointExists.
RACERS = ["posix", *OBJECT_STORES]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", RACERS, indirect=True)
def test_two_jobs_save_one_name(backend: Backend, tmp_path: Path) -> None:
    """Two single-process jobs save different states to one name at the same moment,
    6 times: exactly one commits, the other raises CheckpointExists, and the name holds
    the winner's state, bit for bit, with no claim left beside it. (Each process is
    started afresh: obstore's runtime does not survive a fork.)"""
    markers = tmp_path / "markers"
    args = ["race", backend.url, "{who}", str(RACE_ROUNDS), str(markers)]
    env = {**backend.env, "DISTCKPT_TIMEOUT": "30"}
    procs = [
        start([sys.executable, str(SCRIPT), *(a.format(who=who) for a in args)], env)
        for who in (0, 1)
    ]
    done = [finish(p, 100) for p in procs]
    results: dict[int, dict[int, str]] = {}
    for proc in done:
        check(proc)
        assert re.search(r"^OK \d$", proc.stdout, re.M), output(proc)
        for r, who, outcome in re.findall(r"^RESULT (\d+) (\d+) (\S+)$", proc.stdout, re.M):
            results.setdefault(int(r), {})[int(who)] = outcome
    winners = []
    for r in range(RACE_ROUNDS):
        outcomes = results.get(r, {})
        assert sorted(outcomes.values()) == ["committed", "exists"], (r, outcomes)
        winner = next(w for w, o in outcomes.items() if o == "committed")
        winners.append(winner)
        path = f"{backend.url}/race-{r}"
        state: dict[str, Any] = {"a": torch.zeros(300, 50), "b": torch.zeros(7, dtype=torch.int64)}
        state["who"] = None
        distckpt.load(state, path, COMM)
        want = sr.race_state(winner, r)
        assert state["who"] == winner
        assert torch.equal(state["a"], want["a"]) and torch.equal(state["b"], want["b"])
        assert claim_mod.read_claim(open_store(path)) is None
    assert len(set(winners)) == 2, f"one process won every round: {winners}"


def test_a_save_that_begins_while_garbage_collection_judges_it_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Garbage collection of a directory (every save's coordinator runs it on the parent)
    looks for the owner file of a staging directory a save has just made, finds none, and
    lists the directory after the save wrote it: that save is live, and its directory
    stays. The interleaving is forced: the first look fails the moment the owner file is
    written. Before, a listing that was not empty, without an index, read as a dead save's
    leftover, and a save into a sibling path removed a live save's staging directory (3
    ranks saving alone into replica-0, -1 and -2 of one directory)."""
    from distckpt.commit import staging as staging_mod

    parent = open_store(tmp_path)
    entry = staging_mod.staging_name("replica-2", "ab12cd34")
    (tmp_path / entry).mkdir()  # the save has made its directory, not yet its owner file
    live = parent.child(entry)
    store_type = type(live)
    real_age = store_type.age
    owner = {"host": staging_mod.socket.gethostname(), "pid": staging_mod.os.getpid()}

    def age(self: Any, key: str = "") -> float:
        if key == staging_mod.OWNER_FILE and self.url == live.url:
            try:
                return float(real_age(self, key))
            except FileNotFoundError:
                # The save writes its owner file just after this look found none.
                live.write(key, staging_mod.seal.encode(owner))
                raise
        return float(real_age(self, key))

    monkeypatch.setattr(store_type, "age", age)
    assert staging_mod.collect(parent) == []
    assert (tmp_path / entry / staging_mod.OWNER_FILE).exists()
