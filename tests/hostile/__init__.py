"""Hostile and damaged input, fuzzing."""
