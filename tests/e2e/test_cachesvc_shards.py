"""Three cachesvc shards (``kvmesh up --cachesvc 3``, two copies of each pooled block) on a real stack (the real
model, real nats-server): the pool and the index split by block key; a prompt written back through one instance is
fetched whole, from every shard, by another; one shard killed under load costs no request and changes no answer,
and a prompt written back while it is down is still fetched whole from the other copies; restarted, it rebuilds
its index from the events stream, not from the engines."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request

import grpc
import pytest
from kvmesh import tls
from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc

from .conftest import start_stack
from .test_faults import chat

pytestmark = pytest.mark.slow

SHARDS = 3
# long enough for several 16-token blocks on every shard; distinct so each is computed once
QUESTIONS = [f"Question {i}: " + " ".join(f"{w}{i}" for w in ("alpha", "bravo", "charlie", "delta", "echo",
                                                             "foxtrot", "golf", "hotel", "india", "juliet",
                                                             "kilo", "lima", "mike", "november", "oscar"))
             + " Which of these words is the longest?" for i in range(6)]
RR = {"x-kvmesh-policy": "round_robin"}  # alternate the two instances: the second has nothing of the first's


def stub(stack, name: str) -> tuple[grpc.Channel, cache_pb2_grpc.CacheServiceStub]:
    channel = tls.channel(stack.service(name).grpc_address, cfg=stack.mesh_settings())
    return channel, cache_pb2_grpc.CacheServiceStub(channel)


def stats(stack, name: str) -> cache_pb2.StatsResponse:
    channel, s = stub(stack, name)
    with channel:
        return s.Stats(cache_pb2.StatsRequest(), timeout=10)


def metric(url: str, prefix: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                   if line.startswith(prefix))


def pool_fetched(stack) -> float:
    return sum(metric(stack.service(f"both-{i}").endpoints["metrics"],
                      'kvmesh_worker_kv_transfer_bytes_total{direction="pool_fetch"}') for i in range(2))


def pool_written(stack) -> float:
    """Bytes the instances wrote back to the pool: counted once every shard's part of a write-back is done."""
    return sum(metric(stack.service(f"both-{i}").endpoints["metrics"],
                      'kvmesh_worker_kv_transfer_bytes_total{direction="pool_write"}') for i in range(2))


def eventually(what: str, check, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def answer(stack, question: str, headers: dict | None = None) -> dict:
    return chat(stack, question, max_tokens=6, headers=headers)


def test_three_shards_split_the_pool_serve_fetches_and_lose_nothing_when_one_dies(tmp_path_factory):
    stack = start_stack(tmp_path_factory, "shards", prefill=0, decode=0, both=2, cachesvc=SHARDS,
                        env={"KVMESH_CACHESVC_POOL_COPIES": "2"})
    try:
        names = [f"cachesvc-{i}" for i in range(SHARDS)]
        assert [s.name for s in stack.caches] == names
        assert all((stack.ready_dir / f"{n}.json").exists() for n in names)
        views = [stats(stack, n).view for n in names]
        assert [(v.shard, v.shards, v.index_copies, v.pool_copies) for v in views] == \
            [(i, SHARDS, 2, 2) for i in range(SHARDS)]

        # the references: each question once, written back to the pool (each block to its shard)
        refs = {q: answer(stack, q)["choices"][0]["message"]["content"] for q in QUESTIONS}
        eventually("every shard's pool got blocks", lambda: all(stats(stack, n).pool_blocks > 0 for n in names))
        eventually("every shard indexed blocks", lambda: all(stats(stack, n).indexed_blocks > 0 for n in names))
        pools = [stats(stack, n).pool_blocks for n in names]
        assert max(pools) < sum(pools) // 2 * 2  # two copies of each block split over three: none holds them all

        # the other instance has none of it: round robin sends it there, and it fetches from all shards
        fetched = pool_fetched(stack)
        again = answer(stack, QUESTIONS[0], RR), answer(stack, QUESTIONS[0], RR)
        assert all(a["choices"][0]["message"]["content"] == refs[QUESTIONS[0]] for a in again)
        assert max(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in again) >= 48
        assert pool_fetched(stack) > fetched

        # a client that lists one address is refused by a shard, saying what to set
        channel, s = stub(stack, "cachesvc-1")
        with channel, pytest.raises(grpc.RpcError) as e:
            s.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=[1, 2]), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "shard 1 of 3" in e.value.details() and "cachesvc_address" in e.value.details()

        # one shard killed while requests run: none lost, none different
        victim = "cachesvc-1"
        results: list[tuple[str, str]] = []
        errors: list[BaseException] = []

        def load(worker: int) -> None:
            for i in range(8):
                q = QUESTIONS[(worker + i) % len(QUESTIONS)]
                try:
                    results.append((q, answer(stack, q, RR)["choices"][0]["message"]["content"]))
                except BaseException as exc:  # noqa: BLE001 - every failure is reported below
                    errors.append(exc)

        threads = [threading.Thread(target=load, args=(w,)) for w in range(3)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        stack.service(victim).proc.send_signal(signal.SIGKILL)
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors
        assert len(results) == 24
        assert all(text == refs[q] for q, text in results)

        # still down: a new prompt is written back to the live copies, and the other instance fetches it whole
        fresh = QUESTIONS[0].replace("Question 0", "Question 99")
        written = pool_written(stack)
        first = answer(stack, fresh, RR)
        eventually("the fresh prompt is written back", lambda: pool_written(stack) > written)
        fetched = pool_fetched(stack)
        second = answer(stack, fresh, RR)
        assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
        assert pool_fetched(stack) > fetched

        # restarted on its address: it replays the events stream and asks no engine for a snapshot
        stack.restart(victim)
        back = stats(stack, victim)
        assert back.caught_up and back.indexed_blocks > 0
        assert back.snapshots_requested == 0
        assert answer(stack, QUESTIONS[1])["choices"][0]["message"]["content"] == refs[QUESTIONS[1]]
    finally:
        stack.stop()


def test_engines_and_the_router_find_the_shards_by_their_beats(tmp_path_factory):
    """``kvmesh up --cachesvc 2 --cachesvc-from-bus``: no engine or router is given a cachesvc address; each learns
    both shards from their beats on NATS, so the pool is written back and fetched across the two shards, and the
    router asks both for MatchPrefix."""
    stack = start_stack(tmp_path_factory, "shards-bus", prefill=0, decode=0, both=2, cachesvc=2,
                        cachesvc_from_bus=True)
    try:
        shards = [stack.service(f"cachesvc-{i}").grpc_address for i in range(2)]
        found = f"cachesvc shards from the bus: {shards[0]}, {shards[1]}"
        for name in ("router", "both-0", "both-1"):
            eventually(f"{name} found the shards", lambda n=name: found in stack.service(n).log_path.read_text())
        q = QUESTIONS[0]
        ref = answer(stack, q)["choices"][0]["message"]["content"]
        names = ["cachesvc-0", "cachesvc-1"]
        eventually("both shards' pools got blocks", lambda: all(stats(stack, n).pool_blocks > 0 for n in names))
        eventually("both shards indexed blocks", lambda: all(stats(stack, n).indexed_blocks > 0 for n in names))
        fetched = pool_fetched(stack)
        again = answer(stack, q, RR), answer(stack, q, RR)
        assert all(a["choices"][0]["message"]["content"] == ref for a in again)
        assert max(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in again) >= 48
        assert pool_fetched(stack) > fetched
    finally:
        stack.stop()
