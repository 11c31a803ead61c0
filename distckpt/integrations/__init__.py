"""Adapters that make distckpt the checkpoint format of training frameworks.

Each module imports its framework when it is itself imported, never before, and uses
distckpt's public API only: ``distckpt.integrations.dcp`` (torch.distributed.checkpoint),
``lightning``, ``accelerate`` and ``hf_trainer``.
"""
