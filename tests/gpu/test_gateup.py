"""The fused gate/up + SwiGLU kernel on q4_K (kernels/gateup_sm90.cu, Hopper only):

    against NumPy: gguf's dequantization rounded to f16, the products summed in f64,
        each sum rounded to f16, silu(g) * u in f32 (a tolerance: another summation
        order, and the f16 roundings after it)
    against the f16 engine's chain (dequantize gate and up, one cuBLAS GEMM with
        f16 output, swiglu_f16 over its column blocks): the same bits, which is what
        keeps a greedy stream the same with the kernel on or off (scripts/gpu_check.sh
        compares the 7B twin's on a prompt that takes it)
    the FFN (Gemms.ffn_f16) takes it where gemm.gateup_fused says, counts it, and
        gives the bits of the FFN without it

Irregular token counts (tails of the 256-token tiles, a single tile, several),
feature counts of a few 64-feature blocks (grids of half tiles only), and feature
counts set by the GPU's SM count so that a grid holds whole tiles only, or whole
tiles and a last wave of half tiles (gateup.tiling); outputs poisoned with NaN first.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from minfer.backend.cuda.gemm import GATEUP_FUSED_LENGTHS

from .test_mmq import _acts, _info, _weights

pytestmark = pytest.mark.gpu

# one 256-token block, several (the kernel takes any T; gemm.py decides where it runs)
SHAPES = [(2, 256, 64), (29, 512, 768), (255, 1536, 192), (256, 256, 128), (257, 768, 128),
          (700, 512, 320)]


@pytest.fixture(scope="module")
def cp():
    import cupy
    from minfer.backend.cuda.launch import device_cc
    if device_cc() != (9, 0):
        pytest.skip(f"gateup_sm90.cu needs compute capability 9.0 (this GPU: {device_cc()})")
    return cupy


def _case(cp, T: int, K: int, d_ff: int, seed: int):
    gate = _weights(QT.Q4_K, d_ff, K, seed=seed)
    up = _weights(QT.Q4_K, d_ff, K, seed=seed + 1)
    x16 = _acts(T, K, seed=seed).astype(np.float16)
    return gate, up, x16


def _numpy_h(gate, up, x16, K: int) -> np.ndarray:
    """The independent reference: gguf's dequantization, f16 weights, f64 sums."""
    x = x16.astype(np.float64)
    g, u = ((x @ dequantize(w, QT.Q4_K).reshape(-1, K).astype(np.float16).astype(np.float64).T)
            .astype(np.float16).astype(np.float32) for w in (gate, up))
    return (g / (np.float32(1) + np.exp(-g)) * u).astype(np.float16)


def _fused(cp, gate, up, x16):
    from minfer.backend.cuda import gateup
    T, d_ff = x16.shape[0], gate.shape[0]
    h = cp.full((T, d_ff), cp.nan, cp.float16)
    out = gateup.gateup_swiglu_q4k(cp.asarray(x16), cp.asarray(gate), cp.asarray(up), d_ff, out=h)
    assert out.data.ptr == h.data.ptr and out.shape == h.shape
    return cp.asnumpy(h)


def _chain(cp, gate, up, x16):
    """The f16 engine's chain: both weights dequantized side by side, one GEMM, SwiGLU."""
    from minfer.backend.cuda import cublas, f16
    T, K = x16.shape
    d_ff = gate.shape[0]
    w16 = cp.empty(2 * d_ff * K, cp.float16)
    f16.dequant_f16_many([(cp.asarray(w), QT.Q4_K, d_ff, K, w16[i * d_ff * K:(i + 1) * d_ff * K], None)
                          for i, w in enumerate((gate, up))])
    gu = cp.empty((T, 2 * d_ff), cp.float16)
    cublas.gemm_f16(cp.asarray(x16), w16.reshape(2 * d_ff, K), gu)
    return cp.asnumpy(f16.swiglu_f16(gu[:, :d_ff], gu[:, d_ff:]))


@pytest.mark.parametrize("T,K,d_ff", SHAPES)
def test_gateup_kernel_against_numpy(cp, T, K, d_ff):
    gate, up, x16 = _case(cp, T, K, d_ff, seed=T + K)
    got = _fused(cp, gate, up, x16).astype(np.float32)
    want = _numpy_h(gate, up, x16, K).astype(np.float32)
    assert np.isfinite(got).all()
    scale = np.abs(want).max()
    # f16 rounding of g and u (2^-11 relative each) and of h, after f32 vs f64 sums
    assert np.abs(got - want).max() <= 4e-3 * scale, (np.abs(got - want).max(), scale)
    assert np.mean(got == want) > 0.9


@pytest.mark.parametrize("T,K,d_ff", SHAPES)
def test_gateup_kernel_equals_the_f16_engine_chain(cp, T, K, d_ff):
    gate, up, x16 = _case(cp, T, K, d_ff, seed=3 * T + d_ff)
    got, want = _fused(cp, gate, up, x16), _chain(cp, gate, up, x16)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), \
        f"{np.sum(got.view(np.uint16) != want.view(np.uint16))} of {got.size} differ"


@pytest.mark.parametrize("kind", ["whole", "whole and half"])
def test_gateup_grids_of_whole_and_half_tiles(cp, kind):
    """d_ff from this GPU's SM count: 3 rows of 256 tokens over 0.6 n_sm feature blocks
    (a last wave too full to split: whole tiles only), or 2 rows over n_sm + 8 (a last
    wave of 16 tiles: 32 half tiles, those past T = 300 leaving at once). The bits of
    the chain either way."""
    from minfer.backend.cuda import gateup
    n_sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    T, nf = (700, -(-3 * n_sm // 5)) if kind == "whole" else (300, n_sm + 8)
    K, d_ff = 256, 64 * nf
    tiles = nf * -(-T // 256)
    whole, blocks = gateup.tiling(T, d_ff, n_sm)
    assert (whole, blocks) == ((tiles, tiles) if kind == "whole" else (tiles - 16, tiles + 16))
    gate, up, x16 = _case(cp, T, K, d_ff, seed=nf)
    got, want = _fused(cp, gate, up, x16), _chain(cp, gate, up, x16)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), \
        f"{np.sum(got.view(np.uint16) != want.view(np.uint16))} of {got.size} differ"


# each range's ends and a length inside
@pytest.mark.parametrize("T", sorted({t for lo, hi in GATEUP_FUSED_LENGTHS for t in (lo, (lo + hi) // 2 + 1, hi)}))
def test_ffn_takes_the_fused_kernel_with_the_same_bits(cp, cuda_linears, T):
    d, d_ff = 512, 1280
    runs = {}
    for fused in (True, False):
        st, gemm = cuda_linears(gateup_fused=fused)
        ws = [st.register(name, _info(name, qt, n_out, n_in), _weights(qt, n_out, n_in, seed=i + 5))
              for i, (name, qt, n_out, n_in) in enumerate((("blk.0.ffn_gate.weight", QT.Q4_K, d_ff, d),
                                                           ("blk.0.ffn_up.weight", QT.Q4_K, d_ff, d),
                                                           ("blk.0.ffn_down.weight", QT.Q6_K, d, d_ff)))]
        xh = cp.asarray(_acts(T, d, seed=T)).astype(cp.float16)
        res = cp.asarray(_acts(T, d, seed=T + 1))
        gemm.counters.reset()
        y = gemm.ffn_f16(xh, *ws, residual=res)
        runs[fused] = (cp.asnumpy(y), dict(gemm.counters.counts))
    (y1, c1), (y0, c0) = runs[True], runs[False]
    assert any(lo <= T <= hi for lo, hi in GATEUP_FUSED_LENGTHS)
    assert c1["gate/up fused"] == 1 and c0["gate/up fused"] == 0
    assert c1["q4k_f16"] == c0["q4k_f16"] == 2 and c1["q6k exp"] == c0["q6k exp"] == 1
    assert np.array_equal(y1.view(np.uint32), y0.view(np.uint32))


@pytest.mark.parametrize("T", sorted({t for lo, hi in GATEUP_FUSED_LENGTHS for t in (lo - 1, hi + 1)}))
def test_ffn_outside_its_lengths_takes_the_chain(cp, cuda_linears, T):
    d, d_ff = 256, 256
    st, gemm = cuda_linears()
    ws = [st.register(name, _info(name, QT.Q4_K, n_out, n_in), _weights(QT.Q4_K, n_out, n_in, seed=i))
          for i, (name, n_out, n_in) in enumerate((("blk.0.ffn_gate.weight", d_ff, d),
                                                   ("blk.0.ffn_up.weight", d_ff, d),
                                                   ("blk.0.ffn_down.weight", d, d_ff)))]
    gemm.counters.reset()
    gemm.ffn_f16(cp.asarray(_acts(T, d, seed=1)).astype(cp.float16), *ws)
    assert gemm.counters.counts["gate/up fused"] == 0 and gemm.counters.counts["q4k_f16"] == 3
