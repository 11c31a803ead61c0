"""``distckpt.save_hf``: Hugging Face weights written by the ranks in parallel, in
bounded memory, to a directory or a store (``s3://``, ``az://``, ``gs://``, a plug-in).

The layout follows ``save_pretrained`` (:mod:`distckpt.hf.directory`): files of at most
``max_shard_size`` and, when there are several, ``model.safetensors.index.json``.

The protocol, in the order every rank runs it (collectives marked *), which
:func:`write_directory` runs for :func:`save_hf` and for
:func:`distckpt.tools.export_hf.export_hf`:

1. **Describe** (every rank): the tensors to write, by weights name, with dtype, global
   shape and this rank's box (:func:`save_hf`); or nothing (``export_hf``: the
   coordinator reads the checkpoint's index).
2. **Plan** (*gather, coordinator, *broadcast): the coordinator checks the descriptions as
   a save does (every box of every tensor, no overlap, no gap), packs the tensors into
   files and decides who writes what (:mod:`distckpt.hf.write`): on a file system each
   box is written by one rank that holds it (replicas write once), several ranks into one
   file; in an object store each file has one writer, which receives the boxes it does
   not hold from ranks that do. It checks the directory and, on a file system, creates
   every file beside its final name (``.<name>.tmp-<token>``) with its header and its
   full size.
3. **Write** (every rank): each rank writes its bytes with its I/O workers (from host
   tensors in place, from GPU tensors a slab at a time), then makes them durable (fsync;
   the objects completed).
4. **Finish** (*gather, coordinator, *broadcast): with every rank's report in, the
   coordinator renames the files to their names (a file system) and writes the index
   last; after a failure anywhere it removes what the save wrote instead. Every rank
   returns, or raises the same error.

Other files in the directory (``config.json`` ...) are left alone. Existing weights
(``model.safetensors``, ``model-*-of-*.safetensors``, the index) are an error unless
``overwrite=True``, which replaces them: on a file system they are removed just before
the new files are renamed in; in a store the old index is removed first, each object is
replaced as its upload completes, and the old files the new save does not name are
removed at the end. Either way the index is written last, so a reader that follows it
never mixes two saves' files; a reader without the index may find the directory
incomplete meanwhile, and after a failed ``overwrite=True`` in a store (which cannot
rename) the directory holds no index and whichever files were replaced.
"""

from __future__ import annotations

import logging
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distckpt.comm import Communicator, auto
from distckpt.comm.outcome import Failure, coordinate
from distckpt.engine import background
from distckpt.engine.options import HF_SAVE, CheckpointOptions, merge_or_refuse
from distckpt.engine.results import SaveResult
from distckpt.errors import CheckpointExists, ValidationError
from distckpt.hf import names as names_mod
from distckpt.hf.directory import (
    DEFAULT_MAX_BYTES,
    INDEX,
    OutFile,
    index_document,
    parse_size,
    plan_files,
)
from distckpt.hf.write import (
    BoxWrite,
    Files,
    Objects,
    Piece,
    Sink,
    Work,
    temporary_name,
    unit_bytes,
    write_boxes,
)
from distckpt.items import flatten
from distckpt.planning.describe import Desc
from distckpt.planning.save_plan import Balancer
from distckpt.planning.validate import owners, validate
from distckpt.slices import Box, c_order_bands
from distckpt.storage.backend import Store
from distckpt.storage.beneath import Beneath
from distckpt.storage.fsutil import atomic_write, fsync_fd
from distckpt.storage.registry import open_store
from distckpt.transfer import workers as transfer_workers

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from distckpt.engine.options import HFSaveKeywords

log = logging.getLogger("distckpt")

COORDINATOR = 0
_OLD_WEIGHTS = re.compile(
    r"^model(-[0-9]+-of-[0-9]+)?\.safetensors$|^model\.safetensors\.index\.json$"
)


@dataclass
class Plan:
    """The coordinator's decision: the files and each rank's :class:`Work`."""

    token: str
    files: list[OutFile]
    work: list[Work]


#: The coordinator's planner: every rank's contribution and the target in, the plan out.
Planner = Callable[[list[Any], "Target"], Plan]
#: A rank's writer: its work, the sink to write it to, its I/O workers; the bytes out.
Writer = Callable[[Work, Sink, int], int]


def save_hf(
    state: dict[str, Any],
    path: str | os.PathLike[str] | Store,
    comm: Communicator | None = None,
    *,
    prefix: str = "",
    rename: names_mod.Rename | None = None,
    max_shard_size: int | str = DEFAULT_MAX_BYTES,
    options: CheckpointOptions | None = None,
    **keywords: Unpack[HFSaveKeywords],
) -> SaveResult:
    """Write the tensors of ``state`` as Hugging Face weights in the directory ``path``
    (or a store: ``s3://bucket/model``, ``az://...``, ``gs://...``); every rank calls it
    with its own boxes (DTensors, :class:`~distckpt.Shard`, plain tensors), and each box
    is written once, by a rank that holds it (in a store, by the file's writer, which
    receives it from a rank that holds it)::

        distckpt.save_hf(model.state_dict(), "out/")          # FSDP2 model, every rank
        model.config.save_pretrained("out/")                  # then from_pretrained("out/")

    ``prefix`` (stripped; names without it are left out) or ``rename`` (state name to
    weights name, None to leave out) name the tensors. Python values and
    :class:`~distckpt.PerRank` entries are left out. ``max_shard_size`` (bytes, or
    ``"5GB"``, ``"500MiB"``) bounds each file. ``options`` (or the keywords
    ``overwrite``, ``io_workers``) as for :func:`distckpt.save`. Host memory: the
    staging slabs, the I/O workers' buffers and, in a store, at most 64 MiB of messages
    each way, whatever the state's size.
    """
    background.finish_pending()
    comm = comm or auto()
    opts, error = merge_or_refuse(options, keywords, HF_SAVE, "save_hf")
    to_weights = names_mod.for_saving(prefix, rename)
    descs: list[Desc] = []
    contribution: list[Desc] | Failure = descs
    local: dict[str, Any] = {}
    max_bytes = 0
    try:
        if error is not None:
            raise error
        max_bytes = parse_size(max_shard_size)
        for leaf in flatten(state, allow_pickle=True):
            name = to_weights(leaf.name)
            if name is None or leaf.kind != "tensor" or leaf.tensor is None:
                continue
            local[leaf.name] = leaf
            descs.append(Desc(name, "tensor", leaf.dtype, leaf.shape, leaf.box, value=leaf.name))
    except Exception as exc:
        error, contribution = exc, Failure.capture(exc, comm.rank)

    def plan(gathered: list[Any], target: Target) -> Plan:
        return plan_boxes(gathered, max_bytes, comm, objects=not target.files)

    def write(work: Work, sink: Sink, workers: int) -> int:
        return write_boxes(work, local, sink, workers, comm)

    return write_directory(comm, path, opts, contribution, error, plan, write)


def plan_boxes(gathered: list[list[Desc]], max_bytes: int, comm: Any, *, objects: bool) -> Plan:
    """save_hf's plan (step 2): files of at most ``max_bytes`` and who writes each box
    (``objects``: one writer per file, which receives what it does not hold)."""
    sources: dict[str, str] = {}
    for rank_descs in gathered:
        for d in rank_descs:
            first = sources.setdefault(d.name, d.value)
            if first != d.value:
                raise ValidationError(f"both {first!r} and {d.value!r} map to {d.name!r}")
    by_name = validate(gathered)
    tensors = [(n, held[0][1].dtype, held[0][1].shape) for n, held in by_name.items()]
    files = plan_files(tensors, max_bytes)  # type: ignore[arg-type]
    where = {t.name: (f, f.offsets[t.name]) for f in files for t in f.tensors}
    boxes: list[tuple[list[int], dict[int, BoxWrite]]] = []  # holders, each one's write
    for name, held in by_name.items():
        d0 = held[0][1]
        assert d0.dtype is not None and d0.shape is not None
        out, offset = where[name]
        for box, ranks in owners(held).items():
            if not box.empty:
                writes = {
                    r: BoxWrite(d.value, out.name, offset, d0.shape, d0.dtype, box)
                    for r, d in held
                    if d.box == box
                }
                boxes.append((list(ranks), writes))
    work = [Work() for _ in range(comm.size)]
    balancer = Balancer(comm.size)
    if not objects:
        for ranks, writes in boxes:
            rank = balancer.pick(ranks, _nbytes(writes[ranks[0]].box, writes[ranks[0]]))
            work[rank].writes.append(writes[rank])
        return Plan(uuid.uuid4().hex[:16], files, work)
    writer = _writers(files, boxes, comm.size)
    for f in files:
        work[writer[f.name]].create.append((f.name, f.size, f.header))
    unit = unit_bytes(comm.size)
    messages: dict[tuple[int, int], list[list[Piece]]] = {}
    for ranks, writes in boxes:
        w = next(iter(writes.values()))
        if writer[w.file] in ranks:
            work[writer[w.file]].writes.append(writes[writer[w.file]])
            continue
        sender = balancer.pick(ranks, _nbytes(w.box, w))
        queue = messages.setdefault((sender, writer[w.file]), [])
        for band in c_order_bands(w.box.lengths, w.itemsize, unit):
            if not queue or sum(_nbytes(b, p) for p, b in queue[-1]) + _nbytes(band, w) > unit:
                queue.append([])
            queue[-1].append((writes[sender], band))
    if messages and not callable(getattr(comm, "sendrecv", None)):
        raise TypeError(
            f"{type(comm).__name__} has no sendrecv(), which writing weights to a store "
            "from ranks holding parts of one file needs"
        )
    rounds = max((len(queue) for queue in messages.values()), default=0)
    for rank, item in enumerate(work):
        item.messages = {pair: q for pair, q in messages.items() if rank in pair}
        item.rounds = rounds
    return Plan(uuid.uuid4().hex[:16], files, work)


def _nbytes(box: Box, w: BoxWrite) -> int:
    return box.numel * w.itemsize


def _writers(
    files: list[OutFile], boxes: list[tuple[list[int], dict[int, BoxWrite]]], size: int
) -> dict[str, int]:
    """The writer of each file: the rank that least adds to the most loaded one, counting
    what it already holds of the file as sent for free (largest files first)."""
    held = {f.name: [0] * size for f in files}
    for ranks, writes in boxes:
        w = next(iter(writes.values()))
        for r in ranks:
            held[w.file][r] += _nbytes(w.box, w)
    load = [0] * size
    writer = {}
    for f in sorted(files, key=lambda f: -f.size):
        rank = min(range(size), key=lambda r: (load[r] - held[f.name][r], r))
        writer[f.name] = rank
        load[rank] += f.size
    return writer


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


def write_directory(
    comm: Communicator,
    path: str | os.PathLike[str] | Store,
    options: CheckpointOptions,
    contribution: Any,
    error: BaseException | None,
    plan_fn: Planner,
    write_fn: Writer,
) -> SaveResult:
    """Steps 2 to 4 of the protocol (see the module doc); ``contribution`` is this rank's
    step 1 (or the :class:`Failure` of ``error``). Collective."""
    t0 = time.perf_counter()
    target: Target | None = None
    try:
        target = Target(open_store(path))
    except Exception as exc:
        error = error or exc
        contribution = Failure.capture(error, comm.rank)
    network = target is not None and not target.files
    workers = transfer_workers.resolve(options.io_workers, comm, network=network)
    plans: list[Plan] = []

    def decide(gathered: list[Any]) -> tuple[str, list[Work]]:
        assert target is not None
        plan = plan_fn(gathered, target)
        target.prepare(plan, options.overwrite)
        plans.append(plan)
        return plan.token, plan.work

    token, work = coordinate(comm, contribution, decide, error=error)
    assert target is not None  # every rank failed otherwise
    t_plan = time.perf_counter()
    report: Any = None
    error = None
    try:
        report = write_fn(work[comm.rank], target.sink(work[comm.rank], token), workers)
    except Exception as exc:
        error, report = exc, Failure.capture(exc, comm.rank)
    t_write = time.perf_counter()

    def finish(reports: list[Any]) -> None:
        target.finish(plans[0], options.overwrite)

    def settle(failure: Failure | None) -> None:
        target.settle(plans[0], options.overwrite, failed=failure is not None)

    coordinate(comm, report, finish, error=error, settle=settle)
    t_end = time.perf_counter()
    result = SaveResult(target.store.url if not target.files else target.root)  # type: ignore[arg-type]
    result.bytes_written = report
    result.timings = {
        "plan": t_plan - t0,
        "write": t_write - t_plan,
        "finish": t_end - t_write,
        "total": t_end - t0,
    }
    if comm.rank == COORDINATOR:
        result.files_written = len(plans[0].files)
        log.info(
            "wrote %d weight files to %s in %.3fs",
            len(plans[0].files),
            target.store.url,
            t_end - t0,
        )
    return result
