"""The README's commands."""
