"""vLLM's paged KV, in every layout and dtype kvmesh converts, read out as kvmesh's wire layout and written back
(kvmesh/vllm/layout.py), without vLLM.

Each backend's cache is built on CPU with that backend's shape and memory order and filled token by token the way
its cache write stores K and V: the placements below are written from vLLM's documented layouts, independently of
layout.py's strides. The wire layout per kvmesh block of ``BS`` tokens is ``[layer, K|V, token, head, dim]``; wire
block ``j`` of the ``i``-th vLLM block read holds that vLLM block's tokens ``j * BS`` to ``(j + 1) * BS - 1``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from kvmesh.contracts.layout import KVLayout
from kvmesh.vllm.layout import TORCH_DTYPES, LayerCache, PagedLayout, Unconvertible, describe

Tensor = torch.Tensor
BS = 16                   # kvmesh's block size
LAYERS, BLOCKS = 4, 6
WRITTEN = (0, 2, 3, 5)    # the vLLM blocks tokens are written to; 1 and 4 stay empty
READ = [3, 0, 5, 1]       # out of order, with an empty block, leaving written block 2 behind


@dataclass(frozen=True)
class Geom:
    heads: int
    dim: int
    vllm_block: int       # tokens per vLLM block: `per` kvmesh blocks

    @property
    def per(self) -> int:
        return self.vllm_block // BS


GEOMS = [Geom(3, 8, 32), Geom(2, 16, BS)]
G = GEOMS[0]


def wire(g: Geom, dtype: str) -> KVLayout:
    return KVLayout("m", LAYERS, g.heads, g.dim, BS, dtype)


Slot = tuple[Tensor, Tensor]  # K and V of one (layer, block, token, head): [dim] views of the buffer


@dataclass(frozen=True)
class Backend:
    """How one attention backend keeps a model's paged KV: the one buffer allocated for all layers (its shape in
    memory order), each layer's tensor as vLLM registers it, and where its cache write stores a token's K and V."""

    packing: str
    backend: str
    kv_layout: str
    shape: Callable[[Geom], tuple[int, ...]]
    layer: Callable[[Tensor, int], Tensor]
    slot: Callable[[Tensor, Geom, int, int, int, int], Slot]  # (buffer, geom, layer, block, token, head)
    isa: str = ""


def cpu_vec_slot(r: Tensor, g: Geom, l: int, b: int, n: int, h: int) -> Slot:
    """CPU attention's vec kernel: page (block, head) holds K transposed, element d * N + n is K[n][d], then V,
    element N * D + n * D + d is V[n][d]."""
    page, kd = r[l, b, h].view(-1), g.vllm_block * g.dim
    return page[n:kd:g.vllm_block], page[kd + n * g.dim:kd + (n + 1) * g.dim]


BACKENDS: dict[str, Backend] = {
    # vLLM 0.32: the logical page [B, H, N, K dim | V dim] of each layer, in the memory order of its KVCacheLayout
    "content-LBHNC": Backend("content", "FLASH_ATTN", "LBHNC",
                             lambda g: (LAYERS, BLOCKS, g.heads, g.vllm_block, 2 * g.dim), lambda r, l: r[l],
                             lambda r, g, l, b, n, h: (r[l, b, h, n, :g.dim], r[l, b, h, n, g.dim:])),
    "content-LBNHC": Backend("content", "FLASHINFER", "LBNHC",
                             lambda g: (LAYERS, BLOCKS, g.vllm_block, g.heads, 2 * g.dim),
                             lambda r, l: r[l].permute(0, 2, 1, 3),
                             lambda r, g, l, b, n, h: (r[l, b, n, h, :g.dim], r[l, b, n, h, g.dim:])),
    "cross-layer-BLHNC": Backend("content", "FLASH_ATTN", "BLHNC",
                                 lambda g: (BLOCKS, LAYERS, g.heads, g.vllm_block, 2 * g.dim), lambda r, l: r[:, l],
                                 lambda r, g, l, b, n, h: (r[b, l, h, n, :g.dim], r[b, l, h, n, g.dim:])),
    "cross-layer-BLNHC": Backend("content", "FLASH_ATTN", "BLNHC",
                                 lambda g: (BLOCKS, LAYERS, g.vllm_block, g.heads, 2 * g.dim),
                                 lambda r, l: r[:, l].permute(0, 2, 1, 3),
                                 lambda r, g, l, b, n, h: (r[b, l, n, h, :g.dim], r[b, l, n, h, g.dim:])),
    "content-LHBNC": Backend("content", "FLASH_ATTN", "LHBNC",
                             lambda g: (LAYERS, g.heads, BLOCKS, g.vllm_block, 2 * g.dim),
                             lambda r, l: r[l].permute(1, 0, 2, 3),
                             lambda r, g, l, b, n, h: (r[l, h, b, n, :g.dim], r[l, h, b, n, g.dim:])),
    # older vLLM releases, by shape
    "kv-first": Backend("kv-first", "FLASH_ATTN", "", lambda g: (LAYERS, 2, BLOCKS, g.vllm_block, g.heads, g.dim),
                        lambda r, l: r[l], lambda r, g, l, b, n, h: (r[l, 0, b, n, h], r[l, 1, b, n, h])),
    "kv-inner": Backend("kv-inner", "FLASHINFER", "", lambda g: (LAYERS, BLOCKS, 2, g.vllm_block, g.heads, g.dim),
                        lambda r, l: r[l], lambda r, g, l, b, n, h: (r[l, b, 0, n, h], r[l, b, 1, n, h])),
    "kv-inner-hnd": Backend("kv-inner-hnd", "FLASHINFER", "HND",
                            lambda g: (LAYERS, BLOCKS, 2, g.heads, g.vllm_block, g.dim),
                            lambda r, l: r[l], lambda r, g, l, b, n, h: (r[l, b, 0, h, n], r[l, b, 1, h, n])),
    "head-slots": Backend("head-slots", "B12X", "", lambda g: (LAYERS, BLOCKS, 2, g.vllm_block, g.heads * g.dim),
                          lambda r, l: r[l], lambda r, g, l, b, n, h: (r[l, b, 0, n, h * g.dim:(h + 1) * g.dim],
                                                                       r[l, b, 1, n, h * g.dim:(h + 1) * g.dim])),
    "cpu-vec": Backend("cpu-vec", "CPU_ATTN", "", lambda g: (LAYERS, BLOCKS, g.heads, g.vllm_block, 2 * g.dim),
                       lambda r, l: r[l], cpu_vec_slot, isa="vec"),
}
BACKENDS["content-LBNHC-triton"] = dataclasses.replace(BACKENDS["content-LBNHC"], backend="TRITON_ATTN")
BACKENDS["kv-inner-hnd-undeclared"] = dataclasses.replace(BACKENDS["kv-inner-hnd"], kv_layout="")


@dataclass(frozen=True)
class Dtype:
    """A cache dtype (the tensor vLLM allocates, what its elements mean, the kv_cache_dtype) and the wire dtype."""

    storage: torch.dtype
    values: torch.dtype
    cache_dtype: str
    wire: str
    converter: str = "exact"
    scales: tuple[float, float] = (1.0, 1.0)

    def encode(self, x: Tensor) -> Tensor:
        return x.to(self.values).view(self.storage)

    def on_wire(self, stored: Tensor) -> Tensor:
        """Stored K/V (``[..., 2, heads, dim]``) as the wire holds them: dequantised by the scales and cast."""
        scale = torch.tensor(self.scales).view(2, 1, 1)
        x = (stored.view(self.values).float() * scale).to(TORCH_DTYPES[self.wire])
        return x.view(torch.uint8) if x.itemsize == 1 else x


SAME = {name: Dtype(dt, dt, "auto", name) for name, dt in
        [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)]}
DTYPES: dict[str, Dtype] = {
    **SAME,
    "fp8": Dtype(torch.uint8, torch.float8_e4m3fn, "fp8", "fp8"),
    "fp8_e4m3": Dtype(torch.uint8, torch.float8_e4m3fn, "fp8_e4m3", "fp8"),
    "bf16->fp32": dataclasses.replace(SAME["bf16"], wire="fp32", converter="cast bf16->fp32"),
    "fp8_e5m2->fp16": Dtype(torch.uint8, torch.float8_e5m2, "fp8_e5m2", "fp16", "cast fp8_e5m2->fp16"),
    "fp8x0.5,x2->fp32": Dtype(torch.uint8, torch.float8_e4m3fn, "fp8", "fp32", "cast fp8->fp32 (scaled)", (0.5, 2.0)),
}

Token = tuple[int, int, int]  # layer, vLLM block, offset in the block


def bits(x: Tensor) -> Tensor:
    return x.contiguous().view(torch.uint8)


def same_bits(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def allocate(be: Backend, g: Geom, dt: Dtype) -> Tensor:
    return torch.zeros(be.shape(g), dtype=dt.storage)


def kv_to_write(g: Geom, dt: Dtype, seed: int = 0) -> tuple[Tensor, list[Token]]:
    """Random K/V ``[layer, block, token, K|V, head, dim]`` (stored dtype) and the tokens to write: about
    half of the tokens of each written block, in every layer."""
    gen = torch.Generator().manual_seed(seed)
    kv = dt.encode(torch.randn(LAYERS, BLOCKS, g.vllm_block, 2, g.heads, g.dim, generator=gen))
    hit = torch.rand(LAYERS, BLOCKS, g.vllm_block, generator=gen) < 0.5
    return kv, [(l, b, n) for l, b, n in hit.nonzero().tolist() if b in WRITTEN]


def cache_write(be: Backend, g: Geom, buf: Tensor, kv: Tensor, tokens: list[Token]) -> None:
    """The backend's cache write, token by token: each head's K and V into the slots it keeps them in."""
    for l, b, n in tokens:
        for h in range(g.heads):
            k, v = be.slot(buf, g, l, b, n, h)
            k.copy_(kv[l, b, n, 0, h])
            v.copy_(kv[l, b, n, 1, h])


def expected_wire(g: Geom, dt: Dtype, kv: Tensor, tokens: list[Token], ids: list[int]) -> Tensor:
    """What the wire holds for vLLM blocks ``ids``: each written token's K and V at [layer, K|V, token, head]
    of its wire block, zeros elsewhere."""
    kv = dt.on_wire(kv)
    out = torch.zeros(len(ids) * g.per, *wire(g, "fp32").block_shape, dtype=kv.dtype)
    for l, b, n in tokens:
        if b in ids:
            out[ids.index(b) * g.per + n // BS, l, :, n % BS] = kv[l, b, n]
    return out


def paged(be: Backend, g: Geom, buf: Tensor, dt: Dtype) -> PagedLayout:
    k_scale, v_scale = dt.scales
    layers = [LayerCache(be.layer(buf, l), be.backend, dt.cache_dtype, be.kv_layout, be.isa, k_scale, v_scale)
              for l in range(LAYERS)]
    return PagedLayout(layers, wire(g, dt.wire), g.vllm_block)


def filled(be: Backend, g: Geom, dt: Dtype) -> tuple[Tensor, Tensor, list[Token]]:
    buf = allocate(be, g, dt)
    kv, tokens = kv_to_write(g, dt)
    cache_write(be, g, buf, kv, tokens)
    return buf, kv, tokens


# every layout with every dtype, but CPU attention's vec kernel with fp32 alone (its other pages are refused, below)
CASES = [(be, dt, g) for be in BACKENDS for dt in DTYPES for g in GEOMS
         if BACKENDS[be].backend != "CPU_ATTN" or DTYPES[dt].values == torch.float32]
every_layout_dtype_and_geometry = pytest.mark.parametrize(
    ("backend", "dtype", "g"), CASES, ids=[f"{be}-{dt}-H{g.heads}D{g.dim}bv{g.vllm_block}" for be, dt, g in CASES])


@every_layout_dtype_and_geometry
def test_reads_out_the_kv_each_token_was_written_with(backend: str, dtype: str, g: Geom) -> None:
    be, dt = BACKENDS[backend], DTYPES[dtype]
    buf, kv, tokens = filled(be, g, dt)
    out = paged(be, g, buf, dt).read(READ)
    assert out.dtype == TORCH_DTYPES[dt.wire]
    assert same_bits(out, expected_wire(g, dt, kv, tokens, READ))


@every_layout_dtype_and_geometry
def test_writes_the_read_out_back_bit_exact(backend: str, dtype: str, g: Geom) -> None:
    """Written into a fresh cache, the read-out rebuilds the blocks read, byte for byte, and touches nothing
    else: the whole buffer equals one the cache write filled with the read blocks' tokens alone."""
    be, dt = BACKENDS[backend], DTYPES[dtype]
    buf, kv, tokens = filled(be, g, dt)
    fresh = allocate(be, g, dt)
    paged(be, g, fresh, dt).write(READ, paged(be, g, buf, dt).read(READ))
    want = allocate(be, g, dt)
    cache_write(be, g, want, kv, [t for t in tokens if t[1] in READ])
    assert same_bits(fresh, want)


@every_layout_dtype_and_geometry
def test_writes_each_wire_token_where_the_backend_keeps_it(backend: str, dtype: str, g: Geom) -> None:
    """The write on its own: wire blocks built from the K/V alone land where the cache write puts them."""
    be, dt = BACKENDS[backend], DTYPES[dtype]
    kv, tokens = kv_to_write(g, dt)
    fresh = allocate(be, g, dt)
    paged(be, g, fresh, dt).write(READ, expected_wire(g, dt, kv, tokens, READ).view(TORCH_DTYPES[dt.wire]))
    want = allocate(be, g, dt)
    cache_write(be, g, want, kv, [t for t in tokens if t[1] in READ])
    assert same_bits(fresh, want)


@every_layout_dtype_and_geometry
def test_reads_a_range_of_layers_as_that_slice_of_every_block(backend: str, dtype: str, g: Geom) -> None:
    be, dt = BACKENDS[backend], DTYPES[dtype]
    p = paged(be, g, filled(be, g, dt)[0], dt)
    assert same_bits(p.read(READ, layers=(1, 3)), p.read(READ)[:, 1:3])


@every_layout_dtype_and_geometry
def test_names_its_packing_and_converter(backend: str, dtype: str, g: Geom) -> None:
    be, dt = BACKENDS[backend], DTYPES[dtype]
    said = paged(be, g, allocate(be, g, dt), dt).describe()
    assert (said["packing"], said["converter"], said["wire"]) == (be.packing, dt.converter, dt.wire)


def content(dtype: torch.dtype = torch.float32, shape: tuple[int, ...] = (BLOCKS, G.heads, G.vllm_block, 2 * G.dim),
            **kw: Any) -> LayerCache:
    return dataclasses.replace(LayerCache(torch.zeros(shape, dtype=dtype), "FLASH_ATTN"), **kw)


def nhd_content(**kw: Any) -> LayerCache:
    """LBNHC in memory ([B, N, H, C]) as vLLM's [B, H, N, C] view."""
    t = torch.zeros(BLOCKS, G.vllm_block, G.heads, 2 * G.dim).permute(0, 2, 1, 3)
    return dataclasses.replace(LayerCache(t, "FLASHINFER"), **kw)


REFUSED = [  # what vLLM registered, the geometry, a fragment of the refusal
    pytest.param(lambda: [content(shape=(BLOCKS, G.vllm_block, 576), mla=True)] * LAYERS, G,
                 "MLA's single latent cache", id="an MLA layer"),
    pytest.param(lambda: [content(shape=(BLOCKS, G.vllm_block, 576), backend="FLASHMLA")] * LAYERS, G,
                 "backend FLASHMLA keeps MLA", id="an MLA backend"),
    pytest.param(lambda: [content(backend="CPU_ATTN", isa="amx")] * LAYERS, G,
                 "'amx' kernel", id="CPU attention's amx kernel"),
    pytest.param(lambda: [content(torch.bfloat16, backend="CPU_ATTN", isa="vec")] * LAYERS, G,
                 "'vec' kernel with torch.bfloat16", id="CPU attention's vec kernel on bf16"),
    pytest.param(lambda: [content(torch.uint8, backend="CPU_ATTN", isa="vec", cache_dtype="fp8")] * LAYERS, G,
                 "'vec' kernel with torch.float8_e4m3fn", id="CPU attention's vec kernel on fp8"),
    pytest.param(lambda: [content(torch.uint8, cache_dtype="fp8_per_token_head")] * LAYERS, G,
                 "'fp8_per_token_head' .per-token-head, 4-bit", id="per-token-head fp8"),
    pytest.param(lambda: [content(torch.uint8, cache_dtype="nvfp4")] * LAYERS, G, "'nvfp4'", id="nvfp4"),
    pytest.param(lambda: [content(cache_dtype="fp8")] * LAYERS, G, "not bytes", id="an fp8 cache of fp32"),
    pytest.param(lambda: [content(shape=(BLOCKS, G.heads, G.vllm_block, 3 * G.dim))] * LAYERS, G,
                 "not a layout kvmesh knows", id="a shape that matches nothing"),
    pytest.param(lambda: [nhd_content(kv_layout="LBHNC")] * LAYERS, G, "the declared layout LBHNC",
                 id="strides that disagree with the declared layout"),
    pytest.param(lambda: [content()] * (LAYERS - 1) + [content(torch.bfloat16)], G, "differ in layout or dtype",
                 id="layers that differ in dtype"),
    pytest.param(lambda: [content()] * (LAYERS - 1), G, f"registered {LAYERS - 1} KV layers; the model has {LAYERS}",
                 id="another layer count"),
    pytest.param(lambda: [content(shape=(BLOCKS, 2, BS, BS, 8), backend="FLASHINFER")] * LAYERS, Geom(BS, 8, BS),
                 "does not tell NHD from HND", id="NHD or HND undeclared with as many heads as tokens"),
    pytest.param(lambda: [content(shape=(BLOCKS, G.heads, 24, 2 * G.dim))] * LAYERS, Geom(G.heads, G.dim, 24),
                 "block size 24 is not a multiple", id="a vLLM block that is not whole kvmesh blocks"),
]


@pytest.mark.parametrize(("layers", "g", "match"), REFUSED)
def test_a_kv_it_cannot_convert_is_refused_saying_why(layers: Callable[[], list[LayerCache]], g: Geom,
                                                      match: str) -> None:
    with pytest.raises(Unconvertible, match=match):
        PagedLayout(layers(), wire(g, "fp32"), g.vllm_block)


def test_a_refusal_is_a_value_error_from_the_layer_descriptor_itself() -> None:
    with pytest.raises(ValueError, match="MLA"):
        describe(content(shape=(BLOCKS, G.vllm_block, 576), mla=True), G.heads, G.dim, G.vllm_block)
