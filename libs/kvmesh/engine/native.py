"""The C decode-attention kernel (``csrc/paged_decode.c``): compiled on first use with the system C compiler,
cached per source, flags and CPU, and loaded through ctypes. ``load()`` returns None when no compiler is
available, and the engine falls back to the pure-torch backend."""

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

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC"]
KERNELS = {torch.float32: "kvmesh_paged_decode_f32", torch.bfloat16: "kvmesh_paged_decode_bf16",
           torch.float8_e4m3fn: "kvmesh_paged_decode_fp8"}


def _cpu_id() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return os.uname().machine


def _build(out: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) found")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        subprocess.run([cc, *FLAGS, "-o", str(tmp_so), str(SOURCE), "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp_so, out)


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    from kvmesh.model_source.resolve import default_cache_dir

    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_id().encode()).hexdigest()
    path = default_cache_dir() / "native" / f"paged_decode-{digest[:16]}.so"
    try:
        if not path.exists():
            _build(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("native decode kernel unavailable (%s); using torch attention", detail)
        return None
    lib.kvmesh_init_fp8_table()
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in KERNELS.values():
        fn = getattr(lib, name)
        fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr]
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
