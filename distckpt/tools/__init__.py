"""What the ``distckpt`` command does, one module per command family.

* :mod:`~distckpt.tools.catalog`: a checkpoint's tensors and values, per-rank ones
  expanded, checked well-formed before anything reads them;
* :mod:`~distckpt.tools.slabs`: cutting a tensor into boxes of bounded bytes (pure);
* :mod:`~distckpt.tools.runs`: the checkpoints of a run directory (``distckpt ls``);
* :mod:`~distckpt.tools.summary`: the variables of one checkpoint (``distckpt inspect``);
* :mod:`~distckpt.tools.verify`: re-reading and checking every stored byte;
* :mod:`~distckpt.tools.export`: one-file
  exports (safetensors, streamed; ``torch.save``); Hugging Face directories are
  :mod:`distckpt.hf`;
* :mod:`~distckpt.tools.importer`: DCP directories, ``torch.save`` and safetensors files
  into a committed checkpoint;
* :mod:`~distckpt.tools.diff`: comparing two checkpoints with bounded memory.

The command line (:mod:`distckpt.cli`) only parses arguments and prints; everything here
is callable from Python and raises :class:`~distckpt.errors.CheckpointError` subclasses.
"""
