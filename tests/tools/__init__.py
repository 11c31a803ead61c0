"""The distckpt command."""
