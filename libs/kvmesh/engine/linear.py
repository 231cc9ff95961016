"""A projection matrix ``W [N, K]`` kept only in the forms the forward pass reads on this device.

CPU, fp32, one torch thread, the C GEMM built for AVX-512 (``native.load_gemm``, ``native.gemm_fast``) and wanted
(the engine's ``native_gemm``): panels for the kernel, which streams the weights once for all the rows of a step
(a decode step of 8 rows costs little more than one), plus, for steps of more than ``NATIVE_ROWS`` rows (prefill),
oneDNN's blocked copy, which is faster there. A matrix loaded from a GGUF may instead keep its Q4_1 / Q8_0 blocks
for the kernel (``use_quantized``: only when they dequantize to exactly its fp32 values; the kernel then computes
the same products from a 4-6x smaller stream). CPU fp32 without the kernel: the oneDNN copy alone. Elsewhere
(CUDA, bf16): the dense matrix and ``F.linear``. The dense fp32 matrix is not kept beside a
packed form; ``rows`` (an embedding lookup) reads the panels.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvmesh.engine import native, quant

if TYPE_CHECKING:
    import numpy as np

NATIVE_ROWS = 48  # rows up to which the kernel beats oneDNN here (measured: 1.1-1.45x at 1-16 rows, ~1.1x at 64)


def _onednn(w: torch.Tensor) -> torch.Tensor | None:
    """``w`` reordered into oneDNN's blocked layout, or None where that is unavailable."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w)
    except (RuntimeError, AttributeError):  # a torch built without it: another form serves
        return None


def _gemm_lib(w: torch.Tensor, wanted: bool) -> ctypes.CDLL | None:
    cpu_fp32 = w.device.type == "cpu" and w.dtype == torch.float32
    if not (wanted and cpu_fp32 and torch.get_num_threads() == 1):
        return None
    lib = native.load_gemm()
    return lib if lib is not None and native.gemm_fast(lib) else None


class Linear:
    """``y = x @ W.T (+ bias)`` for ``x [M, K]``. ``lookup``: ``rows`` must work (a tied embedding).
    ``native_gemm``: use the C GEMM where it applies (off: torch's products only)."""

    def __init__(self, w: torch.Tensor, lookup: bool = False, prefill_copy: bool = True,
                 native_gemm: bool = True) -> None:
        self.out_features, self.in_features = w.shape
        self.lookup = lookup
        self.q: torch.Tensor | None = None  # quantized panels (use_quantized), read instead of ``panels``
        self.q_type = 0
        self.q_scratch: torch.Tensor | None = None  # the quantized kernel's scratch, made with ``q``
        self.lib = _gemm_lib(w, native_gemm)
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
        lib = self.lib
        if lib is not None and (self.onednn is None or x.shape[0] <= NATIVE_ROWS):
            if x.stride(-1) != 1 or x.dtype != torch.float32:
                x = x.float().contiguous()
            if residual is not None and not residual.is_contiguous():
                return residual.add_(self._kernel(lib, x, bias, None))
            return self._kernel(lib, x, bias, residual)
        if self.onednn is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.onednn, bias, "none", [], "")
        else:
            assert self.dense is not None  # no kernel and no oneDNN copy: the dense matrix is kept
            y = F.linear(x, self.dense, bias)
        return y if residual is None else residual.add_(y)

    def _kernel(self, lib: ctypes.CDLL, x: torch.Tensor, bias: torch.Tensor | None,
                out: torch.Tensor | None) -> torch.Tensor:
        if self.q is not None:
            assert self.q_scratch is not None  # made with ``q`` (use_quantized)
            return native.gemm_q(lib, x, self.q, self.q_type, self.out_features, self.q_scratch, bias, out)
        assert self.panels is not None  # with the kernel and no ``q``, the panels are kept
        return native.gemm(lib, x, self.panels, self.out_features, bias, out=out)

    def use_quantized(self, kind: str, rows: np.ndarray) -> bool:
        """Read this matrix from its GGUF blocks (``rows``: the file's rows of type ``kind``, in this matrix's
        row order) where the kernel can: only if they dequantize to exactly the fp32 values it holds (checked
        over the whole matrix); the dense panels are then dropped, except for a lookup (the embedding reads
        rows). False, and nothing changed, otherwise."""
        n, k = self.out_features, self.in_features
        if self.lib is None or self.panels is None or not quant.supported(kind, n, k) \
                or self.lib.kvmesh_q_block_bytes(quant.TYPES[kind]) == 0:
            return False
        q = torch.from_numpy(quant.to_panels(kind, rows))
        if not torch.equal(native.q_dequant(self.lib, q, quant.TYPES[kind], n, k), self.panels):
            return False
        self.q, self.q_type = q, quant.TYPES[kind]
        self.q_scratch = torch.empty(2 * k * quant.NR, dtype=torch.float32)
        if not self.lookup:
            self.panels = None
        return True

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``W[ids]`` ``[len(ids), K]`` (an embedding lookup)."""
        if self.dense is not None:
            return self.dense.index_select(0, ids)
        panels = self.panels
        assert panels is not None  # without the dense matrix, a lookup's panels are kept (``lookup``)
        nr = panels.shape[2]
        return panels[ids // nr, :, ids % nr]

    def nbytes(self) -> int:
        """Bytes held by every form kept (the oneDNN copy counted at the dense size it reorders)."""
        forms = (self.panels, self.dense, self.q)
        size = sum(t.numel() * t.element_size() for t in forms if t is not None)
        if self.onednn is not None:
            size += self.out_features * self.in_features * 4
        return size
