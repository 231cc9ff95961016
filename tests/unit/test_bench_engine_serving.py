"""The serving benchmark's tables: each row against one stream, and against the --target server's run."""

import asyncio

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily

from app.bench.engine_serving import _step_stats, metrics_probe, render


def run(tok_s: list[float]) -> dict:
    streams = [{"streams": n, "tok/s": t, "vs 1 stream": t / tok_s[0], "ITL p50 ms": 30.0, "ITL p99 ms": 60.0}
               for n, t in zip((1, 8, 16), tok_s)]
    mixed = {"ITL p50 ms": 100.0, "ITL p99 ms": 200.0, "ITL max ms": 250.0, "p50 while arriving": 100.0,
             "p99 while arriving": 200.0, "arrival TTFT p50 ms": 900.0}
    return {"streams": streams, "mixed": mixed}


def test_with_a_target_each_row_shows_its_tok_s_against_the_targets_at_the_same_streams():
    text = render({"quantized": run([30.0, 120.0, 160.0]), "target: vLLM": run([15.0, 80.0, 120.0])}, 1,
                  stack=True)
    assert "| vs target |" in text
    assert "| quantized | 16 | 160.0 | 5.33x | 1.33x |" in text
    assert "| target: vLLM | 8 | 80.0 | 5.33x | 1.00x |" in text
    assert "| quantized | 100.0 | 200.0 | 2.00 |" in text  # mixed: p50, p99, p99 / p50


def test_without_a_target_there_is_no_target_column():
    assert "vs target" not in render({"quantized": run([30.0, 120.0, 160.0])}, 1, stack=True)


def test_the_metrics_probe_reads_the_decode_step_counters_from_prometheus_text():
    totals = {"steps": 4.0, "rows": 32.0, "seconds": 0.2, "cpu": 0.18}

    class Steps:
        def collect(self):
            for name, key in (("engine_steps", "steps"), ("engine_step_rows", "rows"),
                              ("engine_step_seconds", "seconds"), ("engine_step_cpu_seconds", "cpu")):
                family = CounterMetricFamily(f"kvmesh_worker_{name}", "", labels=["kind"])
                family.add_metric(["prefill"], 99.0)
                family.add_metric(["decode"], totals[key])
                yield family

    registry = CollectorRegistry()
    registry.register(Steps())
    text = generate_latest(registry).decode()

    class Response:
        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

        async def text(self):
            return text

    session = type("Session", (), {"get": lambda self, url: Response()})()
    got = asyncio.run(metrics_probe(session, "http://engine/metrics")())
    assert got == totals
    zero = dict.fromkeys(totals, 0.0)
    assert _step_stats(zero, got) == {"step ms": 50.0, "step CPU ms": 45.0, "rows/step": 8.0}


def test_scenario_c_counts_goodput_and_shows_a_refusal_as_such():
    from app.bench import prefill_slo

    def row(kind, ttft, itl, refused=False):
        return {"kind": kind, "ttft_s": ttft, "itl_p99_s": itl, "refused": refused,
                "ttft_met": ttft <= 6.0, "itl_met": itl <= 0.15}

    rows = [row("stream", 0.2, 0.12)] * 3 + [row("stream", 0.2, 0.4), row("long", 5.5, 0.1),
                                            row("long", 9.0, 0.1), row("long", float("inf"), float("inf"), True)]
    got = prefill_slo.slo_row("kvmesh both", rows)
    assert got["goodput"] == "4 of 7" and got["streams met"] == 3 and got["long prompts met"] == 1
    assert got["long prompts' TTFT s"] == "5.50 / 9.00 / 429"


def test_the_cold_table_reads_the_prefill_as_a_share_of_the_fma_limit_and_against_the_target():
    from app.bench import prefill_slo

    flops = prefill_slo.prefill_flops(1500)
    assert 390e9 < flops < 400e9  # SmolLM2-135M: ~212 MFLOP of matmuls a token, plus causal attention
    text = prefill_slo.render({"kvmesh both": {"cold": {"ttft": [4.0, 4.2, 3.9], "cpu": [3.96]}},
                               "target: vLLM": {"cold": {"ttft": [5.0, 5.1, 4.9], "cpu": []}}}, 117.0, 3)
    assert f"| kvmesh both | 4.00 (3.90-4.20) | 0.80x | 375 | {flops / 4.0 / 1e9 / 117:.0%} | 3.96 |" in text
    assert "| target: vLLM | 5.00 (4.90-5.10) | 1.00x |" in text


def test_p99_is_the_nearest_rank():
    from app.bench.prefill_slo import p99

    assert p99([0.1] * 99 + [5.0]) == 0.1 and p99([0.1] * 98 + [5.0] * 2) == 5.0
