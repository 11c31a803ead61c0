"""A rank's data path: its I/O workers, the staging slabs for device tensors, and the
parallel writer and reader that the engine's save and load use."""

from distckpt.transfer.slabs import prepare as prepare_staging
from distckpt.transfer.slabs import set_staging
from distckpt.transfer.workers import default_io_workers

__all__ = ["default_io_workers", "prepare_staging", "set_staging"]
