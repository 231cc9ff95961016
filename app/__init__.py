"""The application layer: the `kvmesh` command line and what it starts, composes and measures."""
