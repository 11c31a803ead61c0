"""Communicators under every launcher."""
