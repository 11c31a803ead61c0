"""How a save becomes a checkpoint on a store: the two commit strategies (rename a
staging directory; claim the name, write in place, create the index last), the
transaction that drives them, and the leases that tell a live save from an abandoned one."""
