"""A GGUF's quantized weights rearranged for the C GEMM's quantized panels (``csrc/gemm.c``).

The engine computes in fp32 from the dequantized values, as before; for the small steps of decode the kernel
reads them in the file's own form instead, Q4_1 (``w = d * q + m``, 4-bit q, d and m fp16 per 32 weights along a
row) or Q8_0 (``w = d * q``, int8 q), regrouped per panel of 16 output features and block of 32 inputs, with d
and m widened to fp32 (exactly). A decode step then streams 5-9 bits a weight instead of 32; the products are
bit for bit those of the fp32 weights (``Linear.use_quantized`` checks the whole matrix before it trusts one).
"""

from __future__ import annotations

import numpy as np

TYPES = {"Q4_1": 1, "Q8_0": 2}  # GGUF type name -> the kernel's code
QK, NR = 32, 16  # weights per GGUF block (along a row); output features per panel
_GGUF_BLOCK = {"Q4_1": 20, "Q8_0": 34}  # bytes per block in the file


def supported(kind: str, n: int, k: int) -> bool:
    return kind in TYPES and n % NR == 0 and k % QK == 0


def _fp16(blk: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte ``at`` of each block ``[..., bytes]`` as fp32 ``[...]``."""
    return np.ascontiguousarray(blk[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def to_panels(kind: str, rows: np.ndarray) -> np.ndarray:
    """GGUF rows ``[n, k / 32 * block bytes]`` (uint8) of type ``kind`` -> ``[n / 16, k / 32, panel block bytes]``
    uint8, the layout ``kvmesh_gemm_q_f32`` reads (see csrc/gemm.c)."""
    n = rows.shape[0]
    blk = np.ascontiguousarray(rows).reshape(n, -1, _GGUF_BLOCK[kind])
    nb, p = blk.shape[1], n // NR
    d = _fp16(blk, 0).reshape(p, NR, nb).transpose(0, 2, 1)  # [panel, block, feature]
    if kind == "Q4_1":
        m = _fp16(blk, 2).reshape(p, NR, nb).transpose(0, 2, 1)
        qs = blk[..., 4:]  # byte j: weight j (low nibble), weight j + 16 (high)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [n, block, 32 weights in order]
        q = q.reshape(p, NR, nb, QK).transpose(0, 2, 3, 1)  # [panel, block, k, feature]
        packed = q[..., :NR // 2] | (q[..., NR // 2:] << 4)  # byte j: feature j (low), j + 8 (high)
        parts = [d, m, packed]
    else:
        q = blk[..., 2:].view(np.int8).reshape(p, NR, nb, QK).transpose(0, 2, 3, 1)
        parts = [d, q]
    return np.concatenate([np.ascontiguousarray(a).view(np.uint8).reshape(p, nb, -1) for a in parts], axis=-1)
