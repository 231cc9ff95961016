"""The C GEMM (csrc/gemm.c, its fused residual add included) and RMSNorm / RoPE / SiLU-and-multiply
(csrc/pointwise.c) against torch, and ``Linear``'s choice of weight forms."""

import fnmatch
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from kvmesh.engine import linear, native, quant
from kvmesh.engine.linear import Linear
from kvmesh.model_source.hf_config import ModelConfig

from . import helpers
from .helpers import engine_from_hf, hf_greedy, hf_tiny

LIB = native.load_gemm()
POINTWISE = native.load_pointwise()
needs_kernel = helpers.needs_kernel(LIB, native.GEMM_SOURCE)
needs_pointwise = helpers.needs_kernel(POINTWISE, native.POINTWISE_SOURCE)
# an engine multiplies through the kernel only where it is built for AVX-512 (native.gemm_fast)
needs_engine_kernel = pytest.mark.skipif(LIB is None or not native.gemm_fast(LIB),
                                         reason="engines use the C GEMM only where it builds with AVX-512")


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 12, 13, 16, 17, 40, 200])
@pytest.mark.parametrize("n,k", [(16, 8), (37, 64), (960, 576), (50, 300), (24, 513)])
def test_kernel_matches_torch_matmul(m, n, k):
    """Every row-tile split, N not a multiple of the panel width, K over one K block and not a multiple of it."""
    x, w, bias = rand(m, k, seed=1), rand(n, k, seed=2), rand(n, seed=3)
    y = native.gemm(LIB, x, native.gemm_pack(LIB, w), n, bias)
    assert y.shape == (m, n)
    assert torch.allclose(y, x @ w.T + bias, atol=1e-4, rtol=1e-4)


@needs_kernel
def test_kernel_reads_rows_of_a_strided_view():
    base = rand(6, 100, seed=4)
    x, w = base[:, 10:74], rand(40, 64, seed=5)  # rows 100 floats apart
    assert torch.allclose(native.gemm(LIB, x, native.gemm_pack(LIB, w), 40), x @ w.T, atol=1e-4)


@needs_kernel
def test_an_engine_leaves_the_products_to_onednn_where_the_kernel_is_not_built_for_avx512(monkeypatch):
    """Without AVX-512 the kernel's tile spills its registers (3.4x oneDNN's time per decode step, measured):
    a Linear then keeps oneDNN's copy, and no panels."""
    monkeypatch.setattr(native, "gemm_fast", lambda lib: False)
    lin = Linear(rand(70, 32, seed=6))
    assert lin.lib is None and lin.panels is None and lin.onednn is not None


@needs_engine_kernel
def test_linear_keeps_panels_and_no_dense_copy_on_one_cpu_thread():
    w = rand(70, 32, seed=6)
    lin = Linear(w, lookup=True, prefill_copy=False)
    assert lin.panels is not None and lin.dense is None and lin.onednn is None
    ids = torch.tensor([0, 15, 16, 69, 3])
    assert torch.equal(lin.rows(ids), w[ids])
    x = rand(4, 32, seed=7)
    assert torch.allclose(lin(x), x @ w.T, atol=1e-4)


@needs_engine_kernel
def test_linear_routes_long_steps_to_the_prefill_copy_with_the_same_result():
    w = rand(48, 32, seed=8)
    lin = Linear(w)
    assert lin.panels is not None and lin.onednn is not None
    for m in (1, linear.NATIVE_ROWS, linear.NATIVE_ROWS + 1, 130):
        x = rand(m, 32, seed=m)
        assert torch.allclose(lin(x), x @ w.T, atol=1e-4)


def test_linear_without_the_kernel_serves_lookups_and_products():
    w = rand(40, 24, seed=9)
    lin = Linear(w, lookup=True, native_gemm=False)
    assert lin.panels is None
    ids = torch.tensor([1, 39, 7])
    assert torch.equal(lin.rows(ids), w[ids])
    x = rand(3, 24, seed=10)
    assert torch.allclose(lin(x), x @ w.T, atol=1e-4)


def test_more_than_one_torch_thread_uses_torch_not_the_single_threaded_kernel():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert Linear(rand(16, 16, seed=11)).panels is None
    finally:
        torch.set_num_threads(threads)


def test_greedy_tokens_match_transformers_without_the_kernel():
    """The fallback path (no compiler, or ``native_gemm`` / ``native_pointwise`` off) on a whole model:
    Hugging Face's greedy tokens."""
    from kvmesh.contracts.sampling import SamplingParams

    cfg = ModelConfig.tiny()
    hf = hf_tiny(cfg)
    engine = engine_from_hf(hf, cfg, native_gemm=False, native_pointwise=False)
    assert engine.model.layers[0].qkv.panels is None and engine.model.pointwise is None
    prompt = [11, 42, 7, 7, 130, 66, 201]
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))
    assert out.token_ids == hf_greedy(hf, prompt, 10)


@needs_engine_kernel
@needs_pointwise
def test_the_kernel_settings_take_effect_per_engine_in_one_process():
    """The libraries are built and loaded once per process; each engine's settings decide whether it uses
    them, in either order."""
    cfg = ModelConfig.tiny()
    hf = hf_tiny(cfg)
    for order in ((True, False), (False, True)):
        engines = {on: engine_from_hf(hf, cfg, native_gemm=on, native_pointwise=on) for on in order}
        assert engines[True].model.layers[0].qkv.lib is LIB and engines[True].model.pointwise is POINTWISE
        assert engines[False].model.layers[0].qkv.lib is None and engines[False].model.pointwise is None
    only_gemm = engine_from_hf(hf, cfg, native_pointwise=False)
    assert only_gemm.model.lm_head.lib is LIB and only_gemm.model.pointwise is None


@needs_engine_kernel
def test_an_engine_on_one_thread_multiplies_through_the_kernel():
    """So that the engine tests (greedy equal to Hugging Face's) exercise the kernel, not a fallback."""
    cfg = ModelConfig.tiny()
    model = engine_from_hf(hf_tiny(cfg), cfg).model
    assert all(getattr(layer, n).panels is not None for layer in model.layers for n in ("qkv", "o", "gate_up", "down"))
    assert model.embed is None and model.lm_head.panels is not None and model.lm_head.dense is None
    assert model.pointwise is not None or POINTWISE is None


@needs_pointwise
def test_rms_norm_kernel_matches_torch_on_a_strided_view():
    x, w = rand(5, 80, seed=12)[:, :72], rand(72, seed=13)
    out = native.rms_norm(POINTWISE, x, w, 1e-5)
    assert torch.allclose(out, torch.nn.functional.rms_norm(x, (72,), w, 1e-5), atol=1e-5)


@needs_pointwise
def test_rope_kernel_rotates_q_and_k_heads_in_place_and_leaves_v():
    from kvmesh.engine.model import _rotate_half

    heads, d, t = 3, 8, 4  # 2 q heads + 1 k head rotated, then 1 v head
    qkv = rand(t, (heads + 1) * d, seed=14)
    positions = torch.tensor([0, 5, 2, 9])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(16).float()[:, None] * inv[None, :]
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    x = qkv[:, :heads * d].reshape(t, heads, d)
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    expected = torch.cat([(x * c + _rotate_half(x) * s).reshape(t, -1), qkv[:, heads * d:]], dim=1)
    native.rope_(POINTWISE, qkv, heads, d, cos, sin, positions)
    assert torch.allclose(qkv, expected, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("m", [1, 13, 40])
def test_kernel_adds_into_a_residual_bit_for_bit_as_the_separate_add(m):
    x, w, bias, h = rand(m, 64, seed=20), rand(37, 64, seed=21), rand(37, seed=22), rand(m, 37, seed=23)
    panels = native.gemm_pack(LIB, w)
    expected = h + native.gemm(LIB, x, panels, 37, bias)
    out = h.clone()
    assert native.gemm(LIB, x, panels, 37, bias, out=out) is out
    assert torch.equal(out, expected)


def test_linear_adds_into_a_residual_on_every_path():
    x, w, h = rand(60, 64, seed=24), rand(37, 64, seed=25), rand(60, 37, seed=26)
    lin = Linear(w)
    for rows in (3, 60):  # the kernel's rows and, past NATIVE_ROWS, the prefill copy's
        expected = h[:rows] + lin(x[:rows])
        assert torch.equal(lin(x[:rows], residual=h[:rows].clone()), expected)
    strided = h.clone()[:, :30]  # not contiguous: added to after the product
    assert torch.allclose(Linear(w[:30])(x, residual=strided.clone()), strided + x @ w[:30].T, atol=1e-4)


@needs_pointwise
@pytest.mark.parametrize("rows", [1, 7])
def test_silu_mul_kernel_matches_torch(rows):
    gu = rand(rows, 2 * 96, seed=27) * 8  # gates of +-30 included: exp's clamp and both tails
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    expected = torch.nn.functional.silu(gu[:, :96]) * gu[:, 96:]
    assert torch.allclose(native.silu_mul(POINTWISE, gu, 96), expected, rtol=1e-6, atol=1e-6)


def test_the_wheel_ships_every_kernel_source_and_header():
    """A header missing from the package data would fail the build in an installed engine, which then falls
    back to the torch paths (a warning, several times slower), so check the globs cover csrc/ whole."""
    root = Path(__file__).resolve().parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kvmesh"]
    for f in (f for f in native.CSRC.iterdir() if f.is_file()):
        rel = f"engine/csrc/{f.name}"
        assert any(fnmatch.fnmatch(rel, g) for g in globs), f"{rel} is not in pyproject's package-data"


def gguf_rows(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random GGUF rows of ``kind`` (finite fp16 scales), as the file stores them: [n, k / 32 * block bytes]."""
    rng = np.random.default_rng(seed)
    size = {"Q4_1": 20, "Q8_0": 34}[kind]
    blk = rng.integers(0, 256, (n, k // 32, size), dtype=np.uint8)
    for at in (0, 2) if kind == "Q4_1" else (0,):
        blk[..., at:at + 2] = (rng.standard_normal((n, k // 32, 1)) * 0.05).astype(np.float16).view(np.uint8)
    return blk.reshape(n, -1)


def dequantized(kind: str, rows: np.ndarray, n: int, k: int) -> torch.Tensor:
    """What the GGUF conversion makes of them (gguf-py's dequantize), [n, k] fp32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(np.array(dequantize(rows, GGMLQuantizationType[kind]), dtype=np.float32)).reshape(n, k)


needs_q = (needs_kernel if LIB is None else
           pytest.mark.skipif(LIB.kvmesh_q_block_bytes(1) == 0, reason="the quantized kernel needs AVX-512"))


@needs_q
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_quantized_panels_dequantize_to_the_converted_weights_bit_for_bit(kind):
    n, k = 48, 96
    rows = gguf_rows(kind, n, k, seed=30)
    q = torch.from_numpy(quant.to_panels(kind, rows))
    dense = native.gemm_pack(LIB, dequantized(kind, rows, n, k))
    assert torch.equal(native.q_dequant(LIB, q, quant.TYPES[kind], n, k), dense)


@needs_q
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 5, 12, 13, 16, 40])  # one fused tile (<= 12 rows), then the scratch path
def test_quantized_kernel_computes_the_dense_kernels_products_bit_for_bit(kind, m):
    n, k = 80, 64  # 5 panels: a lone last panel too
    rows = gguf_rows(kind, n, k, seed=31)
    q = torch.from_numpy(quant.to_panels(kind, rows))
    panels = native.gemm_pack(LIB, dequantized(kind, rows, n, k))
    x, bias, h = rand(m, k, seed=32), rand(n, seed=33), rand(m, n, seed=34)
    scratch = torch.empty(2 * k * 16)
    t = quant.TYPES[kind]
    assert torch.equal(native.gemm_q(LIB, x, q, t, n, scratch, bias), native.gemm(LIB, x, panels, n, bias))
    out = h.clone()
    native.gemm_q(LIB, x, q, t, n, scratch, bias, out=out)
    assert torch.equal(out, native.gemm(LIB, x, panels, n, bias, out=h.clone()))


@needs_q
def test_linear_reads_quantized_blocks_only_when_they_hold_its_values():
    n, k = 64, 96
    rows = gguf_rows("Q4_1", n, k, seed=35)
    w = dequantized("Q4_1", rows, n, k)
    x = rand(3, k, seed=36)
    expected = Linear(w)(x)
    lin = Linear(w)
    assert lin.use_quantized("Q4_1", rows) and lin.q is not None and lin.panels is None
    assert torch.equal(lin(x), expected)
    assert lin.nbytes() == lin.q.numel() + w.numel() * 4  # quantized panels + the prefill copy, no dense panels
    other = Linear(w)
    assert not other.use_quantized("Q4_1", gguf_rows("Q4_1", n, k, seed=37))  # another matrix's blocks
    assert other.q is None and other.panels is not None
    assert not Linear(w).use_quantized("Q4_0", rows)  # a type the kernel does not read
    lookup = Linear(w, lookup=True, prefill_copy=False)
    assert lookup.use_quantized("Q4_1", rows) and lookup.panels is not None  # rows() still reads the panels
    assert torch.equal(lookup.rows(torch.tensor([3, 60])), w[[3, 60]])
