"""What one core of this machine can do at most: the limits the engine's figures are read against.

    kvmesh bench machine [--quick] [--no-write]        (also python -m app.bench.machine)

- **FMA peak**: one core's fp32 multiply-add throughput, GFLOP/s, from a register-only loop in C
  (``csrc/machine.c``, compiled as the engine's kernels are: ``kvmesh.engine.native``). Without a C compiler, the
  best of torch's sgemm on a small in-cache product stands in (a bound from below; the output says which ran).
- **sgemm**: torch's fp32 matmul at a few of the engine's shapes, 1 thread: MKL (``torch.mm``, what
  ``F.linear`` runs) and oneDNN over weights reordered once (what the engine's prefill steps run), GFLOP/s and
  their share of the FMA peak.
- **Memory stream**: one thread's bandwidth over arrays far larger than the caches: read (a sum, as a decode
  step streams its weights), copy and triad, bytes counted as STREAM does (read + written), GB/s.

Each figure is the best of several repetitions, timed in this thread's CPU time (a shared machine only ever makes
a run slower, and time the core spent on other jobs does not count).
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable
from pathlib import Path

import torch

from app.bench.report import load_average, markdown_table, publish

SECTION = "Machine limits"
SOURCE = Path(__file__).parent / "csrc" / "machine.c"
SHAPES = [  # (rows M, inputs K, outputs N): x [M, K] @ W [N, K]^T
    (16, 576, 3072, "decode step, 16 rows x gate+up (7 MB of weights, from cache)"),
    (512, 576, 3072, "prefill chunk of 512 x gate+up"),
    (2048, 576, 1536, "prefill chunk of 2,048 x q+k+v-sized"),
    (1024, 1024, 1024, "square 1,024"),
]


def _best(fn: Callable[[], object], repeats: int) -> float:
    """This thread's CPU seconds in the fastest of ``repeats`` calls (CPU time, not wall: on a shared machine the
    time the core spends on other jobs does not count)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best


def _load_probe() -> ctypes.CDLL | None:
    from kvmesh.engine import native

    lib = native.compile_source(SOURCE)
    if lib is None:
        return None
    lib.kvmesh_probe_lanes.restype = lib.kvmesh_probe_chains.restype = ctypes.c_int64
    lib.kvmesh_probe_fma.argtypes, lib.kvmesh_probe_fma.restype = [ctypes.c_int64, ctypes.c_float], ctypes.c_float
    lib.kvmesh_probe_read.argtypes, lib.kvmesh_probe_read.restype = [ctypes.c_void_p, ctypes.c_int64], ctypes.c_float
    lib.kvmesh_probe_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.kvmesh_probe_triad.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,
                                       ctypes.c_int64]
    lib.kvmesh_probe_copy.restype = lib.kvmesh_probe_triad.restype = None
    return lib


def fma_peak(lib: ctypes.CDLL | None, repeats: int) -> tuple[float, str]:
    """(GFLOP/s, how it was measured)."""
    if lib is None:
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        seconds = _best(lambda: torch.mm(a, b), repeats * 20)
        return 2 * 256 ** 3 / seconds / 1e9, "torch sgemm 256x256x256 in cache (no C compiler: a bound from below)"
    lanes, chains = lib.kvmesh_probe_lanes(), lib.kvmesh_probe_chains()
    iters = 20_000_000
    seconds = _best(lambda: lib.kvmesh_probe_fma(iters, 1.0), 2 * repeats)
    return (chains * lanes * 2 * iters / seconds / 1e9,
            f"C loop, {chains} independent chains of {lanes}-lane fp32 FMAs on registers (csrc/machine.c)")


def sgemm(peak: float, repeats: int) -> list[dict]:
    rows = []
    for m, k, n, what in SHAPES:
        g = torch.Generator().manual_seed(m + k + n)
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
        flop = 2 * m * k * n
        mkl = flop / _best(lambda x=x, w=w: torch.mm(x, w.t()), repeats) / 1e9
        row = {"shape M x K x N": f"{m} x {k} x {n}", "what": what, "MKL GFLOP/s": f"{mkl:.1f}",
               "MKL / peak": f"{mkl / peak:.0%}"}
        if torch.backends.mkldnn.is_available():
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            onednn = flop / _best(lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [],
                                                                                           ""), repeats) / 1e9
            row |= {"oneDNN GFLOP/s": f"{onednn:.1f}", "oneDNN / peak": f"{onednn / peak:.0%}"}
        rows.append(row)
    return rows


def stream(lib: ctypes.CDLL | None, mib: int, repeats: int) -> tuple[list[dict], str]:
    """One thread's read / copy / triad GB/s over arrays of ``mib`` MiB each."""
    n = mib * 2 ** 20 // 4
    a, b, c = torch.ones(n), torch.ones(n), torch.ones(n)  # written once: the pages are mapped before timing
    p = a.data_ptr(), b.data_ptr(), c.data_ptr()
    if lib is not None:
        kernels = {"read (sum)": (lambda: lib.kvmesh_probe_read(p[1], n), 4),
                   "copy (y = x)": (lambda: lib.kvmesh_probe_copy(p[0], p[1], n), 8),
                   "triad (a = b + s*c)": (lambda: lib.kvmesh_probe_triad(p[0], p[1], p[2], 3.0, n), 12)}
        how = "C loops (csrc/machine.c)"
    else:
        kernels = {"read (sum)": (lambda: b.sum(), 4), "copy (y = x)": (lambda: a.copy_(b), 8),
                   "triad (a = b + s*c)": (lambda: torch.add(b, c, alpha=3.0, out=a), 12)}
        how = "torch ops, 1 thread (no C compiler)"
    rows = [{"kernel": name, "bytes per float": per, "GB/s": f"{per * n / _best(fn, repeats) / 1e9:.1f}"}
            for name, (fn, per) in kernels.items()]
    return rows, how


def run(quick: bool = False) -> dict:
    torch.set_num_threads(1)
    repeats = 2 if quick else 5
    lib = _load_probe()
    peak, how = fma_peak(lib, repeats)
    with torch.inference_mode():
        gemm_rows = sgemm(peak, repeats)
    mib = 64 if quick else 256
    stream_rows, stream_how = stream(lib, mib, repeats)
    return {"peak": peak, "peak_how": how, "sgemm": gemm_rows, "stream": stream_rows, "stream_how": stream_how,
            "mib": mib}


def render(res: dict, load_start: str, load_end: str) -> str:
    read = next(r["GB/s"] for r in res["stream"] if r["kernel"].startswith("read"))
    gemm_cols = ["shape M x K x N", "what", "MKL GFLOP/s", "MKL / peak"]
    if "oneDNN GFLOP/s" in res["sgemm"][0]:
        gemm_cols += ["oneDNN GFLOP/s", "oneDNN / peak"]
    head = (f"One core, 1 thread; best of several repetitions, in the thread's CPU time. Load average (1, 5, "
            f"15 min) {load_start} at the start, {load_end} at the end (the machine is shared).")
    limits = (f"**FMA peak: {res['peak']:.1f} GFLOP/s** fp32 ({res['peak_how']}).  \n"
              f"**Memory read: {read} GB/s** (one thread).")
    streams = (f"Memory stream, {res['mib']} MiB arrays, {res['stream_how']}; bytes counted as STREAM does (read + "
               "written):\n\n" + markdown_table(res["stream"], ["kernel", "bytes per float", "GB/s"]))
    return "\n\n".join([head, limits, "sgemm (torch, 1 thread):\n\n" + markdown_table(res["sgemm"], gemm_cols),
                        streams])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh bench machine", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions, smaller arrays (a smoke run; not written)")
    p.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = p.parse_args(argv)
    load_start = load_average()
    res = run(args.quick)
    body = render(res, load_start, load_average())
    publish(SECTION, "kvmesh bench machine", body, write=not args.no_write and not args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
