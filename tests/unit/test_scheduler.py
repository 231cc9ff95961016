"""The step scheduler on its own: decode rows first, prefill chunks under the mixed-step budget."""

from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.engine.block_manager import BlockManager
from kvmesh.engine.kv_cache import DeviceKVPool
from kvmesh.engine.scheduler import Scheduled, Scheduler
from kvmesh.engine.sequence import Sequence
from kvmesh.engine.slo import MIN_CHUNK, chunk_budget

BS = 4
LAYOUT = KVLayout("fp", num_layers=1, num_kv_heads=1, head_dim=2, block_size=BS)
PARAMS = SamplingParams(max_tokens=1000, ignore_eos=True)


def scheduler(num_blocks: int = 256, max_batched_tokens: int = 256) -> Scheduler:
    return Scheduler(BlockManager(DeviceKVPool(LAYOUT, num_blocks)), max_batched_tokens, max_num_seqs=32)


def seq(rid: str, n: int, first: int = 1) -> Sequence:
    return Sequence(rid, list(range(first, first + n)), PARAMS)


def run_step(sched: Scheduler, chunk_tokens: int | None = None) -> list[Scheduled]:
    """Schedule one step (prompt tokens beside decode rows capped at ``chunk_tokens``) and account it the way the
    engine does: computed tokens, a sampled token when a sequence has none left to compute."""
    batch = sched.schedule(chunk_tokens)
    for s, n in batch:
        s.num_computed_tokens += n
        if s.num_uncomputed == 0:
            s.output_token_ids.append(7)
    return batch


def decoding(sched: Scheduler, count: int) -> list[Sequence]:
    seqs = [seq(f"d{i}", 6, first=100 * i + 1) for i in range(count)]
    for s in seqs:
        sched.add(s)
    run_step(sched)  # their prompts, in one step
    assert all(s.num_uncomputed == 1 for s in seqs)
    return seqs


def test_a_mixed_step_at_the_budget_costs_at_most_one_plus_stall_decode_steps():
    overhead, speed, rows, stall = 0.08, 400.0, 8, 0.5
    budget = chunk_budget(overhead, speed, rows, stall)
    decode_only = overhead + rows / speed
    assert overhead + (rows + budget) / speed <= (1 + stall) * decode_only + 1e-9
    assert overhead + (rows + budget + 1) / speed > (1 + stall) * decode_only


def test_prompts_waiting_to_join_a_small_batch_may_hold_it_back_as_long_as_the_settled_batch_would_bear():
    overhead, speed, stall = 0.03, 1500.0, 0.5
    line = (0.035, 500.0)  # decode-only steps: 35 ms + rows / 500
    step = lambda rows: line[0] + rows / line[1]
    # nobody waiting: a mixed step costs at most (1 + stall) x today's decode step
    plain = chunk_budget(overhead, speed, 8, stall, line, settled_rows=8)
    assert step(8) + plain / speed <= (1 + stall) * step(8) + 1e-9 < step(8) + (plain + 1) / speed
    # one stream running, fifteen waiting: together held back no longer than the 16-row batch would be
    ramp = chunk_budget(overhead, speed, 1, stall, line, settled_rows=16)
    assert 1 * ramp / speed <= stall * step(16) * 16 + 1e-9 < (ramp + 1) / speed
    assert ramp >= 10 * 20  # ten of the 20-token prompts in one step, not one
    # the more streams already run, the less each may be held back
    assert chunk_budget(overhead, speed, 8, stall, line, 16) < chunk_budget(overhead, speed, 4, stall, line, 16) < ramp


def test_the_budget_never_drops_below_the_minimum_chunk():
    assert chunk_budget(0.0, 1.0, 1, 0.5) == MIN_CHUNK


def test_decode_rows_come_first_then_a_prefill_chunk_under_the_cap():
    sched = scheduler()
    running = decoding(sched, 3)
    sched.add(seq("long", 200, first=1000))
    batch = sched.schedule(chunk_tokens=16)
    assert [(s.request_id, n) for s, n in batch] == [("d0", 1), ("d1", 1), ("d2", 1), ("long", 16)]
    assert [s for s, _ in batch[:3]] == running


def test_a_long_prompt_does_not_starve_running_streams():
    sched = scheduler()
    running = decoding(sched, 3)
    long = seq("long", 200, first=1000)
    sched.add(long)
    steps = 0
    while long.num_uncomputed > 1 or not long.output_token_ids:
        batch = run_step(sched, chunk_tokens=16)
        steps += 1
        counts = {s.request_id: n for s, n in batch}
        assert all(counts.get(s.request_id) == 1 for s in running)  # every stream gets its token every step
        assert counts["long"] <= 16
    assert steps == -(-200 // 16)
    assert all(len(s.output_token_ids) == steps + 1 for s in running)


def test_without_decode_rows_a_prompt_gets_the_whole_token_budget():
    sched = scheduler(max_batched_tokens=128)
    sched.add(seq("alone", 200))
    assert [n for _, n in sched.schedule(chunk_tokens=16)] == [128]


def test_a_prompt_ranked_ahead_by_its_deadline_is_admitted_before_earlier_arrivals():
    sched = scheduler(max_batched_tokens=16)
    first, urgent = seq("first", 40, first=1), seq("urgent", 40, first=500)
    sched.add(first)
    sched.add(urgent)
    urgent.slo_rank = (0, 3.0)  # the owner's plan (engine/slo.py): a deadline it can still make
    assert [(s.request_id, n) for s, n in sched.schedule()] == [("urgent", 16)]
    assert list(sched.waiting) == [first]



def test_one_order_admits_a_waiting_prompt_ranked_ahead_before_a_running_prefills_chunk():
    for one_order, first in ((False, "long"), (True, "short")):
        sched = Scheduler(BlockManager(DeviceKVPool(LAYOUT, 256)), 16, max_num_seqs=32, one_order=one_order)
        long = seq("long", 64)
        sched.add(long)
        run_step(sched)  # its first 16 tokens: a running prefill
        short = seq("short", 8, first=500)
        sched.add(short)
        long.slo_rank, short.slo_rank = (1, 5.0), (1, 1.0)  # the short one ranked ahead (least_work's keys)
        batch = run_step(sched)
        assert batch[0].seq.request_id == first
        assert sum(n for _, n in batch) == 16  # the budget is spent either way
        if one_order:
            assert {s.request_id: n for s, n in batch} == {"short": 8, "long": 8}


def test_a_row_preempted_by_a_later_rows_room_is_not_scheduled():
    # 5 blocks of 4. A long prompt running its prefill; a short one admitted after it (ranked ahead) and now
    # decoding, so it is the newest running sequence: the long one's next chunk takes its blocks
    sched = Scheduler(BlockManager(DeviceKVPool(LAYOUT, 5)), 8, max_num_seqs=32, one_order=True)
    long, short = seq("long", 40), seq("short", 3, first=500)
    sched.add(long)
    run_step(sched)  # 8 tokens: 2 blocks
    sched.add(short)
    long.slo_rank, short.slo_rank = (1, 5.0), (1, 1.0)
    run_step(sched)  # the short prompt (1 block) and 5 more of the long one's (4 blocks): all 5 held
    assert short.num_uncomputed == 1 and long.num_computed_tokens == 13
    batch = sched.schedule()  # the short one's decode row first, then the long one's chunk, which preempts it
    assert [(s.request_id, n) for s, n in batch] == [("long", 7)]
    assert short.status.value == "waiting" and short.num_preemptions == 1
