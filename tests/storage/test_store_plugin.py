"""A newcomer's backend: one new module plus an entry point, proven with the shipped suite.

The backend below (:data:`BACKEND`, the plug-in example of docs/storage/plugins.md, word
for word) is a ``files://`` store written on
:class:`~distckpt.storage.object_store.ObjectStore` (its six primitives): a directory of
any file system, whose saves commit as on an object store (a claim, then the index last),
so no directory is ever renamed. The test installs it as a
package would be: the module and a ``files_store-1.0.dist-info`` with
``entry_points.txt`` (group ``distckpt.stores``) in a directory on ``sys.path`` here and
on ``PYTHONPATH`` in the jobs. Then:

* it passes :class:`distckpt.testing.StoreTests`, opened through its URL (the forked
  racers find it by its entry point too);
* a 2-rank torchrun job saves through ``files://`` and runs a manager with retention on
  it, and a 3-rank job (mpiexec, or torchrun without it) restores both, resharded, bit
  for bit.
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import distckpt
from distckpt.storage import registry
from distckpt.storage.backend import Capabilities, Store
from distckpt.storage.registry import open_store
from distckpt.testing import StoreTests
from tests.docs.blocks import read
from tests.support.launch_util import (
    HAVE_MPIEXEC,
    REPO_ROOT,
    SCRIPTS,
    assert_all_ok,
    output,
    run_mpi_ranks,
    run_ranks,
)

JOB = SCRIPTS / "plugin_ranks.py"

BACKEND = '''\
"""files://<path>: checkpoints in a directory of any file system, committed as on an
object store (a claim, then the index last): no directory is ever renamed. The store's
full paths are the files' paths without their leading "/"."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import stat
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from distckpt.storage.backend import ConditionFailed, byte_view
from distckpt.storage.object_store import ObjectInfo, ObjectStore


class FilesStore(ObjectStore):
    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__("files://", os.path.abspath(path))

    @classmethod
    def from_url(cls, url: str) -> FilesStore:
        return cls(url.removeprefix("files://"))

    def get(self, path: str) -> tuple[bytes, str]:
        data = Path("/" + path).read_bytes()
        return data, _version(data)

    def get_into(self, path: str, offset: int, buffers: Sequence[memoryview]) -> int:
        fd = os.open("/" + path, os.O_RDONLY)
        try:
            return os.preadv(fd, buffers, offset)
        finally:
            os.close(fd)

    def put(
        self, path: str, data: Any, *, if_absent: bool = False, if_version: str | None = None
    ) -> str:
        directory = os.path.dirname("/" + path)
        os.makedirs(directory, exist_ok=True)
        tmp = f"{directory}/.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as f:
            f.write(byte_view(data))
            os.fsync(f.fileno())
        fd = os.open(directory, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # one put at a time in the directory
            if if_absent and os.path.lexists("/" + path):
                raise ConditionFailed(f"{self.address(path)} exists")
            if if_version is not None and self.get(path)[1] != if_version:
                raise ConditionFailed(f"{self.address(path)} changed")
            os.replace(tmp, "/" + path)  # readers see the old object or the new one
            os.fsync(fd)  # and so does a crash
        finally:
            os.close(fd)
            Path(tmp).unlink(missing_ok=True)
        return _version(data)

    def head(self, path: str) -> ObjectInfo:
        try:
            st = os.stat("/" + path)
        except NotADirectoryError:  # a key below an object: there is none
            raise FileNotFoundError(f"{self.address(path)} does not exist") from None
        if not stat.S_ISREG(st.st_mode):  # a directory is a prefix, not an object
            raise FileNotFoundError(f"{self.address(path)} is not a file")
        return ObjectInfo(path, st.st_size, st.st_mtime)

    def scan(self, prefix: str, limit: int | None = None) -> Iterator[ObjectInfo]:
        for directory, _, files in os.walk("/" + prefix):
            for name in files:
                try:
                    found = self.head(os.path.join(directory, name)[1:])
                except FileNotFoundError:
                    continue  # removed while we looked
                yield found

    def remove(self, paths: Sequence[str]) -> None:
        for path in paths:
            Path("/" + path).unlink(missing_ok=True)

    def delete_tree(self, key: str = "") -> None:
        shutil.rmtree("/" + self.path_of(key), ignore_errors=True)  # the directories too


def _version(data: Any) -> str:
    return hashlib.sha256(byte_view(data)).hexdigest()
'''

ENTRY_POINTS = """\
[project.entry-points."distckpt.stores"]
files = "files_store:FilesStore.from_url"
"""


def install(site: Path) -> None:
    """Install the backend into ``site`` as pip would: the module, and its distribution's
    metadata with the entry point that names the scheme."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "files_store.py").write_text(BACKEND)
    info = site / "files_store-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: files-store\nVersion: 1.0\n")
    group = re.search(r'^\[project\.entry-points\."(.+)"\]$', ENTRY_POINTS, re.M)
    entries = re.findall(r'^(\w+) = "(.+)"$', ENTRY_POINTS, re.M)
    assert group is not None and entries, ENTRY_POINTS
    (info / "entry_points.txt").write_text(
        f"[{group[1]}]\n" + "".join(f"{name} = {ref}\n" for name, ref in entries)
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The backend installed and importable in this process, through its entry point only."""
    where = tmp_path_factory.mktemp("site")
    install(where)
    sys.path.insert(0, str(where))
    importlib.invalidate_caches()
    try:
        yield where
    finally:
        sys.path.remove(str(where))
        registry._openers.pop("files", None)
        sys.modules.pop("files_store", None)


def test_the_docs_show_this_very_backend() -> None:
    """The page's module and pyproject.toml (the files its blocks write) are these."""
    page = read(REPO_ROOT / "docs" / "storage" / "plugins.md")
    files = {block.arg: block.code for block in page if block.kind == "file"}
    assert files["files_store.py"] == BACKEND
    assert ENTRY_POINTS in files["pyproject.toml"]


class TestFilesStore(StoreTests):
    """The shipped suite, on the backend found through its entry point."""

    capabilities = Capabilities(
        conditional_create=True, conditional_update=True, ranged_reads=True, parallel_writes=True
    )

    @pytest.fixture
    def store(self, site: Path, tmp_path: Path) -> Store:
        found = open_store(f"files://{tmp_path}/store")
        assert type(found).__module__ == "files_store" and type(found).__name__ == "FilesStore"
        return found


def test_a_save_on_a_base_writes_every_piece(
    site: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The store does not declare copies: a save built on a base (as the manager's are)
    writes every piece, without trying, and warning about, a copy of each."""
    state = {"w": torch.arange(4096.0), "b": torch.ones(3)}
    url = f"files://{tmp_path}"
    distckpt.save(state, f"{url}/ckpt-1")
    with caplog.at_level(logging.WARNING):
        result = distckpt.save(state, f"{url}/ckpt-2", base=f"{url}/ckpt-1")
    assert result.bytes_reused == 0 and result.pieces_reused == 0
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    restored = {"w": torch.zeros(4096), "b": torch.zeros(3)}
    distckpt.load(restored, f"{url}/ckpt-2")
    assert torch.equal(restored["w"], state["w"]) and torch.equal(restored["b"], state["b"])


@pytest.mark.timeout(300)
def test_ranks_save_load_and_keep_checkpoints_through_the_plugin(
    site: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    env = {"PYTHONPATH": f"{site}:{REPO_ROOT}", "DISTCKPT_TIMEOUT": "60"}
    saved = run_ranks(2, JOB, "save", str(run), env=env, timeout=120)
    assert_all_ok(saved, 2)
    assert f"LATEST files://{run}/ckpt-2" in saved.stdout, output(saved)
    # What the store holds: the checkpoints and the pointer; no claim, lock or staging left.
    assert sorted(p.name for p in run.iterdir()) == [
        "ckpt-2",
        "exported",
        "failed",
        "hf",
        "latest",
        "plain",
    ]
    assert sorted(p.name for p in (run / "hf").iterdir()) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert (run / "ckpt-2" / "zarr.json").is_file() and (run / "plain" / "zarr.json").is_file()
    launch = run_mpi_ranks if HAVE_MPIEXEC else run_ranks
    loaded = launch(3, JOB, "load", str(run), env=env, timeout=120)
    assert_all_ok(loaded, 3)
