"""Dying processes cost one request at most, never the service (real processes, real nats-server)."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
from kvmesh import tls
from kvmesh.client import KvmeshClient, Unavailable
from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc

from .conftest import start_stack
from .test_tracing import spans_of

pytestmark = pytest.mark.slow


def service(stack, name: str):
    return next(s for s in stack.services if s.name == name)


def chat(stack, content: str, max_tokens: int = 8, timeout: float = 120, headers: dict | None = None) -> dict:
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{stack.http_port}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


HANG = "fault injection: the stream hangs after"
PROMPT = [(i * 7919) % 30000 + 100 for i in range(24)]  # any 24 token ids: greedy gives some 40 tokens


def hung_decode(stack, request_id: str, within_s: float = 120.0):
    """The decode instance whose stream of ``request_id`` hangs (``fault_hang_after_tokens``), once it logged so."""
    deadline = time.monotonic() + within_s
    while True:
        # decode knows the request by its dispatch id, <tenant hash>.<client id>.<nonce>
        hung = [s for s in stack.services if "decode" in s.name and re.search(
            rf"request [0-9a-f]+\.{re.escape(request_id)}\.[0-9a-f]+: {HANG}", s.log_path.read_text())]
        if hung:
            return hung[0]
        assert time.monotonic() < deadline, f"no decode instance hung on {request_id}"
        time.sleep(0.1)


def stream_until_killed(stack, request_id: str, max_tokens: int, after: int, retries: int = 3,
                        **options) -> tuple[list, str]:
    """Stream ``PROMPT`` through the SDK; once ``after`` tokens arrived (the decode serving it then hangs: the
    fault), SIGKILL that decode. Every chunk's tokens, and the name of the decode killed. ``retries`` 0: the SDK
    does not resume a cut stream itself, so what the router does shows. ``options``: more of the request's."""
    chunks, killed = [], ""
    with KvmeshClient(stack.router_grpc, timeout_s=240, retries=retries) as client:
        for chunk in client.generate(PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                     request_id=request_id, **options):
            chunks.append(chunk)
            if not killed and sum(len(c.token_ids) for c in chunks) == after:
                victim = hung_decode(stack, request_id)
                victim.proc.send_signal(signal.SIGKILL)
                killed = victim.name
    return chunks, killed


def greedy_reference(prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    """The uninterrupted greedy run of ``prompt`` on the default model, in this process."""
    from kvmesh.contracts.sampling import SamplingParams
    from kvmesh.engine.llm_engine import LLMEngine
    from kvmesh.settings import EngineSettings

    [done] = LLMEngine(EngineSettings(threads=1)).generate([prompt], SamplingParams(max_tokens=max_tokens,
                                                                                  ignore_eos=True))
    return done.token_ids, done.text


def test_a_decode_killed_at_token_10_of_40_costs_no_token(tmp_path_factory):
    """Both decodes' fresh streams hang after 10 tokens (test-only fault); the one serving the request is
    SIGKILLed there. The router migrates the request (prompt + the 10 tokens) to the other decode and the
    client's stream goes on: 40 tokens, the uninterrupted greedy run's, and the trace shows one migration."""
    stack = start_stack(tmp_path_factory, "migrate", decode=2, env={"KVMESH_INSTANCE_FAULT_HANG_AFTER_TOKENS": "10"})
    try:
        chunks, killed = stream_until_killed(stack, "migrate-me", 40, after=10)
        assert killed
        tokens = [t for c in chunks for t in c.token_ids]
        assert (tokens, "".join(c.text for c in chunks)) == greedy_reference(PROMPT, 40)
        assert chunks[-1].finished and chunks[-1].usage.completion_tokens == 40
        _, tree = spans_of(stack, "migrate-me")
        [migrate] = [s for s in tree if s.name == "router.migrate"]
        assert migrate.attributes["kvmesh.migration.from"] == killed
        assert migrate.attributes["kvmesh.migration.tokens"] == 10
        assert killed in migrate.attributes["kvmesh.reason"]
        assert router_metric(stack, 'kvmesh_router_migrations_total{outcome="migrated"}') == 1
    finally:
        stack.stop()


def test_a_scored_prompts_stream_migrates_without_scoring_it_again(tmp_path_factory):
    """A request with ``prompt_logprobs`` runs undisaggregated on a decode; its prompt's logprobs come with the
    first chunk. Killed at token 10, it moves to the other decode, which continues it (a continuation asks for
    no prompt logprobs: they went out already) and the client gets the uninterrupted run's 30 tokens."""
    stack = start_stack(tmp_path_factory, "migrate-scored", decode=2,
                        env={"KVMESH_INSTANCE_FAULT_HANG_AFTER_TOKENS": "10"})
    try:
        chunks, killed = stream_until_killed(stack, "score-me", 30, after=10, prompt_logprobs=1)
        assert killed
        assert [t for c in chunks for t in c.token_ids] == greedy_reference(PROMPT, 30)[0]
        scored = [c.prompt_logprobs for c in chunks if c.prompt_logprobs]
        assert len(scored) == 1 and [lp.token_id for lp in scored[0]] == PROMPT[1:]
        assert router_metric(stack, 'kvmesh_router_migrations_total{outcome="migrated"}') == 1
    finally:
        stack.stop()


def test_a_decode_frozen_mid_stream_is_left_after_the_inter_token_timeout(tmp_path_factory):
    """The decode serving the stream stops after 10 tokens and is SIGSTOPped there (frozen: a stalled engine).
    The router's heartbeat timeout is far off (120 s); its inter-token watchdog (2 s) moves the stream to the
    other decode, and the client gets all 40 tokens, the uninterrupted greedy run's. The wait for the first
    token is not watched: the stream's prefill does not trip it."""
    stack = start_stack(tmp_path_factory, "stall", decode=2,
                        env={"KVMESH_INSTANCE_FAULT_HANG_AFTER_TOKENS": "10", "KVMESH_ROUTER_INSTANCE_TIMEOUT_S": "120",
                             "KVMESH_ROUTER_INTER_TOKEN_TIMEOUT_S": "2"})
    frozen = None
    try:
        chunks, t_frozen, t_done = [], 0.0, 0.0
        with KvmeshClient(stack.router_grpc, timeout_s=240, retries=0) as client:
            for chunk in client.generate(PROMPT, max_tokens=40, temperature=0, ignore_eos=True,
                                         request_id="freeze-me"):
                chunks.append(chunk)
                if frozen is None and sum(len(c.token_ids) for c in chunks) == 10:
                    frozen = hung_decode(stack, "freeze-me")
                    frozen.proc.send_signal(signal.SIGSTOP)
                    t_frozen = time.monotonic()
            t_done = time.monotonic()
        tokens = [t for c in chunks for t in c.token_ids]
        assert (tokens, "".join(c.text for c in chunks)) == greedy_reference(PROMPT, 40)
        assert t_done - t_frozen < 60  # moved by the watchdog, long before the 120 s heartbeat timeout
        _, tree = spans_of(stack, "freeze-me")
        [migrate] = [s for s in tree if s.name == "router.migrate"]
        assert migrate.attributes["kvmesh.migration.from"] == frozen.name
        assert "inter_token_timeout_s" in migrate.attributes["kvmesh.reason"]
    finally:
        if frozen is not None:
            frozen.proc.send_signal(signal.SIGCONT)
        stack.stop()


def test_with_migration_off_a_killed_decode_fails_only_its_stream(tmp_path_factory):
    """``migration_limit = 0``: the stream whose decode dies ends with an error naming that instance; new
    requests are served by the other decode."""
    stack = start_stack(tmp_path_factory, "nomigrate", decode=2,
                        env={"KVMESH_INSTANCE_FAULT_HANG_AFTER_TOKENS": "6", "KVMESH_ROUTER_MIGRATION_LIMIT": "0"})
    try:
        with pytest.raises(Unavailable) as err:
            stream_until_killed(stack, "no-migration", 30, after=6, retries=0)
        killed = hung_decode(stack, "no-migration").name
        assert killed in str(err.value)
        assert router_metric(stack, 'kvmesh_router_migrations_total{outcome="over_request_limit"}') == 1
        for q in ("What is 2 + 2?", "Name a color."):  # fresh requests hang at 6 of 8 tokens: ask for 4
            assert chat(stack, q, max_tokens=4)["choices"][0]["message"]["content"]
    finally:
        stack.stop()


def test_killing_the_cache_service_degrades_routing_to_load(tmp_path_factory):
    stack = start_stack(tmp_path_factory, "killcache")
    try:
        first = chat(stack, "What is the capital of Italy?")
        service(stack, "cachesvc").proc.send_signal(signal.SIGKILL)
        again = chat(stack, "What is the capital of Italy?")
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # prefill's own cache still hits
    finally:
        stack.stop()


def test_a_dead_prefill_costs_latency_not_the_answer(tmp_path_factory):
    stack = start_stack(tmp_path_factory, "killprefill", env={"KVMESH_INSTANCE_KV_TIMEOUT_S": "2"})
    try:
        expected = chat(stack, "Say hello in French.")["choices"][0]["message"]["content"]
        service(stack, "prefill-0").proc.send_signal(signal.SIGKILL)
        # until missed heartbeats drop it, the router may still pick the dead prefill: decode recomputes
        got = chat(stack, "Say hello in French.")
        assert got["choices"][0]["message"]["content"] == expected
        eventually_decode_holds_no_block(stack)
    finally:
        stack.stop()


def router_metric(stack, name: str) -> float:
    with urllib.request.urlopen(stack.router_metrics, timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_unreachable_instances_cost_a_retry_not_the_request(tmp_path_factory):
    # a long instance timeout keeps the dead instances in the router's registry, so it really tries them
    # and a long kv_timeout_s makes any wait for KV that never comes show in the time
    stack = start_stack(tmp_path_factory, "retry", prefill=2, decode=2,
                        env={"KVMESH_ROUTER_INSTANCE_TIMEOUT_S": "60", "KVMESH_INSTANCE_KV_TIMEOUT_S": "30"})
    try:
        # killed before any request: both decodes look alike, so the router's tie-break (by id) picks decode-0
        for name in ("prefill-1", "decode-0"):
            service(stack, name).proc.send_signal(signal.SIGKILL)
        time.sleep(0.5)
        # round robin alternates prefills by attempt: each request's first attempt (prefill-0, on the dead decode-0,
        # whose call grants no push, so no Prefill is sent) fails over to decode-1 with prefill-1, the dead one
        rr = {"x-kvmesh-policy": "round_robin"}
        t0 = time.monotonic()
        answers = [chat(stack, "Say hello in French.", headers=rr)["choices"][0]["message"]["content"]
                   for _ in range(2)]
        assert answers[0] and answers == [answers[0]] * 2
        assert time.monotonic() - t0 < 25  # retried at once, never after a kv_timeout_s (30 s) wait
        assert router_metric(stack, 'kvmesh_router_retries_total{role="decode"}') >= 1
        assert router_metric(stack, 'kvmesh_router_retries_total{role="prefill"}') >= 1
        assert router_metric(stack, "kvmesh_router_kv_fallbacks_total") == 0  # KV came from the live prefill
    finally:
        stack.stop()


def cache_stats(stack):
    with tls.channel(service(stack, "cachesvc").grpc_address, cfg=stack.mesh_settings()) as ch:
        return cache_pb2_grpc.CacheServiceStub(ch).Stats(cache_pb2.StatsRequest(), timeout=10)


def test_a_nats_restart_costs_no_request(tmp_path_factory):
    stack = start_stack(tmp_path_factory, "natsrestart", env={"KVMESH_INSTANCE_KV_TIMEOUT_S": "3"})
    try:
        chat(stack, "Name three rivers.")
        before = cache_stats(stack).events_applied
        stack.nats.stop()
        t0 = time.monotonic()  # during the outage a request ends (served or refused), it never hangs
        try:
            assert chat(stack, "What is 3 + 3?", timeout=60)["choices"][0]["message"]["content"]
        except urllib.error.HTTPError as e:
            assert e.code == 503 and json.load(e)["error"]["message"]
        assert time.monotonic() - t0 < 30
        # same port, same JetStream store: the port NATS bound at first (free a moment ago) is bound again, so
        # NatsServer.start retries that bind for a few seconds rather than fail on a brief holder
        stack.nats.start()
        deadline = time.monotonic() + 30
        while True:  # the services reconnect and beat again; the router sees both instances
            try:
                answer = chat(stack, "Name three mountains.")
                break
            except urllib.error.HTTPError:
                assert time.monotonic() < deadline, "the stack did not recover from the NATS restart"
                time.sleep(0.5)
        assert answer["choices"][0]["message"]["content"]
        # cachesvc's JetStream consumer resumed: a new prompt's kv.events are applied. (Back on the bus, cachesvc
        # resyncs every instance from a snapshot, which may already hold the blocks of a prompt sent meanwhile;
        # a prompt sent after that snapshot is applied as events.)
        deadline, n = time.monotonic() + 30, 0
        while cache_stats(stack).events_applied <= before:
            assert time.monotonic() < deadline, "cachesvc applies no kv.events after the NATS restart"
            n += 1
            chat(stack, f"Count to {n + 3}.")
            time.sleep(0.5)
        again = chat(stack, "Name three mountains.")  # kv.ready flows again: no fallback, a prefix hit
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert router_metric(stack, "kvmesh_router_kv_fallbacks_total") <= 1  # at most the outage's request
    finally:
        stack.stop()


@pytest.mark.parametrize("fault,reason", [("KVMESH_INSTANCE_FAULT_CORRUPT_PUSHES", "checksum mismatch"),
                                          ("KVMESH_INSTANCE_FAULT_STALL_PUSHES", "its blocks did not")])
def test_bad_or_stalled_kv_is_recomputed_never_consumed(tmp_path_factory, fault, reason):
    stack = start_stack(tmp_path_factory, fault.split("_")[-2].lower(),
                        env={fault: "1", "KVMESH_INSTANCE_KV_TIMEOUT_S": "3"})
    try:
        q = "Write one sentence about the sea."
        t0 = time.monotonic()
        faulty = chat(stack, q, max_tokens=12)  # its push is corrupted / stalls: decode recomputes
        assert time.monotonic() - t0 < 30  # after the 3 s deadline at most, not the stall's 60 s
        clean = chat(stack, q, max_tokens=12)  # this push is fine: decode uses the pushed KV
        assert faulty["choices"][0]["message"]["content"] == clean["choices"][0]["message"]["content"]
        assert router_metric(stack, "kvmesh_router_kv_fallbacks_total") == 1
        assert reason in service(stack, "decode-0").log_path.read_text()
        eventually_decode_holds_no_block(stack)
    finally:
        stack.stop()


def test_a_push_under_a_forged_token_is_refused_counted_and_recomputed(tmp_path_factory):
    """Prefill pushes its first hand-off under a token decode never issued (what an impostor on the network
    would send): decode's transfer endpoint refuses it, counts it and logs the sender's address, prefill tells
    decode, and decode recomputes the prompt at once: the same answer as a clean push gives."""
    stack = start_stack(tmp_path_factory, "forge", env={"KVMESH_INSTANCE_FAULT_FORGE_TOKENS": "1",
                                                        "KVMESH_INSTANCE_KV_TIMEOUT_S": "30"})
    try:
        q = "Write one sentence about the sea."
        t0 = time.monotonic()
        forged = chat(stack, q, max_tokens=12)
        assert time.monotonic() - t0 < 25  # refused and recomputed at once, not after the 30 s kv wait
        clean = chat(stack, q, max_tokens=12)
        assert forged["choices"][0]["message"]["content"] == clean["choices"][0]["message"]["content"]
        assert router_metric(stack, "kvmesh_router_kv_fallbacks_total") == 1
        assert scraped(service(stack, "decode-0").endpoints["metrics"] + "/metrics", lambda line: line.startswith(
            'kvmesh_worker_kv_transfer_refused_total{reason="bad_token"}')) == 1
        log = service(stack, "decode-0").log_path.read_text()
        assert "from 127.0.0.1:" in log and "refused (bad_token)" in log
        eventually_decode_holds_no_block(stack)
    finally:
        stack.stop()


def test_every_request_has_a_deadline(tmp_path_factory):
    stack = start_stack(tmp_path_factory, "deadline", env={"KVMESH_ROUTER_REQUEST_TIMEOUT_S": "1.5"})
    try:
        body = json.dumps({"prompt": "Count slowly:", "max_tokens": 400, "ignore_eos": True,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{stack.http_port}/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
        t0 = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=60)
        assert err.value.code == 503 and "DEADLINE_EXCEEDED" in json.load(err.value)["error"]["message"]
        assert time.monotonic() - t0 < 10
        assert chat(stack, "Hi", max_tokens=2)["choices"][0]["message"]["content"]  # still serving
    finally:
        stack.stop()


def scraped(url: str, keep) -> float:
    """The sum of the Prometheus samples at ``url`` whose line ``keep`` accepts."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if keep(line))


def worker_blocks(stack, name: str, state: str) -> float:
    return scraped(service(stack, name).endpoints["metrics"] + "/metrics",
                   lambda line: line.startswith("kvmesh_worker_kv_blocks{") and f'state="{state}"' in line
                   and 'tier="device"' in line)


def eventually_decode_holds_no_block(stack) -> None:
    """Decode's pins, references and reservations (the blocks a push lands in) all released (as each call ends:
    a leak never gets to 0)."""
    eventually(lambda: worker_blocks(stack, "decode-0", "pinned") == 0)
    eventually(lambda: worker_blocks(stack, "decode-0", "referenced") == 0)
    eventually(lambda: worker_blocks(stack, "decode-0", "reserved") == 0)


def worker_metric(stack, name: str, metric: str) -> float:
    return scraped(service(stack, name).endpoints["metrics"] + "/metrics", lambda line: line.startswith(metric + " "))


def cachesvc_metric(stack, name: str) -> float:
    return scraped(service(stack, "cachesvc").endpoints["metrics"], lambda line: line.startswith(name + " "))


def eventually(condition, within_s: float = 20.0) -> None:
    """Wait for ``condition`` (something that happens after a response went out) rather than sleep a guess."""
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.1)


def completion(stack, prompt: list[int], max_tokens: int = 6, headers: dict | None = None, **extra) -> str:
    """Greedy text of a token-id completion; ``extra``: more body fields (``cache_salt``, ...)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       **extra}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{stack.http_port}/v1/completions", data=body,
                                 headers={"content-type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["choices"][0]["text"]


def two_turns(first: int, added: int) -> tuple[list[int], list[int]]:
    """Token ids of a conversation's turn 1 (``first`` tokens) and turn 2 (turn 1 + ``added``)."""
    turn1 = [(i * 7919) % 30000 + 100 for i in range(first)]
    return turn1, turn1 + [(i * 104729) % 30000 + 100 for i in range(added)]


@pytest.mark.parametrize("fault", ["KVMESH_INSTANCE_FAULT_CORRUPT_PUSHES", "KVMESH_INSTANCE_FAULT_STALL_PUSHES"])
def test_a_bad_delta_push_is_recomputed_and_leaks_no_pinned_block(tmp_path_factory, fault):
    """The second push is a delta (decode holds the first turn): corrupted or stalled, decode recomputes with
    the pinned prefix, the tokens equal a clean run's, and afterwards no block is pinned or referenced."""
    stack = start_stack(tmp_path_factory, "delta-" + fault.split("_")[-2].lower(),
                        env={fault: "2", "KVMESH_INSTANCE_KV_TIMEOUT_S": "3"})
    always = {"x-kvmesh-disaggregate": "always"}
    try:
        turn1, turn2 = two_turns(70, 40)
        completion(stack, turn1, headers=always)  # push 1 (faulty): recomputed; decode now holds turn 1
        # kv.events reach cachesvc, so MatchPrefix sees decode's blocks: both engines are in its index
        eventually(lambda: cachesvc_metric(stack, "kvmesh_cachesvc_instances") >= 2)
        t0 = time.monotonic()
        faulty = completion(stack, turn2, headers=always)  # push 2: a delta, and faulty: recomputed
        assert time.monotonic() - t0 < 30  # the 3 s deadline, not the stall's 60 s
        clean = completion(stack, turn2, headers=always)  # a clean delta push
        assert faulty == clean
        assert router_metric(stack, "kvmesh_router_kv_fallbacks_total") == 2
        eventually_decode_holds_no_block(stack)
        eventually(lambda: worker_blocks(stack, "prefill-0", "referenced") == 0)
    finally:
        stack.stop()


def completion_thread(stack, prompt: list[int], headers: dict, result: list) -> threading.Thread:
    def run() -> None:
        try:
            result.append(completion(stack, prompt, headers=headers))
        except Exception as e:  # noqa: BLE001 - recorded for the assertion
            result.append(e)
    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_prefill_killed_half_way_through_its_push_costs_a_recompute_and_leaks_nothing(tmp_path_factory):
    """Prefill pushes a long prompt chunk by chunk, each chunk in two layer groups; after the third part (the
    second chunk's first layer group) it stops, and is SIGKILLed there. Decode recomputes on top of the prefix it
    pinned, the tokens equal a fresh computation, and afterwards decode holds no pinned or referenced block and
    no received part."""
    stack = start_stack(tmp_path_factory, "killmidpush",
                        env={"KVMESH_INSTANCE_FAULT_HANG_AFTER_PARTS": "3", "KVMESH_INSTANCE_KV_TIMEOUT_S": "3",
                             "KVMESH_INSTANCE_PUSH_LAYER_GROUPS": "2",
                             "KVMESH_ENGINE_MAX_BATCHED_TOKENS": "64"})  # 64-token chunks: two parts each
    always = {"x-kvmesh-disaggregate": "always"}
    try:
        # turn 1: one chunk, two parts, all pushed; turn 2: two parts during each of 5 chunks
        turn1, turn2 = two_turns(40, 260)
        completion(stack, turn1, headers=always)
        eventually(lambda: cachesvc_metric(stack, "kvmesh_cachesvc_instances") >= 2)
        # its own namespace (cache_salt): computed from scratch
        reference = completion(stack, turn2, headers={"x-kvmesh-disaggregate": "never"}, cache_salt="reference")
        eventually(lambda: worker_blocks(stack, "decode-0", "referenced") == 0)
        assert worker_blocks(stack, "decode-0", "pinned") == 0
        result: list = []
        t = completion_thread(stack, turn2, always, result)
        prefill = service(stack, "prefill-0")
        eventually(lambda: "the push hangs after 3 parts" in prefill.log_path.read_text(), within_s=120)
        assert worker_blocks(stack, "decode-0", "pinned") > 0  # decode holds turn 1 for this request
        assert worker_blocks(stack, "decode-0", "reserved") > 0  # and the blocks the rest is landing in
        prefill.proc.send_signal(signal.SIGKILL)
        t.join(120)
        assert result == [reference]
        assert router_metric(stack, "kvmesh_router_kv_fallbacks_total") == 1
        eventually_decode_holds_no_block(stack)
        eventually(lambda: worker_metric(stack, "decode-0", "kvmesh_worker_kv_transfer_buffered_bytes") == 0)
    finally:
        stack.stop()

