"""The decode step's fused kernels give the bits of the unfused kernels they replace:

    rmsnorm_q8_1        == quantize_q8_1(rmsnorm(x))
    matvecs (3 weights) == three matvec launches; with a residual == add(res, matvec)
    matvecs of B rows   == each row alone (B = 1), for every B up to past MAX_NB
    swiglu_q8_1         == quantize_q8_1(swiglu(gate, up))
    rope_store_kv_f16   == rope(q), rope(k), store_kv_f16(k, v); with the q/k/v biases
                           and q to f16 == the bias adds, then those, then cast_f16(q);
                           q/k/v as column blocks of one matrix == packed q/k/v
    q/k/v as one f16 GEMM over the weights side by side == three GEMMs
    gate/up as one f16 GEMM, SwiGLU over its column blocks == two GEMMs, packed SwiGLU
    rmsnorm (f16 out)   == cast_f16(rmsnorm(x))
    decode attention with the q8_1 output == quantize_q8_1(decode attention)
    f16 GEMM accumulating into the residual ~= residual + GEMM (cuBLAS may take
                           another kernel for beta = 1: a tolerance of f32 sums)

The unfused kernels are each checked against NumPy (test_ops.py, test_mmq.py,
test_quants32.py, test_decode.py); equality bit for bit is what keeps the greedy
streams (tests/golden) unchanged by the fusion. Irregular shapes; outputs poisoned
with NaN first (an element a kernel forgets fails the comparison)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from .test_mmq import _acts, _info, _pad, _weights
from .test_quants32 import _random_blocks

pytestmark = pytest.mark.gpu

TYPES = (QT.Q4_K, QT.Q6_K, QT.Q4_1, QT.Q8_0, QT.Q5_K, QT.Q5_0)


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy



def _labels(counts: dict) -> dict:
    """The path labels of a counters table (the launches by kernel name left out: a
    grouped GEMM is fewer launches on the same paths)."""
    from minfer.backend.cuda.counters import LABELS
    return {k: v for k, v in counts.items() if k in LABELS}

def _raw(qtype, n_out: int, K: int, seed: int) -> np.ndarray:
    if qtype in (QT.Q4_K, QT.Q6_K):
        return _pad(qtype, _weights(qtype, n_out, K, seed=seed))
    return _random_blocks(qtype, n_out, K, seed)


def _x(rng, T: int, K: int) -> np.ndarray:
    x = (rng.standard_normal((T, K)) * rng.uniform(0.2, 4.0, (1, K))).astype(np.float32)
    x[rng.random((T, K)) < 0.01] *= 30.0
    return x


def _same(a, b) -> bool:
    a, b = (np.ascontiguousarray(v) for v in (a, b))
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _q8_equal(cp, got, want) -> None:
    for g, w, nm in zip(got, want, "qds"):
        assert _same(cp.asnumpy(g), cp.asnumpy(w)), nm


@pytest.mark.parametrize("T,K", [(1, 96), (1, 1536), (3, 3584), (2, 8960)])
def test_rmsnorm_q8_1_equals_norm_then_quantize(cp, T, K):
    from minfer.backend.cuda.kernels import norm, quantize
    rng = np.random.default_rng([T, K])
    x, w = cp.asarray(_x(rng, T, K)), cp.asarray(rng.uniform(0.5, 2.0, K).astype(np.float32))
    if T > 1:
        x[T - 1, :32] = 0.0                                   # an all-zero block (amax == 0)
    want = quantize.quantize_q8_1(norm.rmsnorm(x, w, 1e-6))
    got = (cp.full((T, K), 7, cp.int8), cp.full((T, K // 32), cp.nan, cp.float32),
           cp.full((T, K // 32), cp.nan, cp.float32))
    norm.rmsnorm_q8_1(x, w, 1e-6, *got)
    _q8_equal(cp, got, want)


def test_matvecs_q4k_q4k_q6k_in_one_launch_equal_their_own_launches(cp):
    """q and k q4_K beside a q6_K attn_v (the 7B's layers): the mixed launch gives
    each weight the bits of its own launch."""
    from minfer.backend.cuda.kernels import quantize
    from minfer.backend.cuda.kernels.matvec import matvec, matvecs
    rng = np.random.default_rng(9)
    K, segs = 1024, ((QT.Q4_K, 300), (QT.Q4_K, 40), (QT.Q6_K, 40))
    ws = [cp.asarray(_raw(t, od, K, i)) for i, (t, od) in enumerate(segs)]
    bias = cp.asarray(rng.standard_normal(40).astype(np.float32))
    q8 = quantize.quantize_q8_1(cp.asarray(_x(rng, 1, K)))
    for order in ((0, 1, 2), (2, 0, 1)):
        got = matvecs(*q8, [(segs[i][0], ws[i], segs[i][1], bias if i == 2 else None, None, None) for i in order])
        for y, i in zip(got, order):
            want = matvec(segs[i][0], *q8, ws[i], segs[i][1], bias if i == 2 else None)
            assert _same(cp.asnumpy(y), cp.asnumpy(want)), (order, i)


def test_matvecs_refuses_weights_that_split_differently(cp):
    from minfer.backend.cuda.kernels import quantize
    from minfer.backend.cuda.kernels.matvec import SPLIT_BELOW_ROWS, matvecs
    small, big = (cp.asarray(_raw(QT.Q8_0, n, 64, 0)) for n in (32, SPLIT_BELOW_ROWS))
    q8 = quantize.quantize_q8_1(cp.zeros((1, 64), cp.float32))
    with pytest.raises(ValueError, match="split K differently"):
        matvecs(*q8, [(QT.Q8_0, small, 32, None, None, None),
                      (QT.Q8_0, big, SPLIT_BELOW_ROWS, None, None, None)])
    with pytest.raises(ValueError, match="cannot share"):
        matvecs(*q8, [(QT.Q8_0, small, 32, None, None, None), (QT.Q4_1, small, 32, None, None, None)])


@pytest.mark.parametrize("qtypes", [(QT.Q4_K,) * 2, (QT.Q4_K, QT.Q6_K), (QT.Q6_K,), (QT.Q5_0,) * 3],
                         ids=lambda ts: "+".join(t.name for t in ts))
@pytest.mark.parametrize("ods", [(300, 37, 64), (9000, 8193, 8200)], ids=["split", "whole-K"])
def test_matvecs_rows_per_warp_give_the_same_bits(cp, qtypes, ods):
    """Every rows-per-warp of a launch gives the bits of every other: a row's sums
    do not depend on it."""
    from minfer.backend.cuda.kernels import quantize
    from minfer.backend.cuda.kernels.matvec import RPW, matvecs
    rng = np.random.default_rng([len(qtypes), ods[0]])
    K = 512
    segs = [(t, cp.asarray(_raw(t, od, K, i)), od) for i, (t, od) in enumerate(zip(qtypes, ods))]
    res = cp.asarray(rng.standard_normal((1, ods[0])).astype(np.float32))
    q8 = quantize.quantize_q8_1(cp.asarray(_x(rng, 1, K)))
    got = {r: [cp.asnumpy(y) for y in matvecs(*q8, [(t, w, od, None, res if i == 0 else None,
                                                     cp.full((1, od), cp.nan, cp.float32))
                                                    for i, (t, w, od) in enumerate(segs)], rpw=r)]
           for r in RPW}
    for r in RPW[1:]:
        assert all(_same(a, b) for a, b in zip(got[r], got[RPW[0]])), r
    assert all(np.isfinite(y).all() for y in got[2])
    with pytest.raises(ValueError, match="rows per warp"):
        matvecs(*q8, [(t, w, od, None, None, None) for t, w, od in segs], rpw=3)


@pytest.mark.parametrize("qtypes", [(QT.Q4_K,) * 3, (QT.Q4_K, QT.Q4_K, QT.Q6_K), (QT.Q6_K,), (QT.Q5_0,),
                                    (QT.Q4_1, QT.Q4_1), (QT.Q8_0,), (QT.Q5_K,)],
                         ids=lambda ts: "+".join(t.name for t in ts))
@pytest.mark.parametrize("ods", [(300, 37, 64), (9000, 8193, 8200)], ids=["split", "whole-K"])
def test_matvecs_of_b_rows_give_each_row_its_one_row_bits(cp, qtypes, ods):
    """A decode step of B sequences runs its linears as matvecs of B rows: each
    row's output (bias and residual included) is bit for bit what it is alone,
    for every B (launches of 8, 4, 2 and 1 rows), so a sequence's greedy stream
    does not depend on its neighbours."""
    from minfer.backend.cuda.kernels import quantize
    from minfer.backend.cuda.kernels.matvec import MAX_NB, matvecs, row_launches
    rng = np.random.default_rng([len(qtypes), ods[0], int(qtypes[-1])])
    K = 768
    ods = ods[:len(qtypes)]
    segs = [(t, cp.asarray(_raw(t, od, K, i)), od) for i, (t, od) in enumerate(zip(qtypes, ods))]
    bias = cp.asarray(rng.standard_normal(ods[-1]).astype(np.float32))
    B = 2 * MAX_NB + 3                                   # launches of 8, 8, 2 and 1 rows
    assert [nb for _, nb in row_launches(B)] == [8, 8, 2, 1]
    x = cp.asarray(_x(rng, B, K))
    res = cp.asarray(rng.standard_normal((B, ods[0])).astype(np.float32))
    q8 = quantize.quantize_q8_1(x)

    def run(rows):
        n = rows.stop - rows.start
        return [cp.asnumpy(y) for y in matvecs(
            *(a[rows] for a in q8),
            [(t, w, od, bias if i == len(segs) - 1 else None,
              res[rows].copy() if i == 0 else None, cp.full((n, od), cp.nan, cp.float32))
             for i, (t, w, od) in enumerate(segs)])]

    alone = [run(slice(b, b + 1)) for b in range(B)]
    for lo, hi in ((0, B), (0, 4), (3, 5), (5, 12)):
        got = run(slice(lo, hi))
        for i in range(len(segs)):
            assert np.isfinite(got[i]).all()
            for b in range(lo, hi):
                assert _same(got[i][b - lo], alone[b][i][0]), (lo, hi, i, b)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matvecs_three_weights_equal_three_launches(cp, qtype):
    from minfer.backend.cuda.kernels import elementwise, quantize
    from minfer.backend.cuda.kernels.matvec import matvec, matvecs
    rng = np.random.default_rng(int(qtype))
    K = 768
    ods = (200, 37, 64)                                  # never a whole number of blocks' rows
    ws = [cp.asarray(_raw(qtype, od, K, i)) for i, od in enumerate(ods)]
    biases = [cp.asarray(rng.standard_normal(od).astype(np.float32)) if i != 1 else None
              for i, od in enumerate(ods)]
    res = [None, None, cp.asarray(rng.standard_normal((1, ods[2])).astype(np.float32))]
    q8 = quantize.quantize_q8_1(cp.asarray(_x(rng, 1, K)))
    outs = [cp.full((1, od), cp.nan, cp.float32) for od in ods]
    got = matvecs(*q8, [(qtype,) + seg for seg in zip(ws, ods, biases, res, outs)])
    assert all(g is o for g, o in zip(got, outs))
    for i, od in enumerate(ods):
        want = matvec(qtype, *q8, ws[i], od, biases[i])
        if res[i] is not None:
            want = elementwise.add(res[i], want)
        assert _same(cp.asnumpy(got[i]), cp.asnumpy(want)), i


@pytest.mark.parametrize("T,n", [(1, 96), (1, 8960), (3, 544)])
def test_swiglu_q8_1_equals_swiglu_then_quantize(cp, T, n):
    from minfer.backend.cuda.kernels import elementwise, quantize
    rng = np.random.default_rng([T, n])
    g, u = (cp.asarray(_x(rng, T, n)) for _ in range(2))
    g[0, :32] = -200.0                                   # exp(-g) overflows: silu = -0
    want = quantize.quantize_q8_1(elementwise.swiglu(g, u))
    got = (cp.full((T, n), 7, cp.int8), cp.full((T, n // 32), cp.nan, cp.float32),
           cp.full((T, n // 32), cp.nan, cp.float32))
    quantize.swiglu_q8_1(g, u, *got)
    _q8_equal(cp, got, want)


@pytest.mark.parametrize("T,pos,on_device", [(1, 0, True), (1, 77, True), (6, 5, False), (1, 9, False)])
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "pairs"])
def test_rope_store_kv_equals_rope_then_store(cp, T, pos, on_device, neox):
    from minfer.backend.cuda.kernels import decode_attn, rope
    from minfer.backend.cuda.launch import DevicePos
    rng = np.random.default_rng([T, pos, neox])
    n_head, n_kv, hd, n_ctx = 12, 2, 128, 96
    table = cp.asarray(rope.rope_table(n_ctx, hd, 1e6))
    q, k, v = (cp.asarray((rng.standard_normal((T, h, hd)) * 3).astype(np.float32))
               for h in (n_head, n_kv, n_kv))
    p = DevicePos(pos, cp.asarray(np.array([pos], np.int32))) if on_device else pos
    kc_w, vc_w = cp.full((n_ctx, n_kv, hd), np.nan, cp.float16), cp.full((n_ctx, n_kv, hd), np.nan, cp.float16)
    q_w = rope.rope(q, table, p, neox)
    decode_attn.store_kv_f16(rope.rope(k, table, p, neox), v, kc_w, vc_w, p)
    kc, vc = cp.full_like(kc_w, np.nan), cp.full_like(vc_w, np.nan)
    q_out = cp.full_like(q, np.nan)
    assert decode_attn.rope_store_kv_f16(q, k, v, kc, vc, table, p, neox, q_out) is q_out
    assert _same(cp.asnumpy(q_out), cp.asnumpy(q_w))
    for got, want in ((kc, kc_w), (vc, vc_w)):                  # NaN rows match NaN rows bytewise
        assert _same(cp.asnumpy(got), cp.asnumpy(want))


@pytest.mark.parametrize("pos,n_ctx", [(0, 70), (63, 70), (64, 200), (130, 131)])
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "pairs"])
def test_decode_attention_with_rope_equals_rope_store_then_attention(cp, pos, n_ctx, neox):
    """RoPE and the store of the new row inside the decode attention: the same output
    and the same cache bytes as rope_store_kv_f16 then decode_attention (the row
    at pos lands in the chunk's first, middle or last key)."""
    from minfer.backend.cuda.kernels import decode_attn, rope
    from minfer.backend.cuda.launch import DevicePos
    rng = np.random.default_rng([pos, n_ctx, neox])
    n_head, n_kv, hd = 28, 4, 128
    table = cp.asarray(rope.rope_table(n_ctx, hd, 1e6))
    q, k, v = (cp.asarray((rng.standard_normal((1, h, hd)) * 2).astype(np.float32))
               for h in (n_head, n_kv, n_kv))
    kc0, vc0 = (rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float16) for _ in range(2))
    kc0[pos + 1:] = vc0[pos + 1:] = np.nan                      # never read
    p = DevicePos(pos, cp.asarray(np.array([pos], np.int32)))
    kc_w, vc_w = cp.asarray(kc0), cp.asarray(vc0)
    kc, vc = kc_w.copy(), vc_w.copy()
    qr = decode_attn.rope_store_kv_f16(q, k, v, kc_w, vc_w, table, p, neox)
    want = decode_attn.decode_attention(qr, kc_w, vc_w, p)
    got = decode_attn.decode_attention(q, kc, vc, p, new_kv=(k, v), cos_sin=table, neox=neox)
    assert np.isfinite(cp.asnumpy(got)).all()
    assert _same(cp.asnumpy(got), cp.asnumpy(want))
    assert _same(cp.asnumpy(kc), cp.asnumpy(kc_w)) and _same(cp.asnumpy(vc), cp.asnumpy(vc_w))


@pytest.mark.parametrize("pos,n_ctx", [(0, 70), (130, 300)])
def test_decode_attention_q8_output_equals_attention_then_quantize(cp, pos, n_ctx):
    """The combine writing the o projection's q8_1 operand: quantize_q8_1 of the f32
    output, bit for bit (one split and several)."""
    from minfer.backend.cuda.kernels import decode_attn, quantize
    rng = np.random.default_rng([pos, n_ctx, 8])
    n_head, n_kv, hd = 28, 4, 128
    q = cp.asarray((rng.standard_normal((1, n_head, hd)) * 2).astype(np.float32))
    kc, vc = (cp.asarray(rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float16)) for _ in range(2))
    want = quantize.quantize_q8_1(decode_attn.decode_attention(q, kc, vc, pos))
    got = (cp.full((1, n_head * hd), 77, cp.int8), cp.full((1, n_head * hd // 32), np.nan, cp.float32),
           cp.full((1, n_head * hd // 32), np.nan, cp.float32))
    assert decode_attn.decode_attention(q, kc, vc, pos, q8=got) is got
    _q8_equal(cp, got, want)
    with pytest.raises(ValueError, match="one output"):
        decode_attn.decode_attention(q, kc, vc, pos, out=cp.empty((1, n_head * hd), cp.float32), q8=got)


@pytest.mark.parametrize("T,K", [(2, 96), (5, 1536), (4, 999), (3, 3584), (2, 8960), (3, 5000)])
def test_rmsnorm_f16_equals_norm_then_cast(cp, T, K):
    from minfer.backend.cuda.kernels import dequant_f16, norm
    rng = np.random.default_rng([T, K, 16])
    x, w = cp.asarray(_x(rng, T, K)), cp.asarray(rng.uniform(0.5, 2.0, K).astype(np.float32))
    want = dequant_f16.cast_f16(norm.rmsnorm(x, w, 1e-6))
    got = cp.full((T, K), np.nan, cp.float16)
    assert norm.rmsnorm(x, w, 1e-6, out=got, dtype=cp.float16) is got
    assert _same(cp.asnumpy(got), cp.asnumpy(want))


@pytest.mark.parametrize("T,pos0,n_head,n_kv", [(2, 0, 28, 4), (37, 5, 12, 2), (333, 0, 28, 4), (130, 70, 8, 8)])
def test_flash_attention_f16_output_equals_f32_then_cast(cp, T, pos0, n_head, n_kv):
    """The flash attention storing the o projection's f16 operand: cast_f16 of its f32
    output, bit for bit, every element written (the buffer is poisoned first)."""
    from minfer.backend.cuda.kernels import dequant_f16, flash_attn
    rng = np.random.default_rng([T, pos0, n_head])
    n_ctx = pos0 + T + 3
    q = cp.asarray(rng.standard_normal((T, n_head, 128)).astype(np.float16))
    kc, vc = (cp.asarray(rng.standard_normal((n_ctx, n_kv, 128)).astype(np.float16)) for _ in range(2))
    want = dequant_f16.cast_f16(flash_attn.flash_attention(q, kc, vc, pos0))
    got = cp.full((T, n_head * 128), np.nan, cp.float16)
    assert flash_attn.flash_attention(q, kc, vc, pos0, out=got) is got
    assert _same(cp.asnumpy(got), cp.asnumpy(want))


def test_linear_f16_equals_linear_on_the_rounded_x(cp, cuda_linears):
    """linear_f16 on x already rounded to f16 (where the flash attention writes it):
    linear's bits on the f32 x, with the residual accumulated and without; a weight
    off the f16 engine (a decode row) refused."""
    from minfer.backend.cuda.kernels import dequant_f16
    T, d, n_out = 37, 512, 384
    st, parts = cuda_linears()
    w = st.register("blk.0.attn_output.weight", _info("blk.0.attn_output.weight", QT.Q4_K, n_out, d),
                    _weights(QT.Q4_K, n_out, d, seed=9))
    x = cp.asarray(_acts(T, d, seed=9))
    res = cp.asarray(_acts(T, n_out, seed=10))
    xh = dequant_f16.cast_f16(x, parts.state.x16((T, d)))
    for r in (None, res):
        want = parts.lin.linear(x, w, residual=None if r is None else r.copy())
        got = parts.lin.linear_f16(xh, w, residual=None if r is None else r.copy())
        assert _same(cp.asnumpy(got), cp.asnumpy(want))
    with pytest.raises(ValueError, match="f16-engine"):
        parts.lin.linear_f16(xh[:1], w)


@pytest.mark.parametrize("T,pos", [(6, 5), (37, 0)])
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "pairs"])
def test_rope_store_kv_with_biases_and_f16_q_equals_the_unfused_ops(cp, T, pos, neox):
    from minfer.backend.cuda.kernels import decode_attn, dequant_f16, rope
    rng = np.random.default_rng([T, pos, neox, 1])
    n_head, n_kv, hd, n_ctx = 12, 2, 128, 96
    table = cp.asarray(rope.rope_table(n_ctx, hd, 1e6))
    q, k, v = (cp.asarray((rng.standard_normal((T, h, hd)) * 3).astype(np.float32))
               for h in (n_head, n_kv, n_kv))
    bq, bk, bv = (cp.asarray(rng.standard_normal(h * hd).astype(np.float32)) for h in (n_head, n_kv, n_kv))
    kc_w, vc_w = cp.full((n_ctx, n_kv, hd), np.nan, cp.float16), cp.full((n_ctx, n_kv, hd), np.nan, cp.float16)
    qb, kb, vb = ((a.reshape(T, -1) + b).reshape(a.shape) for a, b in ((q, bq), (k, bk), (v, bv)))
    q_w = dequant_f16.cast_f16(rope.rope(qb, table, pos, neox))
    decode_attn.store_kv_f16(rope.rope(kb, table, pos, neox), vb, kc_w, vc_w, pos)
    kc, vc = cp.full_like(kc_w, np.nan), cp.full_like(vc_w, np.nan)
    q16 = cp.full(q.shape, np.nan, cp.float16)
    assert decode_attn.rope_store_kv_f16(q, k, v, kc, vc, table, pos, neox, q16, biases=(bq, bk, bv)) is q16
    assert _same(cp.asnumpy(q16), cp.asnumpy(q_w))
    for got, want in ((kc, kc_w), (vc, vc_w)):
        assert _same(cp.asnumpy(got), cp.asnumpy(want))


@pytest.mark.parametrize("T,K,N", [(7, 256, 96), (300, 1536, 544)])
def test_f16_gemm_accumulates_into_the_residual(cp, T, K, N):
    from minfer.backend.cuda import cublas
    rng = np.random.default_rng([T, K, N])
    xh = cp.asarray(rng.standard_normal((T, K)).astype(np.float16))
    w16 = cp.asarray((rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float16))
    res = cp.asarray((rng.standard_normal((T, N)) * 4).astype(np.float32))
    want = cp.asnumpy(res) + cp.asnumpy(cublas.gemm_w16(xh, w16))
    acc = res.copy()
    assert cublas.gemm_w16(xh, w16, out=acc, accumulate=True) is acc
    # f32 sums of K exact products in another order at most: a few ulp of the sum's terms
    tol = 1e-6 * (np.abs(cp.asnumpy(res)).max() + np.sqrt(K) * 4)
    assert np.abs(cp.asnumpy(acc) - want).max() <= tol
    with pytest.raises(ValueError, match="order"):
        cublas.gemm_w16(xh, w16, out=acc, bias=cp.zeros(N, cp.float32), accumulate=True)


@pytest.mark.parametrize("T,pos", [(6, 5), (37, 0)])
def test_rope_store_kv_reads_column_blocks_of_one_matrix(cp, T, pos):
    """q, k, v as views into one (T, (n_head + 2 n_kv) hd) matrix (the grouped q/k/v
    GEMM's output) give the q16 and cache bytes of the same values packed."""
    from minfer.backend.cuda.kernels import decode_attn, rope
    rng = np.random.default_rng([T, pos, 2])
    n_head, n_kv, hd, n_ctx = 12, 2, 128, 96
    table = cp.asarray(rope.rope_table(n_ctx, hd, 1e6))
    y = cp.asarray((rng.standard_normal((T, (n_head + 2 * n_kv) * hd)) * 3).astype(np.float32))
    a, b = n_head * hd, (n_head + n_kv) * hd
    views = [y[:, :a].reshape(T, n_head, hd), y[:, a:b].reshape(T, n_kv, hd), y[:, b:].reshape(T, n_kv, hd)]
    assert not views[0].flags.c_contiguous
    packed = [cp.ascontiguousarray(t) for t in views]
    bq, bk, bv = (cp.asarray(rng.standard_normal(h * hd).astype(np.float32)) for h in (n_head, n_kv, n_kv))
    outs = []
    for q, k, v in (packed, views):
        kc, vc = (cp.full((n_ctx, n_kv, hd), np.nan, cp.float16) for _ in range(2))
        q16 = cp.full((T, n_head, hd), np.nan, cp.float16)
        decode_attn.rope_store_kv_f16(q, k, v, kc, vc, table, pos, True, q16, biases=(bq, bk, bv))
        outs.append([cp.asnumpy(t) for t in (q16, kc, vc)])
    for got, want in zip(outs[1], outs[0]):
        assert _same(got, want)
    with pytest.raises(ValueError, match="strides"):
        decode_attn.rope_store_kv_f16(views[0], views[1], packed[2], kc, vc, table, pos, True, q16)


def test_qkv_as_one_gemm_equals_three_gemms(cp, cuda_linears):
    """norm_linears(views=True) on the f16 engine: q4_K q/k and a q6_K v (through its
    W_exp plane) dequantized side by side, one GEMM; each block equals its own GEMM
    bit for bit, and each weight is counted as before."""
    T, d = 37, 512
    st, parts = cuda_linears()
    ws = []
    for name, qt, n_out in (("blk.0.attn_q.weight", QT.Q4_K, 512), ("blk.0.attn_k.weight", QT.Q4_K, 128),
                            ("blk.0.attn_v.weight", QT.Q6_K, 128)):
        ws.append(st.register(name, _info(name, qt, n_out, d), _weights(qt, n_out, d, seed=len(ws) + 3)))
    x = cp.asarray(_acts(T, d, seed=5))
    norm_w = cp.asarray(np.random.default_rng(5).uniform(0.5, 1.5, d).astype(np.float32))
    assert parts.lin.groups(T, ws, (None,) * 3)
    parts.counters.reset()
    grouped = parts.lin.norm_linears(x, norm_w, 1e-6, ws, (None,) * 3, views=True)
    counts = dict(parts.counters.counts)
    parts.counters.reset()
    alone = parts.lin.norm_linears(x, norm_w, 1e-6, ws, (None,) * 3)
    assert _labels(counts) == _labels(parts.counters.counts) and counts["q6k exp"] == 1 and counts["q4k_f16"] == 2
    assert grouped[1].base is grouped[0].base and not grouped[0].flags.c_contiguous
    for g, a in zip(grouped, alone):
        assert g.shape == a.shape and _same(cp.asnumpy(g), cp.asnumpy(a))
    assert not parts.lin.groups(T, ws, (None, cp.zeros(128, cp.float32), None))      # a bias: separate
    assert not parts.lin.groups(1, ws, (None,) * 3)                                   # a decode row: matvecs


def _silu_mul_f16(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u in f32, rounded once to f16 (swiglu_f16's arithmetic in NumPy)."""
    g32, u32 = g.astype(np.float32), u.astype(np.float32)
    return (g32 / (np.float32(1) + np.exp(-g32)) * u32).astype(np.float16)


@pytest.mark.parametrize("T,n", [(1, 4), (5, 36), (37, 1000), (3, 8)])
def test_swiglu_f16_packed_and_over_column_blocks(cp, T, n):
    """swiglu_f16 against NumPy (within one f16 step: expf and np.exp may differ in the
    last f32 bit), and over the column blocks of one (T, 2n) matrix (the grouped
    gate/up GEMM's output) and over rows that allow only 4 elements a thread bit for
    bit as over packed copies."""
    from minfer.backend.cuda.kernels import dequant_f16
    rng = np.random.default_rng(T * 7 + n)
    gu = (rng.standard_normal((T, 2 * n)) * 3).astype(np.float16)
    both = cp.asarray(gu)
    g, u = both[:, :n], both[:, n:]
    assert T == 1 or not g.flags.c_contiguous                       # (one row: packed either way)
    packed = dequant_f16.swiglu_f16(cp.ascontiguousarray(g), cp.ascontiguousarray(u),
                            out=cp.full((T, n), cp.nan, cp.float16))
    strided = dequant_f16.swiglu_f16(g, u, out=cp.full((T, n), cp.nan, cp.float16))
    assert _same(cp.asnumpy(strided), cp.asnumpy(packed))
    # columns 4.. of a wider matrix: rows 8 bytes off 16-byte alignment, so the kernel
    # takes 4 elements a thread where the packed copies (n % 8 == 0) took 8
    wide = cp.zeros((T, 2 * n + 8), cp.float16)
    wide[:, 4:4 + 2 * n] = both
    shifted = dequant_f16.swiglu_f16(wide[:, 4:4 + n], wide[:, 4 + n:4 + 2 * n],
                             out=cp.full((T, n), cp.nan, cp.float16))
    assert _same(cp.asnumpy(shifted), cp.asnumpy(packed))
    want = _silu_mul_f16(gu[:, :n], gu[:, n:])
    got = cp.asnumpy(packed)
    step = np.abs(np.spacing(want.astype(np.float16))).astype(np.float32)
    assert np.all(np.abs(got.astype(np.float32) - want.astype(np.float32)) <= step)
    assert np.mean(got == want) > 0.99
    if T > 1:
        with pytest.raises(ValueError):
            dequant_f16.swiglu_f16(g, cp.ascontiguousarray(u))              # rows of two strides


def test_gate_up_as_one_gemm_equals_two_gemms(cp, cuda_linears):
    """The f16 FFN with gate and up dequantized side by side and one GEMM (f16 out),
    SwiGLU over its column blocks: the bits of two GEMMs and a packed SwiGLU, the
    same launch counts, and the grouped path really taken (the scratch holds both).
    (The fused gate/up kernel off: test_gateup.py compares it with this path.)"""
    from minfer.backend.cuda.kernels import dequant_f16
    T, d, d_ff = 29, 512, 768
    st, parts = cuda_linears(gateup_fused=False)
    ws = []
    for name, qt, n_out, n_in in (("blk.0.ffn_gate.weight", QT.Q4_K, d_ff, d),
                                  ("blk.0.ffn_up.weight", QT.Q4_K, d_ff, d),
                                  ("blk.0.ffn_down.weight", QT.Q6_K, d, d_ff)):
        ws.append(st.register(name, _info(name, qt, n_out, n_in),
                              _weights(qt, n_out, n_in, seed=len(ws) + 9)))
    gate, up, down = ws
    xh = cp.asarray(_acts(T, d, seed=4)).astype(cp.float16)
    assert parts.lin.groups(T, (gate, up), (None, None))
    parts.counters.reset()
    grouped = cp.asnumpy(parts.ffn.f16(xh.copy(), parts.layer(gate, up, down)))
    counts = dict(parts.counters.counts)
    assert parts.state.w16().size >= 2 * d_ff * d
    parts.counters.reset()
    g, u = (parts.lin.f16_gemm(xh, w, out=cp.empty((T, d_ff), cp.float16)) for w in (gate, up))
    alone = cp.asnumpy(parts.lin.f16_gemm(dequant_f16.swiglu_f16(g, u), down))
    assert _labels(counts) == _labels(parts.counters.counts) and counts["q4k_f16"] == 2 and counts["q6k exp"] == 1
    assert _same(grouped, alone)
