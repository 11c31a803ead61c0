"""Hugging Face weights (safetensors files and their index) in and out of distckpt.

* :func:`load_hf`: a weights directory straight into a sharded state, each rank reading
  only its own boxes (:mod:`distckpt.hf.load`);
* :func:`save_hf`: a sharded state, from its ranks, as a weights directory
  (:mod:`distckpt.hf.save`); :func:`export_hf`: a checkpoint's tensors, likewise;
* :mod:`~distckpt.hf.safetensors` and :mod:`~distckpt.hf.directory`: the formats.
"""

from distckpt.hf.load import load_hf
from distckpt.hf.save import export_hf, save_hf

__all__ = ["export_hf", "load_hf", "save_hf"]
