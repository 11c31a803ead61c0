"""Stores: where bytes live. The :class:`~distckpt.storage.backend.Store` protocol and its
capabilities, the POSIX store, the object stores (S3, and Azure / GCS through obstore) on
one base, and the registry that turns a location into a store. Nothing here knows the
checkpoint format or how a save commits."""
