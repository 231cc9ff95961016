"""The fault schedule of ``kvmesh bench load --faults`` and how its report counts requests lost, wrong outputs,
and each recovery window's latency against the load before the first fault."""

import pytest

from app.bench.faults import (
    Fault,
    FaultRun,
    Held,
    Limits,
    Moved,
    Outcome,
    Window,
    parse_schedule,
    report,
)


def test_a_schedule_is_service_at_seconds_in_time_order():
    assert parse_schedule("decode-0@20, nats@100") == [Fault("decode-0", 20.0), Fault("nats", 100.0)]


def test_stop_after_the_time_freezes_the_service_for_that_long_instead_of_killing_it():
    assert parse_schedule("decode-0@20:stop30,decode-1@60") == [Fault("decode-0", 20.0, freeze_s=30.0),
                                                                 Fault("decode-1", 60.0)]


@pytest.mark.parametrize("bad", ["", "decode-0", "decode-0@", "@20", "decode-0@-1", "nats@50,decode-0@20",
                                 "decode-0@inf", "decode-0@x:stop30"])
def test_a_bad_schedule_says_what_to_write(bad):
    with pytest.raises(ValueError, match="SERVICE@SECONDS"):
        parse_schedule(bad)


@pytest.mark.parametrize("bad", ["decode-0@20:", "decode-0@20:stop", "decode-0@20:stop0", "decode-0@20:30",
                                 "decode-0@20:pause30"])
def test_a_bad_freeze_says_to_write_stop_and_its_seconds(bad):
    with pytest.raises(ValueError, match=r"write stop and the freeze's seconds, > 0 \(e\.g\. decode-0@20:stop30\)"):
        parse_schedule(bad)


def test_nats_is_killed_never_frozen():
    with pytest.raises(ValueError, match="only the stack's own services freeze"):
        parse_schedule("nats@20:stop30")


def outcome(prompt: str, start: float, ttft: float, tokens: list[int], text: str, error: str = "") -> Outcome:
    return Outcome(prompt, start, [start + ttft + 0.1 * i for i in range(len(tokens))], tokens, text, error,
                   chunk_n=list(range(1, len(tokens) + 1)))


def test_the_report_counts_lost_and_wrong_and_compares_each_recovery_with_before():
    refs = {"a": ([1, 2], "xy")}
    run = FaultRun(outcomes=[outcome("a", 1.0, 0.2, [1, 2], "xy"),           # before: right
                             outcome("a", 11.0, 0.8, [1, 2], "xy"),          # in the window: slower, right
                             outcome("a", 12.0, 0.4, [1, 3], "xz"),          # in the window: wrong
                             outcome("a", 13.0, 0.0, [], "", error="Unavailable: gone")],  # lost
                   windows=[Window(Fault("decode-0", 10.0), 10.0, 14.0)], references=refs, migrations=2,
                   duration_s=30.0, load_before="1.00 1.00 1.00", load_after="2.00 1.00 1.00", moved=[],
                   limits=Limits(3.0, 10.0), max_num_seqs=64)
    assert [o.start_s for o in run.wrong()] == [12.0] and [o.start_s for o in run.lost()] == [13.0]
    text = report(run, clients=4, decode=2, routers=2, restart_after_s=4)
    assert "| 4 | 3 | 1 | 1 | 2 | 0 |" in text  # requests, completed, lost, wrong, migrations, 429s
    assert "| before the first fault (0-10 s) | 1 | 0 | 200 | 1.00x |" in text
    assert "| kill -9 decode-0 at 10 s, back at 14 s | 3 | 1 | 796 | 3.98x |" in text


def test_a_victims_row_says_what_it_held_and_how_soon_each_moved_stream_went_on():
    """The freeze at 10 s (wall clock 1000 s): two streams moved off decode-0, re-dispatched 3.5 and 4 s after
    it; their first tokens past the seam came 4 and 5 s after it (a token sent before the seam that reached the
    client just after the signal does not count); both completed, one of them wrong. A stream moved off decode-1
    and one moved off decode-0 after the window are not its."""
    refs = {"a": ([1, 2, 3], "xyz")}
    right = Outcome("a", 9.0, [9.5, 10.05, 14.0], [1, 2, 3], "xyz", request_ids={"r1"}, chunk_n=[1, 2, 3])
    wrong = Outcome("a", 9.0, [9.6, 15.0], [1, 3, 3], "xzz", request_ids={"r2", "r2-resumed"}, chunk_n=[1, 3])
    elsewhere = Outcome("a", 9.0, [9.7, 11.0], [1, 2, 3], "xyz", request_ids={"r3"}, chunk_n=[1, 3])
    moved = [Moved("r1", "decode-0", 1003.5, "instance decode-0 stopped answering: no heartbeat for 3.2s", 2),
             Moved("r2-resumed", "decode-0", 1004.0, "instance decode-0 stalled: no token and no engine step for "
                                                     "10.1s (inter_token_timeout_s)", 1),
             Moved("r3", "decode-1", 1003.0, "instance decode-1 failed: UNAVAILABLE", 1),
             Moved("r9", "decode-0", 1100.0, "instance decode-0 failed: UNAVAILABLE", 1)]
    run = FaultRun(outcomes=[right, wrong, elsewhere],
                   windows=[Window(Fault("decode-0", 10.0, freeze_s=30.0), 10.0, 40.0, wall_s=1000.0,
                                   held=Held(64, 7))],
                   references=refs, migrations=3, duration_s=60.0, load_before="1.00 1.00 1.00",
                   load_after="1.00 1.00 1.00", moved=moved, limits=Limits(3.0, 10.0), max_num_seqs=64)
    text = report(run, clients=128, decode=2, routers=2, restart_after_s=8)
    assert ("| SIGSTOP decode-0 for 30 s at 10 s | 64 + 7 | 2 | 2 | 0 | 1 | 1 heartbeats stopped, 1 watchdog "
            "| 3.8 / 4.0 | 4.5 / 5.0 |") in text
    assert "| SIGSTOP decode-0 for 30 s at 10 s, SIGCONT at 40 s |" in text
    assert "instance_timeout_s (3 s without a heartbeat)" in text and "inter_token_timeout_s (10 s" in text


def test_a_service_down_past_30_s_gets_a_row_for_its_last_stretch_with_the_cached_share():
    """A cachesvc shard down from 10 s to 55 s: the requests from 40 s on (30 s after the signal) get a row of their
    own, and every row says what share of the prompt tokens was served from a cache."""
    refs = {"a": ([1, 2], "xy")}

    def cached(start: float, prompt: int, hit: int) -> Outcome:
        o = outcome("a", start, 0.2, [1, 2], "xy")
        o.prompt_tokens, o.cached_tokens = prompt, hit
        return o

    run = FaultRun(outcomes=[cached(1.0, 100, 80), cached(12.0, 100, 40), cached(45.0, 100, 78),
                             cached(50.0, 100, 76)],
                   windows=[Window(Fault("cachesvc-1", 10.0), 10.0, 55.0)], references=refs, migrations=0,
                   duration_s=70.0, load_before="1.00 1.00 1.00", load_after="1.00 1.00 1.00", moved=[],
                   limits=Limits(3.0, 10.0), max_num_seqs=64, cachesvc=3)
    text = report(run, clients=4, decode=2, routers=2, restart_after_s=45)
    assert "| before the first fault (0-10 s) | 1 | 0 | 200 | 1.00x | 100 | 1.00x | 80.0% |" in text
    assert "| kill -9 cachesvc-1 at 10 s, back at 55 s | 3 | 0 |" in text and "| 64.7% |" in text
    assert ("| kill -9 cachesvc-1: its last 15 s down (30 s after the signal on) | 2 | 0 | 200 | 1.00x | 100 | 1.00x "
            "| 77.0% |") in text
    assert "3 cachesvc shards" in text
