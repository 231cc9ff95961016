"""An engine instance's client of the cache service's block pool: write back finished blocks, fetch hits.

Every block travels with the instance's layout descriptor and an xxh3_64 checksum; fetched blocks are verified
before the engine sees them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import grpc
import torch

from kvmesh.convert import layout_to_proto
from kvmesh.engine.kv_cache import KVLayout, storage_dtype
from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc
from kvmesh.transfer.header import block_checksums

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 64 * 2**20
Metadata = tuple[tuple[str, str], ...]


def _as_bytes(blocks: torch.Tensor) -> memoryview:
    flat = blocks.contiguous().view(-1)
    return memoryview(flat.view(torch.uint8).numpy())


class PoolClient:
    def __init__(self, address: str, layout: KVLayout, remember: int = 200_000) -> None:
        self.layout = layout
        self.proto_layout = layout_to_proto(layout)
        self.block_nbytes = layout.block_nbytes
        opts = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        self.channel = grpc.aio.insecure_channel(address, options=opts)
        self.stub = cache_pb2_grpc.CacheServiceStub(self.channel)
        self._written: OrderedDict[int, None] = OrderedDict()  # keys this instance already stored
        self._remember = remember

    async def write_back(self, keys: list[int], blocks: torch.Tensor, metadata: Metadata = ()) -> int:
        """Store the blocks the pool does not have from us yet; returns how many were sent. ``metadata``: gRPC
        call metadata (the trace context)."""
        todo = [i for i, k in enumerate(keys) if k not in self._written]
        per_call = max(1, MAX_MESSAGE_BYTES // 2 // self.block_nbytes)
        for start in range(0, len(todo), per_call):
            idx = todo[start:start + per_call]
            data = _as_bytes(blocks[idx])
            sums = block_checksums(data, self.block_nbytes)
            await self.stub.PutBlocks(cache_pb2.PutBlocksRequest(
                layout=self.proto_layout, block_keys=[keys[i] for i in idx], checksums=sums, data=bytes(data)),
                metadata=metadata)
            for i in idx:
                self._written[keys[i]] = None
        while len(self._written) > self._remember:
            self._written.popitem(last=False)
        return len(todo)

    async def fetch(self, keys: list[int], metadata: Metadata = ()) -> torch.Tensor | None:
        """The leading run of ``keys`` the pool holds in our layout, verified, as ``[n, *block_shape]``."""
        resp = await self.stub.GetBlocks(cache_pb2.GetBlocksRequest(layout=self.proto_layout, block_keys=keys),
                                         metadata=metadata)
        n = len(resp.block_keys)
        if n == 0:
            return None
        if list(resp.block_keys) != keys[:n] or len(resp.data) != n * self.block_nbytes:
            raise ValueError("the pool answered with blocks that were not asked for")
        sums = block_checksums(memoryview(resp.data), self.block_nbytes)
        bad = [i for i, (got, sent) in enumerate(zip(sums, resp.checksums)) if got != sent]
        if bad:
            raise ValueError(f"pool blocks {bad} fail their checksums; not used")
        raw = torch.frombuffer(bytearray(resp.data), dtype=torch.uint8)
        return raw.view(storage_dtype(self.layout.dtype)).view(n, *self.layout.block_shape)

    async def close(self) -> None:
        await self.channel.close()
