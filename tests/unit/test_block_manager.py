"""Radix prefix cache, eviction order per policy, events and the host tier, on the block manager alone."""

import math

import pytest
from kvmesh.contracts.events import BlockRemoved, BlockStored
from kvmesh.contracts.keys import block_keys
from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.engine.block_manager import BlockManager
from kvmesh.engine.eviction import LFU, LRU, SLRU, PriorityLRU, make_policy, online_policies
from kvmesh.engine.kv_cache import DeviceKVPool, HostKVPool
from kvmesh.engine.sequence import RetentionRange, Sequence

BS = 4
LAYOUT = KVLayout("fp", num_layers=1, num_kv_heads=1, head_dim=2, block_size=BS)


def manager(num_blocks=8, policy=None, host_blocks=0, events=None):
    host = HostKVPool(LAYOUT, host_blocks) if host_blocks else None
    return BlockManager(DeviceKVPool(LAYOUT, num_blocks), host, policy or LRU(),
                        events.append if events is not None else None)


def run(bm, tokens, seed=1, retention=()):
    """Admit a sequence, 'compute' all its tokens, and finish it (its blocks stay cached)."""
    seq = Sequence("r", list(tokens), SamplingParams(), seed, retention)
    assert bm.allocate_prefix(seq)
    assert bm.ensure_slots(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    bm.free(seq)
    return seq


def hit(bm, tokens, seed=1):
    """A request that reuses ``tokens`` and adds nothing to the cache."""
    seq = Sequence("h", list(tokens) + [0], SamplingParams(), seed)
    assert bm.allocate_prefix(seq)
    bm.free(seq)


def cached_prefixes(bm, prompts, seed=1):
    return [bm.match(seed, p).num_tokens for p in prompts]


def test_match_stops_mid_block_at_the_first_different_token():
    bm = manager()
    run(bm, [1, 2, 3, 4, 5, 6, 7, 8])
    assert bm.match(1, [1, 2, 3, 4, 5, 6, 9, 9]).num_tokens == 6


def test_a_partial_match_is_copied_into_a_private_block():
    bm = manager()
    run(bm, [1, 2, 3, 4, 5, 6, 7, 8])
    seq = Sequence("s", [1, 2, 3, 4, 5, 6, 0, 0, 0], SamplingParams(), 1)
    assert bm.allocate_prefix(seq)
    shared = bm.match(1, [1, 2, 3, 4, 5, 6, 7, 8]).nodes
    assert seq.block_table[0] == shared[0].block_id
    assert seq.block_table[1] != shared[1].block_id
    assert seq.num_computed_tokens == 6


def test_the_trailing_partial_block_is_cached_for_reuse():
    bm = manager()
    run(bm, [1, 2, 3, 4, 5, 6])
    assert bm.match(1, [1, 2, 3, 4, 5, 6, 7]).num_tokens == 6


def test_a_referenced_block_is_never_evicted():
    bm = manager(num_blocks=4)
    seq = Sequence("s", [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(), 1)
    bm.allocate_prefix(seq)
    bm.ensure_slots(seq, 8)
    seq.num_computed_tokens = 8
    bm.cache_computed_blocks(seq)
    assert bm.evict(4) == 0
    assert bm.match(1, [1, 2, 3, 4, 5, 6, 7, 8, 0]).num_tokens == 8


def test_lru_evicts_the_least_recently_used_prefix():
    bm = manager(num_blocks=4, policy=LRU())
    a, b = [1, 1, 1, 1], [2, 2, 2, 2]
    run(bm, a)
    run(bm, b)
    hit(bm, a)  # touch a
    bm.evict(1)
    assert cached_prefixes(bm, [a + [9], b + [9]]) == [4, 0]


def test_lfu_evicts_the_least_frequently_hit_prefix():
    bm = manager(num_blocks=4, policy=LFU())
    a, b = [1, 1, 1, 1], [2, 2, 2, 2]
    run(bm, a)
    for _ in range(3):
        hit(bm, a)
    run(bm, b)
    hit(bm, b)  # b is the most recent, but hit less often
    bm.evict(1)
    assert cached_prefixes(bm, [a + [9], b + [9]]) == [4, 0]


def test_slru_protects_blocks_hit_twice_over_newer_ones():
    bm = manager(num_blocks=4, policy=SLRU())
    a, b = [1, 1, 1, 1], [2, 2, 2, 2]
    run(bm, a)
    hit(bm, a)
    hit(bm, a)  # hit twice: protected
    run(bm, b)        # newer, but on probation
    bm.evict(1)
    assert cached_prefixes(bm, [a + [9], b + [9]]) == [4, 0]


def test_priority_keeps_a_system_prompt_over_newer_chat_turns():
    bm = manager(num_blocks=4, policy=PriorityLRU())
    system, turn = [7, 7, 7, 7], [3, 3, 3, 3]
    run(bm, system, retention=(RetentionRange(0, 4, priority=50),))
    run(bm, turn)
    bm.evict(1)
    assert cached_prefixes(bm, [system + [9], turn + [9]]) == [4, 0]


def test_priority_expires_after_its_duration():
    policy = PriorityLRU()
    bm = manager(num_blocks=4, policy=policy)
    run(bm, [7, 7, 7, 7], retention=(RetentionRange(0, 4, priority=50, duration_s=0.0),))
    node = bm.match(1, [7, 7, 7, 7, 0]).nodes[0]
    assert policy.sort_key(node, math.inf)[0] == 0


def test_ghost_keeps_a_block_that_came_back_after_eviction_over_a_newer_one():
    policy = make_policy("ghost")
    policy.eviction_age = 1e6         # as if blocks had lived long: the stays, not recency, decide
    bm = manager(num_blocks=3, policy=policy)
    a, x, b = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    run(bm, a)
    run(bm, x)
    bm.evict(1)                       # a goes; the ghost remembers its key
    run(bm, a)                        # a returns (a miss): known
    run(bm, b)                        # b is newer than a, but never seen before
    bm.evict(2)                       # LRU would take x and a
    assert cached_prefixes(bm, [a + [9], x + [9], b + [9]]) == [4, 0, 0]


def test_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="lru"):
        make_policy("fifo")


def test_without_a_host_tier_only_leaves_are_evicted():
    bm = manager(num_blocks=4)
    run(bm, [1, 1, 1, 1, 2, 2, 2, 2])
    bm.evict(1)
    assert bm.match(1, [1, 1, 1, 1, 2, 2, 2, 2, 0]).num_tokens == 4  # the child went, the parent stayed


def test_stored_events_carry_the_chained_block_keys():
    events = []
    bm = manager(events=events)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    run(bm, tokens)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored[0].block_keys == tuple(block_keys(1, tokens, BS))
    assert stored[0].parent_key is None and stored[0].tier == "device"


def test_eviction_to_host_reports_removed_from_device_and_stored_on_host():
    events = []
    bm = manager(num_blocks=4, host_blocks=4, events=events)
    run(bm, [1, 2, 3, 4])
    bm.evict(1)
    assert isinstance(events[-2], BlockRemoved) and events[-2].tier == "device"
    assert isinstance(events[-1], BlockStored) and events[-1].tier == "host"
    assert bm.num_host_blocks == 1 and bm.num_cached_blocks == 0


def test_host_blocks_load_back_with_their_bytes():
    bm = manager(num_blocks=4, host_blocks=4)
    seq = Sequence("s", [1, 2, 3, 4], SamplingParams(), 1)
    bm.allocate_prefix(seq)
    bm.ensure_slots(seq, 4)
    bm.device.k[0, seq.block_table[0]] = 42.0
    seq.num_computed_tokens = 4
    bm.free(seq)
    bm.evict(1)
    bm.device.k.zero_()
    again = Sequence("t", [1, 2, 3, 4, 5], SamplingParams(), 1)
    assert bm.allocate_prefix(again)
    assert again.num_computed_tokens == 4
    assert bool((bm.device.k[0, again.block_table[0]] == 42.0).all())


def test_full_host_tier_drops_its_least_valuable_leaf():
    bm = manager(num_blocks=2, host_blocks=1)
    run(bm, [1, 1, 1, 1])
    run(bm, [2, 2, 2, 2])
    bm.evict(2)
    assert bm.num_host_blocks == 1
    assert cached_prefixes(bm, [[1, 1, 1, 1, 0], [2, 2, 2, 2, 0]]) == [0, 4]


def test_host_tier_evicts_leaves_in_policy_order_and_a_parent_once_its_children_are_gone():
    bm = manager(num_blocks=4, host_blocks=2)
    run(bm, [1, 1, 1, 1, 2, 2, 2, 2])   # a chain of two blocks
    run(bm, [3, 3, 3, 3])
    bm.evict(3)                          # all three spill; the host keeps 2: the chain's tail leaves first (LRU)
    assert bm.num_host_blocks == 2
    assert cached_prefixes(bm, [[1, 1, 1, 1, 2, 2, 2, 2, 0], [3, 3, 3, 3, 0]]) == [4, 4]
    run(bm, [4, 4, 4, 4])
    bm.evict(1)                          # the chain's head is a host leaf now, and the least recent
    assert cached_prefixes(bm, [[1, 1, 1, 1, 0], [3, 3, 3, 3, 0]]) == [0, 4]


def test_held_blocks_lists_every_full_block_with_its_tier():
    bm = manager(num_blocks=4, host_blocks=4)
    run(bm, [1, 2, 3, 4, 5, 6, 7, 8])  # two full blocks
    bm.evict(1)
    held = bm.held_blocks()
    assert sorted(t for _, t in held) == ["device", "host"]
    assert {k for k, _ in held} == set(block_keys(1, [1, 2, 3, 4, 5, 6, 7, 8], BS))


@pytest.mark.parametrize("name", online_policies())
def test_every_online_policy_evicts_through_both_tiers_and_keeps_the_cache_consistent(name):
    bm = manager(num_blocks=6, policy=make_policy(name), host_blocks=3)
    prompts = [[p, p, p, p, q, q, q, q] for p in range(1, 6) for q in (7, 8)]
    for tokens in prompts * 2:
        run(bm, tokens)
    assert bm.num_host_blocks <= 3 and bm.stats["evicted_host"] > 0
    counts = bm.counts()
    assert counts["free"] + counts["cached"] == 6 and counts["referenced"] == 0


def test_making_host_room_never_drops_a_host_block_that_a_prefix_being_attached_holds():
    """The host tier is full with the one block a new sequence matched; loading it needs a device block, and
    that eviction wants host room: the block being loaded is not the one to go."""
    bm = manager(num_blocks=4, host_blocks=1)
    a = list(range(100, 108))  # 2 full blocks
    run(bm, a)
    bm.evict(2)  # one of them ends on the host (its only slot), the other is dropped
    assert bm.num_host_blocks == 1
    run(bm, list(range(200, 216)))  # the device fills with 4 other cached blocks
    seq = Sequence("s", a + [7], SamplingParams(), 1)
    assert bm.allocate_prefix(seq)
    assert len(seq.nodes) == 1 and seq.num_cached_tokens == BS  # the host block, loaded


def test_a_host_block_refused_while_held_is_evictable_again_once_released():
    """Host room refuses a host block a reader holds (it leaves the host queue); when the reader lets go while
    the block is still on the host (an attach that failed), the block is queued again, not stuck for good."""
    bm = manager(num_blocks=4, host_blocks=1)
    run(bm, list(range(100, 108)))
    bm.evict(2)
    (node,) = bm.tiers.host_nodes
    node.ref_count += 1  # what allocate_prefix does to the blocks it matched
    assert not bm.tiers._make_host_room()
    assert node not in bm.tiers.host_queue
    bm.tiers.unref(node)
    assert node in bm.tiers.host_queue and bm.tiers._make_host_room() and bm.num_host_blocks == 0


def landed_import(bm, tokens, lease, first_block, seed=1):
    """A decode-side request whose blocks from ``first_block`` on were received into the blocks ``lease``
    reserved (its first token appended, as ``add_request`` does)."""
    from kvmesh.engine.kv_cache import Landed

    seq = Sequence("d", list(tokens) + [0], SamplingParams(), seed)
    return seq, bm.import_prefix(seq, Landed(lease, []), len(tokens), first_block)


def test_reserved_blocks_are_adopted_by_the_import_as_they_are_without_a_copy(monkeypatch):
    import torch

    bm = manager(num_blocks=8)
    ids = bm.reserve("lease", 3)
    assert ids is not None and len(ids) == 3 and bm.counts()["reserved"] == 3
    assert not set(ids) & set(bm.free_blocks)
    sent = torch.randn(3, *LAYOUT.block_shape)
    bm.device.write_blocks(ids, sent)  # what the transfer server's landing did
    monkeypatch.setattr(bm.device, "write_blocks", lambda *a, **k: pytest.fail("the import copied"))
    seq, ok = landed_import(bm, list(range(10, 20)), "lease", 0)  # 10 tokens: 2 full blocks and 2 tokens
    assert ok and seq.block_table == ids and seq.num_computed_tokens == 10
    assert bm.device.read_blocks(seq.block_table).equal(sent)
    assert bm.counts()["reserved"] == 0 and bm.counts()["leases"] == 0
    assert bm.match(1, list(range(10, 20))).num_tokens == 8  # its full blocks are cached, as imported


def test_a_delta_import_adopts_the_reservation_after_the_pinned_prefix():
    bm = manager(num_blocks=8)
    run(bm, [1, 2, 3, 4, 5, 6, 7, 8])  # two cached blocks
    cached = [n.block_id for n in bm.match(1, [1, 2, 3, 4, 5, 6, 7, 8]).nodes]
    assert bm.pin("pin", 1, [1, 2, 3, 4, 5, 6, 7, 8, 9, 9], 2) == 2
    ids = bm.reserve("lease", 1)
    seq, ok = landed_import(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9, 9], "lease", 2)
    assert ok and seq.block_table == cached + ids
    bm.unpin("pin")
    bm.free(seq)
    assert bm.counts()["referenced"] == bm.counts()["reserved"] == 0


def test_a_released_reservation_goes_back_to_the_free_list_and_cannot_be_imported():
    bm = manager(num_blocks=8)
    bm.reserve("lease", 4)
    assert bm.num_free_blocks == 4
    bm.release_reserved("lease")
    bm.release_reserved("lease")  # idempotent
    assert bm.num_free_blocks == 8 and bm.counts()["reserved"] == 0
    _, ok = landed_import(bm, list(range(10, 20)), "lease", 0)
    assert not ok and bm.num_free_blocks == 8


def test_a_reservation_that_does_not_match_the_import_is_freed_not_leaked():
    bm = manager(num_blocks=8)
    bm.reserve("lease", 2)  # the prompt needs 3 blocks
    _, ok = landed_import(bm, list(range(10, 20)), "lease", 0)
    assert not ok and bm.num_free_blocks == 8 and bm.counts()["reserved"] == 0


def test_a_reservation_the_pool_cannot_hold_takes_nothing():
    bm = manager(num_blocks=4)
    assert bm.reserve("a", 3) is not None
    assert bm.reserve("b", 2) is None and bm.counts()["reserved"] == 3


@pytest.mark.parametrize("name", [p.value for p in online_policies()])
def test_a_request_that_fits_the_device_gets_its_blocks_whatever_the_host_tier_holds(name):
    """Conversations growing in turn on a device of 8 blocks and a host tier of 4, each turn taking the whole
    device: its prefix's host blocks cannot all come back while they are held (the device's other blocks have
    children on the full host tier), and an inner node the host cannot take at one moment can go later in the
    same eviction. Every turn still gets its blocks: the part of its prefix on the device is attached and the
    rest computed, and no node is lost from the eviction queue."""
    import random

    rng = random.Random(0)
    bm = manager(num_blocks=8, policy=make_policy(name), host_blocks=4)
    convs = [[100 * c + 1] * BS for c in range(4)]
    for _ in range(60):
        c = rng.randrange(4)
        convs[c] = convs[c] + [rng.randrange(1000, 2000) for _ in range(rng.randint(1, 6))]
        tokens = convs[c][:8 * BS - 2]
        seq = Sequence("r", list(tokens), SamplingParams(), 1)
        assert bm.allocate_prefix(seq) and bm.ensure_slots(seq, len(tokens)), bm.counts()
        seq.num_computed_tokens = len(tokens)
        bm.free(seq)
