"""The vLLM benches' pure parts: both sides get the same engine arguments, the serving figures as ratios against
their targets, the routing workload's shape, the cached-token share and the comparisons it is judged by."""

import math

from app.bench import vllm_bench
from app.bench.stats import RequestRecord
from app.bench.vllm_routing import RunResult, comparisons, row, share, workload
from app.bench.vllm_servers import EngineShape
from app.bench.vllm_serving import FIGURES, KVMESH, NO_POOL, VLLM, Figures, Target, ratios


def test_kvmesh_and_vllm_serve_get_the_same_kv_size_and_limits():
    shape = EngineShape(vllm_blocks=33, max_num_seqs=32, max_batched_tokens=2048)
    engine = shape.kvmesh_engine()
    args = shape.serve_args("/m", block_bytes=5_898_240)
    flag = dict(zip(args[::2], args[1::2]))  # the flags that take a value (the switches pair up harmlessly)
    # kvmesh's vLLM backend: num_blocks kvmesh blocks of 16 = num_blocks / 8 vLLM blocks of 128, null block on top
    assert engine["num_blocks"] * engine["block_size"] == 33 * 128 == shape.vllm_blocks * int(flag["--block-size"])
    assert engine["vllm_block_size"] == 128 and int(args[args.index("--num-gpu-blocks-override") + 1]) == 34
    assert int(args[args.index("--kv-cache-memory-bytes") + 1]) == 35 * 5_898_240
    assert args[args.index("--max-num-seqs") + 1] == str(engine["max_num_seqs"]) == "32"
    assert args[args.index("--max-num-batched-tokens") + 1] == str(engine["max_batched_tokens"]) == "2048"
    assert args[args.index("--max-model-len") + 1] == str(engine["max_model_len"])
    assert args[args.index("--dtype") + 1] == "float32" and engine["dtype"] == "fp32"
    assert "--enforce-eager" in args and "--enable-prefix-caching" in args and engine["enable_prefix_caching"]


def figures(**medians: float) -> Figures:
    f = Figures()
    for name in FIGURES:
        f.add({name: [medians.get(name, 100.0)]})
    return f


def test_each_serving_figure_is_a_ratio_to_vllm_alone_judged_against_its_target():
    base = figures()
    ours = figures(**{"TTFT cold 1,500 tokens, ms": 105.0, "ITL p99, 1 stream, ms": 125.0,
                      "tok/s, 8 streams": 95.0, "tok/s, 16 streams": 80.0})
    rows = {r["figure"]: r for r in ratios({VLLM: base, KVMESH: ours})}
    assert rows["TTFT cold 1,500 tokens, ms"]["kvmesh / vLLM"] == "1.05x"
    assert rows["TTFT cold 1,500 tokens, ms"]["met"] == "yes"
    assert rows["ITL p99, 1 stream, ms"]["met"] == "**no**"      # 1.25x > 1.10x
    assert rows["tok/s, 8 streams"]["met"] == "yes"              # 0.95x >= 0.90x
    assert rows["tok/s, 16 streams"]["met"] == "**no**"          # 0.80x
    assert rows["tok/s, 16 streams"]["target"] == "≥ 0.90x"


def test_kvmesh_with_the_pool_off_is_shown_against_vllm_alone_beside_the_default():
    rows = ratios({VLLM: figures(), KVMESH: figures(**{"TTFT repeated prefix (+32 new), ms": 140.0}),
                   NO_POOL: figures(**{"TTFT repeated prefix (+32 new), ms": 104.0})})
    row = next(r for r in rows if r["figure"] == "TTFT repeated prefix (+32 new), ms")
    assert row["kvmesh / vLLM"] == "1.40x" and row["met"] == "**no**"  # the default (pool on) is what is judged
    assert row[NO_POOL] == "104.0" and row["pool off / vLLM"] == "1.04x"
    assert NO_POOL not in ratios({VLLM: figures(), KVMESH: figures()})[0]


def test_a_figure_is_the_median_over_rounds():
    f = Figures()
    f.add({"tok/s, 8 streams": [10.0]})
    f.add({"tok/s, 8 streams": [30.0]})
    f.add({"tok/s, 8 streams": [20.0]})
    assert f.median("tok/s, 8 streams") == 20.0
    assert math.isnan(f.median("tok/s, 16 streams"))
    assert Target(1.1, True).met(1.1) and not Target(0.9, False).met(0.89)


def test_every_request_starts_with_its_tenants_system_prompt_and_asks_its_own_question():
    reqs = workload(tenants=3, per_tenant=4, system_words=50, question_words=8, seed=0)
    assert len(reqs) == 12 and sorted({r.tenant for r in reqs}) == ["tenant0", "tenant1", "tenant2"]
    for tenant in ("tenant0", "tenant1", "tenant2"):
        systems = {r.prompt.split("\n\n")[0] for r in reqs if r.tenant == tenant}
        assert len(systems) == 1  # one system prompt per tenant
    assert len({r.prompt for r in reqs}) == 12  # each question its own
    assert len({r.prompt.split("\n\n")[0] for r in reqs}) == 3  # no two tenants share one


def test_other_words_keep_the_same_tenants_sizes_and_order():
    a = workload(4, 3, 40, 5, seed=1, words_seed=1)
    b = workload(4, 3, 40, 5, seed=1, words_seed=2)
    assert [r.tenant for r in a] == [r.tenant for r in b]
    assert all(x.prompt != y.prompt for x, y in zip(a, b))
    assert [len(x.prompt.split()) for x in a] == [len(y.prompt.split()) for y in b]


def rec(prompt: int, cached: int | None, ttft: float = 0.1, error: str | None = None) -> RequestRecord:
    return RequestRecord("k", ttft_s=ttft, prompt_tokens=prompt, cached_tokens=cached, error=error)


def test_the_cached_share_counts_tokens_of_answered_requests():
    records = [rec(800, 640), rec(800, 0), rec(400, 128), rec(800, 800, error="HTTP 500")]
    assert share(records) == (640 + 128) / 2000


def run(label: str, system: str, shares: tuple[int, int], ttft: float) -> RunResult:
    return RunResult(label, system, label, "", [rec(1000, shares[0], ttft), rec(1000, shares[1], ttft)], 1.0)


def test_comparisons_judge_cache_aware_over_round_robin_the_pool_and_each_router():
    runs = {r.label: r for r in [
        run("vllm-router round_robin", "vllm serve x2", (0, 100), 0.5),
        run("sglang-router cache_aware", "vllm serve x2", (600, 600), 0.2),
        run("kvmesh cache_aware, pool off", "kvmesh", (700, 700), 0.3),
        run("kvmesh round_robin, pool off", "kvmesh", (100, 300), 0.5),
        run("kvmesh round_robin, pool on", "kvmesh", (500, 500), 0.4),
    ]}
    got = {c["comparison"]: c for c in comparisons(runs)}
    assert got["kvmesh cache_aware / round_robin, cached share (pool off)"]["value"] == "3.50x"
    assert got["kvmesh round_robin, pool on / pool off, cached share"]["met"] == "yes"
    sg = "kvmesh cache_aware, pool off / sglang-router cache_aware"
    assert got[f"{sg}, cached share"]["met"] == "yes"
    assert got[f"{sg}, TTFT p90"]["value"] == "1.50x" and got[f"{sg}, TTFT p90"]["met"] == "**no**"
    assert not any("vllm-router round_robin" in c for c in got)  # a round robin is no router to beat
    assert row(runs["kvmesh round_robin, pool on"])["cached share"] == "50.0%"


def test_kvmesh_bench_vllm_wants_one_mode(capsys):
    assert vllm_bench.main([]) == 2
    assert vllm_bench.main(["--serving", "--routing"]) == 2
    assert "--serving or --routing" in capsys.readouterr().err
