"""The decode service: an engine instance in decode mode (see README.md)."""
