"""Matmul microbenchmark: the C panel GEMM (engine/csrc/gemm.c) against oneDNN's packed weights and MKL.

    python -m app.bench.gemm [--rows 1,2,4,8,16,32,64,256] [--rounds 5]

One "stack" is every matmul of a decode step of the default model's shape (SmolLM2-135M: 30 layers of q|k|v, o,
gate|up, down, plus the 49152-row lm_head), each layer with its own random weights, so the 538 MB of weights
stream from memory as in the engine. Prints ms per stack for each row count, the minimum over interleaved rounds
(the three paths alternate, so load from other jobs hits them alike), 1 thread.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from kvmesh.engine import native

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of q|k|v, o, gate|up, down
LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def _stacks(lib) -> dict:
    g = torch.Generator().manual_seed(0)
    dense = [[torch.randn(n, k, generator=g) * 0.05 for n, k in SHAPES] for _ in range(LAYERS)]
    dense.append([torch.randn(VOCAB, HIDDEN, generator=g) * 0.05])
    shapes = [SHAPES] * LAYERS + [[(VOCAB, HIDDEN)]]
    panels = [[native.gemm_pack(lib, w) for w in ws] for ws in dense]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w) for w in ws] for ws in dense]
    xs = {k: torch.randn(512, k, generator=g) for k in {k for _, k in SHAPES}}

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

    return {"kernel": kernel, "oneDNN packed": packed, "MKL F.linear": mkl}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.bench.gemm")
    p.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    lib = native.load_gemm()
    if lib is None:
        raise SystemExit("the C GEMM could not be built (no compiler?)")
    rows = [int(r) for r in args.rows.split(",")]
    paths = _stacks(lib)
    best: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for m in rows:
                for name, fn in paths.items():
                    t0 = time.perf_counter()
                    fn(m)
                    ms = (time.perf_counter() - t0) * 1000
                    best[name, m] = min(best.get((name, m), ms), ms)
    print("| rows | " + " | ".join(f"{n} ms" for n in paths) + " | oneDNN / kernel |")
    print("|---" * (len(paths) + 2) + "|")
    for m in rows:
        cells = " | ".join(f"{best[n, m]:.1f}" for n in paths)
        print(f"| {m} | {cells} | {best['oneDNN packed', m] / best['kernel', m]:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
