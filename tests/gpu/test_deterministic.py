"""The deterministic mode on the GPU (issue 33's acceptance): 32 sequences of mixed
lengths (16 to 3,000 tokens) generated together, greedy and with seeded sampling,
each byte-identical to the same request run alone and to its prompt prefilled in
chunks; and the engines the mode promises, counted (decode rows and the LM head
on the matvec, prompt rows on the f16 engine at every count, nothing on the MMQ or
mmq_rows). The truth is always another run of the same request.

The synthetic model (every layer type the 7B has) keeps the prefills short.
"""
from __future__ import annotations

import numpy as np
import pytest

from minfer.sampling import SamplingParams

pytestmark = pytest.mark.gpu

N_NEW = 8
LENGTHS = tuple(int(v) for v in np.geomspace(16, 3000, 32).round())


@pytest.fixture(scope="module")
def det(synth_dir):
    from minfer.engine import Engine
    from minfer.tools.synth import synth_model
    return Engine.load(synth_model(synth_dir), backend="cuda", n_ctx=4096, progress=False,
                       deterministic=True, kv_tokens=2 * sum(LENGTHS) + 4096)


@pytest.fixture(scope="module")
def prompts(det):
    rng = np.random.default_rng(33)
    return [rng.integers(0, det.cfg.vocab_size, n).astype(np.int32) for n in LENGTHS]


def _chunked(engine, prompts, budget: int, **kw):
    """Every prompt in one batch whose steps take at most `budget` rows."""
    from minfer.batched import generate_many
    return generate_many(engine, prompts, N_NEW, engine.kv_cache, token_budget=budget, **kw)


@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=5)],
                         ids=["greedy", "seeded"])
def test_32_mixed_sequences_together_alone_and_chunked_are_the_same_bytes(det, prompts, sampling):
    be = det.backend
    kw = dict(ignore_eos=True, sampling=sampling, logprobs=3)
    det.reset_prefix_cache()
    be.reset_counters()
    together = det.generate(prompts, N_NEW, **kw)
    c = be.counters()
    assert c["q4k_f16"] > 0 and c["q4k_mv"] > 0
    assert all(c.get(k, 0) == 0 for k in ("q4k_mmq", "q6k_mmq", "q4k_mvt", "q6k_mvt")), c
    det.reset_prefix_cache()
    alone = [det.generate(p, N_NEW, **kw) for p in prompts]
    det.reset_prefix_cache()
    chunked = _chunked(det, prompts, 200, **kw)          # every long prompt in chunks of 200 and less
    cached = [det.generate(p, N_NEW, **kw) for p in prompts[::5]]   # after the chunked run's blocks
    assert all(g.stats.n_cached > 0 for g, n in zip(cached, LENGTHS[::5]) if n > 64)
    for i, t in enumerate(together):
        assert len(t.ids) == N_NEW
        for other in (alone[i], chunked[i]) + ((cached[i // 5],) if i % 5 == 0 else ()):
            assert (t.ids, t.text, t.logprobs) == (other.ids, other.text, other.logprobs), i


def test_a_one_row_prompt_chunk_takes_the_prompt_rows_engine(det):
    """A prompt whose uncached part is one token (a repeat of a cached prompt) still
    runs that row on the f16 engine and the flash attention, as in a longer chunk."""
    rng = np.random.default_rng(34)
    p = rng.integers(0, det.cfg.vocab_size, 129).astype(np.int32)     # 128 cached, 1 computed
    det.reset_prefix_cache()
    a = det.generate(p, N_NEW, ignore_eos=True)
    det.backend.reset_counters()
    b = det.generate(p, N_NEW, ignore_eos=True)
    c = det.backend.counters()
    assert b.stats.n_cached == 128 and a.ids == b.ids
    assert c["q4k_f16"] > 0 and c.get("flash_attn_f16_sm90", 0) + c.get("flash_attn_f16", 0) > 0
