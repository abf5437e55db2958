"""minfer/logprobs.py, the reference log-probabilities, against independent
computations: Python floats (math.fsum's correctly rounded sums, math.log1p), mpmath
at 50 digits, scipy where installed, and top-n sets formed here by a full sort.
CPU only."""
from __future__ import annotations

import math

import numpy as np
import pytest

from minfer.errors import MinferError
from minfer.logprobs import MAX_TOP_LOGPROBS, log_softmax, prompt_logprobs, token_logprobs, top_logprobs


def _ref_row(row):
    """log-softmax of one row with Python floats, no NumPy: the sum of the exponentials
    less the maximum's 1, correctly rounded by fsum, then log1p (log of 1 + 1e-14 would
    keep little of the 1e-14)."""
    row = [float(v) for v in row]
    m = max(row)
    lse = math.log1p(math.fsum([math.exp(v - m) for v in row] + [-1.0]))
    return [(v - m) - lse for v in row]               # m + lse would round lse away


def _ref(x):
    x = np.asarray(x, np.float32)
    return np.array([_ref_row(r) for r in x.reshape(-1, x.shape[-1])]).reshape(x.shape)


def _close(got, want64):
    """got (float32) within one float32 step of the float64 reference, or of the
    float32 rounding of it (the reference is only float64 itself)."""
    assert got.dtype == np.float32 and got.shape == want64.shape
    np.testing.assert_array_max_ulp(got, want64.astype(np.float32), maxulp=1)


def _random_logits(rng, shape, scale):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 1), (5, 13), (2, 257), (4, 1000)])
@pytest.mark.parametrize("scale", [0.1, 3.0, 40.0])
def test_log_softmax_against_python_floats(shape, scale):
    x = _random_logits(np.random.default_rng(hash((shape, scale)) % 2**32), shape, scale)
    _close(log_softmax(x), _ref(x))


def test_log_softmax_against_mpmath_near_zero_and_far_below():
    mpmath = pytest.importorskip("mpmath")
    rows = np.array([[0.0, -30.0, -35.0], [20.0, 0.0, -1.0], [1e4, -1e4, 0.0], [5.0, 5.0, 5.0]], np.float32)
    got = log_softmax(rows)
    for r, g in zip(rows, got):
        with mpmath.workdps(50):
            lse = mpmath.log(mpmath.fsum(mpmath.exp(mpmath.mpf(float(v))) for v in r))
            want = np.array([float(mpmath.mpf(float(v)) - lse) for v in r])
        np.testing.assert_array_max_ulp(g, want.astype(np.float32), maxulp=1)
    assert got[0, 0] < 0 and got[1, 0] < 0                     # not rounded to 0: log1p


def test_log_softmax_against_scipy():
    special = pytest.importorskip("scipy.special")
    x = _random_logits(np.random.default_rng(3), (6, 301), 8.0)
    _close(log_softmax(x), special.log_softmax(x.astype(np.float64), axis=-1))


def test_large_logits_neither_overflow_nor_underflow():
    x = np.array([[1e4, -1e4, 0.0, 1e4], [-1e4, -1e4 + 1, -1e4 - 1, -1e4]], np.float32)
    with np.errstate(all="raise"):
        got = log_softmax(x)
    assert np.isfinite(got).all()
    _close(got, _ref(x))
    assert got[0, 1] == np.float32(-2e4 - math.log(2))


def test_non_finite_logits_are_reported_not_hidden():
    x = np.array([[0.0, np.nan, 1.0], [0.0, np.inf, 1.0], [-np.inf] * 3, [0.0, -np.inf, 0.0]], np.float32)
    got = log_softmax(x)
    assert np.isnan(got[:3]).all()
    assert got[3, 1] == -np.inf and np.allclose(got[3, [0, 2]], math.log(0.5))
    assert np.isnan(token_logprobs(x, [0, 1, 2, 1])[:3]).all()
    ids, vals = top_logprobs(x, 2)
    assert ids.tolist()[3] == [0, 2] and np.isnan(vals[0]).all()


@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (9, 250)])
def test_token_logprobs_pick_each_rows_token(shape):
    rng = np.random.default_rng(shape[1])
    x = _random_logits(rng, shape, 5.0)
    ids = rng.integers(0, shape[1], shape[0])
    got = token_logprobs(x, ids)
    _close(got, _ref(x)[np.arange(shape[0]), ids])
    assert got.shape == (shape[0],)


def _top_ref(x, n):
    """ids by a full sort on (-logprob, id), from the Python-float reference."""
    lp = _ref(x)
    ids = [sorted(range(x.shape[1]), key=lambda i: (-lp[r, i], i))[:n] for r in range(x.shape[0])]
    return np.array(ids, np.int64).reshape(x.shape[0], -1), lp


@pytest.mark.parametrize("rows, vocab, n", [(1, 5, 1), (4, 37, 5), (3, 200, 20), (2, 3, 20), (3, 7, 0)])
def test_top_logprobs_against_a_full_sort(rows, vocab, n):
    rng = np.random.default_rng(rows * vocab + n)
    x = np.round(_random_logits(rng, (rows, vocab), 2.0))      # rounded: many ties
    ids, vals = top_logprobs(x, n)
    want, lp = _top_ref(x, n)
    k = min(n, vocab)
    assert ids.dtype == np.int32 and vals.dtype == np.float32 and ids.shape == vals.shape == (rows, k)
    assert ids.tolist() == want.tolist()
    _close(vals, np.take_along_axis(lp, want, axis=1))


def test_top_logprobs_ties_go_to_the_lower_id_and_one_row_keeps_its_shape():
    x = np.array([1.0, 3.0, 2.0, 3.0, 3.0, 0.0], np.float32)
    ids, vals = top_logprobs(x, 4)
    assert ids.tolist() == [1, 3, 4, 2] and vals.shape == (4,)
    assert vals[0] == vals[1] == vals[2] > vals[3]
    ids, vals = top_logprobs(x[None], 0)
    assert ids.shape == vals.shape == (1, 0)


def test_prompt_logprobs_score_each_token_under_the_row_before():
    rng = np.random.default_rng(7)
    T, vocab = 11, 29
    x = _random_logits(rng, (T, vocab), 4.0)
    ids = rng.integers(0, vocab, T)
    got = prompt_logprobs(x, ids)
    assert got.shape == (T,) and got.dtype == np.float32 and np.isnan(got[0])
    _close(got[1:], _ref(x)[np.arange(T - 1), ids[1:]])
    assert np.array_equal(got[1:], token_logprobs(x[:-1], ids[1:]))
    x[-1] = np.nan                                             # the last row predicts past the prompt
    assert np.isfinite(prompt_logprobs(x, ids)[1:]).all()
    assert np.isnan(prompt_logprobs(x[:1], ids[:1])).all()


@pytest.mark.parametrize("call, match", [
    (lambda: top_logprobs(np.zeros((2, 5)), -1), "top_logprobs=-1"),
    (lambda: top_logprobs(np.zeros((2, 5)), MAX_TOP_LOGPROBS + 1), "top_logprobs=21"),
    (lambda: top_logprobs(np.zeros((2, 5)), 2.0), "top_logprobs=2.0"),
    (lambda: top_logprobs(np.zeros((2, 5)), True), "top_logprobs=True"),
    (lambda: token_logprobs(np.zeros((2, 5)), [0, 5]), "token id 5"),
    (lambda: token_logprobs(np.zeros((2, 5)), [-1, 0]), "token id -1"),
    (lambda: token_logprobs(np.zeros((2, 5)), [0]), "ids must be 2"),
    (lambda: token_logprobs(np.zeros((2, 5)), [0.0, 1.0]), "ids must be 2"),
    (lambda: token_logprobs(np.zeros(5), [0]), "shape"),
    (lambda: prompt_logprobs(np.zeros((3, 5)), [0, 1, 9]), "token id 9"),
    (lambda: log_softmax(np.zeros((2, 0))), "vocab > 0"),
    (lambda: log_softmax(np.zeros((2, 3, 4))), "shape"),
    (lambda: log_softmax("abc"), "array of numbers"),
])
def test_bad_input_is_a_one_line_error(call, match):
    with pytest.raises(MinferError, match=match) as e:
        call()
    assert "\n" not in str(e.value) and str(e.value).startswith("logprobs: ")
