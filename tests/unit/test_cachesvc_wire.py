"""GetBlocks replies are serialized by hand (data written straight from the blocks): standard readers parse
them."""

import pytest
from kvmesh.proto.v1 import cache_pb2

from services.cachesvc.server import encode_get_reply


@pytest.mark.parametrize("sizes", [[], [1], [127, 1], [300, 70000], [1 << 21]])
def test_a_hand_encoded_reply_parses_as_the_message(sizes):
    data = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    head = cache_pb2.GetBlocksResponse(block_keys=list(range(len(sizes))), checksums=[2**64 - 1] * len(sizes),
                                       tiers=["disk"] * len(sizes), lease_id=7, leased_blocks=len(sizes))
    parsed = cache_pb2.GetBlocksResponse.FromString(encode_get_reply(head, [memoryview(d) for d in data]))
    expected = cache_pb2.GetBlocksResponse()
    expected.CopyFrom(head)
    expected.data = b"".join(data)
    assert parsed == expected
