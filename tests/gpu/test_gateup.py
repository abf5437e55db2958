"""The gate/up + SwiGLU kernels (kernels/gateup_sm90.cu, Hopper only), the one on q4_K
and the one on f16 weights (which also dequantizes the next layer's pair):

    against NumPy: gguf's dequantization rounded to f16, the products summed in f64,
        each sum rounded to f16, silu(g) * u in f32 (a tolerance: another summation
        order, and the f16 roundings after it)
    against the f16 engine's chain (dequantize gate and up, one cuBLAS GEMM with
        f16 output, swiglu_f16 over its column blocks): the same bits, which is what
        keeps a greedy stream the same with the kernels on or off (scripts/check/gpu_check.sh
        compares the 7B twin's on prompts that take them)
    the f16 kernel's next-layer dequantization: the bits of dequant_f16, and no
        change to its own output
    the FFN (ffn.py's FFN.f16) takes each where paths.gateup_kernel says, counts it,
        and gives the bits of the FFN without it, over consecutive layers prefetching
        the next pair

Irregular token counts (tails of the 256-token tiles, a single tile, several),
feature counts of a few 64-feature blocks (grids of half tiles only), and feature
counts set by the GPU's SM count so that a grid holds whole tiles only, or whole
tiles and a last wave of half tiles (gateup_sm90.tiling); outputs poisoned with NaN first.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from minfer.backend.cuda.paths import GATEUP_KERNELS

from .test_mmq import _acts, _info, _weights

pytestmark = pytest.mark.gpu

# the two kernels' launch counters (by kernel name)
Q4K, F16 = "gateup_swiglu_q4k", "gateup_swiglu_f16"

# one 256-token block, several (the kernel takes any T; paths.py decides where it runs)
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


def _w16(cp, gate, up):
    """gate and up dequantized by dequant_f16 as rows [gate; up] of one f16 array."""
    from minfer.backend.cuda.kernels import dequant_f16
    d_ff, K = gate.shape[0], _n_in(gate)
    w16 = cp.empty(2 * d_ff * K, cp.float16)
    dequant_f16.dequant_f16_many([(cp.asarray(w), QT.Q4_K, d_ff, K, w16[i * d_ff * K:(i + 1) * d_ff * K], None)
                          for i, w in enumerate((gate, up))])
    return w16.reshape(2 * d_ff, K)


def _n_in(raw) -> int:
    """A q4_K weight's input count from its row bytes."""
    return raw.shape[1] // 144 * 256


def _fused(cp, gate, up, x16, kind="q4k", prefetch=None):
    """One kernel's h: "q4k" reads the q4_K blocks, "f16" their dequantized rows (and,
    with prefetch, dequantizes that pair into its array)."""
    from minfer.backend.cuda.kernels import gateup_sm90
    T, d_ff = x16.shape[0], gate.shape[0]
    h = cp.full((T, d_ff), cp.nan, cp.float16)
    if kind == "q4k":
        out = gateup_sm90.gateup_swiglu_q4k(cp.asarray(x16), cp.asarray(gate), cp.asarray(up), d_ff, out=h)
    else:
        out = gateup_sm90.gateup_swiglu_f16(cp.asarray(x16), _w16(cp, gate, up), d_ff, prefetch=prefetch, out=h)
    assert out.data.ptr == h.data.ptr and out.shape == h.shape
    return cp.asnumpy(h)


def _chain(cp, gate, up, x16):
    """The f16 engine's chain: both weights dequantized side by side, one GEMM, SwiGLU."""
    from minfer.backend.cuda import cublas
    from minfer.backend.cuda.kernels import dequant_f16
    T, K = x16.shape
    d_ff = gate.shape[0]
    gu = cp.empty((T, 2 * d_ff), cp.float16)
    cublas.gemm_f16(cp.asarray(x16), _w16(cp, gate, up), gu)
    return cp.asnumpy(dequant_f16.swiglu_f16(gu[:, :d_ff], gu[:, d_ff:]))


def _same_bits(got, want):
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), \
        f"{np.sum(got.view(np.uint16) != want.view(np.uint16))} of {got.size} differ"


@pytest.mark.parametrize("kind", ["q4k", "f16"])
@pytest.mark.parametrize("T,K,d_ff", SHAPES)
def test_gateup_kernel_against_numpy(cp, T, K, d_ff, kind):
    gate, up, x16 = _case(cp, T, K, d_ff, seed=T + K)
    got = _fused(cp, gate, up, x16, kind).astype(np.float32)
    want = _numpy_h(gate, up, x16, K).astype(np.float32)
    assert np.isfinite(got).all()
    scale = np.abs(want).max()
    # f16 rounding of g and u (2^-11 relative each) and of h, after f32 vs f64 sums
    assert np.abs(got - want).max() <= 4e-3 * scale, (np.abs(got - want).max(), scale)
    assert np.mean(got == want) > 0.9


@pytest.mark.parametrize("kind", ["q4k", "f16"])
@pytest.mark.parametrize("T,K,d_ff", SHAPES)
def test_gateup_kernel_equals_the_f16_engine_chain(cp, T, K, d_ff, kind):
    gate, up, x16 = _case(cp, T, K, d_ff, seed=3 * T + d_ff)
    _same_bits(_fused(cp, gate, up, x16, kind), _chain(cp, gate, up, x16))


@pytest.mark.parametrize("T,K,d_ff", SHAPES)
def test_gateup_f16_dequantizes_the_next_pair_as_dequant_f16(cp, T, K, d_ff):
    """The f16 kernel with a next pair: that pair's f16 rows are dequant_f16's bits to the
    last element (the array poisoned first, every block of the grid doing its share,
    half tiles past T included), and h is what it is without the job."""
    gate, up, x16 = _case(cp, T, K, d_ff, seed=5 * T + K)
    g2, u2 = (_weights(QT.Q4_K, d_ff, K, seed=T + 40 + i) for i in range(2))
    out16 = cp.full((2 * d_ff, K), cp.nan, cp.float16)
    got = _fused(cp, gate, up, x16, "f16", prefetch=(cp.asarray(g2), cp.asarray(u2), out16))
    _same_bits(got, _fused(cp, gate, up, x16, "f16"))
    assert np.array_equal(cp.asnumpy(out16).view(np.uint16), cp.asnumpy(_w16(cp, g2, u2)).view(np.uint16))


@pytest.mark.parametrize("at", [0, 128 * 256, 3 * 128 * 256 // 2])    # w16's start, inside it, its last rows
def test_gateup_f16_refuses_a_next_pairs_array_over_its_own_weights(cp, at):
    from minfer.backend.cuda.kernels import gateup_sm90
    gate, up, x16 = _case(cp, 64, 256, 128, seed=1)
    room = cp.empty(4 * 2 * 128 * 256, cp.float16)
    w16 = room[:2 * 128 * 256].reshape(2 * 128, 256)
    w16[...] = _w16(cp, gate, up)
    with pytest.raises(ValueError, match="overlaps this launch's w16"):
        gateup_sm90.gateup_swiglu_f16(cp.asarray(x16), w16, 128,
                                 prefetch=(cp.asarray(gate), cp.asarray(up), room[at:at + 2 * 128 * 256]))


@pytest.mark.parametrize("kind", ["q4k", "f16"])
@pytest.mark.parametrize("grid", ["whole", "whole and half"])
def test_gateup_grids_of_whole_and_half_tiles(cp, grid, kind):
    """d_ff from this GPU's SM count: 3 rows of 256 tokens over 0.6 n_sm feature blocks
    (a last wave too full to split: whole tiles only), or 2 rows over n_sm + 8 (a last
    wave of 16 tiles: 32 half tiles, those past T = 300 leaving at once). The bits of
    the chain either way."""
    from minfer.backend.cuda.kernels import gateup_sm90
    n_sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    T, nf = (700, -(-3 * n_sm // 5)) if grid == "whole" else (300, n_sm + 8)
    K, d_ff = 256, 64 * nf
    tiles = nf * -(-T // 256)
    whole, blocks = gateup_sm90.tiling(T, d_ff, n_sm)
    assert (whole, blocks) == ((tiles, tiles) if grid == "whole" else (tiles - 16, tiles + 16))
    gate, up, x16 = _case(cp, T, K, d_ff, seed=nf)
    _same_bits(_fused(cp, gate, up, x16, kind), _chain(cp, gate, up, x16))


def _ffn_weights(st, layers: int, d: int, d_ff: int, seed: int = 5):
    """Registered gate, up (q4_K) and down (q6_K) of consecutive layers."""
    return [[st.register(f"blk.{i}.ffn_{n}.weight", _info(f"blk.{i}.ffn_{n}.weight", qt, n_out, n_in),
                         _weights(qt, n_out, n_in, seed=seed + 3 * i + j))
             for j, (n, qt, n_out, n_in) in enumerate((("gate", QT.Q4_K, d_ff, d), ("up", QT.Q4_K, d_ff, d),
                                                        ("down", QT.Q6_K, d, d_ff)))]
            for i in range(layers)]


def _kind_lengths(kind: str) -> list[int]:
    """Each range of this kind: its ends and a length inside (an open end: 3 lengths)."""
    out = set()
    for (lo, hi), k in GATEUP_KERNELS:
        if k == kind:
            out |= {lo, lo + 131, lo + 700} if hi is None else {lo, (lo + hi) // 2 + 1, hi}
    return sorted(out)


@pytest.mark.parametrize("T", _kind_lengths("q4k"))
def test_ffn_takes_the_q4k_kernel_with_the_same_bits(cp, cuda_linears, T):
    d, d_ff = 512, 1280
    runs = {}
    for fused in (True, False):
        st, parts = cuda_linears(gateup_fused=fused)
        (ws,) = _ffn_weights(st, 1, d, d_ff)
        xh = cp.asarray(_acts(T, d, seed=T)).astype(cp.float16)
        res = cp.asarray(_acts(T, d, seed=T + 1))
        parts.counters.reset()
        y = parts.ffn.f16(xh, parts.layer(*ws), residual=res)
        runs[fused] = (cp.asnumpy(y), dict(parts.counters.counts))
    (y1, c1), (y0, c0) = runs[True], runs[False]
    assert c1.get(Q4K, 0) == 1 and c0.get(Q4K, 0) == 0 and c1.get(F16, 0) == 0
    assert c1["q4k_f16"] == c0["q4k_f16"] == 2 and c1["q6k exp"] == c0["q6k exp"] == 1
    assert np.array_equal(y1.view(np.uint32), y0.view(np.uint32))


@pytest.mark.parametrize("T", _kind_lengths("f16"))
def test_ffn_layers_take_the_f16_kernel_and_hand_the_next_pair_on(cp, cuda_linears, monkeypatch, T):
    """Three layers' FFNs in order, each told the next layer's gate/up: the first
    dequantizes its pair, each launch writes the next one's (the later pairs never
    reach a dequantization), and every layer's output has the bits of the chain
    (kernels off). The counters: three f16 launches, two of them with the next pair,
    gate and up counted once a layer either way."""
    from minfer.backend.cuda.kernels import dequant_f16
    d, d_ff, n = 512, 1280, 3
    runs = {}
    dequantized = []                                   # the raw weights dequant_f16_many saw
    real = dequant_f16.dequant_f16_many

    def recording(weights):
        dequantized.extend(int(w[0].data.ptr) for w in weights)
        return real(weights)

    from minfer.backend.cuda import ffn, linears
    monkeypatch.setattr(ffn, "dequant_f16_many", recording)      # where the FFN and the linears call it
    monkeypatch.setattr(linears, "dequant_f16_many", recording)
    for fused in (True, False):
        st, parts = cuda_linears(gateup_fused=fused)
        layers = _ffn_weights(st, n, d, d_ff)
        Ls = [parts.layer(*ws) for ws in layers]
        parts.ffn.plan(Ls)                             # each layer's FFN knows the next one
        parts.counters.reset()
        dequantized.clear()
        ys = []
        for i, L in enumerate(Ls):
            xh = cp.asarray(_acts(T, d, seed=T + i)).astype(cp.float16)
            res = cp.asarray(_acts(T, d, seed=T + 10 + i))
            ys.append(cp.asnumpy(parts.ffn.f16(xh, L, residual=res)))
        if fused:                                      # only layer 0's pair by a dequantization
            gu = [{w.ptr for w in ws[:2]} for ws in layers]
            assert gu[0] <= set(dequantized) and not (gu[1] | gu[2]) & set(dequantized)
        runs[fused] = (ys, dict(parts.counters.counts), parts.state.prefetched)
    (y1, c1, held1), (y0, c0, held0) = runs[True], runs[False]
    assert (c1.get(F16, 0), c1["gate/up prefetch"], c1.get(Q4K, 0)) == (n, n - 1, 0)
    assert (c0.get(F16, 0), c0["gate/up prefetch"]) == (0, 0)
    assert c1["q4k_f16"] == c0["q4k_f16"] == 2 * n and c1["q6k exp"] == c0["q6k exp"] == n
    assert held1 is None and held0 is None                 # the last layer hands nothing on
    for i in range(n):
        assert np.array_equal(y1[i].view(np.uint32), y0[i].view(np.uint32)), f"layer {i}"


def test_ffn_f16_kernel_dequantizes_a_pair_it_was_not_handed(cp, cuda_linears):
    """Layer 1 run first (nothing after it), then layer 0 followed by layer 1, then
    layer 2 (not the pair prefetched): each pair not prefetched is dequantized at its
    layer, and the outputs stay the chain's."""
    T, d, d_ff = 1100, 256, 768
    runs = {}
    for fused in (True, False):
        st, parts = cuda_linears(gateup_fused=fused)
        layers = _ffn_weights(st, 3, d, d_ff, seed=11)
        parts.counters.reset()
        ys = []
        Ls = [parts.layer(*ws) for ws in layers]
        for i, nxt in ((1, None), (0, 1), (2, None)):
            parts.ffn.plan([Ls[i]] if nxt is None else [Ls[i], Ls[nxt]])   # the layer order as told
            xh = cp.asarray(_acts(T, d, seed=i)).astype(cp.float16)
            ys.append(cp.asnumpy(parts.ffn.f16(xh, Ls[i])))
        runs[fused] = (ys, dict(parts.counters.counts))
    (y1, c1), (y0, c0) = runs[True], runs[False]
    assert (c1.get(F16, 0), c1["gate/up prefetch"]) == (3, 1) and c0.get(F16, 0) == 0
    for a, b in zip(y1, y0):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("T", sorted({t for (lo, hi), _ in GATEUP_KERNELS for t in (lo - 1, hi and hi + 1)
                                      if t and not any(a <= t and (b is None or t <= b)
                                                       for (a, b), _ in GATEUP_KERNELS)}))
def test_ffn_outside_their_lengths_takes_the_chain(cp, cuda_linears, T):
    d, d_ff = 256, 256
    st, parts = cuda_linears()
    ws = [st.register(name, _info(name, QT.Q4_K, n_out, n_in), _weights(QT.Q4_K, n_out, n_in, seed=i))
          for i, (name, n_out, n_in) in enumerate((("blk.0.ffn_gate.weight", d_ff, d),
                                                   ("blk.0.ffn_up.weight", d_ff, d),
                                                   ("blk.0.ffn_down.weight", d, d_ff)))]
    parts.counters.reset()
    parts.ffn.f16(cp.asarray(_acts(T, d, seed=1)).astype(cp.float16), parts.layer(*ws))
    c = parts.counters.counts
    assert c.get(Q4K, 0) == c.get(F16, 0) == 0 and c["q4k_f16"] == 3
