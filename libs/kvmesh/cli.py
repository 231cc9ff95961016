"""The ``kvmesh`` command line."""

from __future__ import annotations

import argparse
import json
import sys


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, help="torch threads for the engine (default 1)")
    p.add_argument("--kv-dtype", choices=["fp32", "bf16", "fp16", "fp8"], help="KV storage dtype")
    p.add_argument("--config", help="TOML file with engine settings (see README)")


def _build_engine(args: argparse.Namespace):
    from kvmesh import config  # noqa: PLC0415 - keep `kvmesh --help` fast
    from kvmesh.engine.llm_engine import LLMEngine  # noqa: PLC0415

    cfg = config.load(config.EngineConfig, args.config, section="engine", model=args.model,
                      threads=args.threads, kv_dtype=args.kv_dtype)
    return LLMEngine(cfg)


def cmd_generate(args: argparse.Namespace) -> int:
    from kvmesh.engine.sequence import SamplingParams  # noqa: PLC0415

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos,
                                stop=tuple(args.stop or ()))
    except ValueError as e:
        print(f"kvmesh generate: {e}", file=sys.stderr)
        return 2
    engine = _build_engine(args)
    tok = engine.tokenizer
    prompt_ids = (tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat
                  else tok.encode(args.prompt))
    try:
        engine.add_request("cli", prompt_ids, params)
    except ValueError as e:
        print(f"kvmesh generate: {e}", file=sys.stderr)
        return 2
    while engine.has_unfinished():
        for out in engine.step():
            if not args.json:
                print(out.text_delta, end="", flush=True)
    result = engine.completion("cli")
    if args.json:
        print(json.dumps({
            "text": result.text, "token_ids": result.token_ids, "prompt_token_ids": result.prompt_token_ids,
            "cached_tokens": result.cached_tokens, "finish_reason": result.finish_reason,
            "ttft_s": round(result.ttft_s, 6), "decode_tokens_per_s": round(result.decode_tokens_per_s, 3),
        }))
    else:
        print()
        print(f"[{len(result.token_ids)} tokens, ttft {result.ttft_s * 1000:.0f} ms, "
              f"{result.decode_tokens_per_s:.1f} tok/s, finish={result.finish_reason}]", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "engine":
        from kvmesh.bench import engine as bench  # noqa: PLC0415
    elif args.what == "transfer":
        from kvmesh.bench import transfer as bench  # noqa: PLC0415
    else:
        print(f"kvmesh bench: unknown benchmark {args.what!r}", file=sys.stderr)
        return 2
    return bench.main(args.rest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh", description="KV-cache-centric disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="single-process generation with the engine")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as one user message (chat template)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _engine_args(g)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="benchmarks (engine, transfer)")
    b.add_argument("what", help="engine | transfer")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to the benchmark")
    b.set_defaults(func=cmd_bench)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
