"""The greedy decode step on the GPU: its kernels against NumPy (one-row attention
split over the keys, the f16 KV store, RoPE and argmax with the position or the
result in device memory), and the captured step against the eager one.

Every output buffer is poisoned with NaN first, so an element a kernel forgets to
write fails the comparison."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


def _dev_pos(cp, p: int):
    from minfer.backend.cuda.launch import DevicePos
    return DevicePos(p, cp.asarray(np.array([p], np.int32)))


def _attn_ref(q, kc, vc, n_keys: int) -> np.ndarray:
    """q (n_head, hd) f64, caches (n_ctx, n_kv, hd) -> (n_head*hd,) over keys 0..n_keys-1."""
    n_head, hd = q.shape
    G = n_head // kc.shape[1]
    out = np.empty((n_head, hd))
    for h in range(n_head):
        K, V = kc[:n_keys, h // G].astype(np.float64), vc[:n_keys, h // G].astype(np.float64)
        s = K @ q[h] / np.sqrt(hd)
        p = np.exp(s - s.max())
        out[h] = p @ V / p.sum()
    return out.reshape(-1)


@pytest.mark.parametrize("n_head,n_kv", [(28, 4), (12, 2), (4, 2), (8, 8)])
@pytest.mark.parametrize("pos", [0, 1, 37, 300, 1500, 9000])     # 9,000: over 128 splits to merge
@pytest.mark.parametrize("on_device", [False, True], ids=["host_pos", "device_pos"])
def test_decode_attention_vs_reference(cp, n_head, n_kv, pos, on_device):
    from minfer.backend.cuda.kernels.decode_attn import decode_attention
    rng = np.random.default_rng([n_head, n_kv, pos])
    n_ctx = pos + 5
    kc = rng.standard_normal((n_ctx, n_kv, 128)).astype(np.float16)
    vc = rng.standard_normal((n_ctx, n_kv, 128)).astype(np.float16)
    kc[pos + 1:] = np.nan                      # past the position: never read
    vc[pos + 1:] = np.nan
    q = (rng.standard_normal((1, n_head, 128)) * 2.0).astype(np.float32)
    out = cp.full((1, n_head * 128), np.nan, cp.float32)
    p = _dev_pos(cp, pos) if on_device else pos
    decode_attention(cp.asarray(q), cp.asarray(kc), cp.asarray(vc), p, out)
    want = _attn_ref(q[0].astype(np.float64), kc, vc, pos + 1)
    got = cp.asnumpy(out)[0]
    # f32 scores, softmax and sums over at most 9,001 keys of magnitude ~1
    assert np.abs(got - want).max() <= 1e-4 * np.abs(vc[:pos + 1]).max(), np.abs(got - want).max()


@pytest.mark.parametrize("n_head,n_kv", [(28, 4), (12, 2), (16, 2), (8, 8)])
@pytest.mark.parametrize("pos", [0, 1, 63, 64, 130, 255])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "rope_store_q8"])
def test_decode_attention_one_launch_equals_two(cp, n_head, n_kv, pos, fused):
    """Below DEC_SHORT_KEYS the decode attention runs in one launch (its splits as
    sub-blocks, merged in shared memory): the bits of the two-launch path (the
    splits' blocks, then the combine), for f32 output and for the q8_1 output with
    RoPE and the KV store inside, at group sizes 7, 6, 8 and 1 and positions at
    the first, last and past the first split's keys; the cache bytes alike; caches
    that end at the position (the L2 prefetch of the splits' rows stops there) and
    longer ones."""
    from minfer.backend.cuda.kernels import decode_attn, rope
    assert decode_attn.decode_short(pos) and not decode_attn.decode_short(decode_attn.DEC_SHORT_KEYS)
    rng = np.random.default_rng([n_head, n_kv, pos, fused])
    n_ctx = 300 if pos % 2 else pos + 1
    kc0, vc0 = (rng.standard_normal((n_ctx, n_kv, 128)).astype(np.float16) for _ in range(2))
    kc0[pos + 1:] = vc0[pos + 1:] = np.nan                        # never read
    q = cp.asarray((rng.standard_normal((1, n_head, 128)) * 2).astype(np.float32))
    k, v = (cp.asarray(rng.standard_normal((1, n_kv, 128)).astype(np.float32)) for _ in range(2))
    table = cp.asarray(rope.rope_table(n_ctx, 128, 1e6))
    got = {}
    for short in (False, True):
        kc, vc = cp.asarray(kc0), cp.asarray(vc0)
        p = _dev_pos(cp, pos)
        if fused:
            q8 = (cp.full((1, n_head * 128), 77, cp.int8), cp.full((1, n_head * 4), np.nan, cp.float32),
                  cp.full((1, n_head * 4), np.nan, cp.float32))
            decode_attn.decode_attention(q, kc, vc, p, new_kv=(k, v), cos_sin=table, q8=q8, short=short)
            outs = tuple(cp.asnumpy(a) for a in q8)
        else:
            out = cp.full((1, n_head * 128), np.nan, cp.float32)
            decode_attn.decode_attention(q, kc, vc, p, out, short=short)
            outs = (cp.asnumpy(out),)
        got[short] = outs + (cp.asnumpy(kc).view(np.uint16), cp.asnumpy(vc).view(np.uint16))
    assert np.isfinite(got[True][0 if not fused else 1]).all()
    for a, b in zip(got[False], got[True]):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_decode_attention_one_launch_only_below_its_limit(cp):
    from minfer.backend.cuda.kernels.decode_attn import DEC_SHORT_KEYS, decode_attention
    kc = cp.zeros((DEC_SHORT_KEYS + 1, 1, 128), cp.float16)
    with pytest.raises(ValueError, match="one-launch"):
        decode_attention(cp.zeros((1, 2, 128), cp.float32), kc, kc, DEC_SHORT_KEYS, short=True)


def test_decode_attention_rejects_large_groups(cp):
    from minfer.backend.cuda.kernels.decode_attn import decode_attention
    from minfer.errors import MinferError
    kc = cp.zeros((4, 1, 128), cp.float16)
    with pytest.raises(MinferError, match="at most 8"):
        decode_attention(cp.zeros((1, 9, 128), cp.float32), kc, kc, 2)


@pytest.mark.parametrize("T,pos", [(1, 0), (1, 9), (5, 3), (33, 0)])
def test_store_kv_at_device_position(cp, T, pos):
    from minfer.backend.cuda.kernels.decode_attn import store_kv_f16
    rng = np.random.default_rng([T, pos])
    n_ctx, n_kv = 40, 3
    k = rng.standard_normal((T, n_kv, 128)).astype(np.float32)
    v = rng.standard_normal((T, n_kv, 128)).astype(np.float32)
    kc = cp.full((n_ctx, n_kv, 128), np.nan, cp.float16)
    vc = cp.full((n_ctx, n_kv, 128), np.nan, cp.float16)
    store_kv_f16(cp.asarray(k), cp.asarray(v), kc, vc, _dev_pos(cp, pos))
    got_k, got_v = cp.asnumpy(kc), cp.asnumpy(vc)
    assert np.array_equal(got_k[pos:pos + T].view(np.uint16), k.astype(np.float16).view(np.uint16))
    assert np.array_equal(got_v[pos:pos + T].view(np.uint16), v.astype(np.float16).view(np.uint16))
    assert np.isnan(got_k[:pos]).all() and np.isnan(got_k[pos + T:]).all()   # nothing else written


def test_rope_device_position_equals_host_position(cp):
    from minfer.backend.cuda.kernels import rope
    rng = np.random.default_rng(5)
    table = cp.asarray(rope.rope_table(64, 128, 10000.0))
    x = cp.asarray(rng.standard_normal((1, 7, 128)).astype(np.float32))
    for neox in (True, False):
        want = cp.asnumpy(rope.rope(x, table, 41, neox))
        got = cp.asnumpy(rope.rope(x, table, _dev_pos(cp, 41), neox))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("n", [1, 31, 1024, 1025, 152064])
def test_argmax_first_maximum_and_finite_flag(cp, n):
    from minfer.backend.cuda.kernels import argmax
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    if n > 3:
        x[[n // 3, n - 1]] = x.max() + 1.0        # a tie: the first index wins, as numpy's
    got = cp.asnumpy(argmax.argmax(cp.asarray(x[None, :])))
    assert got.tolist() == [int(np.argmax(x)), 1]
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[n // 2] = bad
        assert cp.asnumpy(argmax.argmax(cp.asarray(y)))[1] == 0


@pytest.fixture(scope="module")
def engine(synth_dir):
    from minfer.engine import Engine
    from minfer.tools.synth import synth_model
    return Engine.load(synth_model(synth_dir), backend="cuda", n_ctx=256, progress=False)


def _greedy_ids(engine, prompt, n: int, cache) -> list[int]:
    m = engine.model
    tok = int(np.argmax(m.forward(prompt, 0, cache)[-1]))
    out, pos = [tok], len(prompt)
    for _ in range(n - 1):
        tok = m.decode_greedy(tok, pos, cache)
        out.append(tok)
        pos += 1
    return out


def test_captured_decode_equals_eager_and_counts(engine):
    """The step is eager on a cache's first use, captured on its second and replayed
    after: the same ids as an all-eager run, the same ids as the logits' argmax of
    the eager single-token forward, and every replay counts its launches."""
    be = engine.backend
    prompt = np.random.default_rng(3).integers(0, engine.cfg.vocab_size, 21).astype(np.int32)
    with be.using(graphs=False):
        eager = _greedy_ids(engine, prompt, 24, engine.new_cache())
    # the argmax of the logits that the plain forward returns, step by step
    cache = engine.new_cache()
    ref = [int(np.argmax(engine.model.forward(prompt, 0, cache)[-1]))]
    for i in range(23):
        ref.append(int(np.argmax(engine.model.decode(ref[-1], len(prompt) + i, cache))))
    assert eager == ref
    cache = engine.new_cache()
    be.reset_counters()
    graphed = _greedy_ids(engine, prompt, 24, cache)
    c = be.counters()
    assert graphed == eager
    # 23 steps: eager, capture + replay, 21 replays, and the step queued ahead of the last
    assert c["graph replays"] == 23
    n_layer = engine.cfg.n_layer
    assert c["q4k_mv"] + c["q6k_mv"] >= 23 * 7 * n_layer   # every step's matvecs are counted
    (key,) = [k for k in cache.graphs if k[0][0] == "decode"]
    assert key == (("decode", True), be.settings)        # positions 21..44: the one-launch attention


def test_dependent_launches_in_the_decode_graph(engine, cp):
    """The step graph with its kernels launched as programmatic dependents (the
    default) gives the same ids and logits as with ordinary launches, and every
    replay counts its dependent launches (one per kernel of ours in the step)."""
    be = engine.backend
    prompt = np.random.default_rng(5).integers(0, engine.cfg.vocab_size, 17).astype(np.int32)
    ids, counts = {}, {}
    for on in (False, True):
        with be.using(dependent_launches=on):
            cache = engine.new_cache()
            be.reset_counters()
            ids[on] = _greedy_ids(engine, prompt, 12, cache)
            counts[on] = be.counters()
            (key,) = [k for k in cache.graphs if k[0][0] == "decode"]
            per_step = cache.graphs[key].counts["dependent launches"]
    assert ids[True] == ids[False]
    assert counts[False]["dependent launches"] == 0
    # 11 steps: eager, capture + replay, 9 replays, and one queued ahead of the last
    assert per_step >= 5 * engine.cfg.n_layer
    assert counts[True]["dependent launches"] == counts[True]["graph replays"] * per_step
    # the logits of one token's forward captured and replayed (the decode kernels:
    # matvecs, one-query attention, the q8_1 norms): the same bits both ways
    m, w, cfg = engine.model, engine.model.w, engine.cfg
    logits = {}
    for on in (False, True):
        cache = engine.new_cache()
        m.forward(prompt, 0, cache)

        def step(tokens, cache=cache):
            x = be.embed(w.token_embd, tokens)                                # (1, d)
            x = m.blocks(x, len(prompt), cache)
            out, = be.norm_linears(x, w.output_norm, cfg.rms_eps, (w.output,), (None,))
            return out

        graphs, tok = {}, cp.asarray(prompt[:1])
        with be.using(dependent_launches=on):
            for _ in range(3):                                    # eager, capture, replay
                logits[on] = cp.asnumpy(be.graphs.run(graphs, "step", step, tok))
        assert (graphs["step"].counts["dependent launches"] > 0) == on
    assert np.array_equal(logits[True].view(np.uint32), logits[False].view(np.uint32))


def _forced_ids(engine, prompt, forced: dict, n: int, cache) -> list[int]:
    """Greedy steps, except that at step i the token forced[i] is fed instead of the
    model's (teacher forcing): the ids the model returns at each step."""
    m = engine.model
    tok = int(np.argmax(m.forward(prompt, 0, cache)[-1]))
    out, pos = [tok], len(prompt)
    for i in range(n - 1):
        tok = m.decode_greedy(forced.get(i, tok), pos, cache)
        out.append(tok)
        pos += 1
    return out


def test_step_queued_ahead_is_dropped_when_the_caller_feeds_another_token(engine):
    """The step queued ahead reads the device's own token; where the caller feeds a
    different one (or jumps to another position), a fresh step must run: the ids
    equal an all-eager run with the same forced tokens."""
    be = engine.backend
    prompt = np.random.default_rng(4).integers(0, engine.cfg.vocab_size, 9).astype(np.int32)
    forced = {3: 7, 4: 11, 9: 5}
    with be.using(graphs=False):
        eager = _forced_ids(engine, prompt, forced, 16, engine.new_cache())
    cache = engine.new_cache()
    assert _forced_ids(engine, prompt, forced, 16, cache) == eager
    assert _forced_ids(engine, prompt, forced, 16, cache) == eager       # same cache: a new prompt
    assert cache.queued is not None
    engine.model.forward(prompt, 0, cache)                               # rewrites the rows it read
    assert cache.queued is None
    end = engine.new_cache(len(prompt) + 6)                              # nothing queued past the end
    assert _forced_ids(engine, prompt, {}, 7, end) == _greedy_ids(engine, prompt, 7, engine.new_cache())
    assert end.queued is None


def test_decode_rejects_bad_token_and_position(engine):
    from minfer.errors import MinferError
    cache = engine.new_cache(8)
    with pytest.raises(MinferError, match="out of range"):
        engine.model.decode_greedy(engine.cfg.vocab_size, 0, cache)
    with pytest.raises(MinferError, match="does not fit"):
        engine.model.decode_greedy(1, 8, cache)


def test_seeded_sampling_on_the_gpu(engine):
    """A sampled generation on the GPU: the same seed the same ids, temperature 0 the
    greedy stream, and each draw the reference sampler's on the step's own logits
    (the first token's checked against the prefill's logits here)."""
    from minfer import SamplingParams
    from minfer.generate import complete
    from minfer.sampling import sample
    prompt = np.random.default_rng(12).integers(0, engine.cfg.vocab_size, 40).astype(np.int32)
    greedy = complete(engine, prompt, 16, ignore_eos=True, cache=engine.new_cache())
    zero = complete(engine, prompt, 16, ignore_eos=True, cache=engine.new_cache(), sampling=SamplingParams(seed=3))
    assert zero.ids == greedy.ids
    p = SamplingParams(temperature=1.2, top_p=0.9, seed=5)
    a = complete(engine, prompt, 16, ignore_eos=True, cache=engine.new_cache(), sampling=p)
    assert a.ids == complete(engine, prompt, 16, ignore_eos=True, cache=engine.new_cache(), sampling=p).ids
    assert a.ids != greedy.ids
    logits = engine.model.forward(prompt, 0, engine.new_cache())[-1]
    assert a.ids[0] == sample(logits, p, len(prompt), prompt, [])
