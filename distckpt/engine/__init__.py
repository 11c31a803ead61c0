"""The engine: ``save`` and ``load`` of one checkpoint (no pointer, no numbering)."""
