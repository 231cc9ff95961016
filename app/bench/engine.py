"""Engine benchmark: kvmesh's engine side by side with Hugging Face transformers, same weights, same thread.

    kvmesh bench engine [--threads 1] [--quick] [--no-write] [--device cuda] [--dtype bf16]
    kvmesh bench engine --serving [...]   (concurrent streams through AsyncEngine: app.bench.engine_serving)

Prefill tokens/s at 128/512/2048 tokens; decode ms/step at batch 1/8/32 with a 512-token context; TTFT of a
1024-token prompt with 896 tokens cached vs cold. Ratios are against transformers measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from kvmesh.contracts.engine import EngineRequest
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.engine.llm_engine import COMPUTE_DTYPES, LLMEngine
from kvmesh.engine.loader import resolve_model
from kvmesh.settings import EngineSettings

from app.bench.report import markdown_table, publish

SECTION = "Engine vs transformers"


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def _sync() -> None:
    """Wait for the GPU's queued work (a CUDA call returns before it ran); nothing to wait for on CPU."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Ours:
    def __init__(self, threads: int, device: str = "cpu", dtype: str = "fp32") -> None:
        self.engine = LLMEngine(EngineSettings(threads=threads, max_batched_tokens=4096, kv_cache_mb=1024,
                                             max_num_seqs=64, device=device, dtype=dtype, kv_dtype=dtype))
        self.n = 0

    def _fresh_engine_state(self) -> None:
        blocks = self.engine.blocks
        blocks.evict(blocks.num_cached_blocks)

    def prefill(self, prompt: list[int]) -> None:
        self._fresh_engine_state()
        self.engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))

    def decode_ms(self, batch: int, context: int, steps: int) -> float:
        """Per-step time with ``batch`` running sequences of ``context`` tokens each. The sequences share
        their first context-1 tokens in the KV pool (prefilled once); every row still attends to its whole
        context, so the step costs what distinct contexts would."""
        self._fresh_engine_state()
        e = self.engine
        base = _tokens(context - 1, 7)
        e.generate([base + [1]], SamplingParams(max_tokens=1, ignore_eos=True))
        ids = []
        for i in range(batch):
            self.n += 1
            rid = f"d{self.n}"
            e.add_request(EngineRequest(rid, (*base, 200 + i), SamplingParams(max_tokens=steps + 4, ignore_eos=True)))
            ids.append(rid)
        for _ in range(2):  # admit + first decode step
            e.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            e.step()
        dt = (time.perf_counter() - t0) / steps
        for rid in ids:
            e.abort(rid)
        return dt * 1000

    def ttft(self, prompt: list[int], cached: int) -> float:
        self._fresh_engine_state()
        if cached:
            self.engine.generate([prompt[:cached]], SamplingParams(max_tokens=1, ignore_eos=True))
        t0 = time.perf_counter()
        self.engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
        return time.perf_counter() - t0


class HF:
    def __init__(self, device: str = "cpu", dtype: str = "fp32") -> None:
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(resolve_model(None).hf_dir,
                                                          dtype=COMPUTE_DTYPES[dtype]).to(self.device).eval()

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> None:
        self.model(torch.tensor([prompt], device=self.device), logits_to_keep=1, use_cache=True)  # as generate()

    @torch.inference_mode()
    def decode_ms(self, batch: int, context: int, steps: int) -> float:
        out = self.model(torch.tensor([_tokens(context, 7)], device=self.device), logits_to_keep=1, use_cache=True)
        cache = out.past_key_values
        cache.batch_repeat_interleave(batch)
        nxt = torch.full((batch, 1), 200, device=self.device)
        mask = torch.ones(batch, context + 1, dtype=torch.long, device=self.device)
        _sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            out = self.model(nxt, past_key_values=cache, attention_mask=mask, use_cache=True)
            cache = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, mask[:, :1]], dim=1)
        _sync()
        return (time.perf_counter() - t0) / steps * 1000


def run(threads: int = 1, quick: bool = False, device: str = "cpu", dtype: str = "fp32") -> dict:
    torch.set_num_threads(threads)
    ours, hf = Ours(threads, device, dtype), HF(device, dtype)
    repeats = 1 if quick else 3
    prefill_rows = []
    for n in ((128, 512) if quick else (128, 512, 2048)):
        prompt = _tokens(n, n)
        ours.prefill(prompt), hf.prefill(prompt)  # warm-up
        t_ours = _median_time(lambda p=prompt: ours.prefill(p), repeats)
        t_hf = _median_time(lambda p=prompt: hf.prefill(p), repeats)
        prefill_rows.append({"tokens": n, "kvmesh tok/s": f"{n / t_ours:.0f}", "transformers tok/s": f"{n / t_hf:.0f}",
                             "ratio": f"{t_hf / t_ours:.2f}x"})
    decode_rows = []
    steps = 5 if quick else 12
    for b in (1, 8, 32):
        d_ours, d_hf = ours.decode_ms(b, 512, steps), hf.decode_ms(b, 512, steps)
        decode_rows.append({"batch": b, "kvmesh ms/step": f"{d_ours:.1f}", "transformers ms/step": f"{d_hf:.1f}",
                            "kvmesh tok/s": f"{b * 1000 / d_ours:.0f}", "transformers tok/s": f"{b * 1000 / d_hf:.0f}",
                            "ratio": f"{d_hf / d_ours:.2f}x"})
    prompt = _tokens(1024, 99)
    cold = statistics.median(ours.ttft(prompt, 0) for _ in range(repeats))
    warm = statistics.median(ours.ttft(prompt, 896) for _ in range(repeats))
    ttft_rows = [{"case": "cold (0 cached)", "TTFT s": f"{cold:.3f}"},
                 {"case": "896 of 1024 cached", "TTFT s": f"{warm:.3f}"},
                 {"case": "speed-up", "TTFT s": f"{cold / warm:.2f}x"}]
    return {"prefill": prefill_rows, "decode": decode_rows, "ttft": ttft_rows}


def main(argv: list[str] | None = None) -> int:
    if argv and "--serving" in argv:
        from app.bench import engine_serving

        return engine_serving.main([a for a in argv if a != "--serving"])
    p = argparse.ArgumentParser(prog="kvmesh bench engine")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (a smoke run)")
    p.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:<index> (both engines; not written to the "
                                                   "docs unless cpu)")
    p.add_argument("--dtype", default="fp32", choices=sorted(COMPUTE_DTYPES), help="compute and KV dtype of both")
    args = p.parse_args(argv)
    if args.device != "cpu" or args.dtype != "fp32":
        args.no_write = True  # docs/benchmarks.md keeps the CPU fp32 figures; these are printed only
    res = run(args.threads, args.quick, args.device, args.dtype)
    where = (f"{args.threads} thread(s)" if args.device == "cpu"
             else f"on {args.device} ({torch.cuda.get_device_name(args.device)})")
    body = "\n\n".join([
        (f"Default model (SmolLM2-135M-Instruct, {args.dtype} compute and KV), {where}. Ratio > 1 means "
         "kvmesh is faster than transformers (same weight values, same process, same thread budget; on CPU in "
         "fp32 kvmesh's decode-sized steps read the GGUF's quantized blocks, `engine.quantized_weights`, which "
         "hold exactly the fp32 values transformers multiplies)."),
        "Prefill (one prompt, logits for the last position only):\n\n" +
        markdown_table(res["prefill"], ["tokens", "kvmesh tok/s", "transformers tok/s", "ratio"]),
        "Decode, context 512 tokens per sequence:\n\n" +
        markdown_table(res["decode"], ["batch", "kvmesh ms/step", "transformers ms/step", "kvmesh tok/s",
                                       "transformers tok/s", "ratio"]),
        "TTFT of a 1024-token prompt (kvmesh, prefix cache):\n\n" + markdown_table(res["ttft"], ["case", "TTFT s"]),
    ])
    publish(SECTION, f"kvmesh bench engine --threads {args.threads}", body, write=not args.no_write and not args.quick)
    return 0
