"""minfer/batched.py's BatchRunner on the CPU reference with the real SmolLM2-135M:
sequences that join between steps, prompts prefilled in chunks under the step's
row budget, cancellation. Truth: each prompt generated alone through the one-prompt
path (Engine.generate: one prefill forward, then decode steps of one row), another
path than the runner's forward_batch steps."""
from __future__ import annotations

import numpy as np
import pytest

from minfer.batched import BatchRunner
from minfer.sampling import SamplingParams

pytestmark = pytest.mark.model


def _ids(e, text):
    return np.asarray(e.tokenize(text), np.int32)


@pytest.fixture
def kv(smollm2_engine):
    smollm2_engine.reset_prefix_cache()
    return smollm2_engine.kv_cache


def test_prompts_chunked_under_the_budget_give_what_each_gives_alone(smollm2_engine, kv, monkeypatch):
    e = smollm2_engine
    long = "In the beginning there was a long prompt that spans several chunks. " * 6      # > 64 tokens
    prompts = [long, "def add(a, b):", "The capital of France is"]
    alone = [e.generate(p, max_tokens=10) for p in prompts]
    e.reset_prefix_cache()
    steps = []
    real = e.model.forward_batch

    def spy(tokens, batch, cache):
        steps.append([(s.pos0, s.n) for s in batch.spans])
        return real(tokens, batch, cache)

    monkeypatch.setattr(e.model, "forward_batch", spy)
    r = BatchRunner(e, kv, token_budget=7)
    seqs = [r.add(_ids(e, p), 10) for p in prompts]
    while r.running:
        r.step()
    assert all(sum(n for _, n in st) <= 7 for st in steps)
    assert max(len(st) for st in steps) == 3                       # all three in one forward at times
    first = [st[0] for st in steps[:3]]
    assert first == [(0, 7), (7, 7), (14, 7)]                      # the long prompt in chunks of 7
    for s, a in zip(seqs, alone):
        g = s.result()
        assert (g.ids, g.text, g.stop) == (a.ids, a.text, a.stop)
        assert g.stats.n_written == a.stats.n_written


def test_decode_rows_come_first_and_a_sequence_can_join_between_steps(smollm2_engine, kv, monkeypatch):
    e = smollm2_engine
    sp = SamplingParams(temperature=0.8, top_k=20, seed=3)
    a_alone = e.generate("Once upon a time", max_tokens=12, sampling=sp)
    b_alone = e.generate("1, 2, 3, 4,", max_tokens=8)
    e.reset_prefix_cache()
    r = BatchRunner(e, kv, token_budget=4)
    a = r.add(_ids(e, "Once upon a time"), 12, sampling=sp)
    for _ in range(4):
        r.step()
    assert not a.prefilling and len(a.out) >= 1
    b = r.add(_ids(e, "1, 2, 3, 4,"), 8)
    spans = []
    real = e.model.forward_batch
    monkeypatch.setattr(e.model, "forward_batch",
                        lambda t, batch, c: spans.append(batch.spans) or real(t, batch, c))
    r.step()
    assert [s.n for s in spans[0]] == [1, 3]                       # a's next token, then 3 rows of b's prompt
    assert spans[0][0].pos0 == a.stats.n_written - 1
    while r.running:
        r.step()
    assert (a.result().ids, a.result().text) == (a_alone.ids, a_alone.text)     # a draw keyed by seed, position
    assert (b.result().ids, b.result().text) == (b_alone.ids, b_alone.text)


def test_cancel_frees_the_blocks_at_once(smollm2_engine, kv):
    e = smollm2_engine
    base = kv.pool.n_used()
    r = BatchRunner(e, kv)
    ids_s, ids_t = _ids(e, "Tell me a long story about a dragon."), _ids(e, "def add(a, b):")
    s = r.add(ids_s, 500, ignore_eos=True)
    t = r.add(ids_t, 5)
    # the whole run's blocks reserved up front: prompt + max_tokens + 1 positions, 64 a block
    need_s, need_t = -(-(len(ids_s) + 501) // 64), -(-(len(ids_t) + 6) // 64)
    assert (need_s, need_t) == (8, 1)
    assert kv.pool.n_used() == base + need_s + need_t
    r.step()
    r.cancel(s)
    assert s.done and s.cancelled and s not in r.running
    assert kv.pool.n_used() == base + need_t
    r.cancel(s)                                                     # a second cancel does nothing
    while r.running:
        r.step()
    assert kv.pool.n_used() == base and t.result().ids == e.generate("def add(a, b):", max_tokens=5).ids
    assert r.step() == []                                           # nothing to run
