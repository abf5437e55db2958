"""Synthetic models and the 7B twin: layout, determinism, valid quant blocks.

Independent truths: the 7B header's own tensor table (read by minfer.format.gguf),
gguf.quants.dequantize for the blocks, and the table of expected types written
out below (not taken from minfer.tools.synth).
"""
from __future__ import annotations

import hashlib

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from minfer.format.gguf import open_gguf
from minfer.tools.synth import draw_rows, header_7b_path, tensor_bytes, write_synthetic

# the type each tensor of the small model must have
SPEC_TYPES = {
    "token_embd.weight": Q.Q4_K, "output.weight": Q.Q6_K, "output_norm.weight": Q.F32,
    "attn_norm.weight": Q.F32, "ffn_norm.weight": Q.F32,
    "attn_q.weight": Q.Q4_K, "attn_k.weight": Q.Q4_K, "attn_output.weight": Q.Q4_K,
    "ffn_gate.weight": Q.Q4_K, "ffn_up.weight": Q.Q4_K,
    "attn_v.weight": Q.Q6_K, "ffn_down.weight": Q.Q6_K,
    "attn_q.bias": Q.F32, "attn_k.bias": Q.F32, "attn_v.bias": Q.F32,
}

# small irregular geometry: 3 layers, head_dim 64, GQA 4/2, d_ff 768 (the vocabulary
# is the 7B tokenizer's 152,064, so d_model drives the cost of a write)
GEOM = dict(n_layer=3, d_model=256, n_head=4, n_head_kv=2, d_ff=768)


@pytest.fixture(scope="module")
def synth_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    a = write_synthetic(d / "a.gguf", seed=7, **GEOM)
    b = write_synthetic(d / "b.gguf", seed=7, **GEOM)
    return a, b


def sha256(p) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_header_found(header_7b):
    assert header_7b_path().resolve() == header_7b.resolve()


def test_write_synthetic_deterministic(synth_pair):
    a, b = synth_pair
    assert sha256(a) == sha256(b)
    # and the seed matters
    one = tensor_bytes("blk.0.attn_q.weight", (256, 256), Q.Q4_K, seed=7)
    assert np.array_equal(one, tensor_bytes("blk.0.attn_q.weight", (256, 256), Q.Q4_K, seed=7))
    assert not np.array_equal(one, tensor_bytes("blk.0.attn_q.weight", (256, 256), Q.Q4_K, seed=8))


def test_write_synthetic_layout(synth_pair, header_7b):
    gf = open_gguf(str(synth_pair[0]))
    hdr = open_gguf(str(header_7b), header_only=True)
    # the real model's names: the 7B's globals and its blk.0..blk.2 tensors
    want = {n for n in hdr.tensors if not n.startswith("blk.") or int(n.split(".")[1]) < GEOM["n_layer"]}
    assert set(gf.tensors) == want
    d, ff, kv = GEOM["d_model"], GEOM["d_ff"], GEOM["n_head_kv"] * GEOM["d_model"] // GEOM["n_head"]
    vocab = len(hdr.get("tokenizer.ggml.tokens"))
    shapes = {"token_embd.weight": (vocab, d), "output.weight": (vocab, d), "output_norm.weight": (d,),
              "attn_norm.weight": (d,), "ffn_norm.weight": (d,), "attn_q.weight": (d, d),
              "attn_k.weight": (kv, d), "attn_v.weight": (kv, d), "attn_output.weight": (d, d),
              "ffn_gate.weight": (ff, d), "ffn_up.weight": (ff, d), "ffn_down.weight": (d, ff),
              "attn_q.bias": (d,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    for name, t in gf.tensors.items():
        key = name.split(".", 2)[2] if name.startswith("blk.") else name
        assert t.qtype == SPEC_TYPES[key], name
        assert t.shape == shapes[key], name
    # every tokenizer key copied, same values
    tok = {k: v for k, v in hdr.metadata.items() if k.startswith("tokenizer.")}
    assert tok and {k: v for k, v in gf.metadata.items() if k.startswith("tokenizer.")} == tok
    assert gf.get("general.architecture") == "qwen2"
    assert gf.get("qwen2.block_count") == GEOM["n_layer"]


def test_write_synthetic_values(synth_pair):
    """Dequantized by gguf (independent) the tensors follow their laws."""
    gf = open_gguf(str(synth_pair[0]))

    def deq(name):
        t = gf.tensors[name]
        return gguf.quants.dequantize(np.asarray(gf.raw(name)), t.qtype).reshape(t.shape)

    norm = deq("blk.1.ffn_norm.weight")
    assert abs(norm.mean() - 1) < 0.02 and 0.08 < norm.std() < 0.12
    bias = deq("blk.2.attn_q.bias")
    assert abs(bias.mean()) < 0.005 and 0.015 < bias.std() < 0.025
    for name in ("blk.0.attn_q.weight", "blk.2.ffn_down.weight", "output.weight"):
        w = deq(name)
        assert np.isfinite(w).all()
        assert abs(w.std() * np.sqrt(w.shape[1]) - 1) < 0.1, name


def test_synthetic_forward_cpu(synth_pair):
    from minfer.engine import Engine

    eng = Engine.load(synth_pair[0], backend="cpu", n_ctx=64, progress=False)
    cache = eng.new_cache()
    rng = np.random.default_rng(3)
    argmaxes = set()
    for n in (5, 11, 23):
        tokens = rng.integers(0, eng.cfg.vocab_size, size=n, dtype=np.int32)
        logits = eng.model.forward(tokens, 0, cache, logits_from=0)        # (n, vocab)
        assert logits.shape == (n, eng.cfg.vocab_size)
        assert np.isfinite(logits).all()
        assert 0.3 < logits.std() < 5          # neither collapsed nor blown up
        argmaxes.update(logits.argmax(-1).tolist())
    assert len(argmaxes) > 10


def test_synth_model_is_written_once(tmp_path):
    """synth_model names the file by every parameter and reuses it: a second call
    does not write again."""
    from minfer.tools.synth import synth_model
    params = dict(n_layer=1, d_model=256, n_head=2, n_head_kv=1, d_ff=512, seed=5, arch="qwen2")
    path = synth_model(tmp_path, params)
    assert path.name == "synth-qwen2-L1-d256-h2-1-f512-s5.gguf"
    assert open_gguf(str(path)).get("qwen2.block_count") == 1
    stamp = path.stat().st_mtime_ns
    assert synth_model(tmp_path, params) == path and path.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [path.name]          # no temporary left


def test_draw_rows_chunking_invariant():
    """Any block-aligned split of a tensor draws the same values (parallel twin)."""
    shape = (3000, 512)                         # 2048 rows per draw block
    whole = draw_rows("blk.0.ffn_up.weight", shape, 5, 0, 3000)
    parts = np.concatenate([draw_rows("blk.0.ffn_up.weight", shape, 5, 0, 2048),
                            draw_rows("blk.0.ffn_up.weight", shape, 5, 2048, 3000)])
    assert np.array_equal(whole, parts)
    with pytest.raises(ValueError):
        draw_rows("blk.0.ffn_up.weight", shape, 5, 100, 3000)


@pytest.mark.parametrize("name", ["blk.3.attn_k.weight", "blk.3.attn_v.weight",
                                  "blk.3.attn_v.bias", "blk.3.attn_norm.weight"])
def test_tensor_bytes_real_shapes(name, header_7b):
    """Fill a few 7B-shaped tensors: valid blocks that dequantize (gguf) close to the draw."""
    hdr = open_gguf(str(header_7b), header_only=True)
    t = hdr.tensors[name]
    raw = tensor_bytes(name, t.shape, t.qtype, seed=1)
    assert raw.shape == (t.n_rows, t.row_bytes) and raw.nbytes == t.nbytes
    got = gguf.quants.dequantize(raw, t.qtype).reshape(t.n_rows, -1)
    want = draw_rows(name, t.shape, 1, 0, t.n_rows)
    assert np.isfinite(got).all()
    rel = np.sqrt(np.mean((got - want) ** 2)) / np.sqrt(np.mean(want ** 2))
    assert rel < {Q.F32: 1e-7, Q.Q6_K: 0.04, Q.Q4_K: 0.12}[t.qtype], (name, rel)


# --- the 7B twin (partial: the full 4.7 GB file is written on the GPU machine) ---

TWIN_FILLED = ["blk.5.ffn_down.weight",      # q6_K 3584x18944: several row chunks, 2 workers
               "blk.5.attn_k.weight", "blk.5.attn_v.bias", "output_norm.weight"]


@pytest.fixture(scope="module")
def twin_partial(tmp_path_factory, header_7b):
    from minfer.tools.twin import make_twin
    out = tmp_path_factory.mktemp("twin") / "twin.gguf"
    return make_twin(header_7b, out, seed=3, workers=2, tensors=TWIN_FILLED, progress=False)


def test_twin_layout(twin_partial, header_7b):
    """The twin is the header, byte for byte, then the data: same table, same size."""
    hdr = open_gguf(str(header_7b), header_only=True)
    tw = open_gguf(str(twin_partial))
    assert twin_partial.stat().st_size == 4_683_073_248            # the real model's size (models/README.md)
    head = header_7b.read_bytes()
    with open(twin_partial, "rb") as f:
        assert f.read(len(head)) == head
    assert list(tw.metadata.items()) == list(hdr.metadata.items())
    assert [(t.name, t.qtype, t.shape, t.offset, t.nbytes) for t in tw.tensors.values()] == \
           [(t.name, t.qtype, t.shape, t.offset, t.nbytes) for t in hdr.tensors.values()]


def test_twin_data(twin_partial):
    tw = open_gguf(str(twin_partial))
    for name in TWIN_FILLED:
        t = tw.tensors[name]
        raw = np.asarray(tw.raw(name))
        # the chunked, parallel write equals one in-process fill
        assert np.array_equal(raw, tensor_bytes(name, t.shape, t.qtype, seed=3)), name
        got = gguf.quants.dequantize(raw, t.qtype).reshape(t.n_rows, -1)
        want = draw_rows(name, t.shape, 3, 0, t.n_rows)
        rel = np.sqrt(np.mean((got - want) ** 2)) / np.sqrt(np.mean(want ** 2))
        assert np.isfinite(got).all() and rel < 0.12, (name, rel)
    assert not np.asarray(tw.raw("blk.6.ffn_down.weight")[:4]).any()      # not filled: zero


def test_twin_verify_catches_corruption(twin_partial, header_7b, tmp_path):
    from minfer.errors import MinferError
    from minfer.tools.twin import verify_twin
    verify_twin(twin_partial, header_7b, seed=3, filled=TWIN_FILLED)
    with pytest.raises(MinferError):          # wrong seed: the rows do not match their draw
        verify_twin(twin_partial, header_7b, seed=4, filled=TWIN_FILLED, n_rows=len(TWIN_FILLED))
    with pytest.raises(MinferError):          # a tensor claimed filled but zero
        verify_twin(twin_partial, header_7b, seed=3, filled=TWIN_FILLED + ["blk.0.attn_q.weight"],
                    n_rows=len(TWIN_FILLED) + 1)


def test_twin_cli_bad_workers(capsys):
    from minfer.cli import main
    assert main(["twin", "--workers", "0", "-o", "/nonexistent/x.gguf"]) == 2
    assert "workers" in capsys.readouterr().err
