"""Save and load end to end: one process, N x M ranks, async, incremental, failures."""
