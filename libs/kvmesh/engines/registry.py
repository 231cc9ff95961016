"""Engines by backend name. Each backend is named by the module path of its ``start`` coroutine and imported only
when chosen, so an instance of one backend never loads another's framework (a vLLM instance loads no kvmesh model
code beyond what the seam needs; a native one never imports vllm), and the layer rules stay static: nothing here
imports a backend."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvmesh.contracts.ids import EngineBackend

if TYPE_CHECKING:
    from kvmesh.engines.base import Engine
    from kvmesh.settings import EngineSettings

# backend -> "module:coroutine" that builds and starts it from the engine settings
BACKENDS: dict[EngineBackend, str] = {
    EngineBackend.NATIVE: "kvmesh.engine.async_engine:start_native",
    EngineBackend.VLLM: "kvmesh.vllm.engine:start_vllm",
}


async def start_engine(cfg: EngineSettings) -> Engine:
    """The engine ``cfg.backend`` names, built from ``cfg`` and started (its model loaded, its threads running).
    ImportError naming the install command when the backend's package is missing."""
    backend = EngineBackend(cfg.backend)
    module, _, name = BACKENDS[backend].partition(":")
    try:
        start = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if backend is EngineBackend.VLLM:
            raise ImportError(f"engine backend 'vllm' needs vLLM installed ({e.name} is missing): run `make vllm`"
                              ) from e
        raise
    return await start(cfg)
