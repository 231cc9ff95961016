"""Decode attention alone: the C kernel over the paged pool (``native``) against torch's SDPA over gathered
blocks (``torch``), the two CPU backends of ``kvmesh.engine.attention``.

    kvmesh bench attention [--cases 1x512,8x512,16x64] [--rounds 7] [--no-write]   (also python -m app.bench.attention)

The default model's shape (SmolLM2-135M: 30 layers, 9 query heads over 3 KV heads of 64, 16-token blocks, fp32
KV), 1 thread. A case ``BxT`` is one decode step of B rows, each attending to T tokens of its own blocks: the
backend's ``plan`` and its ``forward`` for each of the 30 layers (which also writes the step's new K/V), as the
engine runs them. The pool holds several copies of the step's blocks (at least 256 MiB of KV in all) and each
step reads the next copy, so the KV streams from memory as in a running engine, not from cache. Median of
``--rounds`` steps per backend in the thread's CPU time (time the core spent on other jobs does not count), the
backends alternating; GB/s: the K and V bytes a step reads over its time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from kvmesh.contracts.layout import KVLayout
from kvmesh.engine.attention import AttentionBackend, ForwardBatch, NativeAttention, SeqSlice, TorchAttention
from kvmesh.engine.kv_cache import DeviceKVPool

from app.bench.report import load_average, markdown_table, publish

SECTION = "Decode attention kernel"
LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
POOL_BYTES = 256 * 2 ** 20


def _case(text: str) -> tuple[int, int]:
    rows, tokens = text.lower().split("x")
    return int(rows), int(tokens)


def _step(backend: AttentionBackend, batch: ForwardBatch, pool: DeviceKVPool, q: torch.Tensor,
          kv: torch.Tensor) -> torch.Tensor:
    backend.plan(batch, pool)
    for layer in range(LAYERS):
        out = backend.forward(layer, q, kv, kv, pool)
    return out


def measure(rows: int, tokens: int, rounds: int, native: NativeAttention) -> dict:
    per_row = -(-tokens // BLOCK)
    step_bytes = rows * tokens * LAYERS * 2 * KV_HEADS * HEAD_DIM * 4  # K and V read in one step
    copies = max(2, -(-POOL_BYTES // step_bytes))
    layout = KVLayout("bench", LAYERS, KV_HEADS, HEAD_DIM, BLOCK)
    pool = DeviceKVPool(layout, copies * rows * per_row)
    pool.k.normal_(), pool.v.normal_()
    batches = [ForwardBatch.build([SeqSlice(r, 1, tokens, list(range((c * rows + r) * per_row,
                                                                     (c * rows + r + 1) * per_row)))
                                   for r in range(rows)], [[0]] * rows, BLOCK, list(range(rows)))
               for c in range(copies)]
    g = torch.Generator().manual_seed(rows * tokens)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=g)
    kv = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g)
    backends = {"torch": TorchAttention(), "native": native}
    diff = (_step(backends["torch"], batches[0], pool, q, kv) - _step(native, batches[0], pool, q, kv)).abs().max()
    times: dict[str, list[float]] = {name: [] for name in backends}
    steps = 0
    for _ in range(rounds):
        for name, backend in backends.items():
            steps += 1
            t0 = time.thread_time()
            _step(backend, batches[steps % copies], pool, q, kv)
            times[name].append(time.thread_time() - t0)
    ms = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    return {"rows x tokens": f"{rows} x {tokens}", "KV read MB": f"{step_bytes / 1e6:.1f}",
            "torch ms": f"{ms['torch']:.2f}", "native ms": f"{ms['native']:.2f}",
            "torch / native": f"{ms['torch'] / ms['native']:.2f}x",
            "native GB/s": f"{step_bytes / ms['native'] / 1e6:.1f}",
            "µs per row and layer": f"{ms['native'] * 1e3 / rows / LAYERS:.0f}",
            "max abs diff": f"{diff.item():.1e}"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh bench attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="1x512,8x512,16x64", help="ROWSxTOKENS, comma-separated")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    try:
        native = NativeAttention(HEADS, KV_HEADS, HEAD_DIM)
    except RuntimeError as e:
        raise SystemExit(f"kvmesh bench attention: {e}") from None
    load_start = load_average()
    with torch.inference_mode():
        rows = [measure(*_case(c), args.rounds, native) for c in args.cases.split(",")]
    body = (f"Default model's shape ({LAYERS} layers, {HEADS} query heads over {KV_HEADS} KV heads of {HEAD_DIM}, "
            f"{BLOCK}-token blocks, fp32 KV), 1 thread; one decode step = `plan` + `forward` for every layer, KV "
            "streamed from memory (each step reads another copy of its blocks); median of "
            f"{args.rounds} steps per backend in the thread's CPU time, alternating. `max abs diff`: the two "
            f"backends' outputs of the last layer. Load average (1, 5, 15 min) {load_start} at the start, "
            f"{load_average()} at the end.\n\n"
            + markdown_table(rows, list(rows[0])))
    cmd = "kvmesh bench attention" + ("" if args.cases == "1x512,8x512,16x64" else f" --cases {args.cases}")
    publish(SECTION, cmd, body, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
