"""Perplexity by llama.cpp's method on the real model vs llama.cpp's own figures
(at n_ctx 512 on tests/fixtures/perplexity_gpl3.txt llama.cpp reports 14 chunks,
PPL 1.7601 and the running values below)."""
from __future__ import annotations

import math
import time

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
def test_perplexity_matches_llama_cpp(real_engine, fixtures_dir):
    from minfer.perplexity import perplexity

    engine = real_engine
    text = (fixtures_dir / "perplexity_gpl3.txt").read_text(encoding="utf-8")
    t0 = time.perf_counter()
    res = perplexity(engine, text, n_ctx=512, progress=False)
    dt = time.perf_counter() - t0
    print(f"\n[model] perplexity n_ctx 512: {res.n_chunks} chunks, PPL {res.ppl:.4f} +/- {res.err:.4f} "
          f"(llama.cpp {LLAMA_CPP_PPL}), {dt:.0f} s ({dt / res.n_chunks:.1f} s per 512-token chunk)")
    print("[model] running: " + ",".join(f"[{i + 1}]{p:.4f}" for i, p in enumerate(res.running)))
    assert res.n_chunks == len(LLAMA_CPP_RUNNING)
    assert res.count == res.n_chunks * 255
    assert abs(res.ppl / LLAMA_CPP_PPL - 1) < 0.01
    np.testing.assert_allclose(res.running, LLAMA_CPP_RUNNING, rtol=0.02)
