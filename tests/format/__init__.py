"""What is on disk: golden checkpoints, seals, frames, codecs, zarr data types, values and names."""
