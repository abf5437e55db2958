"""The quantized-weight kernels vs NumPy references (kernels/{quantize,mmq,matvec,
dequant}.cu through minfer/backend/cuda/kernels/).

The independent truth: minfer.format.quants (bit-exact to gguf.quants, tested in CI) for
the weights, a NumPy mirror of ggml's quantize_q8_1 for the activations, float64
matrix products. Every output buffer is poisoned with NaN before the launch, so
an element the kernel forgets to write fails the test.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from minfer.format import quants
from minfer.backend.cuda.q6k_layout import expand_q6k_dense, pad_q6k
from minfer.format.gguf import TensorInfo
from minfer.format.quantize import quantize

pytestmark = pytest.mark.gpu

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
EPS32 = 2.0 ** -24                      # f32 unit roundoff
TS = (1, 7, 33, 130, 517)               # token counts: 1, below/above/far past the 64-row tile
SHAPES = ((200, 256), (264, 512), (1000, 1280))   # (n_out, K): n_out never a multiple of 64


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


@pytest.fixture(scope="module")
def cq():
    """The kernel wrappers under test (minfer/backend/cuda/kernels/{quantize,mmq,dequant}.py)."""
    from types import SimpleNamespace
    from minfer.backend.cuda.kernels import dequant, mmq, quantize
    return SimpleNamespace(quantize_q8_1=quantize.quantize_q8_1, mmq_q4k=mmq.mmq_q4k, mmq_q6k=mmq.mmq_q6k,
                           dequant_rows=dequant.dequant_rows)


def _rng(*key) -> np.random.Generator:
    """A generator seeded by the test's key (stable across processes)."""
    return np.random.default_rng([zlib.crc32(repr(key).encode()), 20260906])


def _weights(qtype, n_out: int, K: int, seed=0) -> np.ndarray:
    """Irregular Gaussian rows (per-row scale, a few outliers) -> raw (n_out, row_bytes)."""
    rng = _rng("w", int(qtype), n_out, K, seed)
    w = rng.standard_normal((n_out, K)).astype(np.float32)
    w *= rng.uniform(0.002, 0.05, (n_out, 1)).astype(np.float32)
    w[rng.random((n_out, K)) < 0.002] *= 9.0
    return quantize(w, qtype)


def _acts(T: int, K: int, seed=0) -> np.ndarray:
    """Activations with per-channel scales and outliers, plus one all-zero q8_1 block
    (the amax == 0 branch) in a nonzero row."""
    rng = _rng("x", T, K, seed)
    x = rng.standard_normal((T, K)).astype(np.float32)
    x *= rng.uniform(0.1, 3.0, (1, K)).astype(np.float32)
    x[rng.random((T, K)) < 0.003] *= 20.0
    if K >= 64:
        x[T // 2, 32:64] = 0.0
    return x


def _q8_1_mirror(x: np.ndarray):
    """NumPy mirror of ggml quantize_q8_1 in f32: d = amax/127, q = roundf(x/d)
    (half away from zero), s = d*sum(q) -> q int8 (T, K), d, s f32 (T, K/32)."""
    T, K = x.shape
    xb = x.reshape(T, K // 32, 32)
    amax = np.abs(xb).max(axis=2)                                  # (T, K/32) f32
    d = (amax / np.float32(127)).astype(np.float32)
    safe = np.where(d == 0, np.float32(1), d)
    v = (xb / safe[:, :, None]).astype(np.float32)
    r = np.trunc(v)
    r = r + np.sign(v) * (np.abs(v - r) >= np.float32(0.5))        # roundf: ties away from 0
    q = np.where(amax[:, :, None] == 0, 0, r).astype(np.int8)
    s = (d * q.astype(np.int32).sum(axis=2).astype(np.float32)).astype(np.float32)
    return q.reshape(T, K), d, s


def _dequant_x(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    T, K = q.shape
    return (q.reshape(T, K // 32, 32).astype(np.float64) * d[:, :, None]).reshape(T, K)


def _envelope(qtype, W: np.ndarray) -> np.ndarray:
    """Per-weight magnitude bound of the terms the kernel rounds: |W| for q6_K; for
    q4_K the kernel forms d*sc*q and dmin*m separately (W = d*sc*q - dmin*m), each at
    most |W| + max|W| of the sub-block (dmin*m = -W where q = 0), so |W| + 2*max."""
    A = np.abs(W.astype(np.float64))
    if qtype == QT.Q4_K:
        n, K = A.shape
        M = A.reshape(n, K // 32, 32).max(axis=2, keepdims=True)
        A = (A.reshape(n, K // 32, 32) + 2 * M).reshape(n, K)
    return A


def _pad(qtype, raw):
    return pad_q6k(raw) if qtype == QT.Q6_K else raw


def _gemm(cp, cq, qtype, raw, x, plane=None, bias=None):
    """Run the MMQ kernel of qtype on f32 x; y is poisoned with NaN first."""
    n_out = raw.shape[0]
    T, K = x.shape
    xq, xd, xs = cq.quantize_q8_1(cp.asarray(x))
    y = cp.full((T, n_out), cp.nan, dtype=cp.float32)
    w = cp.asarray(_pad(qtype, raw))
    b = None if bias is None else cp.asarray(bias)
    if qtype == QT.Q4_K:
        cq.mmq_q4k(xq, xd, xs, w, n_out, b, y)
    else:
        cq.mmq_q6k(xq, xd, w, None if plane is None else cp.asarray(plane), n_out, b, y)
    return cp.asnumpy(y)


def _check_gemm(qtype, raw, x, y, bias=None):
    """y (kernel) vs two references:
    (1) dequant(W) @ dequant(q8_1(x)) in float64: same math, so the only error is
        f32 rounding. Per 16-element sub-block the kernel rounds the scale product,
        the int->f32 dot and the running sum (fused), a few roundings of terms
        bounded by the envelope; over K/16 sub-blocks the worst case is about
        (K/16 + 8) * 2^-24 * envelope; we allow 4x that (q4_K: 8x, two terms per
        32-chunk). Any indexing or scale bug is O(1) relative, far above.
    (2) dequant(W) @ x in float64 (plain f32 activations): the 8-bit activation
        bound |x - d*q| <= d/2 per element, summed with |W|, plus (1)'s tolerance."""
    K = x.shape[1]
    W = quants.dequantize_rows(raw, qtype, K).astype(np.float64)      # (n_out, K)
    q, d, _ = _q8_1_mirror(x)
    xdq = _dequant_x(q, d)                                             # (T, K)
    b = 0.0 if bias is None else bias.astype(np.float64)
    assert np.isfinite(y).all(), "unwritten (NaN) outputs"
    env = np.abs(xdq) @ _envelope(qtype, W).T                         # (T, n_out)
    factor = 8 if qtype == QT.Q4_K else 4
    tol = factor * (K / 16 + 8) * EPS32 * env + 1e-30
    err = np.abs(y - (xdq @ W.T + b))
    assert (err <= tol).all(), f"vs q8_1-exact reference: max err/tol {np.max(err / tol):.3g}"
    half_d = np.repeat(d.astype(np.float64) / 2, 32, axis=1)          # (T, K)
    tol8 = (half_d @ np.abs(W).T) * (1 + 1e-5) + tol
    err8 = np.abs(y - (x.astype(np.float64) @ W.T + b))
    assert (err8 <= tol8).all(), f"vs f32 x: max err/bound {np.max(err8 / tol8):.3g}"


# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("T,K", [(1, 256), (7, 512), (130, 1280), (517, 256)])
def test_quantize_q8_1_vs_numpy_mirror(cp, cq, T, K):
    x = _acts(T, K)
    q_ref, d_ref, s_ref = _q8_1_mirror(x)
    q = cp.full((T, K), 77, dtype=cp.int8)
    d = cp.full((T, K // 32), cp.nan, dtype=cp.float32)
    s = cp.full((T, K // 32), cp.nan, dtype=cp.float32)
    cq.quantize_q8_1(cp.asarray(x), q, d, s)
    assert np.array_equal(cp.asnumpy(q), q_ref)                      # exact ints
    assert np.array_equal(cp.asnumpy(d).view(np.uint32), d_ref.view(np.uint32))
    assert np.array_equal(cp.asnumpy(s).view(np.uint32), s_ref.view(np.uint32))


@pytest.mark.parametrize("n_out,K", SHAPES)
@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=["q4_K", "q6_K"])
def test_mmq_vs_reference(cp, cq, qtype, T, n_out, K):
    raw = _weights(qtype, n_out, K)
    x = _acts(T, K)
    plane = expand_q6k_dense(pad_q6k(raw), n_out, K) if qtype == QT.Q6_K else None
    bias = _rng("b", n_out).standard_normal(n_out).astype(np.float32) if T == 33 else None
    _check_gemm(qtype, raw, x, _gemm(cp, cq, qtype, raw, x, plane, bias), bias)


@pytest.mark.parametrize("T,n_out,K", [(7, 200, 256), (130, 1000, 1280), (517, 264, 512)])
def test_q6k_exp_and_fallback_bit_identical(cp, cq, T, n_out, K):
    """EXP=true (cp.async from W_exp) and EXP=false (in-kernel expansion) stage the
    same bytes and share the accumulation order: outputs equal bit for bit."""
    raw = _weights(QT.Q6_K, n_out, K, seed=1)
    x = _acts(T, K, seed=1)
    plane = expand_q6k_dense(pad_q6k(raw), n_out, K)
    y_exp = _gemm(cp, cq, QT.Q6_K, raw, x, plane)
    y_raw = _gemm(cp, cq, QT.Q6_K, raw, x, None)
    assert np.isfinite(y_exp).all()
    assert np.array_equal(y_exp.view(np.uint32), y_raw.view(np.uint32))


def _matvec(cp, cq, qtype, raw, x, bias=None):
    """The matvec kernel of qtype on q8_1(x), x (1, K); y is poisoned with NaN first.
    Its math is the MMQ's (dequant(W) @ dequant(q8_1(x))), so _check_gemm judges it."""
    n_out = raw.shape[0]
    y = cp.full((1, n_out), cp.nan, dtype=cp.float32)
    xq, xd, xs = cq.quantize_q8_1(cp.asarray(x))
    from minfer.backend.cuda.kernels.matvec import matvec
    matvec(qtype, xq, xd, xs, cp.asarray(_pad(qtype, raw)), n_out, None if bias is None else cp.asarray(bias), y)
    return cp.asnumpy(y)


@pytest.mark.parametrize("n_out,K", SHAPES + ((37, 8960),))
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=["q4_K", "q6_K"])
def test_matvec_vs_reference(cp, cq, qtype, n_out, K):
    raw = _weights(qtype, n_out, K, seed=2)
    x = _acts(1, K, seed=2)
    bias = _rng("mb", n_out).standard_normal(n_out).astype(np.float32)
    _check_gemm(qtype, raw, x, _matvec(cp, cq, qtype, raw, x, bias), bias)


# --- real weights cut from the 1.5B model (tests/tools/cut_real_slices.py) ------- #

@pytest.fixture(scope="module")
def real():
    z = np.load(FIXTURES / "real_slices.npz")
    return {k: (z[f"{k}_raw"], QT(int(z[f"{k}_type"])), tuple(int(v) for v in z[f"{k}_shape"]))
            for k in ("attn_q", "ffn_down", "attn_v")}


@pytest.mark.parametrize("key", ["attn_q", "ffn_down", "attn_v"])
@pytest.mark.parametrize("T", [1, 33, 130])
def test_real_slices(cp, cq, real, key, T):
    raw, qtype, (n_out, K) = real[key]
    x = _acts(T, K, seed=3)
    if T == 1:
        _check_gemm(qtype, raw, x, _matvec(cp, cq, qtype, raw, x))
        return
    plane = expand_q6k_dense(pad_q6k(raw), n_out, K) if qtype == QT.Q6_K else None
    y = _gemm(cp, cq, qtype, raw, x, plane)
    _check_gemm(qtype, raw, x, y)
    if qtype == QT.Q6_K:
        y_raw = _gemm(cp, cq, qtype, raw, x, None)
        assert np.array_equal(y.view(np.uint32), y_raw.view(np.uint32))


# --- embedding rows: bit-identical to quants.dequantize_rows ---------------- #

def _info(name, qtype, n_out, n_in):
    rb = quants.row_bytes(qtype, n_in)
    return TensorInfo(name=name, qtype=qtype, shape=(n_out, n_in), offset=0, nbytes=n_out * rb,
                      n_elements=n_out * n_in, row_bytes=rb, n_rows=n_out)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q8_0, QT.F16, QT.F32],
                         ids=lambda q: q.name)
def test_embed_rows_bit_exact(cp, cq, cuda_linears, qtype):
    n_vocab, d = 97, 768
    raw = _weights(qtype, n_vocab, d, seed=4)
    st, _ = cuda_linears()
    w = st.register("token_embd.weight", _info("token_embd.weight", qtype, n_vocab, d), raw)
    toks = _rng("tok", int(qtype)).integers(0, n_vocab, 41).astype(np.int32)
    toks[:3] = [0, n_vocab - 1, toks[5]]                            # both ends and a repeat
    y = cp.asnumpy(cq.dequant_rows(w.qtype, w.data, w.n_in, cp.asarray(toks)))
    ref = quants.dequantize_rows(raw[toks], qtype, d)
    assert np.array_equal(y.view(np.uint32), ref.view(np.uint32))


# --- liveness through the backend's linear (the fast path is taken) ---------- #

# the settings each q6_K mode runs with (what the MINFER_* switches set)
MODES = {"exp": {}, "off": {"exp_planes": False}, "toggled": {"exp_enabled": False},
         "miss": {"force_exp_miss": True}}


def _linear_counts(cp, cuda_linears, mode="exp", T=7, engine="mmq"):
    n_out, K = 200, 512
    raw = _weights(QT.Q6_K, n_out, K, seed=5)
    pin = 1 << 30 if engine == "mmq" else 2                 # pin the GEMM engine under test
    st, parts = cuda_linears(f16_min_t=pin, **MODES[mode])
    name = "blk.3.ffn_down.weight"
    w = st.register(name, _info(name, QT.Q6_K, n_out, K), raw)
    y = cp.asnumpy(parts.lin.linear(cp.asarray(_acts(T, K, seed=5)), w))
    return dict(parts.counters.counts), y, st, w          # w keeps its plane alive


@pytest.mark.parametrize("engine", ["mmq", "f16"])
def test_linear_liveness_paths(cp, cuda_linears, capsys, engine):
    """The q6_K labels say where B came from on either GEMM engine; the W_exp
    plane (MMQ: cp.async staging; f16: the dequantizer's source) and the padded
    blocks give the same bits."""
    lc = functools.partial(_linear_counts, cp, cuda_linears, engine=engine)
    on, y_on, st, w = lc("exp")
    assert on[f"q6k_{engine}"] == 1
    assert on["q6k exp"] == 1 and on["q6k exp=off"] == 0 and on["q6k fallback!"] == 0
    assert st.plane_bytes == 200 * 512
    off, y_off, st, w = lc("off")
    assert off["q6k exp=off"] == 1 and off["q6k exp"] == 0 and off["q6k fallback!"] == 0
    assert st.plane_bytes == 0
    tog, y_tog, st, w = lc("toggled")
    assert tog["q6k exp=off"] == 1 and tog["q6k exp"] == 0 and st.plane_bytes == 200 * 512
    miss, y_miss, st, w = lc("miss")
    assert miss["q6k fallback!"] == 1 and miss["q6k exp"] == 0
    assert capsys.readouterr().err.count("WARNING: W_exp plane registration failed") == 1
    for y in (y_off, y_tog, y_miss):                               # one accumulation order
        assert np.array_equal(y.view(np.uint32), y_on.view(np.uint32))


def test_linear_routes_matvec_and_q4k(cp, cuda_linears):
    c1, _, _, _ = _linear_counts(cp, cuda_linears, T=1)
    assert c1["q6k_mv"] == 1 and c1["q6k exp"] == 0
    st, parts = cuda_linears(f16_min_t=1 << 30)             # MMQ for T > 1
    raw = _weights(QT.Q4_K, 264, 512, seed=6)
    w = st.register("blk.0.attn_q.weight", _info("blk.0.attn_q.weight", QT.Q4_K, 264, 512), raw)
    x = _acts(33, 512, seed=6)
    bias = _rng("lb").standard_normal(264).astype(np.float32)
    y = cp.asnumpy(parts.lin.linear(cp.asarray(x), w, bias=cp.asarray(bias)))
    _check_gemm(QT.Q4_K, raw, x, y, bias)
    parts.lin.linear(cp.asarray(x[:1]), w)
    assert parts.counters.counts["q4k_mmq"] == 1 and parts.counters.counts["q4k_mv"] == 1
    assert st.bytes["q4_K weights"] == raw.nbytes
    # the default engine for T >= F16_GEMM_MIN_T: W and x rounded once to f16
    # (relative 2^-11 each), products summed in f32: well inside 4e-3 of max|y|
    from minfer.backend.cuda.settings import CudaSettings
    parts.settings = CudaSettings()
    y16 = cp.asnumpy(parts.lin.linear(cp.asarray(x), w, bias=cp.asarray(bias)))
    ref = (x.astype(np.float64) @ quants.dequantize_rows(raw, QT.Q4_K, 512).astype(np.float64).T
           + bias)
    assert np.abs(y16 - ref).max() <= 4e-3 * np.abs(ref).max()
    assert parts.counters.counts["q4k_f16"] == 1
    parts.counters.reset()
    assert not any(parts.counters.counts.values())


def test_debug_counts_printed_at_exit(cp):
    """MINFER_PRINT_LAUNCH_COUNTS=1: one line per counter at process exit."""
    code = (
        "import numpy as np, cupy as cp\n"
        "from gguf import GGMLQuantizationType as QT\n"
        "from minfer.backend.cuda.parts import Parts\n"
        "from minfer.backend.cuda.settings import CudaSettings\n"
        "from minfer.format.gguf import TensorInfo\n"
        "from minfer.format.quantize import quantize\n"
        "x = np.random.default_rng(7).standard_normal((9, 256)).astype(np.float32)\n"
        "raw = quantize(x[:5] * 0.01, QT.Q6_K)\n"
        "p = Parts(CudaSettings.from_env(), eps=1e-6); st, g = p.store, p.lin\n"
        "w = st.register('output.weight', TensorInfo('output.weight', QT.Q6_K, (5, 256), 0,"
        " raw.nbytes, 1280, raw.shape[1], 5), raw)\n"
        "g.linear(cp.asarray(x), w); g.linear(cp.asarray(x), w); cp.cuda.Device().synchronize()\n")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "MINFER_PRINT_LAUNCH_COUNTS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    env.pop("MINFER_MMQ_Q6K_EXP", None)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert "[minfer launches] q6k exp: 2" in p.stderr
    assert "[minfer launches] q6k fallback!: 0" in p.stderr


def test_ffn_f16_vs_reference(cp, cuda_linears):
    """FFN.f16 (the f16 engine's SwiGLU FFN, ffn.py): gate/up GEMMs write f16, swiglu
    reads and writes f16, the down GEMM reads it. Reference: the same roundings in
    float64 (x, W, g, u and f rounded to f16 once each). What remains is f32
    accumulation order, which can move a g/u/f value across an f16 rounding
    boundary (one ulp, 2^-11 relative) now and then: 2e-3 of max|y| holds that."""
    T, d, d_ff = 37, 512, 768
    st, parts = cuda_linears()
    ws = {}
    for name, qt, n_out, K in (("blk.0.ffn_gate.weight", QT.Q4_K, d_ff, d),
                               ("blk.0.ffn_up.weight", QT.Q4_K, d_ff, d),
                               ("blk.0.ffn_down.weight", QT.Q6_K, d, d_ff)):
        raw = _weights(qt, n_out, K, seed=11)
        ws[name.split(".")[2]] = (st.register(name, _info(name, qt, n_out, K), raw),
                                  quants.dequantize_rows(raw, qt, K))
    h = _acts(T, d, seed=11) * 0.3
    gate, up, down = ws["ffn_gate"][0], ws["ffn_up"][0], ws["ffn_down"][0]
    L = parts.layer(gate, up, down)
    assert parts.ffn.fused(T, L)
    y = cp.asnumpy(parts.ffn.f16(cp.asarray(h), L))

    f16 = lambda a: a.astype(np.float16).astype(np.float64)
    h16 = f16(h)
    g = f16(h16 @ f16(ws["ffn_gate"][1]).T)
    u = f16(h16 @ f16(ws["ffn_up"][1]).T)
    f = f16(g / (1.0 + np.exp(-g)) * u)
    ref = f @ f16(ws["ffn_down"][1]).T
    assert y.shape == (T, d) and np.isfinite(y).all()
    assert np.abs(y - ref).max() <= 2e-3 * np.abs(ref).max()
    c = parts.counters.counts
    assert c["q4k_f16"] == 2 and c["q6k_f16"] == 1 and c["q6k exp"] == 1
    parts.settings = parts.settings.replace(exp_enabled=False)   # the padded blocks give the same bits
    y_off = cp.asnumpy(parts.ffn.f16(cp.asarray(h), L))
    assert np.array_equal(y_off.view(np.uint32), y.view(np.uint32))
    assert parts.counters.counts["q6k exp=off"] == 1
