"""The prefill service: an engine instance in prefill mode (see README.md)."""
