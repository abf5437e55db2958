"""kernels/mmq_rows.cu (the tensor-core products of a decode step's few rows) vs the
NumPy references of test_mmq.py, and its promise: each row's output bits are the
same whatever rows share the launch (B = 1 alone, B up to past one launch of 32).

Irregular shapes (row counts not a multiple of the block's 16, K of 1 to 35 super-
blocks, split unevenly over the warps); outputs poisoned with NaN first.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from .test_mmq import FIXTURES, _acts, _check_gemm, _pad, _rng, _weights

pytestmark = pytest.mark.gpu

SHAPES = ((200, 256), (37, 1280), (1000, 512), (264, 8960))      # (n_out, K)


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


def _run(cp, qtype, w, x, n_out: int, bias=None, res=None) -> np.ndarray:
    from minfer.backend.cuda.kernels.mmq_rows import mmq_rows
    from minfer.backend.cuda.kernels.quantize import quantize_q8_1
    q8 = quantize_q8_1(cp.asarray(x))
    y = cp.full((x.shape[0], n_out), cp.nan, cp.float32)
    out = mmq_rows(qtype, *q8, w, n_out, None if bias is None else cp.asarray(bias),
                   None if res is None else cp.asarray(res), y)
    assert out is y
    return cp.asnumpy(y)


@pytest.mark.parametrize("n_out,K", SHAPES)
@pytest.mark.parametrize("T", [1, 3, 16, 17, 32, 45])
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=["q4_K", "q6_K"])
def test_mmq_rows_vs_reference(cp, qtype, T, n_out, K):
    raw = _weights(qtype, n_out, K, seed=5)
    x = _acts(T, K, seed=5)
    bias = _rng("rb", n_out).standard_normal(n_out).astype(np.float32) if T in (3, 32) else None
    y = _run(cp, qtype, cp.asarray(_pad(qtype, raw)), x, n_out, bias)
    _check_gemm(qtype, raw, x, y, bias)


@pytest.mark.parametrize("n_out,K", [(200, 256), (264, 8960)])
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=["q4_K", "q6_K"])
def test_mmq_rows_give_each_row_its_bits_alone(cp, qtype, n_out, K):
    """Row i of x gives the same bits in a launch of 1, of 16 (one m-tile), of 32 (two)
    and in the second launch of a call of 45 rows, with the bias and the residual."""
    raw = _weights(qtype, n_out, K, seed=6)
    w = cp.asarray(_pad(qtype, raw))
    x = _acts(45, K, seed=6)
    rng = _rng("rr", n_out, K)
    bias = rng.standard_normal(n_out).astype(np.float32)
    res = rng.standard_normal((45, n_out)).astype(np.float32)
    alone = [_run(cp, qtype, w, x[i:i + 1], n_out, bias, res[i:i + 1])[0] for i in range(45)]
    for lo, hi in ((0, 45), (0, 16), (0, 32), (7, 10), (30, 45)):
        got = _run(cp, qtype, w, x[lo:hi], n_out, bias, res[lo:hi])
        for i in range(lo, hi):
            assert np.array_equal(got[i - lo].view(np.uint32), alone[i].view(np.uint32)), (lo, hi, i)
    # the residual is added last, as the matvec adds it
    plain = _run(cp, qtype, w, x[:5], n_out, bias)
    assert np.array_equal(_run(cp, qtype, w, x[:5], n_out, bias, res[:5]).view(np.uint32),
                          (res[:5] + plain).view(np.uint32))


@pytest.mark.parametrize("key", ["attn_q", "ffn_down", "attn_v"])
def test_mmq_rows_on_real_slices(cp, key):
    """Weights cut from the real 1.5B model (tests/fixtures/real_slices.npz)."""
    z = np.load(FIXTURES / "real_slices.npz")
    raw, qtype = z[f"{key}_raw"], QT(int(z[f"{key}_type"]))
    n_out, K = (int(v) for v in z[f"{key}_shape"])
    if qtype not in (QT.Q4_K, QT.Q6_K):
        pytest.skip(f"{key} is {qtype.name}")
    x = _acts(20, K, seed=7)
    _check_gemm(qtype, raw, x, _run(cp, qtype, cp.asarray(_pad(qtype, raw)), x, n_out))


def test_mmq_rows_refuses_other_types_and_shapes(cp):
    from minfer.backend.cuda.kernels.mmq_rows import mmq_rows
    from minfer.backend.cuda.kernels.quantize import quantize_q8_1
    q8 = quantize_q8_1(cp.asarray(_acts(2, 256)))
    with pytest.raises(ValueError, match="no kernel for Q8_0"):
        mmq_rows(QT.Q8_0, *q8, cp.zeros((4, 272), cp.uint8), 4)
    with pytest.raises(ValueError, match="shape"):
        mmq_rows(QT.Q4_K, *q8, cp.zeros((4, 288), cp.uint8), 4)          # two super-blocks for K = 256
