"""An engine instance's client of the cache service's block pool: write back finished blocks, fetch hits.

Every block travels with the instance's layout descriptor and an xxh3_64 checksum; fetched blocks are verified
against the checksums the pool stored before the engine sees them.

With a ``receiver`` (the instance's :class:`TransferServer`) the bytes move through the transfer engine, beside
the RPCs, and every push carries a capability its receiver issued: a write-back asks cachesvc for one
(``GrantPut``: its endpoint, a transfer id and a token), pushes the blocks there with it, then ``PutBlocks``
names the transfer; a fetch grants cachesvc a push of the blocks it asks for on our endpoint and names the
endpoint, transfer id and token in ``GetBlocks``, then takes what cachesvc pushed there. Without one they
travel inline in the gRPC messages (tools, the benchmark's baseline). Every failure is a :class:`PoolError`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple, TypeVar

import grpc
from google.protobuf.message import Message

from kvmesh import tls
from kvmesh.contracts.engine import SessionHint
from kvmesh.contracts.ids import BlockKey
from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.shards import ShardMap
from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc
from kvmesh.transfer import ClientTLS, TransferClient, TransferRejected, TransferServer
from kvmesh.transfer.header import block_checksums, parse_versions

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 64 * 2**20
# a block this instance wrote back this recently is taken as still in the pool (concurrent requests sharing a
# prefix write it once); after that only the router's word counts (``write_back``'s ``held``): the pool evicts
WRITTEN_TRUST_S = 10.0
Metadata = tuple[tuple[str, str], ...]
R = TypeVar("R")


class PoolError(Exception):
    """A pool call or its transfer failed: fetch callers compute instead, write-back callers skip."""


class Fetched(NamedTuple):
    """Blocks the pool answered with: ``num_blocks`` whole blocks, their bytes in wire order."""

    data: memoryview
    num_blocks: int


class _Shard(NamedTuple):
    stub: cache_pb2_grpc.CacheServiceStub
    view: cache_pb2.ShardView | None  # None: a lone, unsharded cachesvc


class PoolClient:
    def __init__(self, address: str, layout: KVLayout, receiver: TransferServer | None = None,
                 remember: int = 200_000, timeout_s: float = 30.0, transfer_tls: ClientTLS | None = None,
                 receive_at: str = "") -> None:
        """``address``: cachesvc's host:port, or every shard's in shard order, comma-separated (each block goes
        to, and comes from, the shard ``kvmesh.contracts.shards`` maps its key to); "" = none yet (``use`` gives
        the list: the shards found through the bus). ``receive_at``: the address cachesvc sends fetched blocks to
        (the receiver's as others dial it; "" = the address it bound)."""
        self.layout = layout
        self.receive_at = receive_at
        self.proto_layout = layout.to_proto()
        self.block_nbytes = layout.block_nbytes
        self.receiver = receiver
        self.timeout_s = timeout_s
        self.transfer = TransferClient(reply_timeout=timeout_s, tls=transfer_tls) if receiver is not None else None
        self._retired: list[grpc.aio.Channel] = []  # a former shard list's channels, closed a while later
        self.channels: list[grpc.aio.Channel] = []
        self.use([a.strip() for a in address.split(",") if a.strip()])
        self._written: OrderedDict[int, float] = OrderedDict()  # keys this instance stored -> when
        self._remember = remember

    def use(self, addresses: Sequence[str]) -> None:
        """Write back to and fetch from these shards, in shard order, from now on (a call under way finishes with
        the list it started with; that list's channels close once such calls are over)."""
        old = self.channels
        opts = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        self.channels = [tls.aio_channel(a, opts) for a in addresses]
        n = len(addresses)
        self.shards = [_Shard(cache_pb2_grpc.CacheServiceStub(ch),
                              cache_pb2.ShardView(shard=i, shards=n) if n > 1 else None)
                       for i, ch in enumerate(self.channels)]
        self.shard_map = ShardMap(max(n, 1))  # how many copies the pool keeps: the shards say (``_map``)
        self._learned = n <= 1
        self._down: set[int] = set()  # shards whose last call failed
        if old:
            self._retired += old
            asyncio.get_running_loop().call_later(2 * self.timeout_s, lambda: asyncio.ensure_future(self._close(old)))

    async def _close(self, channels: list[grpc.aio.Channel]) -> None:
        for channel in channels:
            if channel in self._retired:
                self._retired.remove(channel)
                await channel.close()

    async def write_back(self, keys: list[BlockKey], data: memoryview, metadata: Metadata = (),
                         session: SessionHint | None = None, context: list[BlockKey] | None = None,
                         held: int = 0) -> int:
        """Store the blocks the pool does not have from us yet (``data``: the bytes of ``keys``' blocks, whole,
        in wire order); returns how many were sent. Not sent: the first ``held`` blocks of ``context`` (default
        ``keys``), which the pool held when the request was routed (the router's MatchPrefix), and blocks this
        instance wrote in the last ``WRITTEN_TRUST_S``; a block written earlier is sent again, since the pool may
        have evicted it since (it skips what it still holds). ``metadata``: gRPC call metadata (the trace context).
        ``session``: the request's, which holds ``context`` (its blocks in order; default ``keys``) in the
        pool's tiers now: every call says so (a write-back of more blocks than one call carries is several
        puts, and each put makes room first: blocks an earlier call stored under no session would rank as
        nobody's and could be the next call's victims), the last one ending the session when ``session.end``;
        one call without blocks says so when none is left to send."""
        now = time.monotonic()
        context = context if context is not None else keys
        known = set(context[:held])
        todo = [i for i, k in enumerate(keys)
                if k not in known and now - self._written.get(k, float("-inf")) >= WRITTEN_TRUST_S]
        shards = self.shards
        if not shards:  # none found yet
            return 0
        if len(shards) == 1:
            await self._write_shard(shards[0], keys, todo, data, metadata, session, context)
            sent = todo
        else:  # each shard its own blocks and its own part of the session's context, all at once
            smap = await self._map(metadata, shards)
            by_shard = smap.split_pool([keys[i] for i in todo])
            context_by_shard = smap.split_pool(context)
            parts = {s: [todo[j] for j in by_shard.get(s, [])] for s in range(len(shards))
                     if s in by_shard or (session and s in context_by_shard)}
            results = await asyncio.gather(*(
                self._write_shard(shards[s], keys, idx, data, metadata, session,
                                  [context[p] for p in context_by_shard.get(s, [])]) for s, idx in parts.items()),
                return_exceptions=True)
            failed = {s: r for s, r in zip(parts, results) if isinstance(r, BaseException)}
            if failed and len(failed) == len(parts):
                first = next(iter(failed.values()))
                raise first if isinstance(first, PoolError) else PoolError(str(first))
            for s, idx in parts.items():  # the other shards took theirs: a failed shard's blocks stay unpooled
                self._heard(s, failed.get(s), f"write-back of {len(idx)} blocks to")
            sent = sorted({i for s, idx in parts.items() if s not in failed for i in idx})
        for i in sent:
            self._written[keys[i]] = now
            self._written.move_to_end(keys[i])
        while self._written and (len(self._written) > self._remember
                                 or now - next(iter(self._written.values())) >= WRITTEN_TRUST_S):
            self._written.popitem(last=False)
        return len(sent)

    async def _write_shard(self, shard: _Shard, keys: list[BlockKey], todo: list[int], data: memoryview,
                           metadata: Metadata, session: SessionHint | None, context: list[BlockKey]) -> None:
        """Put blocks ``todo`` of ``keys`` (and the session's word on ``context``) to one shard, in calls of at
        most half a message each."""
        per_call = max(1, MAX_MESSAGE_BYTES // 2 // self.block_nbytes)
        nb = self.block_nbytes
        starts = list(range(0, len(todo), per_call)) or ([0] if session is not None else [])
        for start in starts:
            idx = todo[start:start + per_call]
            request = cache_pb2.PutBlocksRequest(layout=self.proto_layout, block_keys=[keys[i] for i in idx],
                                                 view=shard.view)
            if session is not None:
                request.session_key, request.session_end = session.key, session.end and start == starts[-1]
                request.session_blocks.extend(context)
            if idx:  # else only the session's word
                chunk = _gather(data, idx, nb)
                sums = block_checksums(chunk, self.block_nbytes)
                request.checksums.extend(sums)
                if self.transfer is None:
                    request.data = bytes(chunk)
                else:
                    request.transfer_id = await self._push(shard, chunk, list(request.block_keys), sums, metadata)
            await self._call(shard.stub.PutBlocks, request, metadata)

    async def fetch(self, keys: list[BlockKey], metadata: Metadata = ()) -> Fetched | None:
        """The leading run of ``keys`` the pool holds in our layout, verified. Sharded: each block is asked of
        its first copy's shard, all shards at once; what they lacked (or did not answer for) of the next copy's;
        the run ends at the first block no copy gave."""
        shards = self.shards
        if not shards:  # none found yet
            return None
        if len(shards) == 1:
            one = await self._fetch_shard(shards[0], keys, metadata)
            return Fetched(*one) if one is not None else None
        smap = await self._map(metadata, shards)
        nb = self.block_nbytes
        got: dict[int, memoryview] = {}  # position -> its block's bytes
        n = 0  # the leading run got so far
        for copy in range(smap.pool_copies):  # each block from its first copy's shard; what is missing, the next
            need = [p for p in range(n, len(keys)) if p not in got]
            by_shard = smap.split_pool([keys[p] for p in need], copy)
            order = list(by_shard)
            results = await asyncio.gather(*(self._fetch_shard(shards[s], [keys[need[q]] for q in by_shard[s]],
                                                               metadata) for s in order), return_exceptions=True)
            for s, result in zip(order, results):
                self._heard(s, result if isinstance(result, BaseException) else None, "pool fetch from")
                if isinstance(result, BaseException) or result is None:
                    continue
                data = result[0].cast("B") if result[0].format != "B" else result[0]
                for j, q in enumerate(by_shard[s][:result[1]]):  # a shard answers the leading run of its keys
                    got[need[q]] = data[j * nb:(j + 1) * nb]
            while n in got:
                n += 1
            if n == len(keys):
                break
        if n == 0:
            return None
        out = memoryview(bytearray(n * nb))
        for p in range(n):
            out[p * nb:(p + 1) * nb] = got[p]
        return Fetched(out, n)

    def _heard(self, shard: int, error: BaseException | None, what: str) -> None:
        """Log a shard's failure once per outage (while it is down every call fails the same way), and its return."""
        if error is not None and shard not in self._down:
            self._down.add(shard)
            log.warning("%s cachesvc shard %d failed (its blocks are recomputed or stay unpooled until it is back): "
                        "%s", what, shard, error)
        elif error is None and shard in self._down:
            self._down.discard(shard)
            log.info("cachesvc shard %d answers again", shard)

    async def _map(self, metadata: Metadata, shards: list[_Shard]) -> ShardMap:
        """The pool's shard map over ``shards``, with the copies the shards keep (their Stats, asked once per
        shard list)."""
        if self._learned and self.shard_map.shards == len(shards):
            return self.shard_map
        smap = ShardMap(len(shards))
        for shard in shards:
            try:
                stats = await self._call(shard.stub.Stats, cache_pb2.StatsRequest(), metadata)
            except PoolError:
                continue
            smap = ShardMap(len(shards), stats.view.index_copies or 2, stats.view.pool_copies or 1)
            if shards is self.shards:
                self.shard_map, self._learned = smap, True
            break
        return smap

    async def _fetch_shard(self, shard: _Shard, keys: list[BlockKey],
                           metadata: Metadata) -> tuple[memoryview, int] | None:
        request = cache_pb2.GetBlocksRequest(layout=self.proto_layout, block_keys=keys, view=shard.view)
        receiver = self.receiver
        if receiver is not None:  # cachesvc may push the blocks asked for, under this id, for this call
            request.transfer_address = self.receive_at or receiver.address
            request.transfer_id = f"pool-get-{uuid.uuid4().hex}"
            request.transfer_token = receiver.grant(request.transfer_id, 0, len(keys), self.timeout_s).token
            request.transfer_versions = str(receiver.versions)
        try:
            resp = await self._call(shard.stub.GetBlocks, request, metadata)
            n = len(resp.block_keys)
            if n == 0:
                return None
            if list(resp.block_keys) != keys[:n]:
                raise PoolError("the pool answered with blocks that were not asked for")
            if receiver is None:
                data = self._inline(resp, n)
                sums = block_checksums(data, self.block_nbytes)
            else:  # the receiver verified the bytes against the checksums pushed with them
                data, sums = await self._received(receiver, request.transfer_id, n)
        except BaseException:
            if receiver is not None:
                receiver.discard(request.transfer_id)  # a push still under way is refused and freed
            raise
        finally:
            if receiver is not None:
                receiver.revoke(request.transfer_id)
        bad = [i for i, (got, stored) in enumerate(zip(sums, resp.checksums)) if got != stored]
        if bad:
            raise PoolError(f"pool blocks {bad} fail their checksums; not used")
        return data, n

    async def close(self) -> None:
        if self.transfer is not None:
            await self.transfer.close()
        for channel in self.channels + self._retired:
            await channel.close()
        self._retired = []

    async def _call(self, method: Callable[..., Awaitable[R]], request: Message, metadata: Metadata) -> R:
        """``method`` (a stub's RPC) on ``request``; its gRPC errors as PoolError."""
        try:
            return await method(request, metadata=metadata, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise PoolError(f"{type(request).__name__[:-7]}: {e.code().name}: {e.details()}") from None

    async def _push(self, shard: _Shard, blocks: memoryview, keys: list[BlockKey], checksums: Sequence[int],
                    metadata: Metadata) -> str:
        """Push ``blocks`` to cachesvc's transfer endpoint under the capability it granted; returns the transfer
        id PutBlocks names."""
        assert self.transfer is not None
        grant = await self._call(shard.stub.GrantPut, cache_pb2.GrantPutRequest(num_blocks=len(keys), view=shard.view),
                                 metadata)
        try:
            versions = parse_versions(grant.transfer_versions)
        except ValueError as e:
            raise PoolError(f"cachesvc's GrantPut reply: {e}") from None
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.transfer.push(grant.transfer_address, grant.transfer_id, self.layout, blocks, keys,
                                         len(keys) * self.layout.block_size, checksums, token=grant.token,
                                         versions=versions)
        except TransferRejected as e:
            raise PoolError(f"cachesvc refused the pushed blocks: {e.reason}") from None
        except OSError as e:  # ConnectionError and TimeoutError included
            raise PoolError(f"pushing {len(keys)} blocks to cachesvc at {grant.transfer_address} failed: "
                            f"{e or type(e).__name__}") from None
        return grant.transfer_id

    async def _received(self, receiver: TransferServer, transfer_id: str,
                        n: int) -> tuple[memoryview, tuple[int, ...]]:
        """What cachesvc pushed under ``transfer_id`` and the checksums its bytes were verified against (it
        answered after we verified it: no real wait)."""
        try:
            got = await receiver.take(transfer_id, self.timeout_s)
        except TimeoutError:
            raise PoolError(f"the pool's push {transfer_id} did not arrive within {self.timeout_s:g}s") from None
        except TransferRejected as e:
            raise PoolError(f"the pool's push was refused: {e.reason}") from None
        if got.layout != self.layout or got.num_blocks != n:
            raise PoolError(f"the pool pushed {got.num_blocks} blocks in another layout or number than the "
                            f"{n} it answered with")
        return memoryview(got.data), got.checksums

    def _inline(self, resp: cache_pb2.GetBlocksResponse, n: int) -> memoryview:
        if len(resp.data) != n * self.block_nbytes:
            raise PoolError(f"the pool answered {len(resp.data)} bytes for {n} blocks of {self.block_nbytes}")
        return memoryview(bytearray(resp.data))


def _gather(data: memoryview, idx: list[int], block_nbytes: int) -> memoryview:
    """Blocks ``idx`` (ascending) of ``data`` as one buffer: a view when they follow each other, else a copy."""
    flat = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    lo, hi = idx[0], idx[-1] + 1
    if hi - lo == len(idx):
        return flat[lo * block_nbytes:hi * block_nbytes]
    return memoryview(b"".join(flat[i * block_nbytes:(i + 1) * block_nbytes] for i in idx))
