"""The node-local tier."""
