"""Each non-GEMM CUDA kernel vs a float64 NumPy reference, on fresh random inputs
at irregular shapes. Every output is poisoned with NaN before the launch, so an
element the kernel forgets to write fails the comparison."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

T_SHAPES = (1, 7, 33, 517)


@pytest.fixture(scope="module")
def cu():
    """cupy, and the wrappers under test by their op names."""
    import cupy
    from types import SimpleNamespace
    from minfer.backend.cuda.kernels import attention, elementwise, norm, rope
    return cupy, SimpleNamespace(rmsnorm=norm.rmsnorm, rope=rope.rope, rope_table=rope.rope_table,
                                 swiglu=elementwise.swiglu, add=elementwise.add, attention=attention.attention_f32)


def nan_like(cp, shape):
    return cp.full(shape, np.nan, dtype=cp.float32)


def rel_err(got, want) -> float:
    return float(np.max(np.abs(got.astype(np.float64) - want)) / np.max(np.abs(want)))


# --- rmsnorm -------------------------------------------------------------------
@pytest.mark.parametrize("T", T_SHAPES)
@pytest.mark.parametrize("d", (1536, 3584, 999, 5000))    # 5000: past the per-thread registers
def test_rmsnorm(cu, T, d):
    cp, cuda = cu
    rng = np.random.default_rng(1000 * T + d)
    # rows of very different scales: the normalisation must remove them
    x = (rng.standard_normal((T, d)) * rng.uniform(0.01, 50.0, (T, 1))).astype(np.float32)
    w = rng.uniform(-2.0, 2.0, d).astype(np.float32)
    eps = 1e-6
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + eps) * w
    y = nan_like(cp, (T, d))
    cuda.rmsnorm(cp.asarray(x), cp.asarray(w), eps, out=y)
    got = cp.asnumpy(y)
    # f32 sum of d squares (<= 14 per thread, then a 256-way tree): relative error of
    # the scale <= ~log2(d) ulp ~ 1e-6; the two products add 2 ulp -> 1e-5 is 10x margin.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max() * 1e-2)


# --- rope ----------------------------------------------------------------------
def rope_ref(x, pos0, base, neox):
    """float64 rotation with exact angles (no table)."""
    T, H, hd = x.shape
    inv = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = (pos0 + np.arange(T, dtype=np.float64))[:, None, None] * inv     # (T, 1, hd/2)
    c, s = np.cos(ang), np.sin(ang)
    x = x.astype(np.float64)
    if neox:
        a, b = x[..., : hd // 2], x[..., hd // 2:]
        return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)
    out = np.empty_like(x)
    a, b = x[..., 0::2], x[..., 1::2]
    out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


@pytest.mark.parametrize("T,H,hd,pos0", [(1, 28, 128, 0), (1, 4, 128, 3001), (7, 12, 128, 5),
                                         (33, 2, 128, 900), (517, 28, 128, 0), (33, 6, 64, 17)])
@pytest.mark.parametrize("neox", (True, False))
def test_rope(cu, T, H, hd, pos0, neox):
    cp, cuda = cu
    rng = np.random.default_rng(T * 31 + H + hd + pos0 + neox)
    base = 1000000.0 if neox else 10000.0
    x = (rng.standard_normal((T, H, hd)) * 3.0).astype(np.float32)
    table = cp.asarray(cuda.rope_table(pos0 + T + 5, hd, base))
    y = nan_like(cp, x.shape)
    cuda.rope(cp.asarray(x), table, pos0, neox, out=y)
    want = rope_ref(x, pos0, base, neox)
    # cos/sin rounded once to f32 (0.5 ulp each), two products and a sum in f32:
    # |err| <= ~3 ulp of max(|a|, |b|) -> 1e-6 relative to the largest input.
    np.testing.assert_allclose(cp.asnumpy(y), want, rtol=0, atol=1e-6 * np.abs(x).max())
    # in place (the graph's use) gives the same bits
    xd = cp.asarray(x)
    cuda.rope(xd, table, pos0, neox, out=xd)
    np.testing.assert_array_equal(cp.asnumpy(xd), cp.asnumpy(y))


# --- attention -----------------------------------------------------------------
def attention_ref(q, K, V, pos0, rows=None):
    """float64 causal GQA: q (T, H, hd), K/V (S, n_kv, hd) with S >= pos0 + T;
    rows: the query rows to compute (default all) -> (len(rows), H*hd)."""
    T, H, hd = q.shape
    n_kv = K.shape[1]
    rows = np.arange(T) if rows is None else np.asarray(rows)
    out = np.empty((len(rows), H, hd))
    for i, t in enumerate(rows):
        S = pos0 + t + 1
        for h in range(H):
            g = h // (H // n_kv)
            s = K[:S, g].astype(np.float64) @ q[t, h].astype(np.float64) / np.sqrt(hd)
            p = np.exp(s - s.max())
            out[i, h] = p @ V[:S, g].astype(np.float64) / p.sum()
    return out.reshape(len(rows), H * hd)


def run_attention(cp, cuda, rng, T, H, n_kv, hd, pos0, n_ctx, q_scale=1.0):
    """Random q/k/v for T new positions after pos0 random past positions; cache
    positions past pos0+T poisoned with NaN (never read) -> (q, K, V, out)."""
    q = (rng.standard_normal((T, H, hd)) * q_scale).astype(np.float32)
    K = rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float32)
    V = (rng.standard_normal((n_ctx, n_kv, hd)) * rng.uniform(0.5, 4.0, (1, n_kv, 1))).astype(np.float32)
    K[pos0 + T:] = np.nan
    V[pos0 + T:] = np.nan
    kc = cp.asarray(K)
    vc = cp.asarray(V)
    # the call itself stores its k/v: plant different values there first
    kc[pos0:pos0 + T] = 7.0
    vc[pos0:pos0 + T] = -7.0
    y = nan_like(cp, (T, H * hd))
    cuda.attention(cp.asarray(q), cp.asarray(K[pos0:pos0 + T]), cp.asarray(V[pos0:pos0 + T]),
                   kc, vc, pos0, out=y)
    np.testing.assert_array_equal(cp.asnumpy(kc[:pos0 + T]), K[:pos0 + T])
    np.testing.assert_array_equal(cp.asnumpy(vc[:pos0 + T]), V[:pos0 + T])
    return q, K, V, cp.asnumpy(y)


# (T, n_head, n_kv, hd, pos0): GQA 7:1 (28/4, the 7B), 6:1 (12/2, the 1.5B), 1:1;
# T=1 with pos0>0 is a decode step; T>1 with pos0>0 is chunked prefill.
ATT_CASES = [(1, 28, 4, 128, 0), (1, 28, 4, 128, 700), (7, 12, 2, 128, 0), (7, 28, 4, 128, 45),
             (33, 12, 2, 128, 100), (517, 12, 2, 128, 0), (517, 28, 4, 128, 31), (33, 4, 4, 64, 9)]


@pytest.mark.parametrize("T,H,n_kv,hd,pos0", ATT_CASES)
def test_attention(cu, T, H, n_kv, hd, pos0):
    cp, cuda = cu
    rng = np.random.default_rng(T * 7 + H * 3 + pos0 + hd)
    # q_scale 2: scores of a few units (peaked softmax rows, as in real models)
    q, K, V, got = run_attention(cp, cuda, rng, T, H, n_kv, hd, pos0, pos0 + T + 11, q_scale=2.0)
    want = attention_ref(q, K, V, pos0)
    # f32: scores carry ~hd ulp of |q||k| (~1e-6 abs), expf 2 ulp, the P.V and
    # denominator sums over <= pos0+T keys ~1e-6 relative; the output is a convex
    # combination of V rows -> error ~1e-6 of max|V|; 2e-5 leaves 10x margin.
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(V[:pos0 + T]).max())


def test_attention_long_prompt(cu):
    """T = 3325 (the 7B benchmark prompt) for two query heads on one KV head:
    finite everywhere, a float64 reference on a subset of rows, and no
    allocation beyond the output (no T x T score matrix)."""
    cp, cuda = cu
    T, H, n_kv, hd = 3325, 2, 1, 128
    rng = np.random.default_rng(3325)
    q = (rng.standard_normal((T, H, hd)) * 2.0).astype(np.float32)
    kv = rng.standard_normal((2, T, n_kv, hd)).astype(np.float32)
    qd, kd, vd = cp.asarray(q), cp.asarray(kv[0]), cp.asarray(kv[1])
    kc = cp.zeros((T, n_kv, hd), cp.float32)
    vc = cp.zeros((T, n_kv, hd), cp.float32)
    y = nan_like(cp, (T, H * hd))
    pool = cp.get_default_memory_pool()
    cp.cuda.Device().synchronize()
    before = pool.total_bytes()
    cuda.attention(qd, kd, vd, kc, vc, 0, out=y)
    cp.cuda.Device().synchronize()
    assert pool.total_bytes() - before < T * 64, "attention allocated device memory of its own"
    got = cp.asnumpy(y)
    assert np.isfinite(got).all()
    rows = np.unique(np.concatenate([[0, 1, 15, 16, 31, 32, 1000, 2047, T - 1],
                                     rng.integers(0, T, 16)]))
    want = attention_ref(q, kv[0], kv[1], 0, rows)
    # same error model as test_attention; the sums now run over up to 3325 keys
    np.testing.assert_allclose(got[rows], want, rtol=0, atol=5e-5 * np.abs(kv[1]).max())


# --- element-wise --------------------------------------------------------------
@pytest.mark.parametrize("T", T_SHAPES)
def test_swiglu(cu, T):
    cp, cuda = cu
    rng = np.random.default_rng(T + 5)
    d_ff = 1283
    g = (rng.standard_normal((T, d_ff)) * 6.0).astype(np.float32)
    g.flat[:: 97] = -120.0      # exp(-g) overflows to inf: silu must give -0, not NaN
    u = rng.standard_normal((T, d_ff)).astype(np.float32)
    g64 = g.astype(np.float64)
    want = g64 / (1.0 + np.exp(-g64)) * u
    y = nan_like(cp, (T, d_ff))
    cuda.swiglu(cp.asarray(g), cp.asarray(u), out=y)
    got = cp.asnumpy(y)
    # expf <= 2 ulp, one add, one divide, one multiply: <= ~5 ulp relative per element
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("T", T_SHAPES)
def test_add(cu, T):
    cp, cuda = cu
    rng = np.random.default_rng(T + 9)
    a = rng.standard_normal((T, 1536)).astype(np.float32)
    b = (rng.standard_normal((T, 1536)) * 10).astype(np.float32)
    y = nan_like(cp, a.shape)
    cuda.add(cp.asarray(a), cp.asarray(b), out=y)
    np.testing.assert_array_equal(cp.asnumpy(y), a + b)      # one f32 rounding, same as NumPy
    ad = cp.asarray(a)
    cuda.add(ad, cp.asarray(b), out=ad)                      # in place (out aliases a)
    np.testing.assert_array_equal(cp.asnumpy(ad), a + b)


def test_bad_arguments(cu):
    cp, cuda = cu
    x = cp.zeros((3, 8), cp.float32)
    with pytest.raises(ValueError):
        cuda.rmsnorm(x, cp.zeros(7, cp.float32), 1e-6)
    with pytest.raises(ValueError):
        cuda.add(x, cp.zeros((3, 8), cp.float64))
    with pytest.raises(ValueError):
        cuda.rmsnorm(x[:, ::2], cp.zeros(4, cp.float32), 1e-6)
    # contiguous but 4 bytes off a 16-byte boundary: the attention kernel reads float4
    q = cp.zeros(1 + 2 * 4 * 128, cp.float32)[1:].reshape(2, 4, 128)
    kc = cp.zeros((8, 2, 128), cp.float32)
    kv = cp.zeros((2, 2, 128), cp.float32)
    with pytest.raises(ValueError, match="aligned"):
        cuda.attention(q, kv, kv, kc, kc.copy(), 0)


# --- out of memory ---------------------------------------------------------------
def _small_cfg():
    from minfer.config import ModelConfig
    return ModelConfig(arch="qwen2", n_layer=3, d_model=512, n_head=4, n_head_kv=2, d_ff=1280,
                       vocab_size=1000, n_ctx_train=4096, rope_base=10000.0, rms_eps=1e-6,
                       qkv_bias=True, rope_neox=True)


def test_oom_is_one_line_minfer_error(cu, synth_dir, monkeypatch):
    """Device out-of-memory becomes one MinferError line naming what to turn off, at
    the backend's one boundary: a real one (a KV cache far beyond the card), and
    ones raised inside loading and inside a forward pass."""
    cp, _ = cu
    from minfer.backend.cuda import CUDABackend
    from minfer.backend.cuda.linears import Linears
    from minfer.backend.cuda.weights import WeightStore
    from minfer.engine import Engine
    from minfer.errors import MinferError
    from minfer.tools.synth import synth_model

    be = CUDABackend(_small_cfg())
    with pytest.raises(MinferError) as ei:
        be.new_cache(400_000_000)            # 3 * 2 * 4e8 * 256 * 4 B = 2.4 TB
    msg = str(ei.value)
    assert "GPU out of memory while allocating the KV cache" in msg and "\n" not in msg
    assert "-c" in msg

    def boom(*a, **k):
        raise cp.cuda.memory.OutOfMemoryError(1 << 33, 1 << 30)
    path = synth_model(synth_dir)
    with monkeypatch.context() as m:
        m.setattr(WeightStore, "register", boom)
        with pytest.raises(MinferError) as ei:
            Engine.load(path, backend="cuda", n_ctx=16, progress=False)
    msg = str(ei.value)
    assert msg.startswith("GPU out of memory while loading the weights") and "\n" not in msg
    assert "MINFER_MMQ_Q6K_EXP" in msg
    eng = Engine.load(path, backend="cuda", n_ctx=16, progress=False)
    monkeypatch.setattr(Linears, "norm_linears", boom)         # every forward's q/k/v and LM head
    with pytest.raises(MinferError) as ei:
        eng.model.forward(np.arange(1, dtype=np.int32), 0, eng.new_cache())
    assert str(ei.value).startswith("GPU out of memory while running the model")
