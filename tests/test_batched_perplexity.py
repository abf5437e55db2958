"""Perplexity with several chunks per forward (llama-perplexity's -b) on a small
synthetic model, CPU: the same figures as one chunk at a time and as the chunk-by-chunk
loop written out here, one forward_batch per group, and -b's rule as one line."""
from __future__ import annotations

import math

import numpy as np
import pytest

from minfer.tools.synth import write_synthetic

# two layers (attention reads the cache each wrote), GQA 4/2 heads; chunks of 96
# positions span two 64-position blocks, so the block tables are walked across a boundary
SMALL = dict(n_layer=2, d_model=256, n_head=4, n_head_kv=2, d_ff=512)
N_CTX = 96
N_CHUNKS = 10               # 4 per group at -b 4 * N_CTX: groups of 4, 4 and 2
# Tolerance of a batched figure against one chunk at a time: the NLL sums run in the
# same order on the same rows either way; what may differ is the CPU BLAS's blocking
# of a product over 4 x 96 rows instead of 96 (float32, a few ulp in the logits:
# ~1e-7 relative), which moves a mean NLL of ~12 by ~1e-6 at most: rtol 1e-5 on the PPL.
RTOL = 1e-5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("ppl") / "small.gguf", seed=5, **SMALL)


@pytest.fixture(scope="module")
def engine(model):
    from minfer.engine import Engine
    return Engine.load(str(model), backend="cpu", n_ctx=N_CTX, progress=False, warmup=False)


@pytest.fixture(scope="module")
def text(engine) -> str:
    """A text of exactly N_CHUNKS chunks and a few tokens more."""
    line = "the quick brown fox jumps over the lazy dog; 0123 xyz. "
    t = line
    while len(engine.tokenizer.encode(t, parse_special=False)) < N_CHUNKS * N_CTX + 5:
        t += line
    assert len(engine.tokenizer.encode(t, parse_special=False)) // N_CTX == N_CHUNKS
    return t


def chunk_by_chunk(engine, text: str, n_ctx: int) -> tuple[float, float, list[float], int]:
    """llama.cpp's method one chunk at a time, as perplexity() computed it before -b:
    forward on one cache from position 0, LM head from n_ctx // 2."""
    from minfer.perplexity import token_nll
    tok = engine.tokenizer
    tokens = np.asarray(tok.encode(text, parse_special=False), np.int32)
    first, cache = n_ctx // 2, engine.new_cache(n_ctx)
    s = s2 = 0.0
    count, running = 0, []
    for c in range(len(tokens) // n_ctx):
        chunk = tokens[c * n_ctx:(c + 1) * n_ctx].copy()
        if tok.add_bos:
            chunk[0] = tok.bos_id
        nll = token_nll(engine.model.forward(chunk, 0, cache, logits_from=first)[:-1], chunk[first + 1:])
        s, s2, count = s + float(nll.sum()), s2 + float(np.square(nll).sum()), count + len(nll)
        running.append(math.exp(s / count))
    mean = s / count
    ppl = math.exp(mean)
    return ppl, ppl * math.sqrt((s2 / count - mean * mean) / (count - 1)), running, count


def test_groups_give_the_chunk_by_chunk_figures(engine, text):
    from minfer.perplexity import perplexity
    ppl, err, running, count = chunk_by_chunk(engine, text, N_CTX)
    one = perplexity(engine, text, n_ctx=N_CTX, progress=False, batch_size=N_CTX)
    # -b = n_ctx is the same computation as the loop above, in the same order: exact
    assert (one.ppl, one.err, one.running, one.count) == (ppl, err, running, count)
    assert one.n_chunks == N_CHUNKS and count == N_CHUNKS * (N_CTX - 1 - N_CTX // 2)
    seen = []
    for b in (4 * N_CTX, 3 * N_CTX, 16 * N_CTX, None):         # 4, 3, 10 (all) chunks per forward; the default
        res = perplexity(engine, text, n_ctx=N_CTX, progress=False, batch_size=b,
                         on_chunk=lambda i, p: seen.append(i))
        assert res.n_chunks == N_CHUNKS and res.count == count
        np.testing.assert_allclose(res.ppl, ppl, rtol=RTOL)
        np.testing.assert_allclose(res.err, err, rtol=1e-4)     # a difference of sums: less exact
        np.testing.assert_allclose(res.running, running, rtol=RTOL)
        assert seen == list(range(1, N_CHUNKS + 1))              # every chunk reported, in order
        seen.clear()
    two = perplexity(engine, text, n_ctx=N_CTX, progress=False, batch_size=4 * N_CTX, max_chunks=2)
    np.testing.assert_allclose(two.running, running[:2], rtol=RTOL)     # --chunks below a group


@pytest.mark.parametrize("b, forwards, batches", [(N_CTX, N_CHUNKS, 0), (4 * N_CTX, 0, 3), (5 * N_CTX, 0, 2),
                                                  (100 * N_CTX, 0, 1), (None, 0, 1)])
def test_one_forward_per_group(engine, text, monkeypatch, b, forwards, batches):
    """ceil(n_chunks / chunks per group) forwards; each group's sequences from position
    0 over n_ctx positions, the LM head on the scored half, over blocks of their own,
    the same blocks for every group."""
    from minfer.graph.transformer import Transformer
    from minfer.perplexity import chunks_per_forward, perplexity
    calls = {"forward": 0, "batch": []}
    real_forward, real_batch = Transformer.forward, Transformer.forward_batch

    def forward(self, *a, **k):
        calls["forward"] += 1
        return real_forward(self, *a, **k)

    def forward_batch(self, tokens, batch, cache):
        calls["batch"].append(batch)
        return real_batch(self, tokens, batch, cache)

    monkeypatch.setattr(Transformer, "forward", forward)
    monkeypatch.setattr(Transformer, "forward_batch", forward_batch)
    perplexity(engine, text, n_ctx=N_CTX, progress=False, batch_size=b)
    per = chunks_per_forward(N_CTX, b)
    assert calls["forward"] == forwards and len(calls["batch"]) == batches
    assert forwards + batches == -(-N_CHUNKS // per)
    tables = None
    for i, batch in enumerate(calls["batch"]):
        assert batch.logits_from == N_CTX // 2
        assert [(s.pos0, s.n) for s in batch.spans] == [(0, N_CTX)] * min(per, N_CHUNKS - i * per)
        t = [s.table for s in batch.spans]
        assert len({blk for tab in t for blk in tab}) == 2 * len(t)          # 2 blocks each, none shared
        tables = tables or t
        assert t == tables[:len(t)]                                         # reused by every group


def test_chunks_per_forward_is_llama_perplexitys():
    from minfer.perplexity import DEFAULT_BATCH, chunks_per_forward
    assert DEFAULT_BATCH == 2048 and chunks_per_forward(512) == 4
    # the default is rounded down to whole chunks, at least one (llama-perplexity's
    # n_seq = max(1, n_batch / n_ctx)): never an error, whatever -c
    assert chunks_per_forward(1000) == 2 and chunks_per_forward(3000) == 1 and chunks_per_forward(4) == 512
    assert chunks_per_forward(512, 512) == 1 and chunks_per_forward(512, 4096) == 8


@pytest.mark.parametrize("b, fragment", [("0", "must be a positive number"), ("-512", "must be a positive number"),
                                         ("100", "batch size 100 is not a multiple of the context 32"),
                                         ("16", "try -b 32 (one chunk at a time)"),
                                         ("80", "try -b 64 or 96")])
def test_bad_batch_size_is_one_line_before_the_model_opens(tmp_path, capsys, b, fragment):
    from minfer.cli import main
    text = tmp_path / "t.txt"
    text.write_text("hello " * 200)
    capsys.readouterr()
    rc = main(["perplexity", "-m", str(tmp_path / "missing.gguf"), "-f", str(text), "-c", "32", "-b", b,
               "--backend", "cpu"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.startswith("minfer: error:") and err.count("\n") == 1 and fragment in err, err
    assert "missing.gguf" not in err


def test_cli_batched_equals_one_at_a_time(model, text, tmp_path, capsys):
    from minfer.cli import main
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    outs = []
    for b in (N_CTX, 4 * N_CTX):
        capsys.readouterr()
        rc = main(["perplexity", "-m", str(model), "-f", str(path), "-c", str(N_CTX), "-b", str(b),
                   "--backend", "cpu", "-q"])
        out, err = capsys.readouterr()
        assert rc == 0, err
        outs.append(out)
    figures = [[float(v) for v in out.replace("Final estimate: PPL =", ",").replace("+/-", ",")
                .replace("]", ",").replace("[", ",").split(",") if v.strip()] for out in outs]
    assert len(figures[0]) == 2 * N_CHUNKS + 2                    # [i] and running value, then PPL and +/-
    np.testing.assert_allclose(figures[1], figures[0], rtol=RTOL)
