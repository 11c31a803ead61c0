"""Indexes that declare more than they store: a regular entry's chunk grid with a dimension
of zero beside huge ones, a huge grid whose columns claim to match it, a huge shape of a
one-byte dtype, 64 dimensions, listed pieces by the thousand. Each is crafted and resealed
as an attacker would, then read by every reader (``distckpt verify``, ``inspect``,
``ls``, ``diff``, ``export``, the DCP reader's ``read_metadata`` and ``distckpt.load``
into ``None`` placeholders) in a child process whose address space is bounded
(``tests/support/bounded_readers.py``; one child reads every case, once per module): the
memory a reader spends follows what is stored, never what is declared. A node-local
step's manifest that declares more than its data file holds is refused likewise.

What each reader does is the same for every kind of damage: a tensor with no elements
that is well-formed (its grid has no cell, its columns are empty) is read as the empty
tensor it is (``verify`` exit 0); an index that declares what no tensor can be is one
error naming the variable (the CLI: exit 2 and one line; ``verify`` reports the damage
it finds in the data, coverage or files, as exit 1 with a line per damaged piece).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import distckpt
from distckpt.testing.hostile import Crafted

pytestmark = pytest.mark.timeout(300)

READERS = Path(__file__).resolve().parents[1] / "support" / "bounded_readers.py"
CLI = ("verify", "inspect", "ls", "diff", "export")


def regular(
    shape: list[int], chunks: list[int], crc: Any, size: Any, dtype: str = "float32"
) -> dict[str, Any]:
    """A regular entry of ``w`` (see :mod:`distckpt.format.index`)."""
    return {
        "kind": "tensor",
        "dtype": dtype,
        "shape": shape,
        "path": "w",
        "layout": "regular",
        "chunks": chunks,
        "inner": None,
        "crc": crc,
        "size": size,
    }


def _listed_empty() -> dict[str, Any]:
    piece = {"file": "w/c.0.0", "box": [[0, 0], [0, 2**40]], "block": [1, 2**40],
             "inner": None, "crc": 0, "size": 0}  # fmt: skip
    return {"kind": "tensor", "dtype": "float32", "shape": [0, 2**40], "path": "w",
            "layout": "irregular", "pieces": [piece] * 5000}  # fmt: skip


MANY = 2**14  # shards of the many-shards case
CASES: dict[str, dict[str, Any]] = {
    "zero-beside-huge": regular([0, 2**40], [1, 1], [], []),
    "zero-among-64": regular([1] * 31 + [0, 2**31] + [1] * 31, [1] * 64, [], []),
    "64-most-bytes": regular([2] * 60 + [0] + [1] * 3, [1] * 64, [], []),
    "listed-empty": _listed_empty(),
    "zero-beside-impossible": regular([0, 2**61, 2**61], [1, 1, 1], [], []),
    "claims-list": regular([2**31, 2**29], [1, 1], [0, 1, 2], [8, 8, 8]),
    "claims-base64": regular(
        [2**31, 2**29], [1, 1], base64.b64encode(bytes(96)).decode(), [8, 8, 8]
    ),
    "huge-shard": regular([2**30, 2**29], [2**30, 2**29], [7], [2**61 + 4]),
    "one-byte-dtype": regular([2**61, 2], [2**60, 2], [1, 2], [2**61 + 4] * 2, dtype="bool"),
    "many-shards": regular(
        [2**40, 64],
        [2**26, 64],
        base64.b64encode(bytes(4 * MANY)).decode(),
        base64.b64encode((2**34 + 4).to_bytes(8, "little") * MANY).decode(),
    ),
}


def crafted(root: Path, entry: dict[str, Any]) -> dict[str, str]:
    """Under ``root``: a run directory whose one checkpoint's ``w`` is ``entry``
    (resealed), and a pristine checkpoint beside it, as a case of the readers' child."""
    state = {"w": torch.arange(12.0).reshape(3, 4), "x": torch.ones(3)}
    run, other = root / "run", root / "other"
    ck = run / "ckpt-1"
    distckpt.save(state, ck)
    distckpt.save(state, other)
    Crafted(ck).edit_index(lambda variables: variables.update(w=entry))
    out = root / "out.safetensors"
    return {"ck": str(ck), "other": str(other), "run": str(run), "out": str(out)}


@pytest.fixture(scope="module")
def read(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """What every reader did of every case (read by one bounded child), each checked
    to be a result or a CheckpointError, never anything else."""
    top = tmp_path_factory.mktemp("grids")
    cases = [{"name": name, **crafted(top / name, entry)} for name, entry in CASES.items()]
    (top / "cases.json").write_text(json.dumps(cases))
    done = subprocess.run(
        [sys.executable, str(READERS), str(top / "cases.json")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, (done.returncode, done.stdout[-3000:], done.stderr[-3000:])
    found: dict[str, dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def results_of(read: dict[str, dict[str, Any]], case: str) -> dict[str, Any]:
    results = read[case]
    for name, got in results.items():  # nothing but a CheckpointError, ever
        assert "raised" not in got or got["checkpoint_error"], (name, got)
        if name in CLI:
            assert "rc" in got and got["rc"] in (0, 1, 2), (name, got)
            if got["rc"] == 2:
                lines = got["err"].strip().splitlines()
                assert len(lines) == 1 and lines[0].startswith(f"distckpt {name}: error: "), got
                assert "'w'" in lines[0], (name, lines)
    return results


def assert_empty_tensor(results: dict[str, Any], shape: list[int]) -> None:
    """Every reader reads ``w`` as the empty tensor of ``shape`` it is."""
    assert results["verify"]["rc"] == 0, results["verify"]
    assert results["inspect"]["rc"] == 0 and "0 slice(s), 0 bytes" in results["inspect"]["out"]
    assert results["ls"]["rc"] == 0 and "ckpt-1" in results["ls"]["out"], results["ls"]
    assert results["diff"]["rc"] == 1 and "w: shape" in results["diff"]["out"], results["diff"]
    assert results["export"]["rc"] == 0, results["export"]
    assert results["dcp"]["ok"]["w"] == shape, results["dcp"]
    assert results["load"]["ok"]["w"] == shape, results["load"]


def assert_refused(results: dict[str, Any], *words: str) -> None:
    """Every reader refuses the index with one error naming ``w`` (and ``words``); ``ls``
    lists the checkpoint without reading its tensors' entries."""
    for name in ("verify", "inspect", "diff", "export"):
        got = results[name]
        assert got["rc"] == 2, (name, got)
        for word in words:
            assert word in got["err"], (name, word, got["err"])
    assert results["ls"]["rc"] == 0, results["ls"]
    for name in ("dcp", "load"):
        got = results[name]
        assert got.get("raised") == "CorruptCheckpointError", (name, got)
        assert "'w'" in got["message"] and all(w in got["message"] for w in words), got


def test_a_zero_dimension_beside_a_huge_one_is_an_empty_tensor(read: Any) -> None:
    """The grid [0, 2**40] has no cell: a 700-byte index once made every reader build a
    tuple of 2**40 ints (MemoryError; ``verify`` exit 1 with a traceback)."""
    results = results_of(read, "zero-beside-huge")
    assert_empty_tensor(results, [0, 2**40])
    assert "float32[0, 1099511627776]" in results["inspect"]["out"]


def test_a_zero_dimension_among_64_is_an_empty_tensor(read: Any) -> None:
    assert_empty_tensor(results_of(read, "zero-among-64"), CASES["zero-among-64"]["shape"])


def test_64_dimensions_of_the_most_bytes_allowed_beside_a_zero_are_read(read: Any) -> None:
    """The other dimensions multiply to 2**62 bytes, the most a shape may declare."""
    assert_empty_tensor(results_of(read, "64-most-bytes"), CASES["64-most-bytes"]["shape"])


def test_listed_empty_pieces_by_the_thousand_beside_a_huge_dimension(read: Any) -> None:
    """Pieces of no element are stored nowhere, whatever block they declare."""
    results = results_of(read, "listed-empty")
    assert results["verify"]["rc"] == 0 and "5001 pieces" in results["verify"]["out"]
    assert "5000 slice(s), 0 bytes" in results["inspect"]["out"], results["inspect"]
    assert results["export"]["rc"] == 0 and results["load"]["ok"]["w"] == [0, 2**40]


def test_a_zero_dimension_beside_dimensions_no_tensor_can_have_is_refused(read: Any) -> None:
    """[0, 2**61, 2**61] holds no element, but NumPy and torch multiply the others into
    strides: refused, as safetensors headers are."""
    assert_refused(results_of(read, "zero-beside-impossible"), "impossibly large")


@pytest.mark.parametrize("column", ["list", "base64"])
def test_a_huge_grid_whose_columns_claim_to_match_it_is_refused(read: Any, column: str) -> None:
    """2**60 shards declared by a few bytes of columns: refused before any is decoded."""
    results = results_of(read, f"claims-{column}")
    assert_refused(results, "crc column does not hold 1152921504606846976 entries")


def test_a_huge_shard_the_files_do_not_hold_is_refused_before_it_is_allocated(
    read: Any,
) -> None:
    """One shard of 2**61 bytes, its size in the index, in a file of 52: every reader
    that would allocate or write that much (a placeholder of load, export) looks first."""
    results = results_of(read, "huge-shard")
    said = f"file is 52 bytes, the index says {2**61 + 4}"
    assert results["verify"]["rc"] == 1 and results["verify"]["err_lines"] == 1
    assert said in results["verify"]["err"], results["verify"]
    assert results["inspect"]["rc"] == 0 and f"{2**61} bytes" in results["inspect"]["out"]
    assert results["ls"]["rc"] == 0 and results["dcp"]["ok"]["w"] == [2**30, 2**29]
    assert results["diff"]["rc"] == 1  # (another shape than the pristine one's)
    assert results["export"]["rc"] == 2 and said in results["export"]["err"]
    assert results["load"]["raised"] == "CorruptCheckpointError", results["load"]
    assert said in results["load"]["message"]


def test_a_huge_shape_of_a_one_byte_dtype_is_refused_where_it_is_read(read: Any) -> None:
    """2**62 booleans in two shards the index says hold 2**61 bytes each: too many
    elements to prove what tiles them, and files that do not hold them."""
    results = results_of(read, "one-byte-dtype")
    assert results["verify"]["rc"] == 1 and "too many elements" in results["verify"]["err"]
    assert results["inspect"]["rc"] == 0 and results["ls"]["rc"] == 0
    assert results["export"]["rc"] == 2 and "too many elements" in results["export"]["err"]
    assert results["dcp"]["ok"]["w"] == [2**61, 2]
    assert results["load"]["raised"] == "CorruptCheckpointError", results["load"]


def test_a_grid_of_many_shards_costs_what_its_columns_hold(read: Any) -> None:
    """16,384 shards of 16 GiB each, columns and all (260 KB of index), no files: each
    reader's memory follows the shards listed, not the 256 TiB declared."""
    results = results_of(read, "many-shards")
    said = results["verify"]["err_with"]
    assert results["verify"]["rc"] == 1
    assert results["verify"]["err_lines"] == said["'w'"] == MANY  # a line per shard
    assert said["is missing"] == MANY - 1 and said["the index says"] == 1  # (w/c.0.0 is)
    assert results["inspect"]["rc"] == 0 and f"{MANY} slice(s)" in results["inspect"]["out"]
    assert results["export"]["rc"] == 2 and "the index says" in results["export"]["err"]
    assert results["dcp"]["ok"]["w"] == [2**40, 64]
    assert results["load"]["raised"] == "CorruptCheckpointError", results["load"]


_LOCAL = """
import json, os, resource, sys
from pathlib import Path
import torch, distckpt
sys.path.insert(0, sys.argv[2])
from distckpt.testing.hostile import reseal
from tests.support.hostile_fuzz import MEMORY_BOUND
from tests.support.hostile_util import local_manager
tmp = Path(sys.argv[1])
ckpt = distckpt.Checkpoint(step=torch.tensor(0), w=torch.zeros(8, 4))
with local_manager(tmp, ckpt) as keeper:
    for step in (1, 2):  # 1: persistent, 2: in the local tier only
        ckpt.step.fill_(step)
        keeper.save()
(manifest,) = (tmp / "local" / "step-2").glob("o0.*.json")
doc = json.loads(manifest.read_bytes())
(w,) = [t for t in doc["tensors"] if t["name"] == "w"]
w.update(shape=[2**34, 4], box=[[0, 0], [2**34, 4]], nbytes=2**38)  # 256 GiB in 192 bytes
manifest.write_bytes(reseal(json.dumps(doc).encode()))
with open("/proc/self/statm") as f:
    held = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
resource.setrlimit(resource.RLIMIT_AS, (held + MEMORY_BOUND, resource.RLIM_INFINITY))
fresh = distckpt.Checkpoint(step=torch.tensor(0), w=None)  # a slot the checkpoint sizes
with local_manager(tmp, fresh) as keeper:
    keeper.restore_or_initialize()
    print(json.dumps({"tier": keeper.restored.tier, "reason": keeper.restored.reason,
                      "w": list(fresh.w.shape)}))
"""


def test_a_local_manifest_that_declares_more_than_its_data_file_is_refused(
    tmp_path: Path,
) -> None:
    """A node-local step's manifest declares ``w`` as 256 GiB in one piece of its
    192-byte data file, and the restored object's ``w`` is a slot the checkpoint sizes:
    the pieces' end is compared with the data file's size before anything is allocated,
    and the manager falls back to the shared directory. Before: the restore allocated
    the 256 GiB declared (a bounded process: an allocation error)."""
    done = subprocess.run(
        [sys.executable, "-c", _LOCAL, str(tmp_path), str(READERS.parents[2])],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["tier"] == "persistent" and got["w"] == [8, 4], got
    assert "its data file is 192 bytes, its manifest places pieces up to" in got["reason"], got
