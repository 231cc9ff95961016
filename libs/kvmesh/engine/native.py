"""The C kernels in ``csrc/``: the decode and prefill attention over the paged pool (``paged_decode.c``,
``paged_prefill.c``), the small-batch GEMM over panel-packed weights (``gemm.c``) and RMSNorm / rotary embedding
(``pointwise.c``). Each is compiled on first use with the system C compiler, cached per source, flags and CPU, and
loaded through ctypes. ``load()``, ``load_prefill()``, ``load_gemm()`` and ``load_pointwise()`` return None when it
cannot be built (no compiler), and the engine falls back to the torch paths. Each library is built and loaded once per
process; whether an engine uses the GEMM and the pointwise kernels is its own setting (``[engine] native_gemm`` /
``native_pointwise``), read where the model is built (``LlamaModel``, ``Linear``), so two engines in one process may
differ."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "paged_decode.c"
PREFILL_SOURCE = CSRC / "paged_prefill.c"
GEMM_SOURCE = CSRC / "gemm.c"
POINTWISE_SOURCE = CSRC / "pointwise.c"
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC"]
KERNELS = {torch.float32: "kvmesh_paged_decode_f32", torch.bfloat16: "kvmesh_paged_decode_bf16",
           torch.float8_e4m3fn: "kvmesh_paged_decode_fp8"}
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
UNAVAILABLE: dict[str, str] = {}  # source file name -> why this process could not build or load it


def _cpu_id() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return os.uname().machine


def _compiler() -> str:
    """``$CC`` where set, else gcc or cc on the PATH; RuntimeError saying which was looked for."""
    wanted = os.environ.get("CC")
    cc = shutil.which(wanted) if wanted else shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError(f"no C compiler: CC={wanted!r} not found" if wanted
                           else "no C compiler: neither gcc nor cc is on the PATH (or set CC)")
    return cc


def _build(source: Path, out: Path) -> None:
    cc = _compiler()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        subprocess.run([cc, *FLAGS, "-o", str(tmp_so), str(source), "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp_so, out)


def compile_source(source: Path) -> ctypes.CDLL | None:
    """``source`` built (or found cached) and loaded; None, with a warning, when it cannot be built. Also for C
    outside the engine that must be compiled as its kernels are (the machine probe, ``app.bench.machine``)."""
    from kvmesh.model_source.resolve import default_cache_dir

    headers = b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))  # what the sources include
    digest = hashlib.sha256(source.read_bytes() + headers + " ".join(FLAGS).encode()
                            + _cpu_id().encode()).hexdigest()
    path = default_cache_dir() / "native" / f"{source.stem}-{digest[:16]}.so"
    try:
        if not path.exists():
            _build(source, path)
        return ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        UNAVAILABLE[source.name] = str(getattr(e, "stderr", "") or e).strip()
        log.warning("native kernel %s unavailable (%s); using the torch path", source.name, UNAVAILABLE[source.name])
        return None


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    lib = compile_source(SOURCE)
    if lib is None:
        return None
    lib.kvmesh_init_fp8_table()
    for name in KERNELS.values():
        fn = getattr(lib, name)
        fn.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _PTR]
        fn.restype = None
    return lib


def paged_decode(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q ``[B, H, D]`` fp32 contiguous; caches ``[blocks, block_size, Hkv, D]`` of one layer; tables
    ``[B, maxb]`` int64; lens ``[B]`` int64 -> ``[B, H, D]``."""
    B, H, D = q.shape
    _, bs, hkv, _ = k_cache.shape
    maxb = tables.shape[1]
    out = torch.empty_like(q)
    scratch = torch.empty((H // hkv) * maxb * bs, dtype=torch.float32)
    getattr(lib, KERNELS[k_cache.dtype])(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                                         lens.data_ptr(), out.data_ptr(), B, H, hkv, D, bs, maxb, scale,
                                         scratch.data_ptr())
    return out


@lru_cache(maxsize=1)
def load_prefill() -> ctypes.CDLL | None:
    """The prefill attention kernel; None where it cannot be built or this CPU lacks AVX-512 (it has no other
    copy: SDPA serves there)."""
    lib = compile_source(PREFILL_SOURCE)
    if lib is None or not lib.kvmesh_paged_prefill_available():
        return None
    lib.kvmesh_paged_prefill_f32.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR,
                                             _PTR, _PTR, _I64, ctypes.c_float]
    lib.kvmesh_paged_prefill_f32.restype = ctypes.c_int
    return lib


PREFILL_HEAD_DIMS = (64, 128)


def paged_prefill(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  starts: torch.Tensor, nqs: torch.Tensor, lens: torch.Tensor, tables: torch.Tensor, scale: float,
                  out: torch.Tensor) -> None:
    """Causal attention of prefill slices into ``out`` (``[T, H, D]`` fp32, contiguous; only the slices' rows
    are written): q ``[T, H, D]`` fp32 (rows may be strided, each row's heads contiguous); caches
    ``[blocks, block_size, Hkv, D]`` fp32 of one layer, already holding the slices' own K/V; slice i: rows
    ``starts[i] ..`` (``nqs[i]`` of them), the last of its ``lens[i]`` tokens, blocks ``tables[i]``; int64."""
    _, H, D = q.shape
    _, bs, hkv, _ = k_cache.shape
    if q.stride(2) != 1 or q.stride(1) != D:
        raise ValueError("paged_prefill: each query row's heads must be contiguous")
    rc = lib.kvmesh_paged_prefill_f32(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                      out.data_ptr(), H, hkv, D, bs, len(starts), starts.data_ptr(), nqs.data_ptr(),
                                      lens.data_ptr(), tables.data_ptr(), tables.shape[1], scale)
    if rc != 0:
        raise ValueError(f"paged_prefill: no kernel for head dim {D} (has {PREFILL_HEAD_DIMS})")


@lru_cache(maxsize=1)
def load_gemm() -> ctypes.CDLL | None:
    lib = compile_source(GEMM_SOURCE)
    if lib is None:
        return None
    lib.kvmesh_gemm_panel_width.argtypes, lib.kvmesh_gemm_panel_width.restype = [], _I64
    lib.kvmesh_gemm_fast.argtypes, lib.kvmesh_gemm_fast.restype = [], ctypes.c_int
    lib.kvmesh_gemm_pack.argtypes, lib.kvmesh_gemm_pack.restype = [_PTR, _I64, _I64, _I64, _PTR], None
    lib.kvmesh_gemm_f32.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, ctypes.c_int]
    lib.kvmesh_gemm_f32.restype = None
    lib.kvmesh_q_block_bytes.argtypes, lib.kvmesh_q_block_bytes.restype = [_I64], _I64
    lib.kvmesh_q_dequant.argtypes, lib.kvmesh_q_dequant.restype = [_PTR, _I64, _I64, _I64, _PTR], None
    lib.kvmesh_gemm_q_f32.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, ctypes.c_int,
                                      _PTR]
    lib.kvmesh_gemm_q_f32.restype = None
    return lib


def gemm_fast(lib: ctypes.CDLL) -> bool:
    """Whether the GEMM was built for AVX-512, the registers its tile is sized for: without them it is slower
    than oneDNN (3.4x a decode step's time on an AVX2 CPU), so an engine uses it only where this is true; its
    results are right either way (the tests run it wherever it builds)."""
    return bool(lib.kvmesh_gemm_fast())


def gemm_pack(lib: ctypes.CDLL, w: torch.Tensor) -> torch.Tensor:
    """fp32 ``w [N, K]`` (rows contiguous) -> panels ``[ceil(N / NR), K, NR]`` for ``gemm``."""
    n, k = w.shape
    nr = lib.kvmesh_gemm_panel_width()
    panels = torch.empty(-(-n // nr), k, nr, dtype=torch.float32)
    lib.kvmesh_gemm_pack(w.data_ptr(), n, k, w.stride(0), panels.data_ptr())
    return panels


def gemm(lib: ctypes.CDLL, x: torch.Tensor, panels: torch.Tensor, n: int,
         bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias)`` -> ``[M, n]`` fp32, ``W`` given as ``gemm_pack``'s panels; ``x`` fp32 with
    contiguous rows, ``bias`` fp32 contiguous. ``out`` (fp32 ``[M, n]``, contiguous): added to in place and
    returned instead (``out + product``, one rounding, as torch's add)."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32) if out is None else out
    lib.kvmesh_gemm_f32(x.data_ptr(), m, k, x.stride(0), panels.data_ptr(), n,
                        None if bias is None else bias.data_ptr(), y.data_ptr(), n, out is not None)
    return y


def q_dequant(lib: ctypes.CDLL, q: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """Quantized panels (``quant.to_panels``) -> the fp32 panels ``[n / 16, k, 16]`` they hold."""
    panels = torch.empty(n // 16, k, 16, dtype=torch.float32)
    lib.kvmesh_q_dequant(q.data_ptr(), qtype, n, k, panels.data_ptr())
    return panels


def gemm_q(lib: ctypes.CDLL, x: torch.Tensor, q: torch.Tensor, qtype: int, n: int, scratch: torch.Tensor,
           bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gemm`` over quantized panels; ``scratch``: fp32, ``2 * K * 16`` elements, this caller's own."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32) if out is None else out
    lib.kvmesh_gemm_q_f32(x.data_ptr(), m, k, x.stride(0), q.data_ptr(), qtype, n,
                          None if bias is None else bias.data_ptr(), y.data_ptr(), n, out is not None,
                          scratch.data_ptr())
    return y


@lru_cache(maxsize=1)
def load_pointwise() -> ctypes.CDLL | None:
    lib = compile_source(POINTWISE_SOURCE)
    if lib is None:
        return None
    lib.kvmesh_rms_norm_f32.argtypes = [_PTR, _I64, _I64, _I64, _PTR, ctypes.c_float, _PTR]
    lib.kvmesh_rope_f32.argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR]
    lib.kvmesh_silu_mul_f32.argtypes = [_PTR, _I64, _I64, _I64, _PTR]
    lib.kvmesh_rms_norm_f32.restype = lib.kvmesh_rope_f32.restype = lib.kvmesh_silu_mul_f32.restype = None
    return lib


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of fp32 ``x [T, D]`` (rows contiguous) with weight ``w [D]`` -> a new ``[T, D]``."""
    t, d = x.shape
    out = torch.empty(t, d, dtype=torch.float32)
    lib.kvmesh_rms_norm_f32(x.data_ptr(), t, d, x.stride(0), w.data_ptr(), eps, out.data_ptr())
    return out


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate_up[:, :inter]) * gate_up[:, inter:]`` of fp32 ``gate_up [T, 2 * inter]`` (rows contiguous)
    -> a new ``[T, inter]``."""
    t = gate_up.shape[0]
    out = torch.empty(t, inter, dtype=torch.float32)
    lib.kvmesh_silu_mul_f32(gate_up.data_ptr(), t, inter, gate_up.stride(0), out.data_ptr())
    return out


def rope_(lib: ctypes.CDLL, x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
          positions: torch.Tensor) -> None:
    """Rotary embedding in place on the first ``heads`` heads of each row of fp32 ``x [T, >= heads * D]``;
    ``cos``/``sin`` ``[max_pos, D]`` fp32 contiguous, ``positions [T]`` int64."""
    lib.kvmesh_rope_f32(x.data_ptr(), x.shape[0], x.stride(0), heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                        positions.data_ptr())
