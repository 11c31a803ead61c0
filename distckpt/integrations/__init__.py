"""distckpt inside the trainers people use: one small module per framework, each
importing its framework only when used (``distckpt.integrations.dcp`` for
``torch.distributed.checkpoint``)."""
