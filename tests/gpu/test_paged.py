"""The attention kernels over a paged KV cache (block tables, kernels/common.cuh's
kv_row) and over several sequences at once (flash_attn.FlashBatch, decode rows
batched). Truth: the same kernel on a contiguous cache, one sequence at a time,
which tests/gpu/test_fast.py and test_decode.py check against float64 NumPy; a
row's arithmetic does not depend on where its keys sit or on its neighbours, so
the outputs are the same bits. Rows of the paged cache that no sequence owns are
NaN: a read through a wrong table entry fails the comparison."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

BT = 64                                    # positions a block (minfer.kv.blocks.BLOCK_TOKENS)


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


def _bits_equal(got, want):
    g, w = np.asarray(got), np.asarray(want)
    gv = g.view(np.uint16 if g.dtype == np.float16 else np.uint32)
    wv = w.view(np.uint16 if w.dtype == np.float16 else np.uint32)
    bad = np.argwhere(gv != wv)
    assert bad.size == 0, f"{len(bad)} of {g.size} differ; first at {tuple(bad[0])}: {g[tuple(bad[0])]} vs {w[tuple(bad[0])]}"


def _paged(rng, caches, n_blocks, dtype=np.float16):
    """Contiguous caches (n_i, n_kv, hd) -> one paged cache (n_blocks * 64, n_kv, hd)
    with the sequences' blocks scattered in a random order (the rest NaN) and each
    sequence's block table (int32)."""
    n_kv, hd = caches[0].shape[1:]
    paged = np.full((n_blocks * BT, n_kv, hd), np.nan, dtype)
    free = list(rng.permutation(n_blocks))
    tables = []
    for c in caches:
        k = -(-c.shape[0] // BT)
        tab = np.array([free.pop() for _ in range(k)], np.int32)
        for j, b in enumerate(tab):
            rows = c[j * BT:(j + 1) * BT]
            paged[b * BT:b * BT + len(rows)] = rows
        tables.append(tab)
    return paged, tables


@pytest.mark.parametrize("kind", ["mma", "wgmma"])
@pytest.mark.parametrize("n_head,n_kv", [(28, 4), (12, 2), (8, 8)])
def test_flash_batch_equals_each_sequence_alone(cp, kind, n_head, n_kv):
    """Sequences of 1 to 300 new tokens after 0 to 200 cached ones, on one paged
    cache, in one launch: each sequence's rows equal its own launch on a contiguous
    cache (f32 and f16 outputs); one sequence through its table equals it too."""
    from minfer.backend.cuda.kernels import flash_attn
    if flash_attn.flash_kind(kind == "wgmma") != kind:
        pytest.skip(f"no {kind} flash kernel on this GPU")
    rng = np.random.default_rng([n_head, n_kv, kind == "wgmma"])
    shapes = [(0, 300), (64, 1), (200, 77), (0, 1), (5, 130), (63, 2)]      # (pos0, n)
    ks = [rng.standard_normal((p + n, n_kv, 128)).astype(np.float16) * 1.5 for p, n in shapes]
    vs = [rng.standard_normal((p + n, n_kv, 128)).astype(np.float16) for p, n in shapes]
    qs = [rng.standard_normal((n, n_head, 128)).astype(np.float16) for _, n in shapes]
    n_blocks = sum(-(-k.shape[0] // BT) for k in ks) + 3
    kp, tables = _paged(np.random.default_rng(1), ks, n_blocks)
    vp, tables_v = _paged(np.random.default_rng(1), vs, n_blocks)
    assert all((a == b).all() for a, b in zip(tables, tables_v))
    kp, vp = cp.asarray(kp), cp.asarray(vp)
    starts = np.concatenate([[0], np.cumsum([n for _, n in shapes])])
    batch = flash_attn.FlashBatch([(int(starts[i]), n, p, tables[i]) for i, (p, n) in enumerate(shapes)],
                                  n_head, n_kv)
    q_all = cp.asarray(np.concatenate(qs))
    for dtype in (cp.float32, cp.float16):
        got = cp.full((int(starts[-1]), n_head * 128), cp.nan, dtype)
        flash_attn.flash_attention(q_all, kp, vp, 0, got, wgmma=kind == "wgmma", batch=batch)
        got = got.get()
        for i, (p, n) in enumerate(shapes):
            want = cp.full((n, n_head * 128), cp.nan, dtype)
            flash_attn.flash_attention(cp.asarray(qs[i]), cp.asarray(ks[i]), cp.asarray(vs[i]), p, want,
                                       wgmma=kind == "wgmma")
            _bits_equal(got[starts[i]:starts[i + 1]], want.get())
            one = cp.full((n, n_head * 128), cp.nan, dtype)
            flash_attn.flash_attention(cp.asarray(qs[i]), kp, vp, p, one, wgmma=kind == "wgmma",
                                       tab=cp.asarray(tables[i]), n_ctx=p + n)
            _bits_equal(one.get(), want.get())


@pytest.mark.parametrize("pos", [0, 63, 64, 200, 255, 256, 700, 3000])   # one launch below 256, two from it
def test_decode_attention_through_a_table_and_batched(cp, pos):
    """One decode row through its block table equals the contiguous cache's bits,
    with RoPE and the KV store inside (the stored row lands in the right block) and
    the q8_1 output; B = 3 rows at different positions in one launch equal each
    alone (the largest position picks the one- or two-launch path for all)."""
    from minfer.backend.cuda.kernels import decode_attn, rope
    from minfer.backend.cuda.launch import DevicePos
    n_head, n_kv = 28, 4
    rng = np.random.default_rng(pos)
    positions = [pos, max(pos // 2, 0), max(pos - 1, 0)]
    n_ctx = 3072 + 64
    table_rope = cp.asarray(rope.rope_table(n_ctx, 128, 1e6))
    caches = [rng.standard_normal((n_ctx, n_kv, 128)).astype(np.float16) for _ in range(6)]
    ks, vs = caches[:3], caches[3:]
    for c, p in zip(ks + vs, positions * 2):
        c[p:] = np.nan                                         # row p is stored by the kernel
    n_blocks = 3 * n_ctx // BT + 2
    kp, tabs = _paged(np.random.default_rng(7), ks, n_blocks)
    vp, _ = _paged(np.random.default_rng(7), vs, n_blocks)
    kp, vp = cp.asarray(kp), cp.asarray(vp)
    q = cp.asarray((rng.standard_normal((3, n_head, 128)) * 2).astype(np.float32))
    kn = cp.asarray(rng.standard_normal((3, n_kv, 128)).astype(np.float32))
    vn = cp.asarray(rng.standard_normal((3, n_kv, 128)).astype(np.float32))
    short = decode_attn.decode_short(max(positions))
    alone, alone_k = [], []
    for b, p in enumerate(positions):
        kc, vc = cp.asarray(ks[b]), cp.asarray(vs[b])
        out = cp.full((1, n_head * 128), cp.nan, cp.float32)
        decode_attn.decode_attention(q[b:b + 1], kc, vc, p, out, new_kv=(kn[b:b + 1], vn[b:b + 1]),
                                     cos_sin=table_rope, short=short)
        alone.append(out.get())
        alone_k.append(kc[p].get())
        one = cp.full((1, n_head * 128), cp.nan, cp.float32)
        kq, vq = kp.copy(), vp.copy()
        decode_attn.decode_attention(q[b:b + 1], kq, vq, p, one, new_kv=(kn[b:b + 1], vn[b:b + 1]),
                                     cos_sin=table_rope, short=short, tab=cp.asarray(tabs[b]), n_ctx=n_ctx)
        _bits_equal(one.get(), alone[-1])
        _bits_equal(kq[tabs[b][p // BT] * BT + p % BT].get(), alone_k[-1])
    pos_dev = DevicePos(max(positions), cp.asarray(np.array(positions, np.int32)))
    got = cp.full((3, n_head * 128), cp.nan, cp.float32)
    decode_attn.decode_attention(q, kp, vp, pos_dev, got, new_kv=(kn, vn), cos_sin=table_rope,
                                 short=short, tab=cp.asarray(np.stack(tabs)), n_ctx=n_ctx)
    for b, p in enumerate(positions):
        _bits_equal(got[b:b + 1].get(), alone[b])
        _bits_equal(kp[tabs[b][p // BT] * BT + p % BT].get(), alone_k[b])


@pytest.mark.parametrize("neox", [True, False])
def test_rope_store_at_rows_equals_the_contiguous_store(cp, neox):
    """rope_store_kv_f16 with each row's (position, cache row): the same q16 and the
    same stored K/V bits as the contiguous launch at each sequence's positions."""
    from minfer.backend.cuda.kernels import decode_attn, rope
    n_head, n_kv, hd = 12, 2, 128
    rng = np.random.default_rng(int(neox))
    shapes = [(0, 70), (130, 5), (64, 64)]
    table_rope = cp.asarray(rope.rope_table(512, hd, 1e4))
    T = sum(n for _, n in shapes)
    q, k, v = (cp.asarray(rng.standard_normal((T, h, hd)).astype(np.float32)) for h in (n_head, n_kv, n_kv))
    n_rows = 12 * BT
    perm = np.random.default_rng(2).permutation(n_rows).astype(np.int32)
    rows = np.concatenate([np.stack([np.arange(p, p + n), perm[i * 200:i * 200 + n]], 1)
                           for i, (p, n) in enumerate(shapes)]).astype(np.int32)
    kc = cp.full((n_rows, n_kv, hd), cp.nan, cp.float16)
    vc = cp.full((n_rows, n_kv, hd), cp.nan, cp.float16)
    q16 = decode_attn.rope_store_kv_f16(q, k, v, kc, vc, table_rope, 0, neox, q_out=cp.empty(q.shape, cp.float16),
                                        rows=cp.asarray(rows))
    t0 = 0
    for p, n in shapes:
        kw = cp.full((p + n, n_kv, hd), cp.nan, cp.float16)
        vw = cp.full((p + n, n_kv, hd), cp.nan, cp.float16)
        want = decode_attn.rope_store_kv_f16(q[t0:t0 + n], k[t0:t0 + n], v[t0:t0 + n], kw, vw, table_rope, p,
                                             neox, q_out=cp.empty((n, n_head, hd), cp.float16))
        _bits_equal(q16[t0:t0 + n].get(), want.get())
        at = rows[t0:t0 + n, 1]
        _bits_equal(kc[cp.asarray(at)].get(), kw[p:].get())
        _bits_equal(vc[cp.asarray(at)].get(), vw[p:].get())
        t0 += n


def test_f32_attention_and_rope_through_a_table(cp):
    """The f32 cache's attention (head dim 64: SmolLM2) through a block table, and
    RoPE at given row positions, equal the contiguous launches."""
    from minfer.backend.cuda.kernels import attention, rope
    rng = np.random.default_rng(5)
    n_head, n_kv, hd, pos0, T = 9, 3, 64, 100, 40
    kc = rng.standard_normal((pos0 + T, n_kv, hd)).astype(np.float32)
    vc = rng.standard_normal((pos0 + T, n_kv, hd)).astype(np.float32)
    # the paged copy holds every position's row (the new ones are overwritten by the store)
    kp, (tab,) = _paged(np.random.default_rng(6), [kc], 8, np.float32)
    vp, _ = _paged(np.random.default_rng(6), [vc], 8, np.float32)
    q, k, v = (cp.asarray(rng.standard_normal((T, h, hd)).astype(np.float32)) for h in (n_head, n_kv, n_kv))
    want = attention.attention_f32(q, k, v, cp.asarray(kc), cp.asarray(vc), pos0)
    got = attention.attention_f32(q, k, v, cp.asarray(kp), cp.asarray(vp), pos0, tab=cp.asarray(tab),
                                  n_ctx=pos0 + T)
    _bits_equal(got.get(), want.get())
    tbl = cp.asarray(rope.rope_table(256, hd, 1e4))
    rows = cp.asarray(np.stack([np.arange(pos0, pos0 + T), np.zeros(T)], 1).astype(np.int32))
    _bits_equal(rope.rope(q, tbl, 0, True, rows=rows).get(), rope.rope(q, tbl, pos0, True).get())


@pytest.fixture(scope="module")
def engine(synth_dir):
    from minfer.engine import Engine
    from minfer.tools.synth import synth_model
    return Engine.load(synth_model(synth_dir), backend="cuda", n_ctx=512, progress=False)


def test_forward_batch_on_the_gpu_agrees_with_each_sequence_alone(engine, parity_rel):
    """Several sequences in one forward: each one's last-row logits within the
    parity bound of its own forward (the GEMMs see more rows, so cuBLAS may sum
    differently: not bit-exact in this mode), and every row's when asked for all."""
    from minfer.kv.batch import Batch, Span
    from minfer.kv.paged import PagedCache
    e = engine
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, e.cfg.vocab_size, n).astype(np.int32) for n in (3, 130, 64, 257, 1)]
    kv = PagedCache(e.backend, 20)
    free = kv.pool.allocate(19)[::-1]
    spans = []
    for p in prompts:
        k = PagedCache.blocks_for(len(p))
        spans.append(Span(0, len(p), tuple(free[:k])))
        free = free[k:]
    got = e.model.forward_batch(np.concatenate(prompts), Batch(spans), kv.storage)
    for i, p in enumerate(prompts):
        want = e.logits(p)[-1]
        assert np.linalg.norm(got[i] - want) / np.linalg.norm(want) < parity_rel, i


def test_a_chat_turn_on_the_gpu_prefills_only_what_is_new(engine):
    e = engine
    e.reset_prefix_cache()
    rng = np.random.default_rng(4)
    first = rng.integers(0, e.cfg.vocab_size, 150).astype(np.int32)
    a = e.generate(first, max_tokens=6, ignore_eos=True)
    second = np.concatenate([first, a.ids, rng.integers(0, e.cfg.vocab_size, 20)]).astype(np.int32)
    b = e.generate(second, max_tokens=6, ignore_eos=True)
    assert a.stats.n_cached == 0 and b.stats.n_cached == 128
    e.reset_prefix_cache()
    c = e.generate(second, max_tokens=6, ignore_eos=True)
    assert c.stats.n_cached == 0
    # the first token from the cached prefix agrees with the fresh prefill's (same argmax
    # on the synthetic model, whose logits have no near-ties at this depth)
    assert b.ids[0] == c.ids[0]


DECODE_ENGINES = {"mvt": {}, "matvec": {"decode_mma_rows": 0},
                  "f16": {"decode_mma_rows": 0, "decode_matvec_rows": 0},
                  "mmq": {"decode_mma_rows": 0, "decode_matvec_rows": 0, "decode_mmq": True}}


@pytest.mark.parametrize("kind", list(DECODE_ENGINES))
def test_a_decode_step_of_several_sequences_on_the_gpu(engine, parity_rel, kind):
    """One forward of B one-row sequences: each row's logits within the parity bound
    of its sequence run alone; the step takes the batched decode attention and the
    engine its settings give every weight (counted): by default mmq_rows, whose
    rows are bit for bit the same in a step of 3 sequences; else the matvec of B
    rows, whose rows are bit for bit each sequence's step alone."""
    from minfer.kv.batch import Batch, Span
    from minfer.kv.paged import PagedCache
    e, be = engine, engine.backend
    rng = np.random.default_rng(12)
    prompts = [rng.integers(0, e.cfg.vocab_size, n).astype(np.int32) for n in (5, 64, 200, 300, 9, 70)]
    kv = PagedCache(e.backend, 24)
    spans, nxt = [], []
    for p in prompts:
        table = tuple(kv.pool.allocate(PagedCache.blocks_for(len(p) + 1)))
        nxt.append(int(np.argmax(e.model.forward_batch(p, Batch([Span(0, len(p), table)]), kv.storage)[0])))
        spans.append(Span(len(p), 1, table))
    with be.using(**DECODE_ENGINES[kind]):
        be.reset_counters()
        got = e.model.forward_batch(np.array(nxt, np.int32), Batch(spans), kv.storage)
        c = be.counters()
        n = 3 if kind == "mvt" else 1           # mmq_rows takes two sequences and more
        alone = np.concatenate([e.model.forward_batch(np.array(nxt[i:i + n], np.int32), Batch(spans[i:i + n]),
                                                      kv.storage) for i in range(0, len(spans), n)])
    assert c.get("attn_decode_f16", 0) + c.get("attn_decode_short", 0) == e.cfg.n_layer
    label = {"mvt": "q4k_mvt", "matvec": "q4k_mv", "f16": "q4k_f16", "mmq": "q4k_mmq"}
    assert all((c.get(v, 0) > 0) == (k == kind) for k, v in label.items()), c
    for i, p in enumerate(prompts):
        want = e.logits(np.append(p, nxt[i]))[-1]
        assert np.linalg.norm(got[i] - want) / np.linalg.norm(want) < parity_rel, i
        if kind in ("mvt", "matvec"):
            assert np.array_equal(got[i].view(np.uint32), alone[i].view(np.uint32)), i


def test_a_list_of_prompts_on_the_gpu(engine):
    """generate([...]) on the GPU: the same first token as each prompt alone, and as
    many tokens; seeded sampling draws what the prompt alone draws."""
    from minfer.sampling import SamplingParams
    e = engine
    e.reset_prefix_cache()
    rng = np.random.default_rng(13)
    prompts = [rng.integers(0, e.cfg.vocab_size, n).astype(np.int32) for n in (7, 90, 260)]
    got = e.generate(prompts, max_tokens=8, ignore_eos=True)
    for p, g in zip(prompts, got):
        alone = e.generate(p, max_tokens=8, ignore_eos=True)
        assert len(g.ids) == 8 and g.ids[0] == alone.ids[0]
    sp = SamplingParams(temperature=1.0, seed=3)
    a = e.generate(prompts, max_tokens=1, sampling=sp)
    b = e.generate(prompts[2], max_tokens=1, sampling=sp)
    assert a[2].ids == b.ids


def test_decode_steps_of_several_sequences_replay_from_a_graph(engine):
    """A decode step of B sequences is captured once per (B, table width) and
    replayed: the same logits, bit for bit, as every step run eagerly, with each
    step's positions and tables read from the storage's buffers (a replay that read
    the captured step's would give the first step's rows again)."""
    from minfer.kv.batch import Batch, Span
    from minfer.kv.paged import PagedCache
    e, be = engine, engine.backend
    rng = np.random.default_rng(21)
    prompts = [rng.integers(0, e.cfg.vocab_size, n).astype(np.int32) for n in (20, 70, 100)]
    steps = rng.integers(0, e.cfg.vocab_size, (6, 3)).astype(np.int32)

    def run(graphs: bool):
        kv = PagedCache(e.backend, 12)
        tables = [tuple(kv.pool.allocate(3)) for _ in prompts]
        with be.using(graphs=graphs):
            for p, t in zip(prompts, tables):
                e.model.forward_batch(p, Batch([Span(0, len(p), t)]), kv.storage)
            be.reset_counters()
            out = [e.model.forward_batch(ids, Batch([Span(len(p) + i, 1, t) for p, t in zip(prompts, tables)]),
                                         kv.storage) for i, ids in enumerate(steps)]
            return out, be.counters()
    eager, _ = run(False)
    graphed, c = run(True)
    assert c["graph replays"] == 5                  # steps 2..6 (step 1 eager; 2: warm-up, capture, replay)
    for a, b in zip(graphed, eager):
        _bits_equal(a, b)
