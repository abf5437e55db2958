"""The deterministic mode on the CPU reference backend, with the real SmolLM2-135M:
a generation's bytes do not depend on the other prompts of its call, on how its
prompt was chunked, or on what the prefix cache held (issue 33, item 5).

The truth each run is held to is another run of the same request, never a value
the code computed for itself: alone, batched with prompts of other lengths,
prefilled in chunks of 7 rows, after a cached prefix. The same comparisons in the
default mode may differ in the last bits (the BLAS's order follows the row count),
which is what the mode is for; the GPU's own test is tests/gpu/test_deterministic.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from minfer.sampling import SamplingParams

LENGTHS = (3, 16, 64, 65, 90)              # below, at and past one 64-position block
N_NEW = 6                                   # (the mode's CPU linears run a row at a time: keep it short)


@pytest.fixture(scope="module")
def det(smollm2_path):
    from minfer.engine import Engine
    return Engine.load(str(smollm2_path), backend="cpu", n_ctx=1024, progress=False, deterministic=True)


@pytest.fixture(scope="module")
def prompts(det, fixtures_dir):
    ids = det.tokenize((fixtures_dir / "perplexity_gpl3.txt").read_text(encoding="utf-8")[:20000])
    return [np.asarray(ids[37 * i:37 * i + n], np.int32) for i, n in enumerate(LENGTHS)]


def _same(a, b) -> None:
    assert a.ids == b.ids and a.text == b.text
    assert a.logprobs == b.logprobs               # ids and float logprobs, exactly


def _chunked(engine, prompts, budget: int, **kw):
    """Every prompt in one batch whose steps take at most `budget` rows."""
    from minfer.batched import generate_many
    return generate_many(engine, prompts, N_NEW, engine.kv_cache, token_budget=budget, **kw)


def test_the_mode_is_set_and_checked(det, smollm2_path):
    from minfer.engine import Engine
    from minfer.errors import MinferError
    assert det.backend.deterministic
    with pytest.raises(MinferError, match="deterministic is True or False"):
        Engine.load(str(smollm2_path), backend="cpu", progress=False, deterministic="yes")


@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11)],
                         ids=["greedy", "seeded"])
def test_alone_batched_and_chunked_give_the_same_bytes(det, prompts, sampling):
    """Five prompts of 3 to 90 tokens generated together, each alone (after the
    batch: its full prompt blocks come from the cache), and all prefilled in chunks
    of 7 rows from an empty cache: the same ids, text and logprobs, bit for bit."""
    det.reset_prefix_cache()
    kw = dict(ignore_eos=True, sampling=sampling, logprobs=2)
    together = det.generate(prompts, N_NEW, **kw)
    alone = [det.generate(p, N_NEW, **kw) for p in prompts]
    assert [a.stats.n_cached for a in alone] == [64 * ((n - 1) // 64) for n in LENGTHS]
    det.reset_prefix_cache()
    chunked = _chunked(det, prompts, 7, **kw)
    for t, a, c in zip(together, alone, chunked):
        assert len(t.ids) == N_NEW
        _same(t, a)
        _same(t, c)


def test_a_chat_turn_after_a_cached_one_is_the_fresh_run(det):
    """The second turn of a chat prefills after the first turn's prompt blocks (the
    counter), not after the blocks its answer's decode rows wrote, and its text is a
    from-scratch run's."""
    system = "You are a careful assistant. " * 11
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Name a prime number."}]
    det.reset_prefix_cache()
    a = det.generate(first, 8, ignore_eos=True)
    second = first + [{"role": "assistant", "content": a.text}, {"role": "user", "content": "And another?"}]
    b = det.generate(second, 4, ignore_eos=True)
    assert 64 <= b.stats.n_cached <= 64 * (len(a.prompt_ids) // 64)      # the first prompt's blocks only
    det.reset_prefix_cache()
    c = det.generate(second, 4, ignore_eos=True)
    assert c.stats.n_cached == 0
    _same(b, c)


def test_the_default_mode_shares_what_decode_rows_wrote(smollm2_engine):
    """Without the mode, a chat's next turn also finds the blocks the answer filled
    (the first turn's prompt plus its answer cover more than its prompt's blocks)."""
    e = smollm2_engine
    e.reset_prefix_cache()
    ids = e.tokenize("one two three four five six seven eight nine ten " * 6)    # ~60 tokens
    a = e.generate(ids, 40, ignore_eos=True)
    b = e.generate(list(ids) + a.ids + [int(ids[1])], 1, ignore_eos=True)
    assert b.stats.n_cached == 64 * ((len(ids) + 40 - 1) // 64) > 64 * (len(ids) // 64)
