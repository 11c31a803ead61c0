"""Storage: the zarr v3 layout, piece files, the index and the commit."""
