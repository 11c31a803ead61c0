"""``distckpt.export_hf``: a checkpoint's tensors as Hugging Face weights, written by the
ranks in parallel (each writes whole files of its own) with the protocol of
:mod:`distckpt.hf.save`, to a directory or a store."""

from __future__ import annotations

import os
import uuid
from typing import TYPE_CHECKING, Any

from distckpt.comm import Communicator, auto
from distckpt.comm.outcome import Failure
from distckpt.engine import background
from distckpt.engine.options import HF_SAVE, CheckpointOptions, merge_or_refuse
from distckpt.engine.results import SaveResult
from distckpt.errors import ValidationError
from distckpt.hf import names as names_mod
from distckpt.hf.directory import DEFAULT_MAX_BYTES, parse_size, plan_files
from distckpt.hf.save import Plan, Target, write_directory
from distckpt.hf.write import Sink, Work
from distckpt.planning.save_plan import Balancer
from distckpt.storage.backend import Store
from distckpt.tools.catalog import open_catalog
from distckpt.tools.export import tensor_slabs
from distckpt.tools.slabs import DEFAULT_SLAB_BYTES
from distckpt.tools.verify import check_slabs

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from distckpt.engine.options import HFSaveKeywords


def export_hf(
    checkpoint: str | os.PathLike[str] | Store,
    path: str | os.PathLike[str] | Store,
    comm: Communicator | None = None,
    *,
    prefix: str = "",
    rename: names_mod.Rename | None = None,
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
    background.finish_pending()
    comm = comm or auto()
    opts, error = merge_or_refuse(options, keywords, HF_SAVE, "export_hf")
    to_weights = names_mod.for_saving(prefix, rename)
    contribution: Any = None if error is None else Failure.capture(error, comm.rank)

    def plan(gathered: list[Any], target: Target) -> Plan:
        max_bytes = parse_size(max_shard_size)
        catalog = open_catalog(checkpoint)
        tensors = []
        sources: dict[str, str] = {}
        for var in catalog.tensors.values():
            name = to_weights(var.name)
            if name is not None:
                if name in sources:
                    raise ValidationError(
                        f"both {sources[name]!r} and {var.name!r} map to {name!r}"
                    )
                check_slabs(catalog, var, DEFAULT_SLAB_BYTES)  # before a file is made
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

    def write(work: Work, sink: Sink, workers: int) -> int:
        return _copy_tensors(checkpoint, work.copies, sink, workers)

    return write_directory(comm, path, opts, contribution, error, plan, write)


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
