"""A projection matrix ``W [N, K]`` kept only in the forms the forward pass reads on this device.

CPU, fp32, one torch thread, the C GEMM built (``native.load_gemm``): panels for the kernel, which streams the
weights once for all the rows of a step (a decode step of 8 rows costs little more than one), plus, for steps
of more than ``NATIVE_ROWS`` rows (prefill), oneDNN's blocked copy, which is faster there. CPU fp32 without the
kernel: the oneDNN copy alone. Elsewhere (CUDA, bf16): the dense matrix and ``F.linear``. The dense fp32 matrix
is not kept beside a packed form; ``rows`` (an embedding lookup) reads the panels.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from kvmesh.engine import native

NATIVE_ROWS = 48  # rows up to which the kernel beats oneDNN here (measured: 1.1-1.45x at 1-16 rows, ~1.1x at 64)


def _onednn(w: torch.Tensor) -> torch.Tensor | None:
    """``w`` reordered into oneDNN's blocked layout, or None where that is unavailable."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w)
    except (RuntimeError, AttributeError):  # a torch built without it: another form serves
        return None


def _gemm_lib(w: torch.Tensor) -> ctypes.CDLL | None:
    cpu_fp32 = w.device.type == "cpu" and w.dtype == torch.float32
    return native.load_gemm() if cpu_fp32 and torch.get_num_threads() == 1 else None


class Linear:
    """``y = x @ W.T (+ bias)`` for ``x [M, K]``. ``lookup``: ``rows`` must work (a tied embedding)."""

    def __init__(self, w: torch.Tensor, lookup: bool = False, prefill_copy: bool = True) -> None:
        self.out_features, self.in_features = w.shape
        self.lib = _gemm_lib(w)
        self.panels = native.gemm_pack(self.lib, w.contiguous()) if self.lib is not None else None
        cpu_fp32 = w.device.type == "cpu" and w.dtype == torch.float32
        want_onednn = cpu_fp32 and (self.panels is None or prefill_copy)
        self.onednn = _onednn(w) if want_onednn else None
        covered = self.panels is not None or (self.onednn is not None and not lookup)
        self.dense = None if covered else w

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """``residual``: returned with the product added to it in place (``residual + x @ W.T (+ bias)``, the
        same rounding as the separate add; the kernel fuses it, saving an allocation and a pass)."""
        if self.panels is not None and (self.onednn is None or x.shape[0] <= NATIVE_ROWS):
            if x.stride(-1) != 1 or x.dtype != torch.float32:
                x = x.float().contiguous()
            if residual is not None and not residual.is_contiguous():
                return residual.add_(native.gemm(self.lib, x, self.panels, self.out_features, bias))
            return native.gemm(self.lib, x, self.panels, self.out_features, bias, out=residual)
        if self.onednn is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.onednn, bias, "none", [], "")
        else:
            y = F.linear(x, self.dense, bias)
        return y if residual is None else residual.add_(y)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``W[ids]`` ``[len(ids), K]`` (an embedding lookup)."""
        if self.dense is not None:
            return self.dense.index_select(0, ids)
        nr = self.panels.shape[2]
        return self.panels[ids // nr, :, ids % nr]

    def nbytes(self) -> int:
        """Bytes held by every form kept (the oneDNN copy counted at the dense size it reorders)."""
        forms = (self.panels, self.dense)
        size = sum(t.numel() * t.element_size() for t in forms if t is not None)
        if self.onednn is not None:
            size += self.out_features * self.in_features * 4
        return size
