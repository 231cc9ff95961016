"""The converter between vLLM's CPU paged KV and kvmesh's wire blocks (kvmesh/vllm/layout.py), without vLLM: pages
built by hand as vLLM's CPU kernel lays them out (per block and head: K transposed, then V)."""

from __future__ import annotations

import pytest
import torch
from kvmesh.contracts.layout import KVLayout
from kvmesh.vllm.layout import LayerCache, PagedLayout, Unconvertible

WIRE = KVLayout("m", num_layers=3, num_kv_heads=2, head_dim=4, block_size=4)
VBS = 8  # two wire blocks per vLLM block


def vllm_layers(num_blocks: int = 5) -> list[torch.Tensor]:
    return [torch.zeros(num_blocks, WIRE.num_kv_heads, VBS, 2 * WIRE.head_dim) for _ in range(WIRE.num_layers)]


def cpu(layers: list[torch.Tensor], isa: str = "vec") -> list[LayerCache]:
    return [LayerCache(t, "CPU_ATTN", isa=isa) for t in layers]


def test_a_token_of_a_head_lands_where_vllms_kernel_reads_it():
    """K of token t, head h, dim d of vLLM block b sits at page[b, h] position d * block_size + t; V at
    block_size * dim + t * dim + d."""
    layers = vllm_layers()
    paged = PagedLayout(cpu(layers), WIRE, VBS)
    wire = torch.zeros(2, *WIRE.block_shape)
    wire[1, 2, 0, 3, 1, 2] = 7.0  # wire block 1 = tokens 4..7 of vLLM block 0: token 7, layer 2, K, head 1, dim 2
    wire[1, 2, 1, 3, 1, 2] = 9.0  # its V
    paged.write([3], wire)
    page = layers[2].view(5, 2, 2 * VBS * 4)[3, 1]
    assert page[2 * VBS + 7] == 7.0 and page[VBS * 4 + 7 * 4 + 2] == 9.0
    assert int((layers[2] != 0).sum()) == 2


def test_read_inverts_write_on_scattered_blocks():
    layers = vllm_layers(6)
    paged = PagedLayout(cpu(layers), WIRE, VBS)
    wire = torch.randn(6, *WIRE.block_shape)
    paged.write([4, 1, 5], wire)
    assert paged.read([4, 1, 5]).equal(wire)
    assert paged.read([1]).equal(wire[2:4])


@pytest.mark.parametrize("bad,isa,why", [
    (lambda t: t, "amx", "has not measured"),                          # another kernel (bf16 on AMX)
    (lambda t: t.half(), "vec", "has not measured"),                   # the vec kernel, 16-bit
    (lambda t: t.view(t.shape[0], WIRE.num_kv_heads, -1), "vec", "not a layout kvmesh knows"),  # another shape
    (lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), "vec", "contiguous"),            # not contiguous
])
def test_a_kv_it_does_not_know_is_refused(bad, isa, why):
    layers = [bad(t) for t in vllm_layers()]
    with pytest.raises(Unconvertible, match=why):
        PagedLayout(cpu(layers, isa), WIRE, VBS)


def test_a_vllm_block_that_is_not_whole_kvmesh_blocks_is_refused():
    with pytest.raises(ValueError):
        PagedLayout(cpu([torch.zeros(5, 2, 6, 8) for _ in range(3)]), WIRE, 6)
