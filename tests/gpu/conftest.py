"""tests/gpu: the engine on CUDA (run by scripts/gpu_check.sh / `make gpu-check` on a machine with an NVIDIA
GPU). Everywhere else every test here is skipped, saying why."""

from __future__ import annotations

import pytest
import torch


def _no_cuda_reason() -> str | None:
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"no CUDA: torch {torch.__version__} is a CPU build (scripts/gpu_check.sh installs the CUDA one)"
    return f"no CUDA: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _no_cuda_reason()
    if reason is None:
        return
    here = config.rootpath / "tests" / "gpu"
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.skipif(True, reason=reason), append=False)  # read before any other

