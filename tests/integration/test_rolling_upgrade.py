"""A fleet half on this build (N) and half on the next (N+1: ``tests.wire_next``'s double, a transfer header
version more with a field more), over real sockets on 127.0.0.1: each receiver advertises the header versions it
reads with the push's capability, each sender writes the highest both speak, so KV moves both ways, intact, on
every path the transfer wire carries: a bare push, a PD hand-off through a real router, prefill and decode, and
the pool's fetch and write-back through a real cachesvc. Ends with no version in common refuse, naming both
ranges."""

from __future__ import annotations

import pytest
from kvmesh.engine.kv_cache import block_bytes
from kvmesh.transfer import Refusal, TransferClient, TransferRejected, TransferServer
from kvmesh.transfer.header import CODEC, SPOKEN, HeaderCodec, Versions

from tests.wire_next import NEXT, NextCodec, Recording

from .test_pd_capability import mesh, prefill_servicer, prompt  # noqa: F401
from .test_pd_layer_groups import generate, received_bytes
from .test_pool_transfer import KEYS, Mesh
from .test_pool_transfer import make_blocks as pool_blocks
from .test_router_bad_input import model_dir  # noqa: F401
from .test_transfer import LAYOUT, make_blocks, push, run, same_bits, tensor

N = SPOKEN.high
BUILDS = {"N": Recording, "N+1": NextCodec}
MIXED = [("N", "N+1"), ("N+1", "N")]  # (sender, receiver)


def versions_read(codec: Recording) -> set[int]:
    return {v for v, _ in codec.read}


def versions_expected(sender: str, receiver: str) -> set[int]:
    return {NEXT if sender == receiver == "N+1" else N}


# -- a bare push ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("sender", "receiver"), [*MIXED, ("N+1", "N+1")])
def test_a_push_between_builds_arrives_intact_in_the_highest_version_both_speak(sender, receiver) -> None:
    blocks, ours, theirs = make_blocks(LAYOUT), BUILDS[sender](), BUILDS[receiver]()

    async def body():
        async with await TransferServer.start(LAYOUT, codec=theirs) as server, TransferClient(codec=ours) as client:
            await push(client, server, "up-1", LAYOUT, block_bytes(blocks), [1, 2, 3], 3 * LAYOUT.block_size,
                       versions=server.versions)
            return await server.take("up-1", timeout=5)

    assert same_bits(tensor(run(body())), blocks)
    assert versions_read(theirs) == versions_expected(sender, receiver)
    assert all(("sent_ns" in doc) == (v == NEXT) for v, doc in theirs.read)  # an N reader never sees it


class Only(HeaderCodec):
    """A build that speaks one version the receiver under test does not: no version in common."""

    speaks = Versions(NEXT + 1, NEXT + 1)


def test_a_sender_with_no_version_in_common_refuses_before_it_connects() -> None:
    async def body() -> TransferRejected:
        async with await TransferServer.start(LAYOUT) as server, TransferClient(codec=Only()) as client:
            with pytest.raises(TransferRejected) as e:
                await push(client, server, "up-2", LAYOUT, block_bytes(make_blocks(LAYOUT)), [], 1,
                           versions=server.versions)
            assert sum(server.refused.values()) == 0  # nothing reached it
            return e.value

    refused = run(body())
    assert refused.kind == Refusal.VERSION
    assert f"this sender speaks {Only.speaks}, the receiver {SPOKEN}; upgrade the receiver" in refused.reason


def test_a_header_the_receiver_does_not_read_is_refused_naming_both_ranges() -> None:
    """What a sender that was told a wrong range (or ignored it) meets at the receiver."""
    async def body() -> tuple[TransferRejected, int]:
        async with await TransferServer.start(LAYOUT) as server, TransferClient(codec=Only()) as client:
            with pytest.raises(TransferRejected) as e:
                await push(client, server, "up-3", LAYOUT, block_bytes(make_blocks(LAYOUT)), [], 1,
                           versions=Only.speaks)
            return e.value, server.refused[Refusal.VERSION]

    refused, counted = run(body())
    assert refused.kind == Refusal.VERSION and counted == 1
    assert f"the sender speaks {Only.speaks}); this receiver speaks {SPOKEN}" in refused.reason


# -- a PD hand-off through a real router, prefill and decode ------------------------------------------------

@pytest.mark.parametrize(("sender", "receiver", "seed"), [("N", "N+1", 1), ("N+1", "N", 2), ("N+1", "N+1", 3)])
def test_a_hand_off_between_builds_is_used_and_gives_the_tokens_of_a_fresh_computation(
        mesh, sender, receiver, seed) -> None:  # noqa: F811
    decode = mesh.workers[1]
    client, server = prefill_servicer(mesh).handoff.transfer, decode.transfer_server
    assert server is not None
    ours, theirs = BUILDS[sender](), BUILDS[receiver]()
    client.codec, server.codec = ours, theirs
    try:
        fallbacks, received = decode.metrics_fallbacks, received_bytes(decode, "receive")
        handed_off = generate(mesh, prompt(seed), "always")
    finally:
        client.codec = server.codec = CODEC  # this build's again, for the next test
    assert decode.metrics_fallbacks == fallbacks  # the KV pushed was verified and used, not recomputed
    assert received_bytes(decode, "receive") > received
    assert versions_read(theirs) == versions_expected(sender, receiver)
    assert handed_off == generate(mesh, prompt(seed), "never", cache_salt=f"fresh-{seed}")


# -- the pool: fetch and write-back through a real cachesvc -------------------------------------------------

@pytest.mark.parametrize(("instance", "pool"), [*MIXED, ("N+1", "N+1")])
def test_the_pool_fetches_and_takes_write_backs_between_builds_intact(nats_server, instance, pool) -> None:
    ours, theirs = BUILDS[instance](), BUILDS[pool]()

    async def body() -> None:
        async with Mesh(nats_server.url) as fleet:
            fleet.server.transfer.codec = fleet.server.transfer_client.codec = theirs
            writer, reader = await fleet.instance(codec=ours), await fleet.instance(codec=ours)
            blocks = pool_blocks(len(KEYS))
            assert await writer.write_back(KEYS, block_bytes(blocks)) == len(KEYS)  # instance -> cachesvc
            fetched = await reader.fetch(KEYS)                                       # cachesvc -> instance
            assert fetched is not None and fetched.num_blocks == len(KEYS)
            assert bytes(fetched.data) == bytes(block_bytes(blocks))

    run(body())
    assert versions_read(theirs) == versions_read(ours) == versions_expected(instance, pool)


# -- the prompt on the wire: packed where the instance reads it --------------------------------------------

def wire_forms(monkeypatch) -> list[tuple[str, str]]:
    """Record how each work request reaches the engine services from now on: (service, "packed" / "repeated")."""
    import services.decode.servicer as decode_servicer
    import services.prefill.servicer as prefill_servicer_module

    seen: list[tuple[str, str]] = []
    for name, module in (("decode", decode_servicer), ("prefill", prefill_servicer_module)):
        convert = module.engine_request_from_proto

        def recording(work, *args, _name=name, _convert=convert):
            seen.append((_name, "packed" if work.prompt_packed and not work.prompt_token_ids else
                         "repeated" if work.prompt_token_ids and not work.prompt_packed else "both"))
            return _convert(work, *args)

        monkeypatch.setattr(module, "engine_request_from_proto", recording)
    return seen


def builds_before_packing(mesh, monkeypatch, which: tuple[int, ...]) -> None:  # noqa: F811
    """Workers ``which`` beat as a build from before ``prompt_packed`` (their features without it); wait until
    the router has heard them."""
    import dataclasses
    import time

    from kvmesh.contracts.messages import PACKED_PROMPT

    for i in which:
        worker = mesh.workers[i]
        beat = worker._beat
        monkeypatch.setattr(worker, "_beat", lambda b=beat: dataclasses.replace(
            b(), features=tuple(f for f in b().features if f != PACKED_PROMPT)))
        mesh.call(worker._publish_beat())
    deadline = time.monotonic() + 30
    while any((PACKED_PROMPT in mesh.router.registry.get(mesh.workers[i].instance_id).beat.features) ==
              (i in which) for i in range(len(mesh.workers))):
        assert time.monotonic() < deadline, "the router never heard the workers' heartbeats"
        time.sleep(0.05)


@pytest.mark.parametrize(("older", "seed"), [((), 5), ((0,), 6), ((1,), 7), ((0, 1), 8)])
def test_the_router_packs_the_prompt_only_for_instances_that_read_it(mesh, monkeypatch, older, seed) -> None:  # noqa: F811
    """A fleet mid-upgrade: an instance whose heartbeat lists ``packed_prompt`` gets the prompt as packed uint32
    bytes, one of the build before as repeated ids; the same tokens come back either way, handed off or not."""
    expected = generate(mesh, prompt(seed), "never", cache_salt=f"fresh-{seed}")
    try:
        builds_before_packing(mesh, monkeypatch, older)
        seen = wire_forms(monkeypatch)
        assert generate(mesh, prompt(seed), "always", cache_salt=f"pd-{seed}") == expected
        assert generate(mesh, prompt(seed), "never", cache_salt=f"local-{seed}") == expected
    finally:
        monkeypatch.undo()
        builds_before_packing(mesh, monkeypatch, ())  # this build's beats again, for the next test
    form = {0: "repeated" if 0 in older else "packed", 1: "repeated" if 1 in older else "packed"}
    assert sorted(seen) == [("decode", form[1]), ("decode", form[1]), ("prefill", form[0])], seen


# -- a range that is no range -------------------------------------------------------------------------------

def test_a_prefill_told_a_malformed_range_refuses_the_request_naming_the_field(mesh) -> None:  # noqa: F811
    import grpc
    from kvmesh.proto.v1 import worker_pb2, worker_pb2_grpc

    prefill, decode = mesh.workers
    request = worker_pb2.PrefillRequest(
        work=worker_pb2.WorkRequest(request_id="bad-range", prompt_token_ids=prompt(4)),
        decode_instance=decode.instance_id, decode_transfer_address=decode.transfer_address, push_token="t",
        push_versions="3-2")
    with grpc.insecure_channel(prefill.grpc_address) as ch, pytest.raises(grpc.RpcError) as e:
        worker_pb2_grpc.PrefillStub(ch).Prefill(request, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "push_versions: transfer header versions '3-2' are not '<low>-<high>'" in e.value.details()


def test_a_packed_prompt_cut_mid_id_is_refused_naming_the_field_and_the_instance_serves_on(mesh) -> None:  # noqa: F811
    import grpc
    from kvmesh.proto.v1 import worker_pb2, worker_pb2_grpc

    decode = mesh.workers[1]
    request = worker_pb2.DecodeRequest(work=worker_pb2.WorkRequest(request_id="bad-packing", prompt_packed=b"\x01" * 7),
                                       prefill_locally=True)
    with grpc.insecure_channel(decode.grpc_address) as ch, pytest.raises(grpc.RpcError) as e:
        list(worker_pb2_grpc.DecodeStub(ch).Decode(request, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_packed is 7 bytes: not a whole number of 4-byte token ids" in e.value.details()
    assert generate(mesh, prompt(9), "never") == generate(mesh, prompt(9), "never", cache_salt="again")


def test_a_reader_cachesvc_cannot_write_to_is_told_so_before_anything_is_leased(nats_server) -> None:
    """An instance that reads only a version cachesvc does not write: GetBlocks answers FAILED_PRECONDITION
    naming both ranges and which end to upgrade, and holds no lease."""
    import grpc
    from kvmesh.proto.v1 import cache_pb2

    async def body() -> None:
        async with Mesh(nats_server.url) as fleet:
            writer = await fleet.instance()
            await writer.write_back(KEYS, block_bytes(pool_blocks(len(KEYS))))
            request = cache_pb2.GetBlocksRequest(layout=LAYOUT.to_proto(), block_keys=KEYS, lease_s=30,
                                                 transfer_address="tcp://127.0.0.1:1", transfer_id="t",
                                                 transfer_token="x", transfer_versions=str(Only.speaks))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await fleet.stub.GetBlocks(request)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert (f"cachesvc cannot push to tcp://127.0.0.1:1: no transfer header version in common: this sender "
                    f"speaks {SPOKEN}, the receiver {Only.speaks}; upgrade this sender") in e.value.details()
            stats = await fleet.stats()
            assert (stats.leases, stats.leased_blocks) == (0, 0)

    run(body())
