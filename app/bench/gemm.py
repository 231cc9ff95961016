"""Every matmul of one decode step: the C panel GEMM (engine/csrc/gemm.c) over fp32 panels and over the GGUF's
quantized blocks, against oneDNN's packed weights and MKL.

    kvmesh bench gemm [--rows 1,2,4,8,16,32,64,256] [--rounds 5] [--no-write]   (also python -m app.bench.gemm)

One "stack" is every matmul of a decode step of the default model's shape (SmolLM2-135M: 30 layers of q|k|v, o,
gate|up, down, plus the 49152-row lm_head), each layer with its own random weights, so the weights stream from
memory as in the engine: 538 MB as fp32 panels (``dense kernel``, oneDNN, MKL), 111 MB as the default GGUF's
blocks (``quantized kernel``: Q4_1 layers, a Q8_0 lm_head, as ``engine.quantized_weights`` reads them; random
blocks, which cost what real ones do). Prints ms per stack for each row count, the minimum over interleaved
rounds of the thread's CPU time (the paths alternate, so load from other jobs hits them alike, and time the core
spent on other jobs does not count), 1 thread, and the weight stream's GB/s.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from kvmesh.engine import native, quant

from app.bench.report import load_average, markdown_table, publish

SECTION = "Decode-step GEMM"
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of q|k|v, o, gate|up, down
LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def random_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """GGUF rows of ``kind`` for an ``[n, k]`` matrix (random quants, small finite fp16 scales)."""
    size = {"Q4_1": 20, "Q8_0": 34}[kind]
    blocks = rng.integers(0, 256, (n, k // quant.QK, size), dtype=np.uint8)
    for at in (0, 2) if kind == "Q4_1" else (0,):  # d (and m): fp16
        blocks[..., at:at + 2] = (rng.standard_normal((n, k // quant.QK, 1)) * 0.01).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def _stacks(lib) -> tuple[dict[str, Callable[[int], None]], dict[str, int]]:
    """The paths (each: rows -> one stack's matmuls) and the weight bytes each streams."""
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    shapes = [SHAPES] * LAYERS + [[(VOCAB, HIDDEN)]]
    dense = [[torch.randn(n, k, generator=g) * 0.05 for n, k in layer] for layer in shapes]
    panels = [[native.gemm_pack(lib, w) for w in ws] for ws in dense]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w) for w in ws] for ws in dense]
    xs = {k: torch.randn(512, k, generator=g) for k in {k for _, k in SHAPES}}
    dense_bytes = sum(w.numel() * 4 for ws in dense for w in ws)

    def kernel(m: int) -> None:
        for layer, ps in zip(shapes, panels):
            for (n, k), p in zip(layer, ps):
                native.gemm(lib, xs[k][:m], p, n)

    def packed(m: int) -> None:
        for layer, ps in zip(shapes, onednn):
            for (_, k), p in zip(layer, ps):
                torch.ops.mkldnn._linear_pointwise(xs[k][:m], p, None, "none", [], "")

    def mkl(m: int) -> None:
        for layer, ws in zip(shapes, dense):
            for (_, k), w in zip(layer, ws):
                F.linear(xs[k][:m], w)

    paths: dict[str, Callable[[int], None]] = {"dense kernel": kernel}
    nbytes = {"dense kernel": dense_bytes}
    if lib.kvmesh_q_block_bytes(quant.TYPES["Q4_1"]):  # the quantized kernel is AVX-512 only
        kinds = [["Q4_1"] * len(SHAPES)] * LAYERS + [["Q8_0"]]
        qpanels = [[(torch.from_numpy(quant.to_panels(kind, random_blocks(kind, n, k, rng))), quant.TYPES[kind])
                    for (n, k), kind in zip(layer, ks)] for layer, ks in zip(shapes, kinds)]
        scratch = torch.empty(2 * max(k for _, k in SHAPES) * quant.NR)

        def quantized(m: int) -> None:
            for layer, qs in zip(shapes, qpanels):
                for (n, k), (q, t) in zip(layer, qs):
                    native.gemm_q(lib, xs[k][:m], q, t, n, scratch)

        paths["quantized kernel"] = quantized
        nbytes["quantized kernel"] = sum(q.numel() for qs in qpanels for q, _ in qs)
    paths |= {"oneDNN packed": packed, "MKL F.linear": mkl}
    nbytes |= {"oneDNN packed": dense_bytes, "MKL F.linear": dense_bytes}
    return paths, nbytes


def run(rows: list[int], rounds: int) -> tuple[dict[tuple[str, int], float], dict[str, int]]:
    """Best ms per (path, rows) and the weight bytes of each path."""
    lib = native.load_gemm()
    if lib is None:
        raise SystemExit("the C GEMM could not be built (no compiler?)")
    paths, nbytes = _stacks(lib)
    best: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        for _ in range(rounds):
            for m in rows:
                for name, fn in paths.items():
                    t0 = time.thread_time()
                    fn(m)
                    ms = (time.thread_time() - t0) * 1000
                    best[name, m] = min(best.get((name, m), ms), ms)
    return best, nbytes


def render(best: dict[tuple[str, int], float], nbytes: dict[str, int], rows: list[int], rounds: int,
           load_start: str) -> str:
    paths = list(nbytes)
    table = []
    for m in rows:
        row = {"rows": m, **{f"{p} ms": f"{best[p, m]:.1f}" for p in paths},
               "oneDNN / dense kernel": f"{best['oneDNN packed', m] / best['dense kernel', m]:.2f}x"}
        if "quantized kernel" in nbytes:
            row["dense / quantized kernel"] = f"{best['dense kernel', m] / best['quantized kernel', m]:.2f}x"
        table.append(row)
    one = min(rows)
    streams = ", ".join(f"{p} {nbytes[p] / 1e6:.0f} MB at {nbytes[p] / best[p, one] / 1e6:.1f} GB/s"
                        for p in paths if p in ("dense kernel", "quantized kernel"))
    return (f"Every matmul of one decode step of the default model's shape (30 layers + lm_head, each layer its "
            f"own random weights), 1 thread, the minimum of {rounds} interleaved rounds in the thread's CPU "
            f"time. Weight stream at {one} row(s): {streams}. "
            + ("" if "quantized kernel" in nbytes else "No quantized kernel here (it needs AVX-512). ")
            + f"Load average (1, 5, 15 min) {load_start} at the start, {load_average()} at the end.\n\n"
            + markdown_table(table, list(table[0])))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh bench gemm", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [int(r) for r in args.rows.split(",")]
    load_start = load_average()
    best, nbytes = run(rows, args.rounds)
    body = render(best, nbytes, rows, args.rounds, load_start)
    publish(SECTION, f"kvmesh bench gemm --rows {args.rows} --rounds {args.rounds}", body, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
