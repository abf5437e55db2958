"""Several sequences in one forward (minfer/kv/batch.py, Transformer.forward_batch)
and the prefix cache behind the front door, on the CPU reference. Truth: each
sequence run alone from position 0 on a contiguous cache (Engine.logits), an
independent computation path (no block table, no batch). The CPU's BLAS may sum
a row in another order when the GEMM has more rows, so logits agree to float32
rounding (rtol 1e-4 of the largest logit), not bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from minfer.errors import MinferError
from minfer.kv.batch import Batch, Span
from minfer.kv.blocks import BLOCK_TOKENS
from minfer.kv.paged import PagedCache


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_batch_layout():
    b = Batch([Span(0, 3, (5,)), Span(62, 4, (1, 2))])
    assert b.n_rows == 7 and b.n_seq == 2
    assert b.positions.tolist() == [0, 1, 2, 62, 63, 64, 65]
    # positions 62, 63 in block 1 (rows 126, 127), 64, 65 in block 2 (rows 128, 129)
    assert b.rows[:, 1].tolist() == [320, 321, 322, 126, 127, 128, 129]
    assert b.logit_rows.tolist() == [2, 6]
    assert Batch([Span(0, 3, (5,)), Span(0, 4, (1,))], logits_from=1).logit_rows.tolist() == [1, 2, 4, 5, 6]
    assert b.key_rows(1).tolist()[:2] == [64, 65] and len(b.key_rows(1)) == 66


def test_a_decode_step_is_one_row_a_sequence_and_not_prompt_rows():
    one = [Span(5, 1, (1,)), Span(9, 1, (2,))]
    assert Batch(one).decode and Batch(one[:1]).decode                   # one sequence too
    assert not Batch(one, prefill=True).decode and Batch(one, prefill=True).prefill
    assert not Batch([Span(5, 2, (1,))]).decode


@pytest.mark.parametrize("spans, match", [([], "empty batch"), ([Span(0, 0, (1,))], "at least one")])
def test_bad_batches_are_one_line_errors(spans, match):
    with pytest.raises(MinferError, match=match) as e:
        Batch(spans)
    assert "\n" not in str(e.value)


def _prompts(engine, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(10, engine.cfg.vocab_size - 10, n).astype(np.int32) for n in lengths]


def test_forward_batch_equals_each_sequence_alone(smollm2_engine):
    e = smollm2_engine
    prompts = _prompts(e, (5, 70, 130, 1))
    kv = PagedCache(e.backend, 12)
    # blocks handed out in a scrambled order: tables that are not contiguous
    free = kv.pool.allocate(11)[::-1]
    spans, tokens = [], []
    for p in prompts:
        k = PagedCache.blocks_for(len(p))
        spans.append(Span(0, len(p), tuple(free[:k])))
        free = free[k:]
        tokens.append(p)
    got = e.model.forward_batch(np.concatenate(tokens), Batch(spans), kv.storage)
    assert got.shape == (4, e.cfg.vocab_size)
    for i, p in enumerate(prompts):
        _close(got[i], e.logits(p)[-1])
    every = e.model.forward_batch(np.concatenate(tokens), Batch(spans, logits_from=0), kv.storage)
    _close(every[5:75], e.logits(prompts[1]))


def test_a_prompt_prefilled_in_chunks_equals_one_forward(smollm2_engine):
    e = smollm2_engine
    p, = _prompts(e, (150,), seed=3)
    kv = PagedCache(e.backend, 4)
    table = tuple(kv.pool.allocate(3)[::-1])
    outs = []
    for a, b in ((0, 64), (64, 100), (100, 150)):         # a block, part of one, the rest
        outs.append(e.model.forward_batch(p[a:b], Batch([Span(a, b - a, table)], logits_from=0), kv.storage))
    _close(np.concatenate(outs), e.logits(p))


def test_a_chat_turn_prefills_only_what_is_new(smollm2_engine):
    e = smollm2_engine
    e.reset_prefix_cache()
    msgs = [{"role": "system", "content": "You are a terse assistant. " * 12},
            {"role": "user", "content": "Name three prime numbers."}]
    first = e.generate(msgs, max_tokens=8)
    assert first.stats.n_cached == 0
    turn2 = msgs + [{"role": "assistant", "content": first.text},
                    {"role": "user", "content": "And three more?"}]
    before = e.kv_stats()["prefix_hit_tokens"]
    second = e.generate(turn2, max_tokens=8)
    n = len(second.prompt_ids)
    # every full block of the first turn's prompt is found (the last prompt token is always computed)
    assert second.stats.n_cached >= (len(first.prompt_ids) // BLOCK_TOKENS) * BLOCK_TOKENS > 0
    assert second.stats.n_cached % BLOCK_TOKENS == 0 and second.stats.n_cached < n
    assert e.kv_stats()["prefix_hit_tokens"] - before == second.stats.n_cached
    e.reset_prefix_cache()
    fresh = e.generate(turn2, max_tokens=8)
    assert fresh.stats.n_cached == 0
    assert fresh.ids == second.ids


def test_a_failed_call_leaves_the_cache_as_it_was(smollm2_engine):
    e = smollm2_engine
    e.reset_prefix_cache()
    before = e.kv_stats()
    with pytest.raises(MinferError):
        e.generate("hello", max_tokens=-1)
    with pytest.raises(MinferError, match="do not fit|context"):
        e.generate(list(range(1, e.n_ctx + 5)), max_tokens=1)
    assert e.kv_stats()["used"] == before["used"] == 1            # the pad block alone


def test_a_list_of_prompts_gives_what_each_gives_alone(smollm2_engine):
    """generate([...]): one prefill forward, then steps of every running sequence;
    each result as the prompt run alone (greedy; sequences stopping at different
    steps: max_tokens of 1 and the end-of-generation token)."""
    e = smollm2_engine
    e.reset_prefix_cache()
    prompts = ["The capital of France is", "def add(a, b):", "1, 2, 3, 4,"]
    got = e.generate(prompts, max_tokens=12)
    assert [g.prompt_ids for g in got] == [list(e.tokenize(p)) for p in prompts]
    for p, g in zip(prompts, got):
        alone = e.generate(p, max_tokens=12)
        assert (g.ids, g.text, g.stop) == (alone.ids, alone.text, alone.stop)
    one = e.generate(prompts + ["Hello"], max_tokens=1)
    assert [len(g.ids) for g in one] == [1, 1, 1, 1] and all(g.stop == "max_tokens" for g in one)


def test_a_list_of_prompts_with_seeded_sampling(smollm2_engine):
    from minfer.sampling import SamplingParams
    e = smollm2_engine
    sp = SamplingParams(temperature=0.9, top_k=40, seed=7)
    a = e.generate(["Once upon a time", "The weather today"], max_tokens=10, sampling=sp)
    b = e.generate("The weather today", max_tokens=10, sampling=sp)
    assert a[1].ids == b.ids                     # a draw does not depend on the other sequence


def test_bad_batches_of_prompts(smollm2_engine):
    e = smollm2_engine
    with pytest.raises(MinferError, match="empty prompt"):
        e.generate([], max_tokens=4)
    with pytest.raises(MinferError, match="on_text"):
        e.generate(["a", "b"], max_tokens=4, on_text=print)
    with pytest.raises(MinferError, match="prompt 1 of the batch"):
        e.generate(["a", list(range(1, e.n_ctx + 3))], max_tokens=4)
    small = type(e)(gf=e.gf, cfg=e.cfg, tokenizer=e.tokenizer, backend=e.backend, weights=e.weights,
                    model=e.model, n_ctx=256, kv_tokens=256)      # 4 blocks and the pad
    with pytest.raises(MinferError, match="out of blocks"):          # 3 x 2 blocks needed
        small.generate([list(range(10, 110))] * 3, max_tokens=8)
    assert small.kv_stats()["used"] == 1                          # all or nothing: the pad block alone


def test_a_decode_step_of_several_sequences_equals_each_alone(smollm2_engine):
    e = smollm2_engine
    prompts = _prompts(e, (9, 66, 130), seed=5)
    kv = PagedCache(e.backend, 8)
    spans, nxt = [], []
    for p in prompts:
        table = tuple(kv.pool.allocate(PagedCache.blocks_for(len(p) + 1)))
        logits = e.model.forward_batch(p, Batch([Span(0, len(p), table)]), kv.storage)
        nxt.append(int(np.argmax(logits[0])))
        spans.append(Span(len(p), 1, table))
    b = Batch(spans)
    assert b.decode
    got = e.model.forward_batch(np.array(nxt, np.int32), b, kv.storage)
    for i, p in enumerate(prompts):
        _close(got[i], e.logits(np.append(p, nxt[i]))[-1])


def test_a_table_outside_the_cache_is_refused(smollm2_engine):
    e = smollm2_engine
    kv = PagedCache(e.backend, 3)
    with pytest.raises(ValueError, match="outside"):
        e.model.forward_batch(np.array([5, 6], np.int32), Batch([Span(0, 2, (3,))]), kv.storage)


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "4096"])
def test_a_bad_kv_size_is_one_line_before_the_load(smollm2_path, bad):
    from minfer.engine import Engine
    with pytest.raises(MinferError, match="kv_tokens must be a positive number") as e:
        Engine.load(str(smollm2_path), backend="cpu", kv_tokens=bad, progress=False)
    assert "\n" not in str(e.value)
