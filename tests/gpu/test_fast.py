"""The f16 prefill path (minfer/backend/cuda/{f16,cublas,attention}.py): f16 dequantization, cuBLAS
GEMM, tensor-core flash attention. GPU only (skipped without cupy / a device).

Truth: gguf.quants (independent of minfer) for the dequantizers, float64 NumPy on
the same f16 inputs for the GEMM and attention. Tolerances are derived from the
rounding the fast path is allowed to do, per test.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT, quants as gq

from .test_quants32 import _random_blocks

pytestmark = pytest.mark.gpu


def _fast():
    """The f16 path's wrappers under test, by name."""
    from types import SimpleNamespace
    from minfer.backend.cuda import cublas
    from minfer.backend.cuda.kernels import dequant_f16, flash_attn
    return SimpleNamespace(dequant_f16=dequant_f16.dequant_f16, cast_f16=dequant_f16.cast_f16,
                           linear_f16=_linear_f16, gemm_f16=cublas.gemm_f16,
                           flash_attention=flash_attn.flash_attention,
                           attention_f16=flash_attn.attention_f16)



def _linear_f16(x, raw, qtype, n_out: int, n_in: int, out=None, x16=None, w16=None, w_exp=None, bias=None):
    """x (T, n_in) f32 -> rounded to f16 (into x16), W dequantized into w16, one cuBLAS
    GEMM [+ bias]: the f16 engine's linear, composed from the wrappers under test."""
    from minfer.backend.cuda.cublas import gemm_w16
    from minfer.backend.cuda.kernels.dequant_f16 import cast_f16, dequant_f16
    from minfer.backend.cuda.launch import scratch_view
    import cupy as cp
    xh = cast_f16(x, scratch_view(x16, x.shape, "linear_f16 x16", cp.float16))     # (T, n_in)
    return gemm_w16(xh, dequant_f16(raw, qtype, n_out, n_in, w16, w_exp), out, bias)

QK_K = 256


def _f16(rng, shape, lo, hi):
    """Finite f16 values with random sign, magnitudes log-uniform in [lo, hi]."""
    mag = np.exp(rng.uniform(math.log(lo), math.log(hi), shape))
    return (mag * rng.choice([-1.0, 1.0], shape)).astype(np.float16)


def _random_q4k(rng, n_out, n_in):
    """Random q4_K rows: every scale/min/quant bit pattern, finite d and dmin."""
    nb = n_in // QK_K
    blk = rng.integers(0, 256, (n_out, nb, 144), dtype=np.uint8)
    blk[:, :, 0:2] = _f16(rng, (n_out, nb), 1e-4, 5e-2)[..., None].view(np.uint8)
    blk[:, :, 2:4] = _f16(rng, (n_out, nb), 1e-4, 5e-2)[..., None].view(np.uint8)
    return blk.reshape(n_out, nb * 144)


def _random_q6k(rng, n_out, n_in):
    """Random raw q6_K rows (210-byte blocks): any ql/qh/scale bytes, finite d."""
    nb = n_in // QK_K
    blk = rng.integers(0, 256, (n_out, nb, 210), dtype=np.uint8)
    blk[:, :, 208:210] = _f16(rng, (n_out, nb), 1e-5, 2e-2)[..., None].view(np.uint8)
    return blk.reshape(n_out, nb * 210)


def _nan16(cp, n):
    return cp.full(n, cp.nan, dtype=cp.float16)


def _assert_bits_equal(got16, want16):
    """Exact f16 equality, bit for bit (also tells -0 from +0)."""
    g = np.asarray(got16).view(np.uint16)
    w = np.asarray(want16).view(np.uint16)
    bad = np.argwhere(g != w)
    assert bad.size == 0, (f"{len(bad)} of {g.size} differ; first at {tuple(bad[0])}: "
                           f"got {np.asarray(got16)[tuple(bad[0])]}, want {np.asarray(want16)[tuple(bad[0])]}")


# --- dequantization -----------------------------------------------------------
@pytest.mark.parametrize("n_out,n_in", [(1, 256), (37, 768), (129, 1280)])
def test_dequant_q4k_random_blocks(n_out, n_in):
    import cupy as cp
    fp = _fast()

    rng = np.random.default_rng(n_out * 7 + n_in)
    raw = _random_q4k(rng, n_out, n_in)
    want = gq.dequantize(raw, QT.Q4_K).astype(np.float16)              # f32 ref rounded once
    out = _nan16(cp, n_out * n_in + 100)                                # poisoned, oversized scratch
    w16 = fp.dequant_f16(cp.asarray(raw), QT.Q4_K, n_out, n_in, out=out)
    assert w16.shape == (n_out, n_in)
    _assert_bits_equal(w16.get(), want)
    assert bool(cp.isnan(out[n_out * n_in:]).all())                     # nothing written past the end


def test_dequant_q4k_quantized_weights():
    import cupy as cp
    from minfer.format.quantize import quantize
    fp = _fast()

    rng = np.random.default_rng(4)
    x = (rng.standard_normal((96, 1536)) * 0.02).astype(np.float32)
    raw = quantize(x, QT.Q4_K)
    want = gq.dequantize(raw, QT.Q4_K).astype(np.float16)
    w16 = fp.dequant_f16(cp.asarray(raw), QT.Q4_K, 96, 1536, out=_nan16(cp, 96 * 1536))
    _assert_bits_equal(w16.get(), want)


@pytest.mark.parametrize("n_out,n_in", [(1, 256), (29, 512), (133, 1792)])
def test_dequant_q6k_padded(n_out, n_in):
    import cupy as cp
    from minfer.backend.cuda.q6k_layout import pad_q6k
    fp = _fast()

    rng = np.random.default_rng(n_out * 11 + n_in)
    raw = _random_q6k(rng, n_out, n_in)
    want = gq.dequantize(raw, QT.Q6_K).astype(np.float16)
    padded = pad_q6k(raw)                                               # (n_out, nb*224)
    w16 = fp.dequant_f16(cp.asarray(padded), QT.Q6_K, n_out, n_in,
                                out=_nan16(cp, n_out * n_in))
    _assert_bits_equal(w16.get(), want)


def test_dequant_q6k_from_wexp_reads_the_plane():
    """The W_exp variant takes ql/qh from the plane: with ql/qh wiped from the
    padded blocks it must still reproduce the original weight exactly (and the
    padded-only kernel must not, which shows the wipe mattered)."""
    import cupy as cp
    from minfer.backend.cuda.q6k_layout import expand_q6k_dense, pad_q6k
    fp = _fast()

    n_out, n_in = 45, 1024
    rng = np.random.default_rng(6)
    raw = _random_q6k(rng, n_out, n_in)
    want = gq.dequantize(raw, QT.Q6_K).astype(np.float16)
    padded = pad_q6k(raw)
    plane = expand_q6k_dense(padded, n_out, n_in)                       # (n_out, n_in) int8
    wiped = padded.reshape(n_out, -1, 224).copy()
    wiped[:, :, :192] = 0                                               # ql, qh gone; scales, d kept
    wiped = wiped.reshape(n_out, -1)
    w16 = fp.dequant_f16(cp.asarray(wiped), QT.Q6_K, n_out, n_in,
                                out=_nan16(cp, n_out * n_in), w_exp=cp.asarray(plane))
    _assert_bits_equal(w16.get(), want)
    w16_wiped = fp.dequant_f16(cp.asarray(wiped), QT.Q6_K, n_out, n_in)
    assert not np.array_equal(w16_wiped.get().view(np.uint16), want.view(np.uint16))


def test_dequant_many_side_by_side_in_one_scratch(monkeypatch):
    """Several weights of mixed types (q4_K, q6_K padded, q6_K through its plane, a
    group type) dequantized side by side into one poisoned scratch: each equals
    gguf's values, nothing is written between or past them, and the k-quant ones
    went up to three a launch (the group type on its own)."""
    import cupy as cp
    from minfer.backend.cuda.kernels import dequant_f16
    from minfer.backend.cuda.q6k_layout import expand_q6k_dense, pad_q6k

    rng = np.random.default_rng(21)
    specs = [(QT.Q4_K, 37, 768), (QT.Q6_K, 29, 512), ("exp", 45, 1024), (QT.Q4_0, 3, 96),
             (QT.Q4_K, 1, 256), (QT.Q6_K, 133, 256)]
    gap = 8                                                              # poisoned halves between
    total = sum(n * k + gap for _, n, k in specs)
    scratch = _nan16(cp, total + 64)
    items, wants, at = [], [], 0
    for kind, n_out, n_in in specs:
        if kind == QT.Q4_K:
            raw = _random_q4k(rng, n_out, n_in)
            want, dev, qt, plane = gq.dequantize(raw, QT.Q4_K), raw, QT.Q4_K, None
        elif kind == QT.Q4_0:
            raw = _random_blocks(QT.Q4_0, n_out, n_in, 21)
            want, dev, qt, plane = gq.dequantize(raw, QT.Q4_0), raw, QT.Q4_0, None
        else:
            raw = _random_q6k(rng, n_out, n_in)
            want, dev, qt = gq.dequantize(raw, QT.Q6_K), pad_q6k(raw), QT.Q6_K
            plane = cp.asarray(expand_q6k_dense(dev, n_out, n_in)) if kind == "exp" else None
        items.append((cp.asarray(dev).reshape(-1), qt, n_out, n_in, scratch[at:at + n_out * n_in], plane))
        wants.append((at, want.astype(np.float16)))
        at += n_out * n_in + gap
    launches, real = [], dequant_f16._launch_segments
    monkeypatch.setattr(dequant_f16, "_launch_segments", lambda segs: (launches.append(len(segs)), real(segs)))
    w16s = dequant_f16.dequant_f16_many(items)
    assert launches == [3, 2]
    host = scratch.get()
    for (start, want), w16, (_, _, n_out, n_in, _, _) in zip(wants, w16s, items):
        assert w16.shape == (n_out, n_in)
        _assert_bits_equal(w16.get(), want)
        assert np.isnan(host[start + n_out * n_in:start + n_out * n_in + gap]).all()
    assert np.isnan(host[at:]).all()                                   # past the last gap


def test_dequant_rejects_bad_input():
    import cupy as cp
    from minfer.errors import MinferError
    fp = _fast()

    with pytest.raises(MinferError, match="no f16 dequantizer"):
        fp.dequant_f16(cp.zeros(84, cp.uint8), QT.Q2_K, 1, 256)
    with pytest.raises(ValueError, match="elements"):                   # unpadded q6_K bytes
        fp.dequant_f16(cp.zeros(210, cp.uint8), QT.Q6_K, 1, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        fp.dequant_f16(cp.zeros(144, cp.uint8), QT.Q4_K, 1, 200)


def test_cast_f16_rounds_like_numpy():
    import cupy as cp
    fp = _fast()

    rng = np.random.default_rng(8)
    x = np.concatenate([
        rng.standard_normal(4001).astype(np.float32) * 3,
        np.float32([65504, 65520, 7e4, -7e4, 6e-8, 3e-8, 1e-9, 0.0, -0.0]),   # max, overflow, subnormals
        # f32 values exactly halfway between two f16 neighbours (ties to even)
        (np.arange(1, 64, dtype=np.float32) * 2 + 1) * np.float32(2 ** -11) + 1,
    ]).astype(np.float32)
    x = x[: len(x) // 4 * 4].reshape(-1, 4)
    y = fp.cast_f16(cp.asarray(x), out=_nan16(cp, x.size))
    _assert_bits_equal(y.get(), x.astype(np.float16))


# --- GEMM ---------------------------------------------------------------------
def _gemm_bound(x16, w16):
    """|x16| @ |w16|^T in float64: the scale of each output's summation."""
    return np.abs(x16.astype(np.float64)) @ np.abs(w16.astype(np.float64)).T


@pytest.mark.parametrize("T,K,N", [(1, 256, 64), (37, 768, 200), (300, 1536, 520)])
def test_gemm_f16(T, K, N):
    """f16 products are exact in f32 and summed in f32: |err| <= K * u * sum|x w|
    with u = 2^-23 (tensor-core adds may truncate instead of rounding: one ulp,
    not half); an f16 output adds one rounding, 2^-11 of |out| <= sum|x w|.
    Observed errors of random data are far below these worst cases."""
    import cupy as cp
    fp = _fast()

    rng = np.random.default_rng(T + K + N)
    x16 = rng.standard_normal((T, K)).astype(np.float16)
    w16 = (rng.standard_normal((N, K)) * 0.05).astype(np.float16)
    want = x16.astype(np.float64) @ w16.astype(np.float64).T
    bound = _gemm_bound(x16, w16)
    acc = K * 2.0 ** -23
    for dtype, tol in ((cp.float32, acc), (cp.float16, acc + 2.0 ** -11)):
        out = cp.full((T, N), cp.nan, dtype=dtype)
        fp.gemm_f16(cp.asarray(x16), cp.asarray(w16), out)
        err = np.abs(out.get().astype(np.float64) - want) / bound
        assert err.max() < tol, (dtype, err.max())


@pytest.mark.parametrize("T,K,N", [(5, 512, 72), (333, 1536, 520), (1000, 896, 4864)])
def test_gemm_candidates_give_the_same_bits(T, K, N):
    """cublas.py may run any of the heuristic's (non split-K) candidates for a problem
    (the eager and the replayed choice differ): each must give the bits of the first."""
    import cupy as cp
    from minfer.backend.cuda import cublas
    lt = cublas._lt()
    rng = np.random.default_rng(T * K + N)
    x16 = cp.asarray(rng.standard_normal((T, K)).astype(np.float16))
    w16 = cp.asarray((rng.standard_normal((N, K)) * 0.05).astype(np.float16))
    for dtype, c_type in ((cp.float32, cublas.CUDA_R_32F), (cp.float16, cublas.CUDA_R_16F)):
        outs = []
        for algo in lt.candidates(N, K, T, c_type):
            out = cp.full((T, N), cp.nan, dtype=dtype)
            lt.matmul(x16, w16, out, cublas._ZERO, algo, cp.cuda.get_current_stream().ptr)
            outs.append(out.get())
        assert len(outs) >= 1
        for o in outs[1:]:
            _assert_bits_equal(o, outs[0])


def test_gemm_choice_first_use_and_replay():
    """A new shape preloads the first choices at the grid's lengths: a grid length
    then runs its first choice eagerly; an off-grid length runs the best candidate
    among the preloaded kernels (the first choice when none is); under
    best_kernels() every length runs the first choice. Outputs equal either way."""
    import cupy as cp
    from minfer.backend.cuda import cublas
    lt = cublas._lt()
    K, N = 1280, 328                                  # a shape no other test uses
    rng = np.random.default_rng(7)
    w16 = cp.asarray((rng.standard_normal((N, K)) * 0.05).astype(np.float16))
    before = cublas.stats()
    for T in (cublas.GRID_STEP * 3, 2, 777, 1999):
        x16 = cp.asarray(rng.standard_normal((T, K)).astype(np.float16))
        eager = cublas.gemm_f16(x16, w16, cp.empty((T, N), cp.float32))
        with cublas.best_kernels():
            best = cublas.gemm_f16(x16, w16, cp.empty((T, N), cp.float32))
        _assert_bits_equal(eager.get(), best.get())
        cands = lt.candidates(N, K, T, cublas.CUDA_R_32F)
        loaded = lt.preloaded[(N, K, cublas.CUDA_R_32F)]
        plan = lt._plans[(N, K, T, cublas.CUDA_R_32F, 256)]
        assert bytes(plan[1]) == bytes(cands[0])
        want = next((c for c in cands if cublas._kernel_key(c) in loaded), cands[0])
        assert bytes(plan[0]) == bytes(want)
        if T in cublas.preload_grid():
            assert bytes(plan[0]) == bytes(cands[0]), T
    after = cublas.stats()
    assert after["problems"] - before["problems"] == 4
    assert after["preloaded kernels"] > before["preloaded kernels"]
    assert after["first choice"] - before["first choice"] >= 2       # the two grid lengths


@pytest.mark.parametrize("qtype,use_exp", [(QT.Q4_K, False), (QT.Q6_K, False), (QT.Q6_K, True)])
def test_linear_f16(qtype, use_exp):
    """x f32 -> f16, W -> f16 (exact per the dequant tests), one GEMM: compared with
    float64 on the same two f16 operands, bound as in test_gemm_f16."""
    import cupy as cp
    from minfer.backend.cuda.q6k_layout import expand_q6k_dense, pad_q6k
    from minfer.format.quantize import quantize
    fp = _fast()

    T, n_out, n_in = 45, 320, 1280
    rng = np.random.default_rng(12)
    w = (rng.standard_normal((n_out, n_in)) * 0.03).astype(np.float32)
    raw = quantize(w, qtype)
    w16_ref = gq.dequantize(raw, qtype).astype(np.float16)
    dev_raw = pad_q6k(raw) if qtype == QT.Q6_K else raw
    w_exp = cp.asarray(expand_q6k_dense(dev_raw, n_out, n_in)) if use_exp else None
    x = rng.standard_normal((T, n_in)).astype(np.float32)
    x16 = cp.full(T * n_in + 8, cp.nan, cp.float16)                       # scratch, oversized
    w16 = cp.full(n_out * n_in + 8, cp.nan, cp.float16)
    bias = rng.standard_normal(n_out).astype(np.float32)
    y = fp.linear_f16(cp.asarray(x), cp.asarray(dev_raw), qtype, n_out, n_in,
                             x16=x16, w16=w16, w_exp=w_exp, bias=cp.asarray(bias))
    xr = x.astype(np.float16)
    want = xr.astype(np.float64) @ w16_ref.astype(np.float64).T + bias
    # + one f32 rounding of the bias add: 2^-24 of |out|, inside the bound's slack
    err = np.abs(y.get().astype(np.float64) - want) / (_gemm_bound(xr, w16_ref) + np.abs(bias))
    assert y.shape == (T, n_out) and err.max() < n_in * 2.0 ** -23, err.max()


# --- flash attention ------------------------------------------------------------
def _attn_ref(q16, k16, v16, pos0, rows=None):
    """float64 causal GQA attention of the f16 inputs for query rows `rows`."""
    T, n_head, hd = q16.shape
    n_kv = k16.shape[1]
    grp = n_head // n_kv
    rows = np.arange(T) if rows is None else np.asarray(rows)
    n_keys = pos0 + T
    out = np.zeros((len(rows), n_head * hd))
    for h in range(n_head):
        K = k16[:n_keys, h // grp].astype(np.float64)                   # (n_keys, hd)
        V = v16[:n_keys, h // grp].astype(np.float64)
        S = q16[rows, h].astype(np.float64) @ K.T / math.sqrt(hd)       # (rows, n_keys)
        S[np.arange(n_keys)[None, :] > (pos0 + rows)[:, None]] = -np.inf
        P = np.exp(S - S.max(axis=1, keepdims=True))
        out[:, h * hd:(h + 1) * hd] = (P / P.sum(axis=1, keepdims=True)) @ V
    return out


def _attn_inputs(rng, T, pos0, n_head, n_kv, n_ctx):
    q = rng.standard_normal((T, n_head, 128)).astype(np.float32)
    kc = np.full((n_ctx, n_kv, 128), np.nan, np.float16)               # poison: past keys are
    vc = np.full((n_ctx, n_kv, 128), np.nan, np.float16)               # filled below, the rest NaN
    kc[:pos0 + T] = rng.standard_normal((pos0 + T, n_kv, 128)) * 1.5
    vc[:pos0 + T] = rng.standard_normal((pos0 + T, n_kv, 128))
    return q, kc, vc


# The error: Q, K, V are the same f16 values in the reference; the kernel rounds
# P = exp(s - m) to f16 (relative 2^-11) before P V, while l sums the f32 P, so
# |O - O_ref| <= 2^-11 * sum_j p_j |v_j| / l <= 4.9e-4 * max|V|, plus f32 sums and
# exp2f (~1e-6). Tolerance: 1e-3 * max|V|.
ATT_TOL = 1e-3


@pytest.mark.parametrize("T,pos0,n_head,n_kv", [
    (1, 0, 7, 1),         # a single query, GQA 7:1
    (7, 0, 28, 4),        # the 7B's heads, 7:1
    (130, 0, 12, 2),      # 6:1, three query tiles, the last nearly empty
    (517, 61, 14, 2),     # 7:1, prompt continued after a cached prefix
    (64, 64, 4, 4),       # tiles exactly on the boundaries, no GQA
    (1, 200, 6, 1),       # one new token after 200 cached ones
])
@pytest.mark.parametrize("kind", ["mma", "wgmma"])
def test_flash_attention(T, pos0, n_head, n_kv, kind):
    import cupy as cp
    fp = _fast()
    _need_flash_kind(kind)

    rng = np.random.default_rng(T * 31 + pos0 + n_head)
    n_ctx = pos0 + T + 37
    q, kc, vc = _attn_inputs(rng, T, pos0, n_head, n_kv, n_ctx)
    q16 = q.astype(np.float16)
    out = cp.full((T, n_head * 128), cp.nan, cp.float32)
    fp.flash_attention(cp.asarray(q16), cp.asarray(kc), cp.asarray(vc), pos0, out, wgmma=kind == "wgmma")
    want = _attn_ref(q16, kc, vc, pos0)
    err = np.abs(out.get().astype(np.float64) - want).max() / np.abs(vc[:pos0 + T].astype(np.float64)).max()
    assert err < ATT_TOL, err


def _need_flash_kind(kind):
    from minfer.backend.cuda.kernels import flash_attn
    if flash_attn.flash_kind(kind == "wgmma") != kind:
        pytest.skip(f"this GPU has no {kind} flash kernel (flash_attn_sm90.cu is for compute capability 9.0)")


@pytest.mark.parametrize("T,pos0,n_head,n_kv", [
    (3325, 0, 28, 4),     # the 7B's prompt and heads
    (517, 61, 14, 2),     # continued after a cached prefix
    (130, 0, 12, 2),      # 6:1, a nearly empty last item
    (77, 100, 8, 1),      # 8:1, the most query heads decode takes
    (1, 200, 6, 1),
])
def test_flash_wgmma_equals_mma_bit_for_bit(T, pos0, n_head, n_kv):
    """The Hopper kernel does the mma.sync kernel's arithmetic in its order (the same
    tiles, the same softmax, the tensor cores' 16-wide sums): both outputs (f32 and
    the f16 operand) are the same bits, on poisoned caches (NaN past the prompt)."""
    import cupy as cp
    fp = _fast()
    _need_flash_kind("wgmma")

    rng = np.random.default_rng(T + 7 * pos0 + n_head)
    q, kc, vc = _attn_inputs(rng, T, pos0, n_head, n_kv, pos0 + T + 29)
    q16, kc, vc = cp.asarray(q.astype(np.float16)), cp.asarray(kc), cp.asarray(vc)
    for dtype in (cp.float32, cp.float16):
        got = {}
        for kind in ("mma", "wgmma"):
            got[kind] = cp.full((T, n_head * 128), cp.nan, dtype)
            fp.flash_attention(q16, kc, vc, pos0, got[kind], wgmma=kind == "wgmma")
        assert not bool(cp.isnan(got["wgmma"]).any())
        _assert_bits_equal(got["wgmma"].get(), got["mma"].get())


def test_attention_f16_long_prompt_subset():
    """T = 3325 (the target prompt), GQA 7:1: attention_f16 stores K/V (checked
    exactly), rounds q, and attends; a subset of rows (tile edges, the last row,
    random ones) is checked against float64."""
    import cupy as cp
    fp = _fast()

    T, pos0, n_head, n_kv = 3325, 0, 7, 1
    n_ctx = T + 11
    rng = np.random.default_rng(3325)
    q = rng.standard_normal((T, n_head, 128)).astype(np.float32)
    k = (rng.standard_normal((T, n_kv, 128)) * 1.5).astype(np.float32)
    v = rng.standard_normal((T, n_kv, 128)).astype(np.float32)
    kc = cp.full((n_ctx, n_kv, 128), cp.nan, cp.float16)
    vc = cp.full((n_ctx, n_kv, 128), cp.nan, cp.float16)
    out = fp.attention_f16(cp.asarray(q), cp.asarray(k), cp.asarray(v), kc, vc, pos0)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    _assert_bits_equal(kc[:T].get(), k16)
    _assert_bits_equal(vc[:T].get(), v16)
    assert bool(cp.isnan(kc[T:]).all()) and bool(cp.isnan(vc[T:]).all())   # rows past T untouched
    rows = np.unique(np.concatenate([[0, 1, 63, 64, 65, 2047, 3263, 3264, T - 1],
                                     rng.integers(0, T, 24)]))
    want = _attn_ref(q.astype(np.float16), k16, v16, pos0, rows)
    err = np.abs(out.get()[rows].astype(np.float64) - want).max() / np.abs(v16).max()
    assert err < ATT_TOL, err


def test_attention_f16_continues_a_cache():
    """Two calls (prefix of 100, then 77 more at pos0 = 100) equal one call on all
    177 positions within the tolerance: the second call sees the first's K/V."""
    import cupy as cp
    fp = _fast()

    n_head, n_kv, T1, T2 = 6, 1, 100, 77
    rng = np.random.default_rng(177)
    q = rng.standard_normal((T1 + T2, n_head, 128)).astype(np.float32)
    k = rng.standard_normal((T1 + T2, n_kv, 128)).astype(np.float32)
    v = rng.standard_normal((T1 + T2, n_kv, 128)).astype(np.float32)
    kc = cp.full((200, n_kv, 128), cp.nan, cp.float16)
    vc = cp.full((200, n_kv, 128), cp.nan, cp.float16)
    fp.attention_f16(cp.asarray(q[:T1]), cp.asarray(k[:T1]), cp.asarray(v[:T1]), kc, vc, 0)
    out2 = fp.attention_f16(cp.asarray(q[T1:]), cp.asarray(k[T1:]), cp.asarray(v[T1:]), kc, vc, T1)
    want = _attn_ref(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), 0)[T1:]
    err = np.abs(out2.get().astype(np.float64) - want).max() / np.abs(v.astype(np.float16)).max()
    assert err < ATT_TOL, err


def test_attention_rejects_bad_input():
    import cupy as cp
    from minfer.errors import MinferError
    fp = _fast()

    kc = cp.zeros((10, 2, 128), cp.float16)
    with pytest.raises(MinferError, match="do not fit the KV cache"):
        fp.flash_attention(cp.zeros((8, 4, 128), cp.float16), kc, kc, 3)
    with pytest.raises(ValueError, match="do not group"):
        fp.flash_attention(cp.zeros((2, 3, 128), cp.float16), kc, kc, 0)
    with pytest.raises(ValueError, match="128"):
        fp.flash_attention(cp.zeros((2, 4, 64), cp.float16), kc, kc, 0)
