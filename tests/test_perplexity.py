"""Perplexity by llama.cpp's method on the real model vs llama.cpp's own figures
(at n_ctx 512 on tests/fixtures/perplexity_gpl3.txt llama.cpp reports 14 chunks,
PPL 1.7601 and the running values below)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from minfer.perplexity import token_nll

LLAMA_CPP_PPL = 1.7601
LLAMA_CPP_RUNNING = [1.5653, 1.5674, 1.6934, 1.7818, 1.7750, 1.7634, 1.8042, 1.8042, 1.8046,
                     1.8194, 1.8380, 1.8559, 1.8020, 1.7601]


def test_token_nll_is_the_log_softmax():
    rng = np.random.default_rng(2)
    logits = (rng.standard_normal((5, 37)) * 30).astype(np.float32)   # large: overflow-prone
    targets = rng.integers(0, 37, 5)
    want = [-math.log(math.exp(l[t] - max(l)) / sum(math.exp(v - max(l)) for v in l))
            for l, t in zip(logits.astype(np.float64).tolist(), targets)]
    np.testing.assert_allclose(token_nll(logits, targets), want, rtol=1e-12)


@pytest.mark.model
def test_perplexity_matches_llama_cpp(real_engine, check_perplexity):
    check_perplexity(real_engine, "model", LLAMA_CPP_PPL, LLAMA_CPP_RUNNING, rtol_running=0.02)
