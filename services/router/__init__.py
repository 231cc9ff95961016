"""The router: client API, tokenization and block keys, instance registry, scheduling (see README.md)."""
