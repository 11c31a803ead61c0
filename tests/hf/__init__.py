"""Hugging Face weights in and out."""
