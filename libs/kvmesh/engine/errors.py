"""The native engine's per-request error is the seam's (``kvmesh.engines.errors``)."""

from kvmesh.engines.errors import SequenceError

__all__ = ["SequenceError"]
