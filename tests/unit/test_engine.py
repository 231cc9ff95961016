"""The engine against Hugging Face transformers on a tiny random Llama, and its reuse/batching invariants."""

import copy

import pytest
import torch
from kvmesh.contracts.engine import ExportPieces, ExportPlan
from kvmesh.contracts.sampling import SamplingParams

from .helpers import BACKENDS, engine_from_hf, hf_greedy, prompt_logits, pushed, req

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(params=BACKENDS)
def make(request, hf, cfg):
    """An engine on the shared tiny weights, once per attention backend."""
    return lambda **kw: engine_from_hf(hf, cfg, attention=request.param, **kw)


def hf_last_logits(hf, prompt):
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, -1]


def test_prefill_logits_match_transformers(hf, make):
    engine = make()
    prompt = [5, 17, 33, 2, 99, 180, 7, 64, 12, 250, 3]
    logits, _ = prompt_logits(engine, prompt)
    assert torch.allclose(logits, hf_last_logits(hf, prompt), atol=1e-4)


def test_greedy_tokens_match_transformers(hf, make):
    engine = make()
    prompt = [11, 42, 7, 7, 130, 66, 201]
    (out,) = engine.generate([prompt], GREEDY)
    assert out.token_ids == hf_greedy(hf, prompt, 10)


@pytest.mark.parametrize("shared", [8, 10, 13])  # block boundary (bs=4), mid-block, mid-block near the end
def test_logits_after_prefix_reuse_equal_full_prefill(hf, make, shared):
    first = [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11, 12, 13, 14, 15, 16]
    second = first[:shared] + [100, 101, 102, 103, 104]
    cached = make()
    prompt_logits(cached, first)
    reused, hit = prompt_logits(cached, second)
    full, _ = prompt_logits(make(enable_prefix_caching=False), second)
    assert hit == shared
    assert (reused - full).abs().max().item() <= 1e-4


def test_batch_of_different_lengths_gives_each_its_solo_tokens(hf, make):
    prompts = [[1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48], [200, 3], list(range(60, 81))]
    solo = [make().generate([p], GREEDY)[0].token_ids for p in prompts]
    together = make().generate(prompts, GREEDY)
    assert [c.token_ids for c in together] == solo


def test_chunked_prefill_gives_the_same_tokens(hf, make):
    prompt = list(range(30, 70))
    whole = make().generate([prompt], GREEDY)[0].token_ids
    chunked = make(max_batched_tokens=7).generate([prompt], GREEDY)[0].token_ids
    assert chunked == whole


def test_preemption_under_kv_pressure_keeps_outputs_correct(hf, make):
    prompts = [[i, i + 1, i + 2, i + 3, i + 4, i + 5] for i in range(10, 90, 10)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    solo = [make().generate([p], params)[0].token_ids for p in prompts]
    tight = make(num_blocks=14)
    outs = tight.generate(prompts, params)
    assert [c.token_ids for c in outs] == solo
    assert tight.scheduler.num_preemptions > 0


def test_second_request_reports_cached_tokens(hf, make):
    engine = make()
    prompt = list(range(1, 14))
    first = engine.generate([prompt], GREEDY)[0]
    second = engine.generate([prompt + first.token_ids + [5, 6]], GREEDY)[0]
    assert first.cached_tokens == 0
    # the first turn's prompt and answer, except the last sampled token (its KV is never computed)
    assert second.cached_tokens == len(prompt) + len(first.token_ids) - 1


def test_different_cache_salt_never_shares_blocks(hf, make):
    engine = make()
    prompt = list(range(1, 20))
    engine.generate([prompt], GREEDY, cache_salt="tenant-a")
    other = engine.generate([prompt], GREEDY, cache_salt="tenant-b")[0]
    same = engine.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    assert other.cached_tokens == 0
    assert same.cached_tokens == len(prompt) - 1


def test_host_tier_round_trip_restores_evicted_blocks(hf, make):
    engine = make(num_blocks=12, host_cache_mb=1)
    prompt = list(range(100, 121))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    first = engine.generate([prompt], params)[0]
    for i in range(4):  # push the first prompt's blocks out of the device pool
        engine.generate([[i + 1] * 20], params)
    assert engine.blocks.stats["spilled_host"] > 0
    again = engine.generate([prompt], params)[0]
    assert engine.blocks.stats["loaded_host"] > 0
    assert again.cached_tokens == 20
    assert again.token_ids == first.token_ids


def test_fp8_kv_storage_stays_close_to_fp32(hf, make):
    prompt = list(range(20, 45))
    ref, _ = prompt_logits(make(), prompt)
    engine = make(kv_dtype="fp8")
    prompt_logits(engine, prompt[:-3])
    fp8, hit = prompt_logits(engine, prompt)  # reads the cached prefix back from fp8 storage
    assert hit > 0
    assert engine.kv.k.dtype == torch.float8_e4m3fn
    # tiny random weights are harsh on 3 mantissa bits
    assert torch.nn.functional.cosine_similarity(fp8, ref, dim=0) > 0.97


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_16_bit_compute_is_as_close_to_fp32_as_transformers_in_16_bits(hf, make, dtype, torch_dtype):
    """The dtype CUDA runs in (flashinfer computes in 16 bits): logits no further from the fp32 reference than
    twice transformers' own rounding in that dtype, and transformers' greedy tokens in it."""
    hf16 = copy.deepcopy(hf).to(torch_dtype)
    engine = make(dtype=dtype, kv_dtype=dtype)
    prompt = [5, 17, 33, 2, 99, 180, 7, 64, 12, 250, 3]
    logits, _ = prompt_logits(engine, prompt)
    exact, rounded = hf_last_logits(hf, prompt), hf_last_logits(hf16, prompt).float()
    assert (logits - exact).abs().max() <= 2 * (rounded - exact).abs().max() + 1e-3
    prompt = [11, 42, 7, 7, 130, 66, 201]
    assert engine.generate([prompt], GREEDY)[0].token_ids == hf_greedy(hf16, prompt, 10)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch reaches a GPU")
def test_cuda_without_a_gpu_says_what_to_set(cfg):
    from kvmesh.engine.llm_engine import LLMEngine
    from kvmesh.settings import EngineSettings

    with pytest.raises(RuntimeError, match="set device=cpu, or install torch's CUDA build"):
        LLMEngine(EngineSettings(device="cuda", num_blocks=8), model_config=cfg)


def test_bad_prompts_are_refused_with_a_reason(hf, make):
    engine = make()
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request(req("a", [1, 999], GREEDY))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(req("b", [], GREEDY))
    with pytest.raises(ValueError, match="pool holds"):
        engine.add_request(req("c", [1] * 300, GREEDY))
    assert not engine.has_unfinished()


def run_to_end(engine, rid):
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step().outputs if o.request_id == rid]
    return outs


def test_kv_exported_by_one_engine_continues_in_another(make):
    prompt = list(range(40, 63))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = make().generate([prompt], params)[0].token_ids
    prefill = make()
    prefill.add_request(req("p", prompt, SamplingParams(max_tokens=1, ignore_eos=True), export=ExportPlan()))
    (first,) = run_to_end(prefill, "p")
    exported = first.exported
    assert exported.num_tokens == len(prompt) and len(exported.block_keys) == len(prompt) // 4
    decode = make()
    decode.add_request(req("d", prompt, params,
                           imported=pushed(decode.layout, exported.blocks, exported.num_tokens,
                                           first.new_token_ids[0])))
    outs = run_to_end(decode, "d")
    assert [t for o in outs for t in o.new_token_ids] == expected
    assert outs[0].cached_tokens == len(prompt)


def test_imported_kv_on_top_of_a_locally_cached_prefix(make):
    prompt = list(range(40, 63))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = make().generate([prompt], params)[0].token_ids
    prefill = make()
    prefill.add_request(req("p", prompt, SamplingParams(max_tokens=1, ignore_eos=True), export=ExportPlan()))
    (first,) = run_to_end(prefill, "p")
    decode = make()
    decode.generate([prompt[:10]], SamplingParams(max_tokens=1))  # decode already holds 2 blocks + a tail
    decode.add_request(req("d", prompt, params,
                           imported=pushed(decode.layout, first.exported.blocks, len(prompt), first.new_token_ids[0])))
    assert [t for o in run_to_end(decode, "d") for t in o.new_token_ids] == expected


def test_delta_push_only_the_blocks_decode_lacks(make):
    """Decode holds (and pins) the prompt's first blocks; prefill exports only the rest; greedy tokens equal."""
    prompt = list(range(40, 63))  # 23 tokens: 5 full blocks of 4 and a tail
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = make().generate([prompt], params)[0].token_ids
    decode = make()
    decode.generate([prompt[:13]], SamplingParams(max_tokens=1))  # 3 full blocks cached
    before = decode.blocks.counts()
    seed = decode.namespace_seed()
    assert decode.blocks.pin("d", seed, prompt, 5) == 3
    assert decode.blocks.counts()["pinned"] == 3
    decode.blocks.evict(100)  # everything evictable goes, the pinned blocks stay
    assert len(decode.blocks.match(seed, prompt).nodes) == 3
    prefill = make()
    prefill.add_request(req("p", prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                            export=ExportPlan(first_block=3)))
    (first,) = run_to_end(prefill, "p")
    kv = first.exported
    assert kv.first_block == 3 and kv.blocks.shape[0] == 6 - 3 and kv.num_tokens == len(prompt)
    decode.add_request(req("d", prompt, params,
                           imported=pushed(decode.layout, kv.blocks, kv.num_tokens, first.new_token_ids[0], 3)))
    decode.blocks.unpin("d")
    outs = run_to_end(decode, "d")
    assert outs[0].cached_tokens == len(prompt)
    assert [t for o in outs for t in o.new_token_ids] == expected
    after = decode.blocks.counts()
    assert after["pinned"] == after["leases"] == after["referenced"] == 0
    assert after["free"] + after["cached"] == before["free"] + before["cached"]  # every block accounted for


def test_a_delta_push_landed_in_reserved_blocks_is_adopted_and_gives_the_same_tokens(make):
    """Decode pins the first 3 blocks and reserves the other 3; the pushed bytes are written straight into
    the reserved blocks (what the transfer server's landing does); the import adopts exactly those blocks."""
    from kvmesh.engine.kv_cache import Landed

    prompt = list(range(40, 63))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = make().generate([prompt], params)[0].token_ids
    decode = make()
    decode.generate([prompt[:13]], SamplingParams(max_tokens=1))
    assert decode.blocks.pin("d", decode.namespace_seed(), prompt, 5) == 3
    ids = decode.blocks.reserve("d-reserve", 3)
    prefill = make()
    prefill.add_request(req("p", prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                            export=ExportPlan(first_block=3)))
    (first,) = run_to_end(prefill, "p")
    decode.kv.write_blocks(ids, first.exported.blocks)  # landed
    seq = decode.add_request(req("d", prompt, params, imported=pushed(decode.layout, Landed("d-reserve", []),
                                                                      len(prompt), first.new_token_ids[0], 3)))
    assert seq.block_table[3:6] == ids
    assert decode.kv.read_blocks(ids).equal(first.exported.blocks)
    decode.blocks.unpin("d")
    assert [t for o in run_to_end(decode, "d") for t in o.new_token_ids] == expected
    assert decode.blocks.counts()["reserved"] == decode.blocks.counts()["referenced"] == 0


def test_a_reservation_the_engine_has_no_room_to_import_is_released_and_the_prompt_recomputed(make):
    from kvmesh.engine.kv_cache import Landed

    prompt = list(range(40, 63))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    expected = make().generate([prompt], params)[0].token_ids
    decode = make()
    decode.blocks.reserve("r", 6)
    decode.scheduler.has_room = lambda: False  # no room for another running sequence: queued instead
    decode.add_request(req("d", prompt, params, imported=pushed(decode.layout, Landed("r", []), len(prompt), 0, 0)))
    assert decode.blocks.counts()["reserved"] == 0  # freed at once, not when the request ends
    del decode.scheduler.has_room
    assert [t for o in run_to_end(decode, "d") for t in o.new_token_ids] == expected


def test_delta_import_after_the_pinned_prefix_was_lost_recomputes(make):
    prompt = list(range(40, 63))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    expected = make().generate([prompt], params)[0].token_ids
    prefill = make()
    prefill.add_request(req("p", prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                            export=ExportPlan(first_block=3)))
    (first,) = run_to_end(prefill, "p")
    decode = make()  # holds nothing: the import cannot attach, the request is computed here instead
    decode.add_request(req("d", prompt, params,
                           imported=pushed(decode.layout, first.exported.blocks, len(prompt),
                                           first.new_token_ids[0], 3)))
    outs = run_to_end(decode, "d")
    assert [t for o in outs for t in o.new_token_ids] == expected
    assert decode.blocks.counts()["referenced"] == 0


def test_kv_read_out_chunk_by_chunk_continues_in_another_engine(make):
    """With ``export_chunks`` each prefill chunk's new full blocks come out as they are computed (no token);
    the pieces in order, starting past the blocks decode holds, import to the same greedy tokens."""
    prompt = list(range(40, 63))  # 23 tokens: 5 full blocks of 4 and a tail
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = make().generate([prompt], params)[0].token_ids
    prefill = make(max_batched_tokens=6)  # chunks end at tokens 6, 12, 18, 23
    prefill.add_request(req("p", prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                            export=ExportPlan(ExportPieces.BY_CHUNK, 1)))
    outs = run_to_end(prefill, "p")
    # after token 6 no new block past block 1; after 12 blocks 1-2; after 18 block 3; the last: 4 and the tail
    assert [(o.exported.first_block, o.exported.blocks.shape[0], o.exported.final, len(o.new_token_ids))
            for o in outs] == [(1, 2, False, 0), (3, 1, False, 0), (4, 2, True, 1)]
    assert outs[-1].exported.block_keys[:3] == outs[0].exported.block_keys  # keys of all full blocks so far
    decode = make()
    decode.generate([prompt[:5]], SamplingParams(max_tokens=1))  # decode holds block 0
    seed = decode.namespace_seed()
    assert decode.blocks.pin("d", seed, prompt, 1) == 1
    decode.add_request(req("d", prompt, params, imported=pushed(decode.layout, [o.exported.blocks for o in outs],
                                                                len(prompt), outs[-1].new_token_ids[0], 1)))
    decode.blocks.unpin("d")
    got = run_to_end(decode, "d")
    assert got[0].cached_tokens == len(prompt)
    assert [t for o in got for t in o.new_token_ids] == expected


def test_kv_read_out_in_layer_groups_during_the_pass_continues_in_another_engine(make):
    """With ``export_layer_groups`` each chunk's blocks leave layer group by layer group, handed to
    ``on_piece`` from inside the forward pass, the last chunk's partial block included (so its last output
    holds no blocks); placed by block and layer they import to the same greedy tokens."""
    from kvmesh.engine.kv_cache import KVPiece

    prompt = list(range(40, 63))  # 23 tokens: 5 full blocks of 4 and a tail
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = make().generate([prompt], params)[0].token_ids
    prefill = make(max_batched_tokens=12)  # chunks end at tokens 12 and 23
    handed = []
    prefill.on_piece = handed.append
    prefill.add_request(req("p", prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                            export=ExportPlan(ExportPieces.BY_LAYER_GROUP, 1, 2)))
    outs = run_to_end(prefill, "p")
    assert [(o.exported.first_block, o.exported.blocks.shape[0], o.exported.layers, o.exported.num_tokens)
            for o in handed] == [(1, 2, (0, 1), 12), (1, 2, (1, 2), 12), (3, 3, (0, 1), 23), (3, 3, (1, 2), 23)]
    assert len(outs) == 1 and outs[0].exported.blocks.shape[0] == 0 and outs[0].exported.final
    decode = make()
    decode.generate([prompt[:5]], SamplingParams(max_tokens=1))  # decode holds block 0
    assert decode.blocks.pin("d", decode.namespace_seed(), prompt, 1) == 1
    pieces = [KVPiece(o.exported.first_block, o.exported.blocks, o.exported.layers) for o in handed]
    decode.add_request(req("d", prompt, params,
                           imported=pushed(decode.layout, pieces, len(prompt), outs[0].new_token_ids[0], 1)))
    decode.blocks.unpin("d")
    got = run_to_end(decode, "d")
    assert got[0].cached_tokens == len(prompt)
    assert [t for o in got for t in o.new_token_ids] == expected


def test_layer_group_pieces_come_with_the_step_outputs_without_a_receiver(make):
    prefill = make(max_batched_tokens=12)
    prefill.add_request(req("p", list(range(40, 63)), SamplingParams(max_tokens=1, ignore_eos=True),
                            export=ExportPlan(ExportPieces.BY_LAYER_GROUP, layer_groups=2)))
    outs = run_to_end(prefill, "p")
    assert [o.exported.layers for o in outs] == [(0, 1), (1, 2), (0, 1), (1, 2), None]
    assert [len(o.new_token_ids) for o in outs] == [0, 0, 0, 0, 1]
