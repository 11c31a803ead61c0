"""A rank's data path: I/O workers, staging slabs, I/O priority."""
