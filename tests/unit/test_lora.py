"""Multi-LoRA in the engine against Hugging Face + PEFT on the tiny random Llama: each adapter's greedy tokens,
adapters and the base mixed in one batch, LRU residency, validation, and KV keyed by the adapter's identity."""

import json

import pytest
import torch
from kvmesh.contracts.keys import block_keys
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.model_source.hf_config import ModelConfig

from tests.lora_helpers import ATTN, MLP, make_adapter, peft_greedy

from .helpers import BACKENDS, engine_from_hf, hf_greedy, hf_tiny, req

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
PROMPTS = [[11, 42, 7, 7, 130, 66, 201], [5, 17, 33, 2, 99, 180, 7, 64, 12], [200, 3, 9], list(range(60, 75))]


@pytest.fixture(scope="module")
def adapters(hf, tmp_path_factory):
    """name -> (path, PEFT reference): attention-only, MLP-only, and all seven modules (rsLoRA, rank 8)."""
    root = tmp_path_factory.mktemp("loras")
    specs = {"attn": {"targets": ATTN, "r": 4, "seed": 1}, "mlp": {"targets": MLP, "r": 2, "seed": 2},
             "all": {"targets": ATTN + MLP, "r": 8, "seed": 3, "use_rslora": True}}
    return {name: (str(root / name), make_adapter(hf, root / name, **kw)) for name, kw in specs.items()}


@pytest.fixture(params=BACKENDS)
def make(request, hf, cfg, adapters):
    """An engine on the tiny weights with every adapter loaded, once per attention backend."""
    def build(**kw):
        engine = engine_from_hf(hf, cfg, attention=request.param, **kw)
        for name, (path, _) in adapters.items():
            engine.load_lora(name, path)
        return engine
    return build


def test_greedy_tokens_per_adapter_match_hf_peft(hf, make, adapters):
    engine = make()
    base = hf_greedy(hf, PROMPTS[0], 10)
    for name, (_, ref) in adapters.items():
        (out,) = engine.generate([PROMPTS[0]], GREEDY, lora=name)
        want = peft_greedy(ref, PROMPTS[0], 10)
        assert out.token_ids == want, name
        assert want != base, f"adapter {name} does not change the output; the test would prove nothing"


def test_prefill_logits_per_adapter_match_hf_peft(make, adapters):
    engine = make()
    prompt = PROMPTS[1]
    for name, (_, ref) in adapters.items():
        rid = f"l-{name}"
        engine.add_request(req(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True), lora=name))
        while rid not in engine.last_logits[0]:
            engine.step()
        ids, logits = engine.last_logits
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0, -1]
        assert torch.allclose(logits[ids.index(rid)], want, atol=1e-4), name
        engine.completion(rid)


def test_three_adapters_and_the_base_in_one_batch_get_their_solo_tokens(make):
    names = ["attn", "", "mlp", "all", "attn", ""]
    prompts = PROMPTS + PROMPTS[:2]
    solo = [make().generate([p], GREEDY, lora=n)[0].token_ids for p, n in zip(prompts, names)]
    engine = make()
    together = engine.generate(prompts, GREEDY, lora=names)
    assert [c.token_ids for c in together] == solo


def test_more_adapters_than_max_loras_swap_lru_and_stay_correct(make):
    names = ["attn", "mlp", "all", "attn", "mlp", "all"]
    prompts = PROMPTS + PROMPTS[:2]
    solo = [make().generate([p], GREEDY, lora=n)[0].token_ids for p, n in zip(prompts, names)]
    engine = make(max_loras=2)
    together = engine.generate(prompts, GREEDY, lora=names)
    assert [c.token_ids for c in together] == solo
    assert len(engine.loras.resident) <= 2
    assert engine.loras.swaps > 3  # the third adapter forced swaps


def test_same_prompt_under_two_adapters_shares_no_cached_block(make):
    engine = make()
    prompt = list(range(30, 50))  # 5 full blocks of 4
    first = engine.generate([prompt], GREEDY, lora="attn")[0]
    other = engine.generate([prompt], GREEDY, lora="mlp")[0]
    base = engine.generate([prompt], GREEDY)[0]
    assert first.cached_tokens == other.cached_tokens == base.cached_tokens == 0
    keys = {n: set(block_keys(engine.namespace_seed("", engine.lora_spec(n).lora_id if n else ""), prompt, 4))
            for n in ("attn", "mlp", "")}
    assert not keys["attn"] & keys["mlp"] and not keys["attn"] & keys[""] and not keys["mlp"] & keys[""]


def test_second_turn_under_an_adapter_hits_its_first(make):
    engine = make()
    prompt = list(range(30, 50))
    first = engine.generate([prompt], GREEDY, lora="all")[0]
    turn2 = prompt + first.token_ids + [7, 8, 9]
    second = engine.generate([turn2], GREEDY, lora="all")[0]
    assert second.cached_tokens >= len(prompt)
    # and the hit is the adapter's own KV: the tokens equal a cold engine's
    assert second.token_ids == make().generate([turn2], GREEDY, lora="all")[0].token_ids


def test_reload_under_the_same_name_gets_new_keys(hf, make, adapters, tmp_path):
    engine = make()
    prompt = list(range(30, 50))
    before = engine.lora_spec("attn")
    engine.generate([prompt], GREEDY, lora="attn")
    same = engine.load_lora("attn", adapters["attn"][0])  # the same files: the same identity, cache still valid
    assert same.lora_id == before.lora_id
    assert engine.generate([prompt], GREEDY, lora="attn")[0].cached_tokens > 0
    ref = make_adapter(hf, tmp_path / "attn2", ATTN, r=4, seed=9)
    new = engine.load_lora("attn", str(tmp_path / "attn2"))
    assert new.name == "attn" and new.generation != before.generation
    out = engine.generate([prompt], GREEDY, lora="attn")[0]
    assert out.cached_tokens == 0
    assert out.token_ids == peft_greedy(ref, prompt, 10)
    assert ("attn", new.generation) in engine.lora_adapters()


def test_registration_order_does_not_change_keys(make, adapters):
    a, b = make(), make()
    for name in reversed(list(adapters)):
        b.load_lora(name, adapters[name][0])
    for name in adapters:
        assert a.lora_spec(name).lora_id == b.lora_spec(name).lora_id
        assert a.namespace_seed("", a.lora_spec(name).lora_id) == b.namespace_seed("", b.lora_spec(name).lora_id)


def test_unload_lets_requests_in_flight_finish(make):
    engine = make()
    solo = make().generate([PROMPTS[0]], GREEDY, lora="mlp")[0].token_ids
    engine.add_request(req("r", PROMPTS[0], GREEDY, lora="mlp"))
    engine.step()
    engine.unload_lora("mlp")
    while engine.has_unfinished():
        engine.step()
    assert engine.completion("r").token_ids == solo
    with pytest.raises(ValueError, match="unknown LoRA adapter 'mlp'.*'all'"):
        engine.add_request(req("r2", PROMPTS[0], GREEDY, lora="mlp"))




@pytest.fixture
def bare(hf, cfg):
    return engine_from_hf(hf, cfg, max_lora_rank=4)


def test_rank_above_max_is_refused(bare, adapters):
    with pytest.raises(ValueError, match="rank 8 .* exceeds max_lora_rank 4"):
        bare.load_lora("all", adapters["all"][0])
    assert bare.lora_adapters() == []


def test_unreadable_path_is_refused(bare, tmp_path):
    with pytest.raises(ValueError, match="'x'.*not a readable directory"):
        bare.load_lora("x", str(tmp_path / "missing"))
    (tmp_path / "half").mkdir()
    with pytest.raises(ValueError, match="adapter_config.json"):
        bare.load_lora("x", str(tmp_path / "half"))


def test_adapter_for_another_model_is_refused(tmp_path, bare):
    other = hf_tiny(ModelConfig.tiny(hidden_size=32, head_dim=8))
    make_adapter(other, tmp_path / "o", ["q_proj"], r=2)
    with pytest.raises(ValueError, match="q_proj.*do not fit the base model"):
        bare.load_lora("o", str(tmp_path / "o"))


def test_unsupported_module_is_refused(tmp_path, bare, hf):
    make_adapter(hf, tmp_path / "e", ["q_proj"], r=2)
    conf = json.loads((tmp_path / "e" / "adapter_config.json").read_text())
    conf["use_dora"] = True
    (tmp_path / "e" / "adapter_config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="DoRA"):
        bare.load_lora("e", str(tmp_path / "e"))
    make_adapter(hf, tmp_path / "lm", ["lm_head"], r=2)
    with pytest.raises(ValueError, match="lm_head.*not a LoRA weight of a q/k/v/o/gate/up/down"):
        bare.load_lora("lm", str(tmp_path / "lm"))


def test_lora_adapters_setting_loads_at_start(hf, cfg, adapters):
    spec = ",".join(f"{n}={p}" for n, (p, _) in adapters.items() if n != "all")
    engine = engine_from_hf(hf, cfg, lora_adapters=spec)
    assert [n for n, _ in engine.lora_adapters()] == ["attn", "mlp"]
    with pytest.raises(ValueError, match="not NAME=PATH"):
        engine_from_hf(hf, cfg, lora_adapters="oops")


def test_kvmesh_up_lora_flags_become_the_engines_setting(tmp_path):
    from app.cli import lora_env

    env = lora_env([f"sql={tmp_path}/a", "chat=rel/b"])
    assert list(env) == ["KVMESH_ENGINE_LORA_ADAPTERS"]  # the [engine] section's variable, nothing flat
    value = env["KVMESH_ENGINE_LORA_ADAPTERS"]
    assert value.split(",")[0] == f"sql={tmp_path}/a"
    assert value.split(",")[1].startswith("chat=/")  # made absolute for every instance
    from kvmesh.settings import EngineSettings

    assert [n for n, _ in EngineSettings(lora_adapters=value).lora_adapter_paths()] == ["sql", "chat"]
    with pytest.raises(ValueError, match="NAME=PATH"):
        lora_env(["nopath"])
    assert lora_env([]) == {}
