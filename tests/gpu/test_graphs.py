"""CUDA graphs of the decoder layers (Backend.captured): a replay computes the
same bits as the eager forward, counts its launches, and survives scratch
growth after its capture.

Each key (T, pos0) runs eagerly on first use, is captured on the second and
replayed from then on; the graph keeps every scratch buffer it captured alive.
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
GATEUP_Q4K = "gateup_swiglu_q4k"          # the gate/up + SwiGLU kernel on q4_K, counted by name


@pytest.fixture(scope="module")
def engine(synth_dir):
    from minfer.engine import Engine
    from minfer.tools.synth import synth_model
    return Engine.load(synth_model(synth_dir), backend="cuda", n_ctx=700, progress=False)


def _tokens(T: int, seed: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, T).astype(np.int32)


def _counts(be) -> dict:
    """The backend's launch counters without the graph-replay, dependent-launch and
    early-dequantization counts (which only a replay adds)."""
    c = be.counters()
    c.pop("graph replays")
    c.pop("dependent launches")
    c.pop("early dequants")
    return c


def _eager(engine, tokens, cache):
    be = engine.backend
    with be.using(graphs=False):
        be.reset_counters()
        y = engine.model.forward(tokens, 0, cache, logits_from=0)
        return y, _counts(be)


# 200: the FFN takes the gate/up + SwiGLU kernel on q4_K (paths.GATEUP_KERNELS)
@pytest.mark.parametrize("T,gemm", [(7, "f16"), (70, "f16"), (200, "f16"), (333, "f16"), (40, "mmq")])
def test_replay_equals_eager_and_counts(engine, T, gemm):
    be = engine.backend
    assert be.settings.graphs, "MINFER_CUDA_GRAPHS=0 in the environment"
    pin = {"f16_min_t": 1 << 30} if gemm == "mmq" else {}     # pin the int8 MMQ engine (and W_exp staging)
    with be.using(**pin):
        cache = engine.new_cache()
        toks = _tokens(T, T, engine.cfg.vocab_size)
        want, want_counts = _eager(engine, toks, cache)
        # eager; capture (an eager run fills the graph's pool, then one replay); replay.
        # The counters count launches that ran: the capturing call runs the layers twice.
        got_counts, replays = [], []
        for i in range(3):
            be.reset_counters()
            got = engine.model.forward(toks, 0, cache, logits_from=0)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"call {i}"
            replays.append(be.counters()["graph replays"])
            got_counts.append(_counts(be))
    (rec,) = [g for k, g in cache.graphs.items() if k[0] == ("blocks", T, 0)]
    layers = dict(rec.counts)                                     # one replay's launches
    assert layers.pop("dependent launches") >= 7 * engine.cfg.n_layer   # our kernels, dependent
    early = layers.pop("early dequants")                          # the f16 engine's dequantizations
    # q/k/v, o, gate/up and down, less the layers whose gate/up + SwiGLU is one kernel
    dequants = 4 * engine.cfg.n_layer - layers.get(GATEUP_Q4K, 0)
    assert (early >= dequants) if gemm == "f16" else early == 0
    assert sum(layers.values()) >= 7 * engine.cfg.n_layer and all(
        layers[k] <= want_counts.get(k, 0) for k in layers)
    assert got_counts[0] == want_counts and got_counts[2] == want_counts
    assert got_counts[1] == {k: want_counts[k] + layers.get(k, 0) for k in want_counts}
    assert replays == [0, 1, 1]


def test_exp_toggle_is_not_baked_into_a_replay(engine):
    """Toggling the W_exp path after a capture must change the launches: the
    settings are part of the graph key, so a toggled run captures its own graph."""
    be, cache = engine.backend, engine.new_cache()
    toks = _tokens(40, 3, engine.cfg.vocab_size)
    for f16_min_t in (1 << 30, 2):                                 # MMQ, then the f16 engine
        for on in (True, False, True, False):
            with be.using(f16_min_t=f16_min_t, exp_enabled=on):
                for _ in range(3):
                    be.reset_counters()
                    engine.model.forward(toks, 0, cache)
                    c = be.counters()
                    assert (c["q6k exp"] > 0) == on and (c["q6k exp=off"] > 0) == (not on)


def test_replay_survives_scratch_growth(engine):
    """Capture at a short length, then grow every scratch buffer with a longer
    prompt, then replay the short one: a graph holding freed scratch would now
    read or write memory the longer run took over."""
    be = engine.backend
    cache = engine.new_cache()
    short, long_ = _tokens(65, 1, engine.cfg.vocab_size), _tokens(650, 2, engine.cfg.vocab_size)
    want, _ = _eager(engine, short, cache)
    engine.model.forward(short, 0, cache, logits_from=0)          # eager (first use)
    engine.model.forward(short, 0, cache, logits_from=0)          # capture + replay
    x16_before = be.state.keep_alive()[1]                         # (q8 slots, x16, w16, RoPE)
    for _ in range(3):                                            # eager, capture, replay
        engine.model.forward(long_, 0, cache, logits_from=0)
    assert be.state.keep_alive()[1].size > x16_before.size, "x16 scratch did not grow"
    got = engine.model.forward(short, 0, cache, logits_from=0)    # replay of the short graph
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("T", [7, 200, 333])
def test_dependent_launches_same_bits(engine, T):
    """A graph whose kernels launch as programmatic dependents (the default) and one
    whose kernels launch the ordinary way give the same bits; only the first counts
    dependent launches, on every replay."""
    be = engine.backend
    toks = _tokens(T, 11 + T, engine.cfg.vocab_size)
    got = {}
    for on in (False, True):
        with be.using(dependent_launches=on):
            cache = engine.new_cache()
            for _ in range(3):                                    # eager, capture, replay
                be.reset_counters()
                got[on] = engine.model.forward(toks, 0, cache, logits_from=0)
            assert be.counters()["graph replays"] == 1
            n = be.counters()["dependent launches"]
            assert (n >= 7 * engine.cfg.n_layer) if on else n == 0
            # the f16 engine's dequantizations (q/k/v, o, gate/up unless fused, down:
            # each after a kernel of ours) start before their wait, only as dependents
            c = be.counters()
            e, dequants = c["early dequants"], 4 * engine.cfg.n_layer - c.get(GATEUP_Q4K, 0)
            assert (e >= dequants) if on else e == 0
    assert np.array_equal(got[True].view(np.uint32), got[False].view(np.uint32))


def test_decode_graphs_either_side_of_the_one_launch_limit(engine):
    """A decode step's graph key says whether its attention is the one-launch kind
    (decode_attn.decode_short); greedy steps across the limit (positions 250..269 of a
    700-position cache) give the ids of eager steps, one graph each side, each
    replayed, and no step queued ahead across the limit."""
    from minfer.backend.cuda.kernels.decode_attn import DEC_SHORT_KEYS
    from minfer.backend.cuda.graphs import Graph
    assert DEC_SHORT_KEYS == 256
    be, m = engine.backend, engine.model
    prompt = _tokens(250, 21, engine.cfg.vocab_size)

    def greedy(cache):
        tok, pos, out = int(np.argmax(m.forward(prompt, 0, cache)[-1])), len(prompt), []
        for _ in range(20):
            tok = m.decode_greedy(tok, pos, cache)
            out.append(tok)
            pos += 1
        return out

    with be.using(graphs=False):
        eager = greedy(engine.new_cache())
    cache = engine.new_cache()
    be.reset_counters()
    assert greedy(cache) == eager
    keys = {k[0]: g for k, g in cache.graphs.items() if k[0][0] == "decode"}
    assert set(keys) == {("decode", True), ("decode", False)}
    assert all(isinstance(g, Graph) for g in keys.values())
    # positions 250..255: eager, capture + replay, then 2, 1, 1 replays (a step and the
    # one queued ahead; none queued across the limit at 255); 256..269: eager,
    # capture + replay, 2, then 11 x 1 (the last queues position 270)
    assert be.counters()["graph replays"] == (1 + 2 + 1 + 1) + (1 + 2 + 11)


@pytest.mark.parametrize("T", [7, 333])
def test_flash_kernels_same_bits_and_counted(engine, T):
    """The prefill attention runs the wgmma kernel by default on a Hopper GPU and the
    mma.sync kernel with flash_wgmma=False; each is counted
    once a layer eager and once a layer a replay (the capturing forward runs the
    layers once warm and replays the new graph: twice), and the logits are the same
    bits."""
    from minfer.backend.cuda.kernels import flash_attn
    be = engine.backend
    toks = _tokens(T, 5 + T, engine.cfg.vocab_size)
    got = {}
    for on in (True, False):
        kind = flash_attn.flash_kind(on)
        other = "mma" if kind == "wgmma" else "wgmma"
        with be.using(flash_wgmma=on):
            cache = engine.new_cache()
            for runs in (1, 2, 1):                                # eager, capture, replay
                be.reset_counters()
                got[on] = engine.model.forward(toks, 0, cache, logits_from=0)
                c = be.counters()
                assert (c.get(flash_attn.KERNEL[kind], 0) == runs * engine.cfg.n_layer
                        and c.get(flash_attn.KERNEL[other], 0) == 0), c
            assert c["graph replays"] == 1
    if flash_attn.flash_kind(True) != "wgmma":
        pytest.skip("no wgmma kernel on this GPU: the mma.sync kernel ran both times")
    assert np.array_equal(got[True].view(np.uint32), got[False].view(np.uint32))
