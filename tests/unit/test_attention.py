"""The native decode and prefill kernels against torch SDPA on the same paged pool (decode: every storage dtype it
reads; prefill: fresh prompts, chunks on a cached prefix, mixed with decode rows, any block size); which backend
runs where, and what a backend that cannot run here says."""

import pytest
import torch
from kvmesh.contracts.layout import KVLayout
from kvmesh.engine import native
from kvmesh.engine.attention import ForwardBatch, NativeAttention, SeqSlice, TorchAttention, make_backend
from kvmesh.engine.kv_cache import DeviceKVPool

from .helpers import needs_kernel

H, HKV, D, BS = 6, 2, 16, 4
needs_decode_kernel = needs_kernel(native.load(), native.SOURCE)
needs_prefill_kernel = needs_kernel(native.load_prefill(), native.PREFILL_SOURCE)


def pool_with_random_kv(dtype: str, head_dim: int = D) -> DeviceKVPool:
    pool = DeviceKVPool(KVLayout("fp", 1, HKV, head_dim, BS, dtype), num_blocks=32)
    g = torch.Generator().manual_seed(0)
    for t in (pool.k, pool.v):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype) if t.dtype != torch.float8_e4m3fn
                else torch.randn(t.shape, generator=g).to(torch.float8_e4m3fn))
    return pool


def decode_batch(lens: list[int]) -> ForwardBatch:
    tables = [[(7 * i + j * 3) % 32 for j in range(-(-n // BS))] for i, n in enumerate(lens)]
    seqs = [SeqSlice(i, 1, n, t) for i, (n, t) in enumerate(zip(lens, tables))]
    return ForwardBatch.build(seqs, [[1]] * len(lens), BS, list(range(len(lens))))


@needs_decode_kernel
@pytest.mark.parametrize("head_dim", [D, 64, 128])  # 64 and 128: the kernel's copies with a constant head size
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8"])
def test_native_decode_matches_sdpa(dtype, head_dim):
    pool = pool_with_random_kv(dtype, head_dim)
    batch = decode_batch([1 + 1, 5, 16, 23])
    q = torch.randn(4, H, head_dim)
    outs = []
    for backend in (TorchAttention(), NativeAttention(H, HKV, head_dim)):
        backend.plan(batch, pool)
        outs.append(backend._decode(0, q, pool))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)


@needs_decode_kernel
@pytest.mark.parametrize("head_dim", [64, 128])
def test_native_decode_matches_sdpa_with_more_query_heads_per_kv_head_than_fit_in_registers(head_dim):
    """8 query heads per KV head: the fp32 kernel keeps 16 / (head_dim / 16) heads' outputs in registers at a
    time, so it runs them in groups."""
    h, hkv = 16, 2
    pool = DeviceKVPool(KVLayout("fp", 1, hkv, head_dim, BS, "fp32"), num_blocks=32)
    g = torch.Generator().manual_seed(1)
    for t in (pool.k, pool.v):
        t.copy_(torch.randn(t.shape, generator=g))
    batch = decode_batch([3, 9, 30])
    q = torch.randn(3, h, head_dim, generator=g)
    outs = []
    for backend in (TorchAttention(), NativeAttention(h, hkv, head_dim)):
        backend.plan(batch, pool)
        outs.append(backend._decode(0, q, pool))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)


def step_batch(parts: list[tuple[int, int]], block_size: int, g: torch.Generator) -> ForwardBatch:
    """One step's rows: ``(cached, computed)`` tokens per sequence (computed 1 on a cached prefix: a decode row),
    each sequence's blocks scattered over the pool."""
    blocks = torch.randperm(64, generator=g).tolist()
    seqs, tokens, start = [], [], 0
    for cached, n in parts:
        nb = -(-(cached + n) // block_size)
        seqs.append(SeqSlice(start, n, cached + n, blocks[:nb]))
        blocks, start = blocks[nb:], start + n
        tokens.append([1] * n)
    return ForwardBatch.build(seqs, tokens, block_size, [s.start + s.num_query - 1 for s in seqs])


@needs_prefill_kernel
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 16), (64, 32), (64, 5)])
@pytest.mark.parametrize("parts", [[(0, 37)], [(21, 40)], [(0, 1)], [(40, 1), (0, 19), (33, 1), (16, 50)]],
                         ids=["fresh", "on-a-prefix", "one-token", "mixed-with-decode-rows"])
def test_native_prefill_matches_sdpa(head_dim, block_size, parts):
    """9 query heads over 3 KV heads (the default model's grouping); rows not in 16-row tiles, prefixes not on a
    block or tile boundary; a block size that is not a multiple of 16 takes the kernel's copying path."""
    g = torch.Generator().manual_seed(2)
    h, hkv = 9, 3
    pool = DeviceKVPool(KVLayout("fp", 1, hkv, head_dim, block_size, "fp32"), num_blocks=64)
    for t in (pool.k, pool.v):
        t.copy_(torch.randn(t.shape, generator=g))
    batch = step_batch(parts, block_size, g)
    T = batch.input_ids.shape[0]
    qkv = torch.randn(T, (h + 2 * hkv) * head_dim, generator=g)  # q a strided view, as the model hands it over
    q, k, v = (t.view(T, -1, head_dim) for t in qkv.split([h * head_dim, hkv * head_dim, hkv * head_dim], -1))
    outs = []
    for backend in (TorchAttention(), NativeAttention(h, hkv, head_dim)):
        backend.plan(batch, pool)
        outs.append(backend.forward(0, q, k, v, pool))
    assert backend.prefill_lib is not None
    assert torch.allclose(outs[0], outs[1], atol=2e-5)


@needs_decode_kernel
def test_auto_picks_the_native_kernel_on_cpu():
    assert make_backend("auto", H, HKV, D, "cpu").name == "native"


def test_without_the_kernel_auto_runs_torch_and_native_says_what_to_use(monkeypatch):
    monkeypatch.setattr(native, "load", lambda: None)
    assert make_backend("auto", H, HKV, D, "cpu").name == "torch"
    with pytest.raises(RuntimeError, match="use 'torch'"):
        make_backend("native", H, HKV, D, "cpu")


def test_a_kernel_without_a_compiler_is_unavailable_with_the_reason(monkeypatch, tmp_path, caplog):
    """What a machine without a C compiler (and nothing cached) gets: no kernel, a warning, the reason kept."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "UNAVAILABLE", {})
    assert native.compile_source(native.SOURCE) is None
    assert "no-such-cc" in native.UNAVAILABLE["paged_decode.c"] and "torch path" in caplog.text


def test_unknown_backend_is_refused_by_name():
    with pytest.raises(ValueError, match="flashinfer"):
        make_backend("xformers", H, HKV, D, "cpu")


def test_flashinfer_on_cpu_says_it_needs_cuda():
    with pytest.raises(RuntimeError, match="CUDA"):
        make_backend("flashinfer", H, HKV, D, "cpu")


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, None), (torch.bfloat16, torch.float32),
                                            (torch.float16, torch.bfloat16)])
def test_flashinfer_outside_16_bits_names_the_settings_that_work(dtype, kv_dtype):
    """Refused before any GPU or flashinfer is touched: flashinfer's paged kernels compute in 16 bits."""
    with pytest.raises(RuntimeError, match=r"dtype=bf16 and kv_dtype=bf16 \(or fp8\), or attention=torch"):
        make_backend("flashinfer", H, HKV, D, "cuda", dtype, kv_dtype)


def test_auto_on_cuda_in_fp32_runs_torch_attention():
    """The default dtype (fp32) on CUDA: torch SDPA, never a flashinfer that would fail at the first step."""
    assert make_backend("auto", H, HKV, D, "cuda", torch.float32).name == "torch"
