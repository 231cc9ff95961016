"""The fault schedule of ``kvmesh bench load --faults`` and how its report counts requests lost, wrong outputs,
and each recovery window's latency against the load before the first fault."""

import pytest

from app.bench.faults import Fault, FaultRun, Outcome, Window, parse_schedule, report


def test_a_schedule_is_service_at_seconds_in_time_order():
    assert parse_schedule("decode-0@20, nats@100") == [Fault("decode-0", 20.0), Fault("nats", 100.0)]


@pytest.mark.parametrize("bad", ["", "decode-0", "decode-0@", "@20", "decode-0@-1", "nats@50,decode-0@20"])
def test_a_bad_schedule_says_what_to_write(bad):
    with pytest.raises(ValueError, match="SERVICE@SECONDS"):
        parse_schedule(bad)


def outcome(prompt: str, start: float, ttft: float, tokens: list[int], text: str, error: str = "") -> Outcome:
    return Outcome(prompt, start, [start + ttft + 0.1 * i for i in range(len(tokens))], tokens, text, error)


def test_the_report_counts_lost_and_wrong_and_compares_each_recovery_with_before():
    refs = {"a": ([1, 2], "xy")}
    run = FaultRun(outcomes=[outcome("a", 1.0, 0.2, [1, 2], "xy"),           # before: right
                             outcome("a", 11.0, 0.8, [1, 2], "xy"),          # in the window: slower, right
                             outcome("a", 12.0, 0.4, [1, 3], "xz"),          # in the window: wrong
                             outcome("a", 13.0, 0.0, [], "", error="Unavailable: gone")],  # lost
                   windows=[Window(Fault("decode-0", 10.0), 10.0, 14.0)], references=refs, migrations=2,
                   duration_s=30.0, load_before="1.00 1.00 1.00", load_after="2.00 1.00 1.00")
    assert [o.start_s for o in run.wrong()] == [12.0] and [o.start_s for o in run.lost()] == [13.0]
    text = report(run, clients=4, decode=2, routers=2, restart_after_s=4)
    assert "| 4 | 3 | 1 | 1 | 2 | 0 |" in text  # requests, completed, lost, wrong, migrations, 429s
    assert "| before the first fault (0-10 s) | 1 | 0 | 200 | 1.00x |" in text
    assert "| kill -9 decode-0 at 10 s, back at 14 s | 3 | 1 | 796 | 3.98x |" in text
