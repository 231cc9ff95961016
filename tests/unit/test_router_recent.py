"""The router's table of prompts it sent each instance (``services/router/recent.py``): what counts as held until
the index hears of it, and for how long."""

from services.router.recent import RecentPrefixes, merged


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_prompt_sent_counts_as_held_there_for_its_ttl():
    clock = Clock()
    r = RecentPrefixes(ttl_s=10.0, clock=clock)
    r.dispatched("a", [1, 2, 3])
    assert r.matched([1, 2, 3, 4], ["a", "b"]) == {"a": 3}
    assert r.matched([1, 9, 3], ["a"]) == {"a": 1}  # the leading run only
    assert r.matched([9, 1], ["a"]) == {}
    clock.now += 10.0
    assert r.matched([1, 2, 3], ["a"]) == {} and len(r) == 0


def test_a_later_dispatch_renews_the_shared_prefix_only():
    clock = Clock()
    r = RecentPrefixes(ttl_s=10.0, clock=clock)
    r.dispatched("a", [1, 2, 3])
    clock.now += 6.0
    r.dispatched("a", [1, 2, 7])
    clock.now += 6.0
    assert r.matched([1, 2, 3], ["a"]) == {"a": 2}  # block 3 expired, 1-2 were sent again
    assert r.matched([1, 2, 7], ["a"]) == {"a": 3}


def test_the_table_is_bounded_and_forgets_an_instance():
    r = RecentPrefixes(ttl_s=10.0, max_keys=4, clock=Clock())
    r.dispatched("a", [1, 2, 3])
    r.dispatched("b", [1, 2, 3])
    assert len(r) == 4 and r.matched([1, 2, 3], ["a", "b"]) == {"b": 3}  # a's oldest keys went first
    r.forget("b")
    assert r.matched([1, 2, 3], ["a", "b"]) == {}


def test_off_with_no_ttl_and_the_longer_match_wins():
    r = RecentPrefixes(ttl_s=0.0, clock=Clock())
    r.dispatched("a", [1, 2])
    assert r.matched([1, 2], ["a"]) == {} and len(r) == 0
    assert merged({"a": 5, "pool": 9}, {"a": 2, "b": 4}) == {"a": 5, "b": 4, "pool": 9}
