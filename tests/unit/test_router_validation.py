"""The router's settings, API keys → tenants, cache salts, in-flight caps and HTTP sampling fields: each bad
value is refused with a message that says what to fix."""

from __future__ import annotations

import pytest
from kvmesh import settings
from kvmesh.settings import RouterSettings, parse_api_keys

from services.router.access import Admission, Tenants, cache_salt
from services.router.errors import ErrorKind, RequestError
from services.router.openai_body import sampling_from_body

# ---- RouterSettings ----------------------------------------------------------------------------------------

def test_defaults_are_valid():
    cfg = RouterSettings()
    assert cfg.problems() == [] and cfg.max_concurrent_requests == 256 and cfg.api_keys == {}


@pytest.mark.parametrize("field,value,words", [
    ("policy", "fastest", "cache_aware"),
    ("grpc_port", 70000, "[0, 65535]"),
    ("http_port", -1, "[0, 65535]"),
    ("request_timeout_s", -5.0, "request_timeout_s must be > 0"),
    ("match_timeout_s", float("nan"), "match_timeout_s must be > 0"),
    ("instance_timeout_s", 0.0, "instance_timeout_s"),
    ("prefill_tok_per_s", 0, "prefill_tok_per_s"),
    ("slo_ttft_s", -1, "slo_ttft_s must be >= 0"),
    ("block_size", 0, "block_size must be >= 1"),
    ("max_body_bytes", 0, "max_body_bytes must be >= 1"),
    ("max_concurrent_requests", 0, "max_concurrent_requests must be >= 1"),
    ("max_requests_per_tenant", -1, "max_requests_per_tenant must be >= 0"),
    ("cachesvc_address", "localhost", "host:port"),
    ("api_keys", {"k1": "a:b"}, "may not contain"),
    ("api_keys", {"k1": ""}, "non-empty"),
    ("api_keys", {"key with space": "a"}, "without spaces"),
])
def test_bad_setting_is_refused_naming_it(field, value, words):
    with pytest.raises(ValueError, match="invalid router settings") as e:
        RouterSettings(**{field: value})
    assert words in str(e.value)


def test_every_problem_is_listed_at_once():
    with pytest.raises(ValueError) as e:
        RouterSettings(policy="x", http_port=-1, match_timeout_s=0)
    assert all(w in str(e.value) for w in ("policy", "http_port", "match_timeout_s"))


def test_api_keys_come_from_the_environment_as_key_tenant_pairs():
    env = {"KVMESH_ROUTER_API_KEYS": "sk-a:alice, sk-b:bob", "KVMESH_ROUTER_MAX_BODY_BYTES": "1024"}
    cfg = settings.load(["router"], env=env).router
    assert cfg.api_keys == {"sk-a": "alice", "sk-b": "bob"} and cfg.max_body_bytes == 1024


def test_api_keys_come_from_a_toml_table(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text('[router]\nmax_requests_per_tenant = 4\n[router.api_keys]\n"sk-a" = "alice"\n')
    cfg = settings.load(["router"], path=path, env={}).router
    assert cfg.api_keys == {"sk-a": "alice"} and cfg.max_requests_per_tenant == 4


@pytest.mark.parametrize("text,words", [
    ("sk-a", "must be key:tenant"),
    ("sk-a:", "must be key:tenant"),
    (":alice", "must be key:tenant"),
    ("sk-a:alice,sk-a:bob", "two tenants"),
])
def test_malformed_api_keys_are_refused(text, words):
    with pytest.raises(ValueError, match=words):
        parse_api_keys(text, "api_keys")


def test_api_keys_text_allows_lines_comments_and_repeats():
    text = "# team keys\nsk-a:alice\n\nsk-b:bob  # second\nsk-a:alice\n"
    assert parse_api_keys(text, "f") == {"sk-a": "alice", "sk-b": "bob"}


def test_a_malformed_entry_does_not_echo_the_whole_key():
    with pytest.raises(ValueError) as e:
        parse_api_keys("sk-very-secret-key-1234", "api_keys")
    assert "sk-very-secret-key-1234" not in str(e.value)


# ---- Tenants -----------------------------------------------------------------------------------------------

def test_without_keys_everyone_is_the_anonymous_tenant():
    tenants = Tenants.from_config(RouterSettings())
    assert not tenants.required and tenants.authenticate({}) == ""


def test_keys_map_to_tenants_from_settings_file_and_the_tenantless_key(tmp_path):
    path = tmp_path / "keys"
    path.write_text("sk-c:carol\n")
    cfg = RouterSettings(api_keys={"sk-a": "alice"}, api_keys_file=str(path), api_key="sk-old")
    tenants = Tenants.from_config(cfg)
    assert tenants.authenticate({"authorization": "Bearer sk-a"}) == "alice"
    assert tenants.authenticate({"x-api-key": "sk-c"}) == "carol"
    assert tenants.authenticate({"authorization": "bearer sk-old"}) == ""
    assert tenants.authenticate({"authorization": "sk-a"}) == "alice"  # a bare key, as before


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer nope"}, {"authorization": "Basic sk-a"},
                                     {"x-api-key": "sk-"}, {"authorization": "Bearer sk-\u00e9"}])
def test_a_missing_or_wrong_key_is_unauthenticated(headers):
    tenants = Tenants.from_config(RouterSettings(api_keys={"sk-a": "alice"}))
    with pytest.raises(RequestError) as e:
        tenants.authenticate(headers)
    assert e.value.kind == ErrorKind.UNAUTHENTICATED and "Bearer <key>" in e.value.message


def test_an_unreadable_keys_file_stops_the_router_with_its_path(tmp_path):
    with pytest.raises(ValueError, match="api_keys_file: cannot read .*missing"):
        Tenants.from_config(RouterSettings(api_keys_file=str(tmp_path / "missing")))


def test_a_key_given_two_tenants_across_sources_is_refused(tmp_path):
    path = tmp_path / "keys"
    path.write_text("sk-a:mallory\n")
    with pytest.raises(ValueError, match="two tenants"):
        Tenants.from_config(RouterSettings(api_keys={"sk-a": "alice"}, api_keys_file=str(path)))
    with pytest.raises(ValueError, match="one tenant"):
        Tenants.from_config(RouterSettings(api_keys={"sk-a": "alice"}, api_key="sk-a"))


# ---- cache salts -------------------------------------------------------------------------------------------

def test_a_tenant_salt_is_its_own_namespace():
    assert cache_salt("alice", "") != cache_salt("bob", "") != cache_salt("", "")
    assert cache_salt("alice", "conv-1") != cache_salt("alice", "conv-2")
    assert cache_salt("", "conv-1") == "conv-1"  # without keys, a request's salt is what it always was


def test_no_request_can_name_another_tenants_salt():
    with pytest.raises(RequestError, match="NUL"):
        cache_salt("", "alice\x00")
    assert cache_salt("al", "ice") != cache_salt("alice", "")


# ---- Admission ---------------------------------------------------------------------------------------------

def test_admission_refuses_over_the_global_cap_and_frees_on_leave():
    gate = Admission(max_total=2)
    first, second = gate.enter("a"), gate.enter("b")
    with pytest.raises(RequestError) as e:
        gate.enter("c")
    assert e.value.kind == ErrorKind.OVERLOADED and "2 requests in flight" in e.value.message
    first()
    first()  # idempotent
    gate.enter("c")
    assert gate.total == 2
    second()
    assert gate.per_tenant == {"c": 1}


def test_admission_per_tenant_cap_leaves_room_for_others():
    gate = Admission(max_total=10, max_per_tenant=1)
    gate.enter("alice")
    with pytest.raises(RequestError, match="tenant alice is at its quota of 1"):
        gate.enter("alice")
    gate.enter("bob")
    assert gate.total == 2


# ---- HTTP sampling fields ----------------------------------------------------------------------------------

def test_sampling_defaults_and_vllm_extensions():
    p, _ = sampling_from_body({"top_k": -1, "seed": 7, "stop": "\n", "stop_token_ids": [2], "ignore_eos": True})
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed) == (64, 1.0, 0, 1.0, 7)
    assert p.stop == ("\n",) and p.stop_token_ids == (2,) and p.ignore_eos
    assert p.skip_special_tokens and not sampling_from_body({"skip_special_tokens": False})[0].skip_special_tokens


def test_null_fields_mean_their_defaults():
    p, _ = sampling_from_body({"max_tokens": None, "temperature": None, "n": None, "top_p": None, "seed": None})
    assert (p.max_tokens, p.temperature, p.top_p, p.seed) == (64, 1.0, 1.0, None)


def test_max_completion_tokens_wins_over_max_tokens():
    assert sampling_from_body({"max_completion_tokens": 3, "max_tokens": 9})[0].max_tokens == 3


@pytest.mark.parametrize("body,words", [
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"max_completion_tokens": 0}, "max_tokens must be >= 1"),
    ({"max_tokens": True}, "max_tokens must be an integer, not a boolean"),
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"temperature": [1]}, "temperature must be a number, not a list"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.01}, "top_p must be in (0, 1]"),
    ({"top_k": -7}, "top_k must be >= 0"),
    ({"seed": "7"}, "seed must be an integer"),
    ({"stop_token_ids": [True]}, "stop_token_ids must be a list of integers"),
    ({"stop": {"a": 1}}, "stop must be a string or a list of strings"),
    ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
    ({"skip_special_tokens": 0}, "skip_special_tokens must be true or false"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens is not supported"),
])
def test_bad_sampling_field_is_named(body, words):
    with pytest.raises(RequestError) as e:
        sampling_from_body(body)
    assert e.value.kind == ErrorKind.INVALID and words in e.value.message


@pytest.mark.parametrize("n,words", [(0, "n must be an integer in [1, 16]"), (17, "not 17"),
                                     ("2", "n must be an integer")])
def test_a_bad_n_is_named(n, words):
    from services.router.openai_body import shape

    with pytest.raises(RequestError) as e:
        shape({"n": n})
    assert words in e.value.message
    assert shape({}).n == 1 and shape({"n": 16}).n == 16


# ---- latency targets ---------------------------------------------------------------------------------------

def test_latency_targets_come_from_the_body_and_the_headers_win():
    from services.router.openai_body import draft

    body = {"prompt": "hi", "kvmesh_slo": {"ttft_s": 6, "itl_s": 0.15}}
    assert draft(body, False, {}).slo == (6.0, 0.15)
    assert draft(body, False, {"x-kvmesh-slo-itl-s": "0.3"}).slo == (6.0, 0.3)
    assert draft({"prompt": "hi"}, False, {}).slo == (0.0, 0.0)


@pytest.mark.parametrize("body,headers,words", [
    ({"kvmesh_slo": 6}, {}, "kvmesh_slo must be an object"),
    ({"kvmesh_slo": {"ttft": 6}}, {}, "kvmesh_slo must be an object"),
    ({"kvmesh_slo": {"ttft_s": "6"}}, {}, "kvmesh_slo.ttft_s must be a number, not a string"),
    ({}, {"x-kvmesh-slo-ttft-s": "soon"}, "x-kvmesh-slo-ttft-s must be a number of seconds"),
])
def test_a_malformed_latency_target_is_named(body, headers, words):
    from services.router.openai_body import draft

    with pytest.raises(RequestError) as e:
        draft({"prompt": "hi", **body}, False, headers)
    assert e.value.kind == ErrorKind.INVALID and words in e.value.message


@pytest.mark.parametrize("targets", [(-1.0, 0.0), (0.0, float("nan")), (5000.0, 0.0)])
def test_a_latency_target_out_of_range_is_refused_saying_where_targets_are_set(targets):
    from services.router.intake import Intake

    with pytest.raises(RequestError) as e:
        Intake.slo(targets)
    assert e.value.kind == ErrorKind.INVALID and "kvmesh_slo" in e.value.message and "x-kvmesh-slo" in e.value.message


def test_the_router_counts_a_request_as_goodput_only_when_it_met_every_target():
    from kvmesh.contracts.slo import SLO

    from services.router.telemetry import RequestTrace

    def outcome(ttft_s: float, gaps: list[float], slo: SLO) -> list[str]:
        rt = RequestTrace(None, "r", "test")
        rt.slo, rt.ttft_s = slo, ttft_s
        rt.gaps, rt.late_gaps = len(gaps), sum(g > slo.itl_s for g in gaps)
        return rt.slo_outcome()

    steady, one_stall = [0.05] * 99, [0.05] * 99 + [2.0]  # 100 gaps: the p99 tolerates one late gap
    assert outcome(1.0, one_stall, SLO(6.0, 0.15)) == ["met"]
    assert outcome(1.0, [*one_stall, 2.0], SLO(6.0, 0.15)) == ["missed", "missed_itl"]
    assert outcome(7.0, steady, SLO(6.0, 0.15)) == ["missed", "missed_ttft"]
    assert outcome(7.0, steady, SLO(itl_s=0.15)) == ["met"]


# ---- the body and the prompt -------------------------------------------------------------------------------

@pytest.mark.parametrize("raw", [b'{"prompt": "\\ud800 lone"}', b'{"prompt": "a \\uDFFF"}', b'{"\\udbff": "key"}'])
def test_a_lone_surrogate_escape_anywhere_in_the_body_is_refused(raw):
    from services.router.openai_body import parse

    with pytest.raises(RequestError, match="lone UTF-16 surrogate"):
        parse(raw)


def test_a_surrogate_pair_escape_and_plain_token_ids_are_accepted():
    from services.router.openai_body import parse

    assert parse(b'{"prompt": "\\ud83d\\ude00 \\u00e9"}') == {"prompt": "\U0001f600 é"}
    assert parse(b'{"prompt": [1, 2, 3]}') == {"prompt": [1, 2, 3]}


def test_the_fast_parse_reads_what_json_reads():
    """Bodies go through orjson, and what it refuses or reads otherwise (an integer past 64 bits is a float to
    it) through json: the same objects, the same types, the same refusals."""
    import json

    from services.router.openai_body import parse

    bodies = [b'{"prompt": [1, 2, 3], "max_tokens": 18446744073709551615}',
              b'{"prompt": "\\u00e9 \\ud83d\\ude00 \xc3\xa9", "temperature": 0.7, "top_p": 1e-7, "x": -0.0}',
              b'{"max_tokens": 123456789012345678901234567890, "a": {"b": [1.5, true, null, "s"]}}',
              b'{"dup": 1, "dup": 2}']
    for raw in bodies:
        got, want = parse(raw), json.loads(raw)
        assert got == want and [type(v) for v in got.values()] == [type(v) for v in want.values()]
    for raw, words in ((b'{"temperature": NaN}', "NaN is not a JSON number"), (b"[1]", "must be a JSON object"),
                       (b'{"a": 1,}', "the request body must be JSON")):
        with pytest.raises(RequestError, match=words):
            parse(raw)


def _intake(vocab: int):
    from types import SimpleNamespace

    from services.router.intake import Intake

    router = SimpleNamespace(cfg=RouterSettings(), tokenizer=None,
                             source=SimpleNamespace(config=SimpleNamespace(vocab_size=vocab)))
    return Intake(router)  # type: ignore[arg-type]


@pytest.mark.parametrize("ids", [(1, -1), (0, 100), (1, 2.0), (5, 2**31), (5, -2**40)])
def test_token_ids_that_are_not_integers_in_the_vocabulary_are_refused(ids):
    import asyncio

    from kvmesh.contracts.sampling import SamplingParams

    from services.router.intake import Draft

    with pytest.raises(RequestError, match=r"integers in \[0, 100\)"):
        asyncio.run(_intake(100).prompt_ids(Draft(SamplingParams(), token_ids=ids)))


def test_token_ids_in_the_vocabulary_are_the_prompt_and_come_packed_for_the_wire():
    import asyncio
    from array import array

    from kvmesh.contracts.keys import int32s
    from kvmesh.contracts.sampling import SamplingParams

    from services.router.intake import Draft, truncated

    draft = Draft(SamplingParams(), token_ids=(0, 5, 99))
    assert asyncio.run(_intake(100).prompt_ids(draft)) == [0, 5, 99]
    ids, packed = asyncio.run(_intake(100)._prompt(draft))
    assert ids == [0, 5, 99] and packed == array("i", [0, 5, 99]) and int32s(packed) is packed
    assert truncated(packed, 2, 100) == int32s(truncated(ids, 2, 100)) == array("i", [5, 99])
    assert truncated(packed, -1, 100) == array("i", [0])


def test_a_text_or_chat_prompt_comes_packed_for_the_wire_as_the_tokenizer_gave_it(tmp_path):
    import asyncio

    from kvmesh.contracts.keys import int32s
    from kvmesh.contracts.sampling import SamplingParams
    from kvmesh.model_source.tokenizer import Tokenizer, save_byte_tokenizer

    from services.router.intake import Draft

    intake = _intake(300)
    tok = intake.router.tokenizer = Tokenizer.from_dir(save_byte_tokenizer(tmp_path))
    intake.router.tokenize_pool = None  # the loop's default executor
    tok.reuse_prefixes(1 << 20)
    system = "a system prompt of words " * 200
    for text in ("short words", system + "first question", system + "second question"):
        ids, packed = asyncio.run(intake._prompt(Draft(SamplingParams(), text=text)))
        assert ids == tok.encode(text) and packed == int32s(ids)
    served = tok.prefix_tokens.served if tok.prefix_tokens is not None else 0
    assert served >= 1
    intake.router.tool_format = None
    for question in ("first question", "second question"):  # a chat: rendered, then tokenized and packed alike
        chat = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        ids, packed = asyncio.run(intake._prompt(Draft(SamplingParams(), messages=chat)))
        assert ids == tok.apply_chat_template(chat) and packed == int32s(ids)
    assert tok.prefix_tokens.served > served


@pytest.mark.parametrize(("prompt", "words"), [([1, True, 3], "token ids must be integers, not true or false"),
                                               ([False], "token ids must be integers, not true or false"),
                                               ([[1, True], "x"], "prompt[0] must be a string or a list of token ids")])
def test_true_and_false_are_not_token_ids(prompt, words):
    """JSON's true and false are refused where the body is read: the intake packs and range-checks integers."""
    from services.router import openai_body

    with pytest.raises(RequestError) as e:
        openai_body.draft({"prompt": prompt}, False, {})
    assert words in e.value.message


def test_a_completions_batch_is_one_draft_per_prompt_and_a_bad_prompt_is_named():
    from services.router import openai_body

    d = openai_body.draft({"prompt": ["one", [1, 2, 3], "three"], "max_tokens": 2}, False, {})
    batch = d.batch()
    assert [(b.text, b.token_ids) for b in batch] == [("one", None), (None, (1, 2, 3)), ("three", None)]
    assert all(b.sampling == d.sampling and not b.more for b in batch[1:])
    assert openai_body.draft({"prompt": ["only"]}, False, {}).batch() == [openai_body.draft({"prompt": "only"},
                                                                                           False, {})]
    with pytest.raises(RequestError, match=r"prompt\[1\] must be a string or a list of token ids"):
        openai_body.draft({"prompt": ["ok", []]}, False, {})
    with pytest.raises(RequestError, match="a request may batch at most 256"):
        openai_body.draft({"prompt": ["x"] * 257}, False, {})
    with pytest.raises(RequestError, match="send one prompt with session_id, not a batch"):
        openai_body.draft({"prompt": ["a", "b"], "session_id": "s1"}, False, {})


def test_responses_are_written_by_orjson_and_what_it_refuses_by_json():
    import json

    from services.router.openai_body import json_bytes

    answer = {"id": "cmpl-1", "choices": [{"index": 0, "text": "héllo \u2028 \"q\"", "logprobs": None,
                                           "prompt_token_ids": list(range(4096)), "top": {1: -0.5, "a": -9999.0}}],
              "usage": {"prompt_tokens": 4096, "completion_tokens": 1}}
    assert json.loads(json_bytes(answer)) == json.loads(json.dumps(answer))  # int keys become strings, as json's
    huge = {"seed": 2**70, "ids": (1, 2)}
    assert json_bytes(huge) == json.dumps(huge).encode()  # past 64 bits: json writes it
