"""Multi-LoRA decode benchmark: 8 streams spread over 4 adapters against 8 streams on the base model, in one run.

    python -m app.bench.lora [--threads 1] [--rank 16] [--targets attn|all] [--rounds 3] [--quick] [--no-write]

The default model (SmolLM2-135M-Instruct, fp32). Four adapters are written in PEFT's format (random A and B of the
given rank on q/k/v/o, or on all seven projections with ``--targets all``) and loaded by the engine as any
adapter is. Each round runs the base scenario and then the LoRA scenario (2 streams per adapter, all in one
batch): 8 prompts of 20 tokens are prefilled, then the decode steps are timed until every stream has
``--tokens`` tokens. Decode tok/s = tokens generated in those steps / their wall time; the median over rounds is
reported, with the ratio LoRA / base (target >= 0.8x).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from kvmesh.contracts.engine import EngineRequest
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.engine.llm_engine import LLMEngine
from kvmesh.engine.lora import module_shapes
from kvmesh.settings import EngineSettings

from app.bench.report import markdown_table, publish

SECTIONS = {"attn": "Multi-LoRA decode, q/k/v/o", "all": "Multi-LoRA decode, all seven projections"}  # by --targets

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL = (*ATTN, "gate_proj", "up_proj", "down_proj")
PREFIX = {m: "self_attn" if m in ATTN else "mlp" for m in ALL}


def write_adapter(path: Path, engine: LLMEngine, rank: int, targets: tuple[str, ...], seed: int) -> None:
    """A PEFT-format adapter (what ``save_pretrained`` writes) with random weights, without needing peft."""
    from safetensors.torch import save_file

    cfg = engine.model_config
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for m in targets:
            fan_in, fan_out = module_shapes(cfg)[m]
            base = f"base_model.model.model.layers.{layer}.{PREFIX[m]}.{m}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.02
            tensors[f"{base}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
        "bias": "none", "use_rslora": False, "use_dora": False}))


def _prompt(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (20,), generator=g).tolist()


def decode_speed(engine: LLMEngine, loras: list[str], tokens: int, tag: str) -> float:
    """Decode tok/s of ``len(loras)`` streams run together (stream i under ``loras[i]``; "" = base)."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(loras))]
    for i, (rid, lora) in enumerate(zip(ids, loras)):
        engine.add_request(EngineRequest(rid, tuple(_prompt(1000 + i)), params, lora=lora))
    seqs = [engine._requests[r].seq for r in ids]
    while any(not s.output_token_ids for s in seqs):  # prefill every stream (not timed)
        engine.step()
    done = sum(len(s.output_token_ids) for s in seqs)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - t0
    generated = sum(len(s.output_token_ids) for s in seqs) - done
    for r in ids:
        engine.completion(r)
    return generated / wall


def run(threads: int, rank: int, targets: tuple[str, ...], rounds: int, tokens: int) -> dict:
    engine = LLMEngine(EngineSettings(threads=threads, max_num_seqs=64, max_loras=4, enable_prefix_caching=False))
    names = ["a0", "a1", "a2", "a3"]
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            write_adapter(Path(tmp) / name, engine, rank, targets, seed=i)
            engine.load_lora(name, str(Path(tmp) / name))
    spread = [names[i % 4] for i in range(8)]
    decode_speed(engine, [""] * 8, 8, "warm-base")
    decode_speed(engine, spread, 8, "warm-lora")
    base, lora = [], []
    for r in range(rounds):
        base.append(decode_speed(engine, [""] * 8, tokens, f"base{r}"))
        lora.append(decode_speed(engine, spread, tokens, f"lora{r}"))
    b, m = statistics.median(base), statistics.median(lora)
    return {"base": base, "lora": lora, "base_med": b, "lora_med": m, "ratio": m / b}


def render(res: dict, args: argparse.Namespace, targets: tuple[str, ...]) -> str:
    rows = [{"scenario": "8 streams, base model", "decode tok/s (median)": f"{res['base_med']:.1f}",
             "rounds": ", ".join(f"{x:.1f}" for x in res["base"]), "vs base": "1.00x"},
            {"scenario": "8 streams over 4 adapters (2 each)", "decode tok/s (median)": f"{res['lora_med']:.1f}",
             "rounds": ", ".join(f"{x:.1f}" for x in res["lora"]), "vs base": f"{res['ratio']:.2f}x"}]
    return "\n\n".join([
        (f"Default model (SmolLM2-135M-Instruct, fp32), {args.threads} thread(s), `LLMEngine` stepped directly; "
         f"4 adapters of rank {args.rank} on {'/'.join(m.removesuffix('_proj') for m in targets)}, "
         f"20-token prompts, {args.tokens} tokens per stream, decode steps only; {args.rounds} rounds, base and "
         f"LoRA alternating. Target: LoRA >= 0.8x base."),
        markdown_table(rows, ["scenario", "decode tok/s (median)", "rounds", "vs base"]),
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.bench.lora")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", choices=["attn", "all"], default="attn")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--quick", action="store_true", help="one short round (a smoke run; not written)")
    p.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    p.add_argument("--section", default=None, help="docs/benchmarks.md section to (re)write (default: by "
                   f"--targets, {SECTIONS})")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.tokens = 1, 8
    torch.set_num_threads(args.threads)
    targets = ATTN if args.targets == "attn" else ALL
    res = run(args.threads, args.rank, targets, args.rounds, args.tokens)
    body = render(res, args, targets)
    cmd = (f"python -m app.bench.lora --threads {args.threads} --rank {args.rank} --targets {args.targets} "
           f"--rounds {args.rounds} --tokens {args.tokens}" + (f" --section '{args.section}'" if args.section else ""))
    publish(args.section or SECTIONS[args.targets], cmd, body, write=not args.no_write and not args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
