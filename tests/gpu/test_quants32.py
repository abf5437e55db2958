"""The kernels of the types read in 32-element groups (kernels/quants32.cu: Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, Q5_K) against gguf.quants, which is independent of minfer:
f16 dequantization bit-exact to the f32 reference rounded once, embedding rows
bit-exact, the decode matvec against a float64 product of the same q8_1
activations. Blocks are random bytes with finite scales (every quant bit
pattern) and, where gguf can quantize the type, quantized Gaussian rows.
Outputs are poisoned with NaN first."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf import quants as gq

pytestmark = pytest.mark.gpu

TYPES = (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q5_K)
F16_FIELDS = {QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q8_0: (0,),
              QT.Q5_K: (0, 2)}                   # byte offsets of the f16 scales in a block
EPS32 = 2.0 ** -24


def _shapes(qtype):
    bs = GGML_QUANT_SIZES[qtype][0]
    return [(37, bs), (200, 3 * bs), (1, 6 * bs)] if bs == 256 else [(37, 32), (200, 576), (1, 1536)]


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


def _random_blocks(qtype, n_out: int, n_in: int, seed: int) -> np.ndarray:
    """Random bytes (every quant pattern) with finite f16 scales -> (n_out, row_bytes)."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng([int(qtype), n_out, n_in, seed])
    raw = rng.integers(0, 256, (n_out * n_in // bs, ts), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        mag = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), raw.shape[0]))
        raw[:, off:off + 2] = (mag * rng.choice([-1, 1], raw.shape[0])).astype(np.float16) \
            .view(np.uint8).reshape(-1, 2)
    return raw.reshape(n_out, -1)


def _quantized(qtype, n_out: int, n_in: int, seed: int) -> np.ndarray | None:
    """Gaussian rows quantized by gguf (None where gguf has no quantizer for the type)."""
    rng = np.random.default_rng([int(qtype), seed, 7])
    x = (rng.standard_normal((n_out, n_in)) * 0.05).astype(np.float32)
    try:
        return np.asarray(gq.quantize(x, qtype)).reshape(n_out, -1)
    except NotImplementedError:
        return None


def _cases(qtype):
    for i, (n_out, n_in) in enumerate(_shapes(qtype)):
        yield _random_blocks(qtype, n_out, n_in, i), n_in
        q = _quantized(qtype, n_out, n_in, i)
        if q is not None:
            yield q, n_in


def _truth(qtype, raw, n_in) -> np.ndarray:
    return np.asarray(gq.dequantize(raw, qtype), np.float32).reshape(raw.shape[0], n_in)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequant_f16_bit_exact(cp, qtype):
    from minfer.backend.cuda.kernels.dequant_f16 import dequant_f16
    for raw, n_in in _cases(qtype):
        n_out = raw.shape[0]
        out = cp.full(n_out * n_in, np.nan, cp.float16)
        w16 = cp.asnumpy(dequant_f16(cp.asarray(raw.reshape(-1)), qtype, n_out, n_in, out=out))
        want = _truth(qtype, raw, n_in).astype(np.float16)
        assert np.array_equal(w16.view(np.uint16), want.view(np.uint16)), (qtype.name, raw.shape)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_embedding_rows_bit_exact(cp, qtype):
    from minfer.backend.cuda.kernels.dequant import dequant_rows
    for raw, n_in in _cases(qtype):
        n_out = raw.shape[0]
        toks = np.random.default_rng(n_out).integers(0, n_out, 9).astype(np.int32)
        toks[:2] = [0, n_out - 1]
        y = cp.full((9, n_in), np.nan, cp.float32)
        dequant_rows(qtype, cp.asarray(raw), n_in, cp.asarray(toks), y)
        want = _truth(qtype, raw, n_in)[toks]
        assert np.array_equal(cp.asnumpy(y).view(np.uint32), want.view(np.uint32)), qtype.name


def _q8_1(x: np.ndarray):
    """ggml's quantize_q8_1 in NumPy: d = amax/127, q = round half away from zero."""
    xb = x.reshape(-1, 32).astype(np.float32)
    amax = np.abs(xb).max(axis=1)
    d = (amax / np.float32(127)).astype(np.float32)
    v = xb / np.where(d == 0, np.float32(1), d)[:, None]
    q = np.where(amax[:, None] == 0, 0, np.trunc(v) + np.sign(v) * (np.abs(v - np.trunc(v)) >= 0.5))
    return q.astype(np.int8), d


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matvec_vs_reference(cp, qtype):
    """dequant(W) @ dequant(q8_1(x)) in float64 is the same math: what remains is f32
    rounding, a few roundings per group of terms bounded by the envelope (|W| plus
    twice its group maximum, since W = a*q + b can cancel), over K/32 groups and a
    5-level reduction; we allow 8 * (K/32 + 8) * 2^-24 * envelope."""
    from minfer.backend.cuda.kernels.quantize import quantize_q8_1
    from minfer.backend.cuda.kernels.matvec import matvec
    for raw, n_in in _cases(qtype):
        n_out = raw.shape[0]
        x = np.random.default_rng(n_in).standard_normal((1, n_in)).astype(np.float32)
        bias = np.random.default_rng(n_out).standard_normal(n_out).astype(np.float32)
        y = cp.full((1, n_out), np.nan, cp.float32)
        xq, xd, xs = quantize_q8_1(cp.asarray(x))
        matvec(qtype, xq, xd, xs, cp.asarray(raw), n_out, cp.asarray(bias), y)
        W = _truth(qtype, raw, n_in).astype(np.float64)
        q, d = _q8_1(x)
        xdq = (q.astype(np.float64) * d[:, None]).reshape(1, n_in)
        A = np.abs(W).reshape(n_out, -1, 32)
        env = np.abs(xdq) @ (A + 2 * A.max(axis=2, keepdims=True)).reshape(n_out, n_in).T
        tol = 8 * (n_in / 32 + 8) * EPS32 * env + 1e-30
        err = np.abs(cp.asnumpy(y) - (xdq @ W.T + bias))
        assert np.isfinite(cp.asnumpy(y)).all()
        assert (err <= tol).all(), f"{qtype.name} {raw.shape}: max err/tol {np.max(err / tol):.3g}"


def test_paths_are_counted(cp, cuda_linears):
    """A Q8_0 LM head and a Q4_1 layer weight: matvec at one row, the f16 engine
    (which the MMQ lacks) at many, each launch under its type's counter."""
    from minfer.format.gguf import TensorInfo
    st, parts = cuda_linears()
    ws = {}
    for name, qt in (("output.weight", QT.Q8_0), ("blk.0.ffn_up.weight", QT.Q4_1)):
        raw = _quantized(qt, 96, 576, 3)
        info = TensorInfo(name=name, qtype=qt, shape=(96, 576), offset=0, nbytes=raw.nbytes,
                          n_elements=96 * 576, row_bytes=raw.shape[1], n_rows=96)
        ws[name] = st.register(name, info, raw)
    x = cp.asarray(np.random.default_rng(1).standard_normal((5, 576)).astype(np.float32))
    for w in ws.values():
        parts.lin.linear(x[:1], w)
        y = parts.lin.linear(x, w)
        assert bool(cp.isfinite(y).all())
    c = parts.counters.counts
    assert (c["q8_0_mv"], c["q8_0_f16"], c["q4_1_mv"], c["q4_1_f16"]) == (1, 1, 1, 1)
