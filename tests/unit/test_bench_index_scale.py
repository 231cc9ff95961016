"""The index scale bench's simulated fleet: what it fills the index with and what it asks of it."""

from kvmesh.contracts.events import BlockStored

from app.bench.index_scale import PROMPT_BLOCKS, SYSTEM_BLOCKS, Fleet, fill, query_sets


def test_the_fleet_indexes_exactly_the_blocks_asked_for():
    index, cost = fill(Fleet(instances=16, blocks=20_000))
    assert len(index) == 20_000
    assert 16 < cost["holders"] <= 32  # every instance on device, most in host too


def test_batches_number_each_instance_from_one_without_gaps():
    seqs: dict[str, list[int]] = {}
    for batch in Fleet(instances=8, blocks=10_000).batches():
        seqs.setdefault(batch.instance_id, []).append(batch.seq)
    assert all(s == list(range(1, len(s) + 1)) for s in seqs.values())


def test_batches_are_the_same_each_time():
    fleet = Fleet(instances=8, blocks=10_000)
    first = [(b.instance_id, b.seq, b.events) for b in fleet.batches()]
    assert first == [(b.instance_id, b.seq, b.events) for b in fleet.batches()]


def test_the_first_system_prompt_is_held_by_every_instance():
    fleet = Fleet(instances=8, blocks=10_000)
    holders = {b.instance_id for b in fleet.batches() for e in b.events
               if isinstance(e, BlockStored) and e.block_keys == fleet.systems[0]}
    assert len(holders) == 8


def test_held_prompts_match_whole_shared_ones_stop_after_the_system_prompt_misses_match_nothing():
    fleet = Fleet(instances=8, blocks=20_000)
    index, _ = fill(fleet)
    queries = query_sets(fleet, 20)
    held, shared, miss = queries.values()
    assert all(len(keys) == PROMPT_BLOCKS for q in queries.values() for keys in q)
    assert all(max(m.num_blocks for m in index.match_prefix(keys)) == PROMPT_BLOCKS for keys in held)
    assert all(max(m.num_blocks for m in index.match_prefix(keys)) == SYSTEM_BLOCKS for keys in shared)
    assert all(index.match_prefix(keys) == [] for keys in miss)
