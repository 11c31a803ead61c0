"""distckpt under ``torch.distributed.checkpoint`` (DCP): a ``StorageWriter`` that makes
``dcp.save`` (and ``dcp.async_save``) write a committed distckpt checkpoint, and a
``StorageReader`` that makes ``dcp.load`` read any distckpt checkpoint (whatever wrote
it, on any world size)::

    from distckpt.integrations.dcp import DistckptReader, DistckptWriter

    dcp.save(state, storage_writer=DistckptWriter("s3://bucket/run/step-100"))
    dcp.load(state, storage_reader=DistckptReader("s3://bucket/run/step-100"))

The writer writes what DCP's plan says (:mod:`~distckpt.integrations.dcp.writer`), over
the ranks DCP saves with; the reader answers DCP's read plan from distckpt's index
(:mod:`~distckpt.integrations.dcp.reader`). The result is an ordinary distckpt checkpoint
that ``distckpt.load``, ``distckpt verify`` and zarr readers open.

Names: distckpt names a nested entry ``model/layer.weight``; DCP's flattened key for it is
``model.layer.weight``. Two distckpt names that flatten to one DCP key are an error.
"""

from distckpt.integrations.dcp.reader import DistckptReader
from distckpt.integrations.dcp.writer import CheckpointAlreadyExists, DistckptWriter

__all__ = ["CheckpointAlreadyExists", "DistckptReader", "DistckptWriter"]
