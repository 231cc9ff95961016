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
    assert r.matched([1, 9], ["a"]) == {"a": 1}  # the leading run only
    assert r.matched([9, 19], ["a"]) == {}
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
    # the oldest dispatch went first, whole
    assert len(r) == 3 and r.matched([1, 2, 3], ["a", "b"]) == {"b": 3}
    r.dispatched("a", [1])
    r.forget("b")
    assert len(r) == 1 and r.matched([1, 2, 3], ["a", "b"]) == {"a": 1}


def test_generations_go_whole_once_their_last_key_expired():
    clock = Clock()
    r = RecentPrefixes(ttl_s=8.0, clock=clock)
    for t in range(8):  # one dispatch a second: a generation each 2 s
        r.dispatched("a", [t, t + 100])
        clock.now += 1.0
    assert len(r._gens) == 4 and len(r) == 16
    clock.now += 1.5  # the first two dispatches (one generation) stopped counting
    assert r.matched([0], ["a"]) == {} and r.matched([2, 102], ["a"]) == {"a": 2}
    assert len(r._gens) == 3 and len(r) == 12
    r.dispatched("a", [2])  # renewed in the newest generation: counts when its old one goes
    clock.now += 1.0
    assert r.matched([2, 102], ["a"]) == {"a": 1} and r.expiry("a", 1) == 0.0 and r.expiry("a", 2) == 117.5


def test_off_with_no_ttl_and_the_longer_match_wins():
    r = RecentPrefixes(ttl_s=0.0, clock=Clock())
    r.dispatched("a", [1, 2])
    assert r.matched([1, 2], ["a"]) == {} and len(r) == 0
    assert merged({"a": 5, "pool": 9}, {"a": 2, "b": 4}) == {"a": 5, "b": 4, "pool": 9}


def chain(prefix: list[int], n: int, seed: int) -> list[int]:
    """Block keys as a chain: a block's key stands for its whole prefix."""
    keys, h = [], 0
    for i in range(n):
        h = hash((h, prefix[i] if i < len(prefix) else (seed, i)))
        keys.append(h)
    return keys


def test_bisection_finds_what_a_block_by_block_scan_finds_on_chained_prompts():
    import random

    rng = random.Random(5)
    for _ in range(300):
        clock = Clock()
        r = RecentPrefixes(ttl_s=5.0, max_keys=rng.choice([8, 40, 10_000]), clock=clock)
        shared = [rng.randrange(3) for _ in range(6)]  # a few system prompts' blocks
        prompts = [chain(shared[:rng.randrange(7)], rng.randrange(1, 12), rng.randrange(5)) for _ in range(8)]
        for _ in range(rng.randrange(1, 20)):
            clock.now += rng.uniform(0, 2)
            r.dispatched(rng.choice("ab"), rng.choice(prompts))
            if rng.random() < 0.1:
                r.forget(rng.choice("ab"))
        clock.now += rng.uniform(0, 4)
        for keys in prompts:
            got = r.matched(keys, ["a", "b"])
            want = {}
            for inst in "ab":
                n = 0
                while n < len(keys) and r.expiry(inst, keys[n]) > clock.now:
                    n += 1
                if n:
                    want[inst] = n
            assert got == want
