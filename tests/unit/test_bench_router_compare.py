"""``kvmesh bench routers``: its pure parts (reading /proc, py-spy's stacks into parts, the summary and verdict)."""

from collections import Counter

import pytest

from app.bench.router_compare import (
    CONTENDERS,
    REST,
    WAITING,
    Prompt,
    Result,
    Window,
    bodies_for,
    breakdown,
    breakdown_rows,
    picked,
    result_row,
    stat_cpu_ticks,
    verdict,
)


def result(label: str, ok: int, wall_s: float, cpu_s: float) -> Result:
    return Result(label, Window(ok=ok, latencies=[0.01] * ok, wall_s=wall_s), cpu_s)


def line(*frames: str, count: int) -> str:
    """One stack of py-spy's ``--format raw``: the frames, root first, then how many samples it had."""
    return f"{';'.join(frames)} {count}"


def test_stat_cpu_ticks_adds_utime_and_stime_past_a_command_name_with_spaces_and_parentheses():
    stat = "4242 (tokio (rt) w) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 37 0 0 20 0 9 0 12345 0 0"
    assert stat_cpu_ticks(stat) == 287


def test_breakdown_puts_a_sample_in_the_first_part_its_stack_passes_through():
    http = "OpenAIApi.completions (services/router/http_api.py:124)"
    raw = "\n".join([
        line("Thread._bootstrap (threading.py:1002)", "_worker (concurrent/futures/thread.py:83)",
             "Tokenizer.encode (kvmesh/model_source/tokenizer.py:65)", count=30),
        line(http, "Router._dispatch (services/router/core.py:248)", "block_keys (kvmesh/contracts/keys.py:58)",
             count=5),
        line(http, "Router._dispatch (services/router/core.py:248)",
             "block_keys_and_plain (kvmesh/contracts/keys.py:62)", "_int32s (kvmesh/contracts/keys.py:38)", count=2),
        line(http, "Router.matched_blocks (services/router/core.py:201)",
             "UnaryUnaryCall._invoke (grpc/aio/_call.py:595)", count=4),
        line(http, "Router._relay (services/router/core.py:314)", "Router._attribute (services/router/core.py:314)",
             "attribute (kvmesh/routing/hits.py:121)", count=2),
        line(http, "json_errors (services/router/http_api.py:55)", count=3),
        line("BaseEventLoop._run_once (asyncio/base_events.py:1922)", "EpollSelector.select (selectors.py:468)",
             count=6),
        line("Thread._bootstrap (threading.py:1002)", "_worker (concurrent/futures/thread.py:81)", count=4),
        "",
    ])
    assert breakdown(raw) == {"tokenize": 30, WAITING: 4, "hash (block keys)": 7,
                              "match (MatchPrefix on cachesvc, recent prefixes)": 4,
                              "hit attribution (after the answer)": 2,
                              "HTTP and intake (parse, admit, answer)": 3, REST: 6}


def test_breakdown_rows_share_the_measured_cpu_by_samples():
    rows = breakdown_rows({"tokenize": 60, REST: 40, WAITING: 25}, cpu_ms=10.0)  # waiting: no share, no row
    tokenize = next(r for r in rows if r["part"] == "tokenize")
    rest = next(r for r in rows if r["part"] == REST)
    assert (tokenize["share"], tokenize["CPU ms/request"]) == ("60%", "6.00")
    assert (rest["share"], rest["CPU ms/request"]) == ("40%", "4.00")
    assert rows[-1]["part"] == REST and WAITING not in {r["part"] for r in rows}


def test_result_row_gives_rate_cpu_per_request_and_core_busy():
    r = result("vllm-router kv_aware", ok=1000, wall_s=10.0, cpu_s=2.0)
    r.window.errors = Counter({"503": 2})
    row = result_row(r)
    assert row["decisions/s"] == "100"
    assert row["router CPU ms/request"] == "2.00"
    r.cpu_rounds = (2.0, 2.5)
    assert result_row(r)["router CPU ms/request"] == "2.00 (2.00-2.50)"
    assert row["one core's capacity (1 / CPU)"] == "500/s"
    assert row["router's share of core 0"] == "20%"
    assert row["ok / errors"] == "1000 / 2 (503: 2)"
    assert row["index CPU ms/request"] == "-"


def test_verdict_states_the_ratio_and_whether_the_target_is_met():
    ours = result("kvmesh cache_aware", ok=600, wall_s=10.0, cpu_s=9.0)
    theirs = result("vllm-router kv_aware", ok=3000, wall_s=10.0, cpu_s=3.0)
    text = verdict({r.label: r for r in (ours, theirs)})
    assert "0.20x the decisions/s (60 vs 300)" in text
    assert "**not met**" in text
    faster = result("kvmesh cache_aware", ok=4000, wall_s=10.0, cpu_s=3.0)
    assert verdict({r.label: r for r in (faster, theirs)}).endswith(": met.")


def test_verdict_without_both_routers_says_it_did_not_judge():
    assert "not judged" in verdict({"kvmesh cache_aware": result("kvmesh cache_aware", 10, 1.0, 0.1)})


def test_token_id_contenders_send_ids_and_the_others_text():
    prompts = [Prompt(0, "hello world", (1, 2, 3))]
    text = next(c for c in CONTENDERS if not c.token_ids)
    ids = next(c for c in CONTENDERS if c.token_ids)
    assert bodies_for(text, prompts, "m")[0]["prompt"] == "hello world"
    assert bodies_for(ids, prompts, "m")[0] == {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0}


def test_only_names_labels_that_hold_a_comma_whole():
    labels = [c.label for c in picked("kvmesh cache_aware, token ids")]
    assert labels == ["kvmesh cache_aware, token ids"]
    both = picked("vllm-router kv_aware,kvmesh cache_aware, token ids,kvmesh cache_aware")
    assert [c.label for c in both] == ["vllm-router kv_aware", "kvmesh cache_aware, token ids", "kvmesh cache_aware"]
    with pytest.raises(ValueError, match="no router is called 'nope'"):
        picked("kvmesh cache_aware,nope")
