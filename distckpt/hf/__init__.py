"""Hugging Face weights (safetensors files and their index) in and out of distckpt.

* :func:`load_hf`: a weights directory straight into a sharded state, each rank reading
  only its own boxes (:mod:`distckpt.hf.load`);
* :func:`save_hf`: a sharded state, from its ranks, as a weights directory
  (:mod:`distckpt.hf.save`), to a directory or a store (``export_hf``, a checkpoint's
  tensors likewise, is :mod:`distckpt.tools.export_hf`);
* :mod:`~distckpt.hf.safetensors` and :mod:`~distckpt.hf.directory`: the formats.
"""

from distckpt.hf.load import load_hf
from distckpt.hf.save import save_hf

__all__ = ["load_hf", "save_hf"]
