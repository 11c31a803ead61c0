"""A newcomer's backend: one new module plus an entry point, proven with the shipped suite.

The backend below (:data:`BACKEND`, the README's plug-in example, word for word) is a
``files://`` store written from nothing but the protocol: a directory of any file
system, whose saves commit as on an object store (a claim, then the index last), so no
directory is ever renamed. The test installs it as a package would be: the module and a
``files_store-1.0.dist-info`` with ``entry_points.txt`` (group ``distckpt.stores``) in a
directory on ``sys.path`` here and on ``PYTHONPATH`` in the jobs. Then:

* it passes :class:`distckpt.testing.StoreTests`, opened through its URL (the forked
  racers find it by its entry point too);
* a 2-rank torchrun job saves through ``files://`` and runs a manager with retention on
  it, and a 3-rank job (mpiexec, or torchrun without it) restores both, resharded, bit
  for bit.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from distckpt.storage import registry
from distckpt.storage.backend import Capabilities, Store
from distckpt.storage.registry import open_store
from distckpt.testing import StoreTests
from tests.support.launch_util import (
    HAVE_MPIEXEC,
    REPO_ROOT,
    SCRIPTS,
    assert_all_ok,
    output,
    run_mpi,
    run_torchrun,
)

JOB = SCRIPTS / "plugin_ranks.py"

BACKEND = '''\
"""files://<path>: checkpoints in a directory of any file system, committed as on an
object store (a claim, then the index last): no directory is ever renamed."""

from __future__ import annotations

import builtins
import fcntl
import hashlib
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from distckpt.storage.backend import Capabilities, ConditionFailed, byte_view, check_key


class FilesStore:
    capabilities = Capabilities(
        conditional_create=True, conditional_update=True, ranged_reads=True, parallel_writes=True
    )
    commit_strategy = "claim"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).absolute()
        self.url = f"files://{self.path}"

    @classmethod
    def from_url(cls, url: str) -> FilesStore:
        return cls(url.removeprefix("files://"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FilesStore) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def parent(self) -> FilesStore:
        return FilesStore(self.path.parent)

    def child(self, key: str) -> FilesStore:
        return FilesStore(self._p(key)) if key else self

    def where(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    def _p(self, key: str) -> Path:
        return self.path / check_key(key) if key else self.path  # never outside

    def read(self, key: str) -> bytes:
        return self._p(key).read_bytes()

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        data = self.read(key)
        return data, _version(data)

    def open(self, key: str, size: int | None = None) -> FileReader:
        return FileReader(self._p(key))

    def write(self, key: str, data: Any) -> None:
        path = self._p(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        _write_file(tmp, data)
        os.replace(tmp, path)  # readers see the old object or the new one

    def create(self, key: str, size_hint: int | None = None) -> FileWriter:
        path = self._p(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        return FileWriter(path)

    def put_new(self, key: str, data: Any) -> str:
        path = self._p(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        _write_file(tmp, data)
        try:
            os.link(tmp, path)  # fails if the name exists
        except FileExistsError:
            raise ConditionFailed(f"{self.where(key)} exists") from None
        finally:
            tmp.unlink()
        return _version(data)

    def put_if(self, key: str, data: Any, version: str) -> str:
        path = self._p(key)
        try:
            fd = os.open(path.parent, os.O_RDONLY)
        except FileNotFoundError:
            raise ConditionFailed(f"{self.where(key)} is gone") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # one replacement at a time in the directory
            try:
                current = self.read_versioned(key)[1]
            except FileNotFoundError:
                raise ConditionFailed(f"{self.where(key)} is gone") from None
            if current != version:
                raise ConditionFailed(f"{self.where(key)} changed")
            self.write(key, data)
        finally:
            os.close(fd)
        return _version(data)

    def exists(self, key: str) -> bool:
        return os.path.lexists(self._p(key))

    def is_dir(self, key: str) -> bool:
        return self._p(key).is_dir()

    def age(self, key: str) -> float:
        return time.time() - self._p(key).stat().st_mtime

    def list(self, key: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._p(key)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def walk(self, key: str = "") -> builtins.list[tuple[str, int, float]]:
        top, found = self._p(key), []
        for at, _dirs, files in os.walk(top):
            for name in files:
                path = os.path.join(at, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue  # removed while we looked
                found.append((os.path.relpath(path, top), st.st_size, st.st_mtime))
        return found

    def delete(self, key: str) -> None:
        self._p(key).unlink(missing_ok=True)

    def delete_tree(self, key: str = "") -> None:
        path = self._p(key)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    def prepare(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._p(key).parent.mkdir(parents=True, exist_ok=True)

    def persist(self, keys: Iterable[str]) -> None:
        for directory in {self._p(key).parent for key in keys}:
            fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class FileReader:
    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self._fd).st_size

    def readinto(self, buffers: Sequence[Any], offset: int) -> int:
        return os.preadv(self._fd, [byte_view(b) for b in buffers], offset)

    def read(self, offset: int, length: int) -> bytes:
        return os.pread(self._fd, length, offset)

    def will_need(self, runs: Sequence[tuple[int, int]]) -> None:
        pass

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FileWriter:
    """Writes at any offset from any thread (``pwrite``); removed unless finished."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._finished = False

    def write(self, buffers: Sequence[Any], offset: int) -> int:
        if self._fd < 0:
            raise ValueError(f"{self.path} is closed")
        start = offset
        for buffer in buffers:
            view = byte_view(buffer)
            while view.nbytes:
                n = os.pwrite(self._fd, view, offset)
                view, offset = view[n:], offset + n
        return offset - start

    def finish(self, durable: bool = True) -> None:
        if durable:
            os.fsync(self._fd)
        self._finished = True
        self._close()

    def abort(self) -> None:
        self._close()
        if not self._finished:
            self.path.unlink(missing_ok=True)

    def _close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def _version(data: Any) -> str:
    return hashlib.sha256(byte_view(data)).hexdigest()


def _write_file(path: Path, data: Any) -> None:
    with open(path, "wb") as f:
        f.write(byte_view(data))
        f.flush()
        os.fsync(f.fileno())
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


def test_the_readme_shows_this_very_backend() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:python|toml)\n(.*?)```", readme, flags=re.S)
    assert "# files_store.py\n" + BACKEND in blocks
    assert "# its pyproject.toml\n" + ENTRY_POINTS in blocks


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


@pytest.mark.timeout(300)
def test_ranks_save_load_and_keep_checkpoints_through_the_plugin(
    site: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    env = {"PYTHONPATH": f"{site}:{REPO_ROOT}", "DISTCKPT_TIMEOUT": "60"}
    saved = run_torchrun(2, JOB, "save", str(run), env=env, timeout=120)
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
    launch = run_mpi if HAVE_MPIEXEC else run_torchrun
    loaded = launch(3, JOB, "load", str(run), env=env, timeout=120)
    assert_all_ok(loaded, 3)
