"""The KV correctness canary (engine/canary.py): reused KV recomputed off the critical path and compared with
what was served; a corrupted block is caught and quarantined, clean reuses raise no alarm."""

from __future__ import annotations

import pytest
import torch
from kvmesh.contracts.engine import ExportPlan
from kvmesh.contracts.events import BlockRemoved
from kvmesh.contracts.keys import block_keys
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.model_source.hf_config import ModelConfig

from .helpers import engine_from_hf, hf_tiny, pushed, req

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
PROMPT = list(range(40, 63))  # 23 tokens: 5 full blocks of 4 and a tail


@pytest.fixture
def make():
    cfg = ModelConfig.tiny()
    hf = hf_tiny(cfg)

    def build(**kw):
        engine = engine_from_hf(hf, cfg, attention="torch", **{"canary_share": 1.0, "canary_budget": 1.0, **kw})
        engine.events = []
        engine.blocks.on_event = engine.events.append
        return engine
    return build


def drain(engine) -> None:
    while engine.canary.pending:
        engine.canary_step()


def block_of(engine, prompt, i):
    key = block_keys(engine.namespace_seed(), prompt, engine.cfg.block_size)[i]
    return key, engine.blocks.tree.by_key[key].block_id


def swap_layers(engine, b):
    """A layout fault: layers 0 and 1 of block ``b`` trade places (every byte still there, checksums of the
    block's bytes as a whole would not tell)."""
    for t in (engine.kv.k, engine.kv.v):
        t[[0, 1], b] = t[[1, 0], b]


def reinterpret_dtype(engine, b):
    """A dtype fault: block ``b``'s fp32 bytes read as bf16 halves."""
    for t in (engine.kv.k, engine.kv.v):
        x = t[:, b].contiguous()
        t[:, b] = x.view(torch.bfloat16)[..., :x.shape[-1]].to(t.dtype)


def test_a_clean_local_reuse_passes(make):
    e = make()
    e.generate([PROMPT], PARAMS)
    (second,) = e.generate([PROMPT], PARAMS)
    assert second.cached_tokens == 22  # 5 blocks and 2 tokens of the partial one
    drain(e)
    assert e.canary.counts == {("local", "ok"): 1}


@pytest.mark.parametrize("corrupt", [swap_layers, reinterpret_dtype])
def test_a_corrupted_cached_block_is_caught_quarantined_and_rewritten(make, corrupt):
    e = make()
    clean = e.generate([PROMPT], PARAMS)[0].token_ids
    key, b = block_of(e, PROMPT, 2)
    corrupt(e, b)
    e.generate([PROMPT], PARAMS)  # served from the corrupted cache
    drain(e)
    assert e.canary.counts == {("local", "diverged"): 1}
    later = block_keys(e.namespace_seed(), PROMPT, 4)[2:]
    removed = {k for ev in e.events if isinstance(ev, BlockRemoved) for k in ev.block_keys}
    assert set(later) <= removed  # the index is told they are gone
    # never served again: the next request reuses only the blocks before it, recomputes (rewrites) the rest
    (after,) = e.generate([PROMPT], PARAMS)
    assert after.cached_tokens == 8 and after.token_ids == clean
    (again,) = e.generate([PROMPT], PARAMS)
    assert again.cached_tokens == 22 and again.token_ids == clean
    drain(e)
    assert e.canary.counts[("local", "ok")] == 2 and key not in e.blocks.tree.quarantined


def test_a_corrupted_hand_off_is_caught_on_the_decode_side(make):
    prefill = make(canary_share=0.0)
    prefill.add_request(req("p", PROMPT, SamplingParams(max_tokens=1, ignore_eos=True), export=ExportPlan()))
    first = None
    while prefill.has_unfinished():
        first = next((o for o in prefill.step().outputs if o.request_id == "p"), first)
    blocks = first.exported.blocks.clone()
    blocks[1, [0, 1]] = blocks[1, [1, 0]]  # corrupted after prefill read it out: its checksum matches
    decode = make()
    decode.add_request(req("d", PROMPT, PARAMS, imported=pushed(decode.layout, blocks, len(PROMPT),
                                                                  first.new_token_ids[0])))
    while decode.has_unfinished():
        decode.step()
    drain(decode)
    assert decode.canary.counts == {("handoff", "diverged"): 1}
    assert decode.blocks.match(decode.namespace_seed(), PROMPT).num_tokens == 4  # block 0 only


def test_a_thousand_clean_reuses_raise_no_false_alarm(make):
    """Reuses of prefixes computed in chunks of other sizes and batches of other shapes than the recompute."""
    e = make(max_batched_tokens=24, num_blocks=512)
    e.canary.max_pending = 10_000
    system = list(range(100, 112))  # 3 blocks every request shares
    checked = 0
    for batch in range(52):
        prompts = [system + [150 + batch, 10 + i] * (1 + i % 5) for i in range(20)]
        e.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
        drain(e)
        checked = sum(e.canary.counts.values())
    assert checked >= 1000
    assert e.canary.counts.get(("local", "diverged"), 0) == 0 and not e.blocks.tree.quarantined


def test_the_share_samples_reuses_and_the_budget_spaces_the_checks():
    from kvmesh.engine.canary import Canary

    c = Canary(share=0.1, seed=1)
    assert 50 < sum(c.wants() for _ in range(1000)) < 150 or len(c.pending) == 0
    t = [0.0]
    c = Canary(share=1.0, budget=0.25, clock=lambda: t[0])
    c.pending.append(object())  # type: ignore[arg-type]
    c.spent(0.01)
    assert c.due_in() == pytest.approx(0.03)


def test_the_vllm_canarys_logprob_comparison():
    """The vLLM canary's verdict (kvmesh.vllm.canary, no vLLM needed): equal distributions agree, noise within
    tolerance agrees, a moved distribution or a different most likely token does not, and a token missing from
    the served top counts by how far above the served top's last it should have ranked."""
    from kvmesh.vllm.canary import TOLERANCE, VLLMCanary, divergence

    ref = {1: -0.1, 2: -2.5, 3: -4.0}
    assert divergence(ref, ref) == 0.0
    assert divergence({1: -0.1001, 2: -2.5002, 3: -3.9995}, ref) < TOLERANCE["fp32"]
    assert divergence({1: -1.3, 2: -0.4, 3: -4.0}, ref) > 1.0
    assert divergence({2: -0.1, 3: -2.5, 4: -4.0}, ref) == float("inf")  # the recompute's top token was not served
    assert divergence({1: -0.1, 2: -2.5, 4: -3.9}, ref) == pytest.approx(0.0, abs=0.11)  # 3 just below the cut
    assert divergence({1: -0.1, 2: -2.5, 4: -9.0}, ref) == pytest.approx(5.0)  # 3 should have ranked well above
    assert VLLMCanary(1.0, 1.0, "fp32", "fp8").tolerance == TOLERANCE["fp8"]  # the coarser dtype decides
