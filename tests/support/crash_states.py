"""Crash states of a POSIX file system, in the manner of ALICE and CrashMonkey.

:class:`Recorder` records the file-system operations that distckpt makes under one
directory (create, write, truncate, fsync, syncfs, mkdir, rename, exchange, link, unlink,
rmdir), by wrapping the ``os`` functions every write of the library goes through. Files and
directories are followed by inode, so a rename of a directory moves what is below it, and
a write through a descriptor reaches its file under whatever name it has by then. The
recording is checked against the directory it produced: replayed in full it must give the
same tree, byte for byte, or the test fails (an operation went round the recorder).

:func:`crash_states` then builds every state a crash could leave, under this model of
what survives a crash (that of ext4 and XFS, and no stronger):

* the crash comes after any prefix of the operations;
* everything before a ``syncfs`` of the file system is durable;
* a file's data (writes, truncations) are durable once the file is fsynced; of the
  writes not yet durable, any subset survives;
* a directory's entries (create, mkdir, link, unlink, rmdir, rename, exchange within it)
  are durable once the directory is fsynced; of those not yet durable, the operations of
  each directory survive in the order they were made (a prefix of them), independently
  of other directories. Fsyncing a file does not make its name durable.

Where one prefix allows more than :data:`EXHAUSTIVE` states (a larger recording than the
tests make), a covering family is taken instead: all of the non-durable operations, none
of them, and each directory's cut and each file's write varied on its own against those
two backgrounds. Each state is
materialized in a fresh directory; states with the same tree (and the same marks passed,
:meth:`Recorder.mark`) are checked once.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import shutil
import stat
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The most states taken from one prefix by full enumeration (``$DISTCKPT_CRASH_STATES``);
#: the scenarios of the test suite stay below it (at most some 8,000), so every state
#: of theirs is built.
EXHAUSTIVE = int(os.environ.get("DISTCKPT_CRASH_STATES", "65536"))

AT_FDCWD = -100
NAMESPACE = frozenset({"mkdir", "creat", "link", "unlink", "rename", "exchange"})
DATA = frozenset({"write", "trunc"})


@dataclass
class Op:
    kind: str  # mkdir creat link unlink rename exchange write trunc fsync syncfs mark
    args: tuple[Any, ...]

    def parents(self) -> tuple[int, ...]:
        """The directories whose entries this namespace operation changes."""
        if self.kind in ("rename", "exchange"):
            return (self.args[0],) if self.args[0] == self.args[2] else (self.args[0], self.args[2])
        return (self.args[0],)


@dataclass
class Tree:
    """A file-system state: directories (id: {name: id}) and files (id: bytes)."""

    dirs: dict[int, dict[str, int]] = field(default_factory=dict)
    files: dict[int, bytearray] = field(default_factory=dict)

    def copy(self) -> Tree:
        return Tree(
            {d: dict(e) for d, e in self.dirs.items()},
            {f: bytearray(b) for f, b in self.files.items()},
        )

    def apply(self, op: Op) -> None:
        """Apply ``op``; an operation that the state cannot take (its source is gone, as
        a crash can leave it) is skipped, as the file system would have refused it."""
        k, a = op.kind, op.args
        # A directory exists from its mkdir on, whether or not its name survived.
        entries = self.dirs.setdefault(a[0], {}) if k in NAMESPACE else {}
        if k == "mkdir":
            self.dirs.setdefault(a[2], {})
            entries[a[1]] = a[2]
        elif k in ("creat", "link"):
            self.files.setdefault(a[2], bytearray())
            entries[a[1]] = a[2]
        elif k == "unlink":
            entries.pop(a[1], None)
        elif k == "rename":
            moved = entries.pop(a[1], None)
            if moved is not None:
                self.dirs.setdefault(a[2], {})[a[3]] = moved
        elif k == "exchange":
            other = self.dirs.setdefault(a[2], {})
            x, y = entries.get(a[1]), other.get(a[3])
            if x is not None and y is not None:
                entries[a[1]], other[a[3]] = y, x
        elif k == "write":
            data = self.files.setdefault(a[0], bytearray())
            end = a[1] + len(a[2])
            if len(data) < end:
                data.extend(bytes(end - len(data)))
            data[a[1] : end] = a[2]
        elif k == "trunc":
            data = self.files.setdefault(a[0], bytearray())
            del data[a[1] :]
            data.extend(bytes(a[1] - len(data)))

    def listing(self, root: int) -> dict[str, bytes | None]:
        """Path below the root: bytes of a file, None for a directory."""
        out: dict[str, bytes | None] = {}

        def walk(d: int, at: str) -> None:
            for name, child in sorted(self.dirs[d].items()):
                path = f"{at}{name}"
                if child in self.dirs:
                    out[path] = None
                    walk(child, path + "/")
                else:
                    out[path] = bytes(self.files.get(child, b""))

        walk(root, "")
        return out


def listing_of(path: Path) -> dict[str, bytes | None]:
    """The same listing of a real directory."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirs, files in os.walk(path):
        rel = os.path.relpath(dirpath, path)
        prefix = "" if rel == "." else rel + "/"
        for d in dirs:
            out[prefix + d] = None
        for f in files:
            out[prefix + f] = Path(dirpath, f).read_bytes()
    return dict(sorted(out.items()))


def materialize(listing: dict[str, bytes | None], dest: Path) -> None:
    dest.mkdir(parents=True)
    for rel, data in listing.items():
        if data is None:
            (dest / rel).mkdir()
        else:
            (dest / rel).write_bytes(data)


# --------------------------------------------------------------------------- recording

_PATCHED = (
    "open",
    "close",
    "write",
    "pwrite",
    "pwritev",
    "writev",
    "ftruncate",
    "truncate",
    "fsync",
    "fdatasync",
    "mkdir",
    "rename",
    "replace",
    "link",
    "unlink",
    "remove",
    "rmdir",
)


class Recorder:
    """Records what happens under ``root`` while active (a context manager)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(os.path.realpath(root))
        self.ops: list[Op] = []
        self.initial = Tree()
        self.root_id = 0
        self._ids = itertools.count()
        self._by_ino: dict[int, int] = {}  # inode number: model id (current holder)
        self._fds: dict[int, int] = {}  # open descriptor under the root: model id
        self._lock = threading.RLock()
        self._real: dict[str, Callable[..., Any]] = {}
        self._wrapped: list[tuple[Any, str, Callable[..., Any]]] = []
        self._dev = os.stat(self.root).st_dev
        self._openat2: Callable[..., int] | None = None

    # -- the initial state (taken as durable)
    def _snapshot(self) -> None:
        def walk(path: Path) -> int:
            st = os.lstat(path)
            ident = self._new(st.st_ino)
            if stat.S_ISDIR(st.st_mode):
                self.initial.dirs[ident] = {e.name: walk(Path(e.path)) for e in os.scandir(path)}
            elif stat.S_ISREG(st.st_mode):
                self.initial.files[ident] = bytearray(path.read_bytes())
            else:
                raise AssertionError(f"{path}: the recorder handles files and directories only")
            return ident

        self.root_id = walk(self.root)

    def _new(self, ino: int) -> int:
        ident = next(self._ids)
        self._by_ino[ino] = ident
        return ident

    # -- resolving arguments
    def _dir_of(self, path: Any, dir_fd: int | None) -> tuple[int, str] | None:
        """(parent id, name) of ``path`` when it lies under the root, else None."""
        p = os.fsdecode(path)
        if dir_fd is not None and dir_fd != AT_FDCWD and not os.path.isabs(p):
            # A directory under the root, however it was opened (a store keeps the
            # descriptor of its top, perhaps from before the recording).
            st = os.fstat(dir_fd)
            if st.st_dev != self._dev or st.st_ino not in self._by_ino:
                return None
            parent_ino = st.st_ino
            head, name = os.path.split(p)
            if head:
                parent_ino = os.stat(head, dir_fd=dir_fd).st_ino
            return self._by_ino[parent_ino], name
        full = os.path.abspath(p)
        if not full.startswith(str(self.root) + os.sep):
            return None
        head, name = os.path.split(full)
        return self._by_ino[os.lstat(head).st_ino], name

    def _record(self, kind: str, *args: Any) -> None:
        self.ops.append(Op(kind, args))

    def mark(self, label: str) -> None:
        """A point of the recording the checks refer to (e.g. a save that returned)."""
        with self._lock:
            self._record("mark", label)

    # -- the wrappers
    def _open(self, path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        return self._open_with(self._real["open"], path, flags, mode, dir_fd)

    def _open_beneath(self, dir_fd: int, path: str, flags: int, mode: int) -> int:
        """``openat2`` (called through ctypes by distckpt.storage.beneath)."""
        real = self._openat2
        assert real is not None

        def call(path: Any, flags: int, mode: int, *, dir_fd: int | None) -> int:
            return int(real(dir_fd, path, flags, mode))

        return self._open_with(call, path, flags, mode, dir_fd)

    def _open_with(
        self, real: Callable[..., int], path: Any, flags: int, mode: int, dir_fd: int | None
    ) -> int:
        with self._lock:
            where = self._dir_of(path, dir_fd)
            if where is None:
                fd = real(path, flags, mode, dir_fd=dir_fd)
                if dir_fd is None and os.path.abspath(os.fsdecode(path)) == str(self.root):
                    self._fds[fd] = self.root_id  # the root itself, opened to be fsynced
                return int(fd)
            try:
                os.lstat(path, dir_fd=dir_fd)
                existed = True
            except OSError:
                existed = False
            fd = real(path, flags, mode, dir_fd=dir_fd)
            st = os.fstat(fd)
            if not existed:
                ident = self._new(st.st_ino)
                self._record("creat", where[0], where[1], ident)
            else:
                ident = self._by_ino[st.st_ino]
                if flags & os.O_TRUNC and stat.S_ISREG(st.st_mode):
                    self._record("trunc", ident, 0)
            self._fds[fd] = ident
            return fd

    def _close(self, fd: int) -> None:
        with self._lock:
            self._fds.pop(fd, None)
            self._real["close"](fd)

    def _wrap_write(self, name: str) -> Callable[..., int]:
        real = self._real[name]

        def joined(buffers: Sequence[Any]) -> bytes:
            return b"".join(bytes(memoryview(b).cast("B")) for b in buffers)

        def call(fd: int, *args: Any) -> int:
            with self._lock:
                if fd not in self._fds:
                    return int(real(fd, *args))
                at_end = name in ("write", "writev")  # at the descriptor's offset
                offset = os.lseek(fd, 0, os.SEEK_CUR) if at_end else args[-1]
                n = int(real(fd, *args))
                one = name in ("write", "pwrite")
                data = bytes(memoryview(args[0]).cast("B")) if one else joined(args[0])
                self._record("write", self._fds[fd], offset, data[:n])
                return n

        return call

    def _ftruncate(self, fd: int, length: int) -> None:
        with self._lock:
            self._real["ftruncate"](fd, length)
            if fd in self._fds:
                self._record("trunc", self._fds[fd], length)

    def _truncate(self, path: Any, length: int) -> None:
        with self._lock:
            self._real["truncate"](path, length)
            if self._dir_of(path, None) is not None:
                self._record("trunc", self._by_ino[os.lstat(path).st_ino], length)

    def _fsync(self, name: str) -> Callable[[int], None]:
        real = self._real[name]

        def call(fd: Any) -> None:
            fd = fd if isinstance(fd, int) else fd.fileno()
            with self._lock:
                real(fd)
                if fd in self._fds:
                    self._record("fsync", self._fds[fd])

        return call

    def _mkdir(self, path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        with self._lock:
            self._real["mkdir"](path, mode, dir_fd=dir_fd)
            where = self._dir_of(path, dir_fd)
            if where is not None:
                ident = self._new(os.lstat(path, dir_fd=dir_fd).st_ino)
                self._record("mkdir", where[0], where[1], ident)

    def _rename(self, name: str) -> Callable[..., None]:
        real = self._real[name]

        def call(
            src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None
        ) -> None:
            with self._lock:
                a = self._dir_of(src, src_dir_fd)
                b = self._dir_of(dst, dst_dir_fd)
                real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
                if a is not None and b is not None:
                    self._record("rename", a[0], a[1], b[0], b[1])
                elif a is not None or b is not None:
                    raise AssertionError(f"rename across the recorded root: {src} -> {dst}")

        return call

    def _exchange(self, real: Callable[..., bool]) -> Callable[..., bool]:
        def call(a: Any, b: Any, *, src_dir_fd: int = AT_FDCWD, dst_dir_fd: int = AT_FDCWD) -> bool:
            with self._lock:
                x, y = self._dir_of(a, src_dir_fd), self._dir_of(b, dst_dir_fd)
                done = real(a, b, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
                if done and x is not None and y is not None:
                    self._record("exchange", x[0], x[1], y[0], y[1])
                return bool(done)

        return call

    def _syncfs(self, real: Callable[..., None]) -> Callable[..., None]:
        def call(fd: int, what: Any = "") -> None:
            with self._lock:
                real(fd, what)
                if os.fstat(fd).st_dev == self._dev:
                    self._record("syncfs")

        return call

    def _link(
        self,
        src: Any,
        dst: Any,
        *,
        src_dir_fd: int | None = None,
        dst_dir_fd: int | None = None,
        follow_symlinks: bool = True,
    ) -> None:
        with self._lock:
            self._real["link"](
                src,
                dst,
                src_dir_fd=src_dir_fd,
                dst_dir_fd=dst_dir_fd,
                follow_symlinks=follow_symlinks,
            )
            where = self._dir_of(dst, dst_dir_fd)
            if where is not None:
                ident = self._by_ino[os.lstat(dst, dir_fd=dst_dir_fd).st_ino]
                self._record("link", where[0], where[1], ident)

    def _remove(self, name: str) -> Callable[..., None]:
        real = self._real[name]

        def call(path: Any, *, dir_fd: int | None = None) -> None:
            with self._lock:
                where = self._dir_of(path, dir_fd)
                real(path, dir_fd=dir_fd)
                if where is not None:
                    self._record("unlink", where[0], where[1])

        return call

    def __enter__(self) -> Recorder:
        self._snapshot()
        for name in _PATCHED:
            self._real[name] = getattr(os, name)
        wrapped: dict[str, Callable[..., Any]] = {
            "open": self._open,
            "close": self._close,
            "write": self._wrap_write("write"),
            "pwrite": self._wrap_write("pwrite"),
            "pwritev": self._wrap_write("pwritev"),
            "writev": self._wrap_write("writev"),
            "ftruncate": self._ftruncate,
            "truncate": self._truncate,
            "fsync": self._fsync("fsync"),
            "fdatasync": self._fsync("fdatasync"),
            "mkdir": self._mkdir,
            "rename": self._rename("rename"),
            "replace": self._rename("replace"),
            "link": self._link,
            "unlink": self._remove("unlink"),
            "remove": self._remove("remove"),
            "rmdir": self._remove("rmdir"),
        }
        for name, fn in wrapped.items():
            setattr(os, name, fn)
        # openat2 and renameat2(RENAME_EXCHANGE) are called through ctypes: wrapped
        # where they are used.
        from distckpt.storage import beneath, fsutil

        self._openat2 = beneath.openat2
        if self._openat2 is not None:
            beneath.openat2 = self._open_beneath  # type: ignore[assignment]

        # So are renameat2(RENAME_EXCHANGE) and syncfs: wrapped where they are imported.
        wrappers = {
            "exchange": (fsutil.exchange, self._exchange(fsutil.exchange)),
            "syncfs": (fsutil.syncfs, self._syncfs(fsutil.syncfs)),
        }
        for module in list(sys.modules.values()):
            if not getattr(module, "__name__", "").startswith("distckpt"):
                continue
            for name, (real, wrapper) in wrappers.items():
                if getattr(module, name, None) is real:
                    self._wrapped.append((module, name, real))
                    setattr(module, name, wrapper)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._real.items():
            setattr(os, name, fn)
        for module, name, fn in self._wrapped:
            setattr(module, name, fn)
        self._wrapped.clear()
        if self._openat2 is not None:
            from distckpt.storage import beneath

            beneath.openat2 = self._openat2  # type: ignore[assignment]

    # -- after the recording
    def final(self) -> Tree:
        tree = self.initial.copy()
        for op in self.ops:
            tree.apply(op)
        return tree

    def check_complete(self) -> None:
        """The recording replayed in full gives the directory as it is: nothing that
        distckpt wrote went round the recorder."""
        replayed = self.final().listing(self.root_id)
        actual = listing_of(self.root)
        if replayed != actual:
            only_r = sorted(set(replayed) - set(actual))
            only_a = sorted(set(actual) - set(replayed))
            differ = sorted(k for k in set(replayed) & set(actual) if replayed[k] != actual[k])
            raise AssertionError(
                "the recording does not replay to the directory it was made in: "
                f"only replayed {only_r}, only on disk {only_a}, different {differ}"
            )


# --------------------------------------------------------------------------- crash states


@dataclass
class CrashState:
    prefix: int  # how many operations were issued before the crash
    marks: list[str]  # the marks passed (in order)
    listing: dict[str, bytes | None]
    digest: str


def _digest(listing: dict[str, bytes | None]) -> str:
    h = hashlib.sha256()
    for k, v in listing.items():
        h.update(k.encode() + b"\0")
        h.update(b"D" if v is None else b"F" + hashlib.sha256(v).digest())
    return h.hexdigest()


def _choices(prefix: Sequence[Op]) -> tuple[list[Op], list[list[Op]], list[Op]]:
    """Split a prefix: the durable operations (in order), the pending namespace
    operations of each directory (in order), the pending data writes."""
    last_sync: dict[int, int] = {}
    everything = -1  # the last syncfs: what came before it is durable
    for i, op in enumerate(prefix):
        if op.kind == "fsync":
            last_sync[op.args[0]] = i
        elif op.kind == "syncfs":
            everything = i
    durable: list[Op] = []
    pending_dirs: dict[tuple[int, ...], list[Op]] = {}
    pending_data: list[Op] = []
    for i, op in enumerate(prefix):
        if op.kind in NAMESPACE:
            parents = op.parents()
            if i < everything or all(last_sync.get(p, -1) > i for p in parents):
                durable.append(op)
            else:
                pending_dirs.setdefault(parents, []).append(op)
        elif op.kind in DATA:
            if i < everything or last_sync.get(op.args[0], -1) > i:
                durable.append(op)
            else:
                pending_data.append(op)
    return durable, list(pending_dirs.values()), pending_data


def _selections(dirs: list[list[Op]], data: list[Op]) -> Iterator[tuple[list[int], set[int]]]:
    """(cut per directory, indices of surviving writes) of the states to build."""
    count = 1
    for ops in dirs:
        count *= len(ops) + 1
    count *= 2 ** len(data)
    if count <= EXHAUSTIVE:
        for cut in itertools.product(*(range(len(ops) + 1) for ops in dirs)):
            for n in range(len(data) + 1):
                for chosen in itertools.combinations(range(len(data)), n):
                    yield list(cut), set(chosen)
        return
    full = [len(ops) for ops in dirs]
    none = [0] * len(dirs)
    everything = set(range(len(data)))
    backgrounds: list[tuple[list[int], set[int]]] = [(full, everything), (none, set())]
    for cuts, kept in backgrounds:
        yield cuts, kept
        for d, ops in enumerate(dirs):
            for c in range(len(ops) + 1):
                yield [*cuts[:d], c, *cuts[d + 1 :]], kept
        for w in range(len(data)):
            yield cuts, kept ^ {w}


def crash_states(recorder: Recorder) -> Iterator[CrashState]:
    """Every crash state of the recording (distinct trees, in the order first found)."""
    seen: set[tuple[str, int]] = set()
    # The operations a state applies decide its tree: a set of them met before (at a
    # shorter prefix, or by another selection) is not built again.
    built: set[tuple[frozenset[int], int]] = set()
    ops = recorder.ops
    for k in range(len(ops) + 1):
        prefix = ops[:k]
        marks = [op.args[0] for op in prefix if op.kind == "mark"]
        durable, dirs, data = _choices(prefix)
        for cuts, kept in _selections(dirs, data):
            chosen = set(map(id, durable))
            for ops_d, c in zip(dirs, cuts, strict=True):
                chosen.update(map(id, ops_d[:c]))
            chosen.update(id(data[w]) for w in kept)
            key = (frozenset(chosen), len(marks))
            if key in built:
                continue
            built.add(key)
            tree = recorder.initial.copy()
            for op in prefix:  # in program order
                if id(op) in chosen:
                    tree.apply(op)
            listing = tree.listing(recorder.root_id)
            digest = _digest(listing)
            if (digest, len(marks)) in seen:  # a mark passed can change what is promised
                continue
            seen.add((digest, len(marks)))
            yield CrashState(k, marks, listing, digest)


@contextlib.contextmanager
def recording(root: Path) -> Iterator[Recorder]:
    """Record under ``root`` (which must exist), then check the recording is complete."""
    with Recorder(root) as rec:
        yield rec
    rec.check_complete()


def each_state(recorder: Recorder, scratch: Path) -> Iterator[tuple[CrashState, Path]]:
    """Each crash state, materialized in a fresh directory under ``scratch`` (removed
    after the caller's check)."""
    for n, state in enumerate(crash_states(recorder)):
        where = scratch / f"state-{n}"
        materialize(state.listing, where)
        try:
            yield state, where
        finally:
            shutil.rmtree(where, ignore_errors=True)
