"""launch/, SLURM, and two nodes in namespaces."""
