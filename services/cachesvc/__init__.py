"""cachesvc: the global KV block index and the pool's own block store (see README.md)."""
