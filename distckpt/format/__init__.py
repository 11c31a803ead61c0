"""The on-disk format: zarr v3 metadata and dtypes, codecs and frames, shard files and
their reader, stored tables, the index, digests, sealed documents and the well-formedness
checks every byte read from a store passes. Depends on the store protocol only."""
