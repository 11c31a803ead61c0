"""``distckpt.export_hf``: a checkpoint's tensors as Hugging Face weights, written by the
ranks in parallel (each writes whole files of its own) with the protocol of
:mod:`distckpt.hf.save` (a :class:`~distckpt.hf.save.WeightsSave`), to a directory or a
store."""

from __future__ import annotations

import os
import uuid
from typing import TYPE_CHECKING, Any

from distckpt.comm import Communicator
from distckpt.errors import ValidationError
from distckpt.format.backed import check_stored
from distckpt.hf.directory import DEFAULT_MAX_BYTES, parse_size, plan_files
from distckpt.hf.names import Rename, for_saving
from distckpt.hf.save import WeightsSave
from distckpt.hf.target import Plan, Target
from distckpt.hf.write import Sink, Work
from distckpt.pipeline import communicator, save_blocking
from distckpt.pipeline.options import HF_SAVE, CheckpointOptions, merge_or_refuse
from distckpt.pipeline.results import SaveResult
from distckpt.planning.save_plan import Balancer
from distckpt.storage.backend import Store
from distckpt.tools.catalog import open_catalog
from distckpt.tools.export import tensor_slabs
from distckpt.tools.slabs import DEFAULT_SLAB_BYTES
from distckpt.tools.verify import check_slabs

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from distckpt.pipeline.options import HFSaveKeywords


def export_hf(
    checkpoint: str | os.PathLike[str] | Store,
    path: str | os.PathLike[str] | Store,
    comm: Communicator | None = None,
    *,
    prefix: str = "",
    rename: Rename | None = None,
    max_shard_size: int | str = DEFAULT_MAX_BYTES,
    options: CheckpointOptions | None = None,
    **keywords: Unpack[HFSaveKeywords],
) -> SaveResult:
    """Write the tensors of the checkpoint at ``checkpoint`` as Hugging Face weights in
    the directory (or store) ``path``; with several ranks (every rank calls it), each
    writes whole files of its own. ``prefix`` / ``rename`` as in
    :func:`distckpt.save_hf`: a checkpoint saved from ``{"net": model.state_dict()}`` is
    exported with ``prefix="net/"``. ``options`` (or ``overwrite``, ``io_workers``) as for
    :func:`distckpt.save_hf`. Memory: one slab of at most 64 MiB per rank plus the I/O
    workers' buffers (and, in a store, what its uploads hold)::

        distckpt.export_hf("run/ckpt-100", "out/", prefix="net/")
        distckpt.export_hf("s3://bucket/run/ckpt-100", "s3://bucket/hf/", prefix="net/")
    """
    comm = communicator(comm)
    opts, error = merge_or_refuse(options, keywords, HF_SAVE, "export_hf")
    to_weights = for_saving(prefix, rename)
    kind = _CheckpointWeights(path, opts, error, to_weights, max_shard_size)
    return save_blocking(kind, checkpoint, comm)


class _CheckpointWeights(WeightsSave):
    """export_hf: the coordinator reads the checkpoint's index and packs its tensors into
    files; each rank copies whole files of its own, a slab at a time."""

    checkpoint: str | os.PathLike[str] | Store

    def capture(self, state: str | os.PathLike[str] | Store) -> None:
        self.checkpoint = state  # what the coordinator reads, what each rank copies from

    def describe(self, local: None) -> None:
        return None  # the coordinator reads the checkpoint's index

    def files(self, comm: Communicator, gathered: list[Any], target: Target) -> Plan:
        max_bytes = parse_size(self.max_shard_size)
        catalog = open_catalog(self.checkpoint)
        tensors = []
        sources: dict[str, str] = {}
        for var in catalog.tensors.values():
            name = self.to_weights(var.name)
            if name is not None:
                if name in sources:
                    raise ValidationError(
                        f"both {sources[name]!r} and {var.name!r} map to {name!r}"
                    )
                check_slabs(catalog, var, DEFAULT_SLAB_BYTES)  # before a file is made
                check_stored(catalog.root, var.pieces)  # (of the size it declares)
                tensors.append((name, var.dtype, var.shape))
                sources[name] = var.name
        files = plan_files(tensors, max_bytes)
        balancer = Balancer(comm.size)
        work = [Work() for _ in range(comm.size)]
        for f in sorted(files, key=lambda f: -f.size):
            rank = balancer.pick(range(comm.size), f.size)
            copies = [(sources[t.name], f.offsets[t.name]) for t in f.tensors]
            work[rank].copies.append((f.name, copies))
            if not target.files:
                work[rank].create.append((f.name, f.size, f.header))
        return Plan(uuid.uuid4().hex[:16], files, work)

    def write_work(self, comm: Communicator, work: Work, sink: Sink, workers: int) -> int:
        return _copy_tensors(self.checkpoint, work.copies, sink, workers)


def _copy_tensors(
    checkpoint: str | os.PathLike[str] | Store,
    copies: list[tuple[str, list[tuple[str, int]]]],
    sink: Sink,
    workers: int,
) -> int:
    """Write this rank's whole files, each tensor a slab at a time."""
    written = 0
    ok = False
    try:
        catalog = open_catalog(checkpoint) if copies else None
        for name, tensors in copies:
            assert catalog is not None
            sink.open(name)
            for var_name, offset in tensors:
                var = catalog.tensors[var_name]
                for raw in tensor_slabs(catalog, var, io_workers=workers):
                    flat = raw.reshape(-1)
                    sink.write(name, [(offset, flat.nbytes, 0)], flat)
                    offset += flat.nbytes
                    written += flat.nbytes
        ok = True
    finally:
        sink.close(ok)
    return written
