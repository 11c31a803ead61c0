"""Slices and pure save and read plans."""
