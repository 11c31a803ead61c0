"""Checkpoint, CheckpointManager, preemption, elastic resume."""
