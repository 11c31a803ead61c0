"""How a save commits: crash states, racing saves of one name."""
