"""The ``kvmesh`` command line."""

from __future__ import annotations

import argparse
import json
import sys


def lora_env(entries: list[str]) -> dict[str, str]:
    """``--lora NAME=PATH`` flags as the engines' ``lora_adapters`` setting (absolute paths), as the variable
    ``KVMESH_ENGINE_LORA_ADAPTERS`` every engine instance of the stack reads."""
    from pathlib import Path

    pairs = []
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path or "," in entry:
            raise ValueError(f"--lora {entry!r}: expected NAME=PATH (a PEFT adapter directory, no commas)")
        pairs.append(f"{name}={Path(path).expanduser().resolve()}")
    if not pairs:
        return {}
    return {"KVMESH_ENGINE_LORA_ADAPTERS": ",".join(pairs)}


def _engine_args(p: argparse.ArgumentParser) -> None:
    """``kvmesh generate`` reads [shared] and [engine]: --config and the flags generated from their fields."""
    from kvmesh import settings

    p.add_argument("--config", metavar="FILE.toml", help="TOML file with an [engine] table (docs/configuration.md)")
    settings.add_flags(p, ["engine"])


def _build_engine(args: argparse.Namespace):
    from kvmesh import settings
    from kvmesh.engine.llm_engine import LLMEngine

    cfg = settings.load(["engine"], path=args.config, overrides=settings.flag_overrides(args))
    return LLMEngine(cfg.engine)


def cmd_generate(args: argparse.Namespace) -> int:
    from kvmesh.contracts.engine import EngineRequest
    from kvmesh.contracts.sampling import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos,
                                stop=tuple(args.stop or ()))
    except ValueError as e:
        print(f"kvmesh generate: {e}", file=sys.stderr)
        return 2
    try:
        engine = _build_engine(args)
    except (ValueError, OSError) as e:  # a SettingsError names the variable, flag or file key
        print(f"kvmesh generate: {e}", file=sys.stderr)
        return 2
    tok = engine.tokenizer
    prompt_ids = (tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat
                  else tok.encode(args.prompt))
    try:
        engine.add_request(EngineRequest("cli", tuple(prompt_ids), params))
    except ValueError as e:
        print(f"kvmesh generate: {e}", file=sys.stderr)
        return 2
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if not args.json:
                print(out.text_delta, end="", flush=True)
    result = engine.completion("cli")
    if result.error is not None:  # the engine aborted it (e.g. the model's logits went nan)
        print(f"\nkvmesh generate: {result.error}", file=sys.stderr)
        return 2 if result.error.client_fault else 1
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


BENCHES = {  # kvmesh bench NAME -> its module in app.bench
    "engine": "engine", "machine": "machine", "attention": "attention", "gemm": "gemm", "transfer": "transfer",
    "mesh": "mesh", "serve": "serve", "ablation": "ablation", "routing": "routing", "load": "load",
    "tracing": "tracing_cost", "lora": "lora", "link": "handoff_link", "vllm": "vllm_bench", "planner": "planner",
    "canary": "canary", "agents": "agents", "slo-class": "slo_class", "index": "index_scale",
    "tokenize": "tokenize", "routers": "router_compare", "prefill-order": "prefill_order",
    "prompt-logprobs": "prompt_logprobs",
}


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    module = BENCHES.get(args.what)
    if module is None:
        print(f"kvmesh bench: unknown benchmark {args.what!r}; choose one of {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    return importlib.import_module(f"app.bench.{module}").main(args.rest)


def cmd_up(args: argparse.Namespace) -> int:
    import signal
    import threading

    from kvmesh import settings
    from kvmesh.state import state_dir

    from app.launcher import Stack, StackOptions

    directory = state_dir(args.state_dir)
    try:
        lora = lora_env(args.lora)
    except ValueError as e:
        print(f"kvmesh up: {e}", file=sys.stderr)
        return 2
    opts = StackOptions(prefill=args.prefill, decode=args.decode, both=args.both, routers=args.routers,
                        cachesvc=args.cachesvc, cachesvc_from_bus=args.cachesvc_from_bus, config=args.config,
                        settings=settings.flag_overrides(args, prefixed=True), env=lora)
    try:
        stack = Stack(directory, opts)
    except (ValueError, OSError) as e:  # a bad or unknown setting: named, before anything starts
        print(f"kvmesh up: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting kvmesh (state in {directory}) ...", flush=True)
    try:
        info = stack.start()
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"kvmesh up: {e}", file=sys.stderr)
        return 1
    routers = "".join(f"  {r.name + ':':<12} OpenAI HTTP {r.endpoints['http']}/v1, gRPC {r.endpoints['grpc']}\n"
                      for r in stack.routers) if opts.routers > 1 else \
        f"  OpenAI HTTP  {info.router_http}/v1\n  gRPC         {info.router_grpc}\n"
    print(f"kvmesh is up: {opts.prefill} prefill, {opts.decode} decode, {opts.both} both"
          f"{f', {opts.routers} routers' if opts.routers > 1 else ''}"
          f"{f', {opts.cachesvc} cachesvc shards' if opts.cachesvc > 1 else ''}\n{routers}"
          f"  NATS         {info.nats_url}\n  logs         {directory / 'logs'}\n"
          "Try: kvmesh chat    (Ctrl-C here stops the stack)", flush=True)
    told: set[str] = set()
    seen = 0.0
    while not stop.is_set():  # a dead instance or replica leaves the others serving (migration, failover)
        dead = {s.name for s in stack.services if s.proc.poll() is not None}
        if dead - told:
            print(f"kvmesh up: {', '.join(sorted(dead - told))} exited (see {directory / 'logs'})", file=sys.stderr)
            told |= dead
        if all(r.name in dead for r in stack.routers):
            print("kvmesh up: no router is left; stopping", file=sys.stderr)
            break
        asked = stack.pools_asked()
        try:  # the pools' sizes `kvmesh plan --actuator local` asks for: tried once per change of pools.json
            for line in (stack.reconcile() if asked != seen else []):
                print(f"kvmesh up: {line}", flush=True)
        except (ValueError, RuntimeError, TimeoutError, OSError) as e:
            print(f"kvmesh up: scaling failed: {e}", file=sys.stderr)
        seen = asked
        stop.wait(1.0)
    print("stopping ...", flush=True)
    stack.stop()
    return 0 if stop.is_set() else 1


def cmd_chat(args: argparse.Namespace) -> int:
    from app import chat

    return chat.main(args.rest)


def cmd_sim(args: argparse.Namespace) -> int:
    from app import sim

    return sim.main(args.rest)


def cmd_trace(args: argparse.Namespace) -> int:
    from app import trace_cli

    return trace_cli.main(args.rest)


def cmd_report(args: argparse.Namespace) -> int:
    if not args.rest or args.rest[0] != "hits":
        print("usage: kvmesh report hits [--state-dir D] [--last S] [--capacity-blocks N] [--json]", file=sys.stderr)
        return 2
    from app import hits_cli

    return hits_cli.main(args.rest[1:])


def cmd_plan(args: argparse.Namespace) -> int:
    from app import plan

    return plan.main(args.rest)


def cmd_config(args: argparse.Namespace) -> int:
    from app import config_show

    return config_show.main(args.rest)


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

    from kvmesh import settings
    from kvmesh.settings import SECTIONS

    from app.launcher import LAUNCHER_SET

    u = sub.add_parser("up", help="start the whole stack as local processes",
                       description="Settings flags are --<section>-<field> ([shared]: --<field>); an unset "
                                   "--nats-url starts a NATS server; the router's model defaults to the "
                                   "engines' (--engine-model). Every setting: docs/configuration.md.")
    u.add_argument("--prefill", type=int, default=1)
    u.add_argument("--decode", type=int, default=1)
    u.add_argument("--both", type=int, default=0, help="instances that prefill and decode (no transfer)")
    u.add_argument("--routers", type=int, default=1,
                   help="router replicas (router-0, router-1, ...: the router ports + 0, 1, ...; they share their "
                        "in-flight load over NATS); 1 = one router named router")
    u.add_argument("--cachesvc", type=int, default=1, metavar="N",
                   help="cachesvc shards (cachesvc-0 ... cachesvc-N-1: the index and the pool split by block key, "
                        "each key indexed by --cachesvc-index-copies of them; the cachesvc ports + 0, 1, ...); "
                        "1 = one cachesvc named cachesvc")
    u.add_argument("--cachesvc-from-bus", action="store_true",
                   help="engines and routers find the cachesvc shards by the shards' beats on NATS "
                        "(cachesvc_address \"nats\") instead of being given their addresses")
    u.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="a LoRA adapter (PEFT directory) every engine instance loads at start (repeatable; "
                        "sets engine.lora_adapters); requests pick it with model=NAME")
    u.add_argument("--state-dir", help="default: $KVMESH_STATE_DIR, else .kvmesh/")
    u.add_argument("--config", metavar="FILE.toml", help="TOML file, one [section] table per section")
    settings.add_flags(u, list(SECTIONS), prefixed=True, skip=LAUNCHER_SET)
    u.set_defaults(func=cmd_up)

    c = sub.add_parser("chat", help="interactive chat with a running stack", add_help=False)
    c.add_argument("rest", nargs=argparse.REMAINDER)
    c.set_defaults(func=cmd_chat)

    s = sub.add_parser("sim", help="replay a Mooncake trace on simulated instances with the real policies",
                       add_help=False)
    s.add_argument("rest", nargs=argparse.REMAINDER)
    s.set_defaults(func=cmd_sim)

    t = sub.add_parser("trace", help="a request's TTFT waterfall (or the slowest requests) from the span file",
                       add_help=False)
    t.add_argument("rest", nargs=argparse.REMAINDER)
    t.set_defaults(func=cmd_trace)

    rp = sub.add_parser("report", help="kvmesh report hits: the fleet's missed prefill tokens by cause and the gap "
                                       "to the offline optimum, from the span file", add_help=False)
    rp.add_argument("rest", nargs=argparse.REMAINDER)
    rp.set_defaults(func=cmd_report)

    pl = sub.add_parser("plan", help="how many prefill / decode instances the running stack needs for its TTFT / "
                                     "ITL targets (--serve: keep planning and scale)", add_help=False)
    pl.add_argument("rest", nargs=argparse.REMAINDER)
    pl.set_defaults(func=cmd_plan)

    cf = sub.add_parser("config", help="kvmesh config show: the effective settings of every service",
                        add_help=False)
    cf.add_argument("rest", nargs=argparse.REMAINDER)
    cf.set_defaults(func=cmd_config)

    b = sub.add_parser("bench", help=f"benchmarks ({', '.join(BENCHES)})")
    b.add_argument("what", help=" | ".join(BENCHES))
    b.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to the benchmark")
    b.set_defaults(func=cmd_bench)

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in PASSTHROUGH:  # commands with their own parser get every argument as is
        return PASSTHROUGH[argv[0]](argparse.Namespace(rest=argv[1:]))
    if len(argv) >= 2 and argv[0] == "bench":
        return cmd_bench(argparse.Namespace(what=argv[1], rest=argv[2:]))
    args = parser.parse_args(argv)
    return args.func(args)


PASSTHROUGH = {"chat": cmd_chat, "sim": cmd_sim, "trace": cmd_trace, "config": cmd_config, "plan": cmd_plan,
               "report": cmd_report}


if __name__ == "__main__":
    sys.exit(main())
