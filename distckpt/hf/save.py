"""``distckpt.save_hf``: Hugging Face weights written by the ranks in parallel, in
bounded memory, to a directory or a store (``s3://``, ``az://``, ``gs://``, a plug-in).

The layout follows ``save_pretrained`` (:mod:`distckpt.hf.directory`): files of at most
``max_shard_size`` and, when there are several, ``model.safetensors.index.json``.

The protocol, in the order every rank runs it (collectives marked *): a kind of the save
pipeline (:mod:`distckpt.pipeline`), :class:`WeightsSave`, which :func:`save_hf` and
:func:`distckpt.tools.export_hf.export_hf` extend with what they write and how:

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
import uuid
from abc import abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distckpt import pipeline
from distckpt.comm import Communicator
from distckpt.comm.base import COORDINATOR
from distckpt.comm.outcome import Failure, coordinate
from distckpt.errors import ValidationError
from distckpt.hf.directory import DEFAULT_MAX_BYTES, OutFile, parse_size, plan_files
from distckpt.hf.names import Rename, for_saving
from distckpt.hf.target import Plan, Target
from distckpt.hf.write import BoxWrite, Piece, Sink, Work, unit_bytes, write_boxes
from distckpt.items import flatten
from distckpt.pipeline import Clock, SaveKind, communicator
from distckpt.pipeline.options import HF_SAVE, CheckpointOptions, merge_or_refuse
from distckpt.pipeline.results import SaveResult
from distckpt.planning.describe import Desc
from distckpt.planning.save_plan import Balancer
from distckpt.planning.validate import owners, validate
from distckpt.slices import Box, c_order_bands
from distckpt.storage.backend import Store
from distckpt.storage.registry import open_store
from distckpt.transfer import workers as transfer_workers

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from distckpt.pipeline.options import HFSaveKeywords

log = logging.getLogger("distckpt")


class WeightsSave(SaveKind[Any, tuple[str, list[Work]]]):
    """A save of Hugging Face weights to a directory or a store (steps 2 to 4 of the
    module doc, as a kind of :mod:`distckpt.pipeline`). What is written and how is a
    subclass's: :meth:`capture` and :meth:`describe` (step 1), :meth:`files` (the
    coordinator's plan: the files and each rank's :class:`Work`) and :meth:`write_work`
    (a rank's writes)."""

    def __init__(
        self,
        path: str | os.PathLike[str] | Store,
        options: CheckpointOptions,
        refused: BaseException | None,
        to_weights: Callable[[str], str | None],
        max_shard_size: int | str,
    ) -> None:
        self.path = path
        self.options = options
        self.refused = refused  # this rank's arguments were refused
        self.to_weights = to_weights  # a stored name to its weights name (None: left out)
        self.max_shard_size = max_shard_size
        self.where = path.url if isinstance(path, Store) else os.fspath(path)
        self.target: Target | None = None
        self.plans: list[Plan] = []  # the coordinator's
        self.workers = 0

    @abstractmethod
    def files(self, comm: Communicator, gathered: list[Any], target: Target) -> Plan:
        """The coordinator: the plan, from every rank's contribution (step 1)."""

    @abstractmethod
    def write_work(self, comm: Communicator, work: Work, sink: Sink, workers: int) -> int:
        """This rank's writes of ``work`` to ``sink`` with ``workers``; the bytes written."""

    def check(self) -> None:
        if self.refused is not None:
            raise self.refused

    def plan(
        self, comm: Communicator, described: Any, error: BaseException | None
    ) -> tuple[str, list[Work]]:
        """Step 2: the coordinator plans and prepares the directory."""
        target: Target | None = None
        try:
            target = Target(open_store(self.path))
        except Exception as exc:
            error = error or exc
            described = Failure.capture(error, comm.rank)
        network = target is not None and not target.files
        self.workers = transfer_workers.resolve_io_workers(
            self.options.io_workers, comm, network=network
        )

        def decide(gathered: list[Any]) -> tuple[str, list[Work]]:
            assert target is not None
            plan = self.files(comm, gathered, target)
            target.prepare(plan, self.options.overwrite)
            self.plans.append(plan)
            return plan.token, plan.work

        agreed = coordinate(comm, described, decide, error=error)
        assert target is not None  # every rank failed otherwise
        self.target = target
        return agreed

    def write(self, comm: Communicator, plan: tuple[str, list[Work]], clock: Clock) -> int:
        """Step 3."""
        assert self.target is not None
        token, work = plan
        mine = work[comm.rank]
        return self.write_work(comm, mine, self.target.sink(mine, token), self.workers)

    def commit(
        self,
        comm: Communicator,
        plan: tuple[str, list[Work]],
        report: Any,
        error: BaseException | None,
    ) -> int:
        """Step 4; returns the bytes this rank wrote (its report)."""
        target = self.target
        assert target is not None

        def finish(reports: list[Any]) -> None:
            target.finish(self.plans[0], self.options.overwrite)

        def settle(failure: Failure | None) -> None:
            target.settle(self.plans[0], self.options.overwrite, failed=failure is not None)

        coordinate(comm, report, finish, error=error, settle=settle)
        return int(report)

    def finish(
        self,
        comm: Communicator,
        plan: tuple[str, list[Work]],
        committed: int,
        timings: dict[str, float],
    ) -> SaveResult:
        target = self.target
        assert target is not None
        result = SaveResult(target.store.url if not target.files else target.root)
        result.bytes_written = committed
        result.timings = {
            "plan": timings["plan"],
            "write": timings["write"],
            "finish": timings["commit"],
            "total": timings["total"],
        }
        if comm.rank == COORDINATOR:
            result.files_written = len(self.plans[0].files)
            log.info(
                "wrote %d weight files to %s in %.3fs",
                len(self.plans[0].files),
                target.store.url,
                timings["total"],
            )
        return result


def save_hf(
    state: dict[str, Any],
    path: str | os.PathLike[str] | Store,
    comm: Communicator | None = None,
    *,
    prefix: str = "",
    rename: Rename | None = None,
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
    comm = communicator(comm)
    opts, error = merge_or_refuse(options, keywords, HF_SAVE, "save_hf")
    kind = _StateWeights(path, opts, error, for_saving(prefix, rename), max_shard_size)
    return pipeline.save_blocking(kind, state, comm)


class _StateWeights(WeightsSave):
    """save_hf: a state's boxes, each written once by a rank that holds it (in a store,
    by its file's writer, which receives it from a rank that holds it)."""

    max_bytes = 0
    local: dict[str, Any]  # this rank's leaves, by state name (step 1)

    def capture(self, state: dict[str, Any]) -> dict[str, Any]:
        self.max_bytes = parse_size(self.max_shard_size)
        return state

    def describe(self, local: dict[str, Any]) -> list[Desc]:
        """The tensors to write, by weights name, with dtype, global shape and this
        rank's box."""
        descs: list[Desc] = []
        self.local = {}
        for leaf in flatten(local, allow_pickle=True):
            name = self.to_weights(leaf.name)
            if name is None or leaf.kind != "tensor" or leaf.tensor is None:
                continue
            self.local[leaf.name] = leaf
            descs.append(Desc(name, "tensor", leaf.dtype, leaf.shape, leaf.box, value=leaf.name))
        return descs

    def files(self, comm: Communicator, gathered: list[Any], target: Target) -> Plan:
        return plan_boxes(gathered, self.max_bytes, comm, objects=not target.files)

    def write_work(self, comm: Communicator, work: Work, sink: Sink, workers: int) -> int:
        return write_boxes(work, self.local, sink, workers, comm)


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
