"""The directory (or store prefix) that Hugging Face weights are written to, as the
coordinator prepares and finishes it (steps 2 and 4 of :mod:`distckpt.hf.save`): files
created beside their final names and renamed into place on a file system, objects
written by one rank each in a store, the index last."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from distckpt.errors import CheckpointExists, ValidationError
from distckpt.hf.directory import INDEX, OutFile, index_document
from distckpt.hf.write import Files, Objects, Sink, Work, temporary_name
from distckpt.storage.backend import Store
from distckpt.storage.beneath import Beneath
from distckpt.storage.fsutil import atomic_write, fsync_fd

_OLD_WEIGHTS = re.compile(
    r"^model(-[0-9]+-of-[0-9]+)?\.safetensors$|^model\.safetensors\.index\.json$"
)


@dataclass
class Plan:
    """The coordinator's decision: the files and each rank's :class:`Work`."""

    token: str
    files: list[OutFile]
    work: list[Work]


class Target:
    """The directory the weights go to: files of a file system (a store with
    ``local_files``), written at offsets by several ranks and renamed into place, or
    objects of a store, each written by one rank."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.files = store.capabilities.local_files
        self.root = Path(store.url)
        # Its files: created, renamed and removed in the directory, never through a link.
        self.dir = Beneath(store.url)

    def existing(self) -> list[str]:
        """The weights files (and index) the directory holds now."""
        if self.files:
            if not self.root.is_dir():
                return []
            names = os.listdir(self.root)
        else:
            names = self.store.list("")
        return sorted(n for n in names if _OLD_WEIGHTS.match(n))

    def prepare(self, plan: Plan, overwrite: bool) -> None:
        """Coordinator: check the directory; on a file system, create every file with its
        header at its full size; in a store, with ``overwrite``, remove the old index."""
        if self.files and self.root.exists() and not self.root.is_dir():
            raise CheckpointExists(f"{self.root} exists and is not a directory")
        old = self.existing()
        if old and not overwrite:
            raise CheckpointExists(
                f"{self.store.url} already holds weights ({', '.join(old[:3])}); pass "
                "overwrite=True to replace them"
            )
        if not any(f.tensors for f in plan.files):
            raise ValidationError(
                f"no tensor to write to {self.store.url}: none of the state's names is under "
                "the prefix, or the rename function left every one out"
            )
        if not self.files:
            if INDEX in old:
                self.store.delete(INDEX)
            return
        self.dir.makedirs("")
        try:
            for f in plan.files:
                fd = self.dir.create(temporary_name(f.name, plan.token))
                try:
                    os.pwrite(fd, f.header, 0)
                    os.ftruncate(fd, f.size)
                finally:
                    os.close(fd)
        except BaseException:
            self.settle(plan, None, failed=True)
            raise

    def sink(self, work: Work, token: str) -> Sink:
        """Where this rank writes its work."""
        return Files(self.dir, token) if self.files else Objects(self.store, work.create)

    def finish(self, plan: Plan, overwrite: bool) -> None:
        """Coordinator, every rank's writes done: the files under their names, then the
        index (several files) last."""
        new = {f.name for f in plan.files}
        for old in self.existing() if overwrite else []:
            if self.files:
                self.dir.unlink(old)
            elif old not in new:
                self.store.delete(old)
        if self.files:
            top = self.dir.fd()
            for f in plan.files:
                temp = temporary_name(f.name, plan.token)
                os.replace(temp, f.name, src_dir_fd=top, dst_dir_fd=top)
            if len(plan.files) > 1:
                atomic_write(INDEX, index_document(plan.files), dir_fd=top)
            fsync_fd(top, self.root)
        elif len(plan.files) > 1:
            self.store.write(INDEX, index_document(plan.files))

    def settle(self, plan: Plan, overwrite: bool | None, *, failed: bool) -> None:
        """Coordinator, last: remove what is left of the save (its temporary files; after a
        failure in a store, the objects it created, unless they replaced old ones)."""
        if self.files:
            for f in plan.files:
                self.dir.unlink(temporary_name(f.name, plan.token))
        elif failed and not overwrite:
            for f in plan.files:
                self.store.delete(f.name)
