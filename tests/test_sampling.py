"""minfer/sampling.py, the reference semantics of sampling, against independent
computations: exact softmax in float64, the nucleus and min-p sets formed here by
sorting, and frequencies of many seeded draws. CPU only."""
from __future__ import annotations

import numpy as np
import pytest

from minfer.errors import MinferError
from minfer.sampling import REPEAT_LAST_N, SamplingParams, penalized, sample, uniform


def _softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


def _draws(logits, params, n):
    """n draws at positions 0..n-1 (one uniform each)."""
    return np.array([sample(logits, params, pos) for pos in range(n)])


def test_temperature_zero_is_the_first_argmax():
    z = np.array([0.5, 3.0, -1.0, 3.0], np.float32)
    assert sample(z, SamplingParams(), 7) == 1 == int(np.argmax(z))
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy
    assert not SamplingParams(repeat_penalty=1.1).greedy


@pytest.mark.parametrize("bad, match", [
    ({"temperature": -0.1}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"min_p": -0.1}, "min_p"),
    ({"repeat_penalty": 0.0}, "repeat_penalty"), ({"frequency_penalty": 3.0}, "frequency_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"), ({"seed": -1}, "seed"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": float("inf")}, "top_p")])
def test_bad_parameters_are_one_line_errors(bad, match):
    with pytest.raises(MinferError, match=f"sampling: {match}=") as e:
        SamplingParams(**bad)
    assert "\n" not in str(e.value)


def test_uniform_is_a_function_of_seed_and_position():
    u = np.array([uniform(5, p) for p in range(20000)])
    assert u.min() >= 0 and u.max() < 1
    assert uniform(5, 123) == uniform(5, 123) and uniform(5, 123) != uniform(6, 123)
    assert abs(u.mean() - 0.5) < 0.01 and abs(np.mean(u < 0.25) - 0.25) < 0.01
    assert len(set(u.tolist())) == u.size                      # no repeats over positions


@pytest.mark.parametrize("T", [0.5, 1.0, 2.0])
def test_frequencies_follow_the_tempered_softmax(T):
    z = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 1.5], np.float32)
    n = 30000
    got = np.bincount(_draws(z, SamplingParams(temperature=T, seed=11), n), minlength=z.size) / n
    want = _softmax(z / T)
    # binomial standard error per token, 5 sigma
    assert np.all(np.abs(got - want) <= 5 * np.sqrt(want * (1 - want) / n)), (got, want)


def test_top_k_never_emits_an_excluded_token():
    rng = np.random.default_rng(1)
    z = rng.standard_normal(50).astype(np.float32)
    keep = set(np.argsort(-z)[:5].tolist())
    got = set(_draws(z, SamplingParams(temperature=1.5, top_k=5, seed=2), 4000).tolist())
    assert got <= keep and len(got) == 5


def test_top_k_ties_keep_k_tokens():
    z = np.array([1.0, 1.0, 1.0, 0.0], np.float32)
    got = set(_draws(z, SamplingParams(temperature=1.0, top_k=2, seed=3), 2000).tolist())
    assert len(got) == 2 and got <= {0, 1, 2}


@pytest.mark.parametrize("p", [0.3, 0.75, 0.95])
def test_top_p_emits_only_the_nucleus(p):
    rng = np.random.default_rng(4)
    z = rng.standard_normal(40).astype(np.float32) * 2
    probs = _softmax(z)
    order = np.argsort(-probs)
    n_keep = int(np.searchsorted(np.cumsum(probs[order]), p) + 1)   # smallest prefix reaching p
    nucleus = set(order[:n_keep].tolist())
    got = set(_draws(z, SamplingParams(temperature=1.0, top_p=p, seed=5), 4000).tolist())
    assert got <= nucleus and len(got) == len(nucleus)


def test_min_p_emits_only_tokens_near_the_top():
    rng = np.random.default_rng(6)
    z = rng.standard_normal(40).astype(np.float32) * 2
    probs = _softmax(z)
    allowed = set(np.flatnonzero(probs >= 0.2 * probs.max()).tolist())
    got = set(_draws(z, SamplingParams(temperature=1.0, min_p=0.2, seed=7), 4000).tolist())
    assert got <= allowed and len(got) == len(allowed)


def test_penalties():
    z = np.array([2.0, -1.0, 0.5, 3.0], np.float32)
    rp = penalized(z, SamplingParams(repeat_penalty=2.0), context=[0, 1], generated=[1])
    assert rp.tolist() == [1.0, -2.0, 0.5, 3.0]                # positive / 2, negative * 2, once each
    fp = penalized(z, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), context=[3],
                   generated=[2, 2, 0])
    assert fp.tolist() == [2.0 - 0.5 - 0.25, -1.0, 0.5 - 1.0 - 0.25, 3.0]   # the prompt is not counted
    old = list(range(100, 100 + REPEAT_LAST_N))
    far = penalized(np.ones(200, np.float32), SamplingParams(repeat_penalty=2.0), context=[5] + old)
    assert far[5] == 1.0 and far[100] == 0.5                   # only the last REPEAT_LAST_N tokens


def test_a_draw_depends_on_seed_and_position_alone():
    rng = np.random.default_rng(8)
    z = rng.standard_normal(100).astype(np.float32)
    p = SamplingParams(temperature=1.0, seed=42)
    a = [sample(z, p, pos) for pos in range(50)]
    assert a == [sample(z, p, pos) for pos in range(50)]
    assert a != [sample(z, SamplingParams(temperature=1.0, seed=43), pos) for pos in range(50)]
