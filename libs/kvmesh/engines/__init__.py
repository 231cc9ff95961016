"""The engine seam: everything a service or the instance host may ask of an engine (``Engine``), and how an
engine is chosen by name (``start_engine``). Two backends implement it: ``native`` (kvmesh's own, in
``kvmesh.engine``) and ``vllm``. Services and ``kvmesh.instance`` import this package, never a backend (an
import-linter contract holds that)."""

from kvmesh.engines.base import Engine, KVEventSink, Reserved
from kvmesh.engines.errors import SequenceError
from kvmesh.engines.registry import BACKENDS, start_engine

__all__ = ["BACKENDS", "Engine", "KVEventSink", "Reserved", "SequenceError", "start_engine"]
