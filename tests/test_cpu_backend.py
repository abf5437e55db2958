"""CPU reference backend: each op against a float64 reading of its formula, and the
whole graph on a small random model against a naive per-head, per-token forward.

The naive code below loops where the backend vectorizes, computes in float64 and
derives RoPE angles itself, so it shares no code with minfer.backend.cpu.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from minfer.backend import get_backend
from minfer.backend.cpu import CPUBackend, QuantTable
from minfer.config import ModelConfig
from minfer.errors import MinferError
from minfer.graph.transformer import Transformer
from minfer.graph.weights import LayerWeights, Weights


def make_cfg(neox: bool, n_layer=2, d=96, n_head=6, n_kv=2, d_ff=72, vocab=53) -> ModelConfig:
    return ModelConfig(arch="qwen2" if neox else "llama", n_layer=n_layer, d_model=d, n_head=n_head,
                       n_head_kv=n_kv, d_ff=d_ff, vocab_size=vocab, n_ctx_train=4096,
                       rope_base=10000.0 if neox else 500000.0, rms_eps=1e-6,
                       qkv_bias=neox, rope_neox=neox)


# --- naive float64 reference ---------------------------------------------------
def ref_rope(x, pos0, base, neox, factors=None):
    """x (T, H, hd) float64, one pair at a time; pair i's angle divided by factors[i]
    (llama.cpp's RoPE frequency factors) when given."""
    T, H, hd = x.shape
    out = x.copy()
    for t in range(T):
        for i in range(hd // 2):
            a = (pos0 + t) * base ** (-2.0 * i / hd) / (1.0 if factors is None else float(factors[i]))
            c, s = math.cos(a), math.sin(a)
            j, k = (i, i + hd // 2) if neox else (2 * i, 2 * i + 1)
            out[t, :, j] = x[t, :, j] * c - x[t, :, k] * s
            out[t, :, k] = x[t, :, k] * c + x[t, :, j] * s
    return out


def ref_attention(q, K, V, pos0):
    """q (T, H, hd); K, V (S, n_kv, hd) with S >= pos0+T; one query and head at a time."""
    T, H, hd = q.shape
    n_rep = H // K.shape[1]
    out = np.zeros((T, H, hd))
    for t in range(T):
        n = pos0 + t + 1
        for h in range(H):
            g = h // n_rep
            s = K[:n, g] @ q[t, h] / math.sqrt(hd)
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ V[:n, g]
    return out.reshape(T, H * hd)


def ref_rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def ref_forward(cfg, P, tokens):
    """All-position logits (T, vocab) in float64 from dense float weights P."""
    T, hd = len(tokens), cfg.head_dim
    x = P["embd"][tokens].astype(np.float64)
    for L in P["layers"]:
        h = ref_rmsnorm(x, L["attn_norm"], cfg.rms_eps)
        q = h @ L["q"].T + L["qb"]
        k = h @ L["k"].T + L["kb"]
        v = h @ L["v"].T + L["vb"]
        q = ref_rope(q.reshape(T, cfg.n_head, hd), 0, cfg.rope_base, cfg.rope_neox)
        k = ref_rope(k.reshape(T, cfg.n_head_kv, hd), 0, cfg.rope_base, cfg.rope_neox)
        x = x + ref_attention(q, k, v.reshape(T, cfg.n_head_kv, hd), 0) @ L["o"].T
        h = ref_rmsnorm(x, L["ffn_norm"], cfg.rms_eps)
        g, u = h @ L["gate"].T, h @ L["up"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ L["down"].T
    x = ref_rmsnorm(x, P["out_norm"], cfg.rms_eps)
    return x @ P["out"].T


# --- a random model registered through load_weight -------------------------------
def tensor(be, name, arr, qtype=QT.F32):
    """Register arr (float32) as a GGUF tensor of qtype; also return its exact float values."""
    arr = np.asarray(arr, np.float32)
    raw = gq.quantize(arr.reshape(-1, arr.shape[-1]), qtype)          # (rows, row_bytes)
    raw = np.ascontiguousarray(raw).view(np.uint8)                    # F16/F32 come back as floats
    info = SimpleNamespace(name=name, qtype=qtype, shape=arr.shape)
    exact = gq.dequantize(raw, qtype).reshape(arr.shape).astype(np.float64)
    return be.load_weight(name, info, raw), exact


def random_model(cfg, rng, tied=False, keep_quantized=False):
    be = CPUBackend(cfg, keep_quantized=keep_quantized)
    d, kv, ff = cfg.d_model, cfg.kv_dim, cfg.d_ff

    def mat(name, n_out, n_in, qtype=QT.Q8_0):
        return tensor(be, name, rng.standard_normal((n_out, n_in)) / math.sqrt(n_in), qtype)

    def vec(name, n, center=0.0):
        return tensor(be, name, center + 0.3 * rng.standard_normal(n))

    P = {"layers": []}
    layers = []
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        hs = {}
        R = {}
        for key, (name, n_out, n_in, qt) in {
                "q": ("attn_q", d, d, QT.Q8_0), "k": ("attn_k", kv, d, QT.F16),
                "v": ("attn_v", kv, d, QT.Q8_0), "o": ("attn_output", d, d, QT.Q8_0),
                "gate": ("ffn_gate", ff, d, QT.Q8_0), "up": ("ffn_up", ff, d, QT.F32),
                "down": ("ffn_down", d, ff, QT.F16)}.items():
            hs[key], R[key] = mat(p + name + ".weight", n_out, n_in, qt)
        for key, name, n in (("qb", "q", d), ("kb", "k", kv), ("vb", "v", kv)):
            if cfg.qkv_bias:
                hs[key], R[key] = vec(p + f"attn_{name}.bias", n)
            else:
                hs[key], R[key] = None, 0.0
        hs["attn_norm"], R["attn_norm"] = vec(p + "attn_norm.weight", d, 1.0)
        hs["ffn_norm"], R["ffn_norm"] = vec(p + "ffn_norm.weight", d, 1.0)
        layers.append(LayerWeights(
            attn_norm=hs["attn_norm"], attn_q=hs["q"], attn_k=hs["k"], attn_v=hs["v"],
            attn_q_bias=hs["qb"], attn_k_bias=hs["kb"], attn_v_bias=hs["vb"], attn_output=hs["o"],
            ffn_norm=hs["ffn_norm"], ffn_gate=hs["gate"], ffn_up=hs["up"], ffn_down=hs["down"]))
        P["layers"].append(R)
    embd, P["embd"] = tensor(be, "token_embd.weight", rng.standard_normal((cfg.vocab_size, d)), QT.Q8_0)
    norm, P["out_norm"] = vec("output_norm.weight", d, 1.0)
    if tied:
        out, P["out"] = embd, P["embd"]
    else:
        out, P["out"] = mat("output.weight", cfg.vocab_size, d)
    w = Weights(token_embd=embd, layers=layers, output_norm=norm, output=out)
    return be, Transformer(cfg, be, w), P


@pytest.mark.parametrize("neox,tied", [(True, False), (False, True)])
def test_forward_matches_naive_reference(neox, tied):
    rng = np.random.default_rng(7 + neox)
    cfg = make_cfg(neox)
    be, model, P = random_model(cfg, rng, tied=tied)
    assert isinstance(model.w.token_embd, QuantTable)       # the embedding stays quantized
    tokens = rng.integers(0, cfg.vocab_size, 23)
    want = ref_forward(cfg, P, tokens)                                  # (23, vocab)
    got = model.forward(tokens, 0, be.new_cache(40), logits_from=0)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
    # prefill computes the LM head for the last position only
    last = model.prefill(tokens, be.new_cache(40))
    np.testing.assert_allclose(last, want[-1], rtol=2e-4, atol=2e-4 * np.abs(want).max())


def test_decode_continues_prefill():
    """Prefill 9 tokens, then decode one at a time: each step's logits equal the
    all-at-once forward at that position (the KV cache carries the past)."""
    rng = np.random.default_rng(3)
    cfg = make_cfg(True, n_kv=3)
    be, model, P = random_model(cfg, rng)
    tokens = rng.integers(0, cfg.vocab_size, 17)
    want = ref_forward(cfg, P, tokens)
    cache = be.new_cache(17)
    got = [model.prefill(tokens[:9], cache)]
    for pos in range(9, 17):
        got.append(model.decode(int(tokens[pos]), pos, cache))
    np.testing.assert_allclose(np.array(got), want[8:], rtol=2e-4, atol=2e-4 * np.abs(want).max())
    with pytest.raises(MinferError, match="do not fit"):
        model.decode(1, 17, cache)


def test_rope_with_frequency_factors():
    """rope_freqs.weight (Llama 3.1's RoPE scaling): pair i's angle divided by factor i."""
    cfg = make_cfg(False)
    be = get_backend("cpu", cfg)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((9, 3, cfg.head_dim)).astype(np.float32)
    plain = be.rope(x, 1000)
    factors = np.linspace(1.0, 8.0, cfg.head_dim // 2).astype(np.float32)
    be.set_rope_factors(factors)
    got = be.rope(x, 1000)
    np.testing.assert_allclose(got, ref_rope(x.astype(np.float64), 1000, cfg.rope_base, False, factors),
                               atol=2e-5)
    assert np.abs(got - plain).max() > 0.1          # the factors change the rotation


def test_ops_against_formulas():
    rng = np.random.default_rng(11)
    for neox in (True, False):
        cfg = make_cfg(neox)
        be = get_backend("cpu", cfg)
        x = rng.standard_normal((13, 5, cfg.head_dim)).astype(np.float32)
        np.testing.assert_allclose(be.rope(x, 37), ref_rope(x.astype(np.float64), 37, cfg.rope_base, neox),
                                   atol=2e-5)
        # causal GQA with a cached prefix: positions 0..6 first, then 7..15
        q = rng.standard_normal((16, cfg.n_head, cfg.head_dim)).astype(np.float32)
        k = rng.standard_normal((16, cfg.n_head_kv, cfg.head_dim)).astype(np.float32)
        v = rng.standard_normal((16, cfg.n_head_kv, cfg.head_dim)).astype(np.float32)
        cache = be.new_cache(20)
        be.attention(q[:7], k[:7], v[:7], cache, 1, 0)
        got = be.attention(q[7:], k[7:], v[7:], cache, 1, 7)
        np.testing.assert_allclose(got, ref_attention(q[7:].astype(np.float64), k, v, 7), atol=2e-5)
    x = (3 * rng.standard_normal((7, 96))).astype(np.float32)
    w = rng.standard_normal(96).astype(np.float32)
    np.testing.assert_allclose(be.rmsnorm(x, w, 1e-6), ref_rmsnorm(x.astype(np.float64), w, 1e-6), rtol=1e-5)
    g = np.array([[-200.0, -3.5, 0.0, 0.7, 90.0]], np.float32)
    u = rng.standard_normal((1, 5)).astype(np.float32)
    got = be.swiglu(g, u)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, g / (1 + np.exp(-g.astype(np.float64))) * u, rtol=1e-6, atol=1e-30)


def test_weights_kept_quantized_give_the_same_logits():
    """The memory-saving mode (weights too large for f32) dequantizes in each
    linear: the same dequantizer and the same matmul, so the same bits."""
    cfg = make_cfg(True)
    got = {}
    for keep in (False, True):
        rng = np.random.default_rng(11)
        be, model, _ = random_model(cfg, rng, tied=True, keep_quantized=keep)
        assert isinstance(model.w.layers[0].attn_q, QuantTable) == keep
        tokens = rng.integers(0, cfg.vocab_size, 19)
        got[keep] = model.forward(tokens, 0, be.new_cache(32), logits_from=0)
    assert np.array_equal(got[True].view(np.uint32), got[False].view(np.uint32))


def test_keep_quantized_is_chosen_from_the_memory_available(monkeypatch, capsys):
    from minfer.backend import cpu
    cfg = make_cfg(True)
    need = cpu.f32_weight_bytes(cfg)
    monkeypatch.setattr(cpu, "available_bytes", lambda: 10 * need)
    assert not CPUBackend(cfg).keep_quantized and capsys.readouterr().err == ""
    monkeypatch.setattr(cpu, "available_bytes", lambda: need)
    assert CPUBackend(cfg).keep_quantized
    assert "would not fit" in capsys.readouterr().err


@pytest.mark.parametrize("files,room", [
    ({"memory.max": "max\n", "memory.current": "5000\n"}, None),                 # v2, no limit
    ({"memory.max": "100000\n", "memory.current": "30000\n",
      "memory.stat": "anon 20000\ninactive_file 10000\n"}, 80000),               # v2: cache reclaimable
    ({"memory.max": "100000\n", "memory.current": "130000\n"}, 0),              # over the limit
    ({"memory/memory.limit_in_bytes": "9223372036854771712\n",
      "memory/memory.usage_in_bytes": "1000\n"}, None),                           # v1, no limit
    ({"memory/memory.limit_in_bytes": "1048576\n", "memory/memory.usage_in_bytes": "524288\n",
      "memory/memory.stat": "cache 4096\ntotal_inactive_file 24288\n"}, 548576),  # v1
    ({}, None),                                                                  # no cgroup
])
def test_cgroup_room(tmp_path, files, room):
    """A container's memory limit (cgroup v2 or v1) bounds what the CPU backend
    counts as available, so a too-large load is refused with one line instead of
    being killed by the kernel."""
    from minfer.backend import host_memory
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert host_memory.cgroup_room(tmp_path) == room


@pytest.mark.parametrize("have, room, want", [(8 << 30, None, 8 << 30), (8 << 30, 4 << 30, 4 << 30),
                                              (8 << 30, 80 << 30, 8 << 30), (None, 3 << 30, 3 << 30),
                                              (None, None, None)])
def test_available_bytes_takes_the_smaller_of_meminfo_and_the_cgroup(monkeypatch, have, room, want):
    """Both sources fixed, so the test does not race the machine's own memory use."""
    from minfer.backend import host_memory
    monkeypatch.setattr(host_memory, "meminfo_available", lambda: have)
    monkeypatch.setattr(host_memory, "cgroup_room", lambda: room)
    assert host_memory.available_bytes() == want


def test_meminfo_available_reads_this_machine():
    from minfer.backend import host_memory
    have = host_memory.meminfo_available()
    assert have is None or have > 0


def test_embed_dequantizes_only_the_rows_asked_for():
    rng = np.random.default_rng(5)
    cfg = make_cfg(True)
    be = CPUBackend(cfg)
    table, exact = tensor(be, "token_embd.weight", rng.standard_normal((cfg.vocab_size, cfg.d_model)), QT.Q8_0)
    ids = np.array([52, 0, 17, 17, 3], np.int32)
    np.testing.assert_array_equal(be.embed(table, ids), exact[ids].astype(np.float32))
    with pytest.raises(MinferError, match="outside the vocabulary"):
        be.embed(table, np.array([cfg.vocab_size], np.int32))


def test_unknown_backend_is_a_minfer_error():
    with pytest.raises(MinferError, match="unknown backend"):
        get_backend("tpu", make_cfg(True))


class _FakeTokenizer:
    """Just what generate() needs: an EOG set and a streaming decoder."""

    def __init__(self, eog):
        self.eog_ids = eog

    def stream_decoder(self):
        return SimpleNamespace(push=lambda i: f"<{i}>", flush=lambda: "")


def test_greedy_loop_stops_on_eog_and_full_context():
    from minfer.generate import GenerationStats, generate

    rng = np.random.default_rng(10)
    cfg = make_cfg(True, vocab=11)             # a seed whose greedy chain varies
    be, model, _ = random_model(cfg, rng)
    prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, 5)]

    def engine(eog, n_ctx=64):
        return SimpleNamespace(model=model, backend=be, tokenizer=_FakeTokenizer(eog),
                               new_cache=lambda: be.new_cache(n_ctx))

    # the greedy chain, recomputed from scratch at every step (no KV cache reuse)
    want: list[int] = []
    for _ in range(8):
        ids = np.array(prompt + want, np.int32)
        want.append(int(model.forward(ids, 0, be.new_cache(len(ids)))[-1].argmax()))

    text: list[str] = []
    got = list(generate(engine({want[0]}), prompt, 8, ignore_eos=True, on_text=text.append))
    assert got == want and "".join(text) == "".join(f"<{i}>" for i in want)

    k = next(i for i in range(2, 8) if want[i] not in want[:i])   # this seed's chain has one
    st = GenerationStats()                     # the first new token after the start is EOG
    assert list(generate(engine({want[k]}), prompt, 8, stats=st)) == want[:k]
    assert st.stop == "eog" and st.n_generated == k

    st = GenerationStats()                     # context of prompt + 3: 4 tokens fit
    assert list(generate(engine(set(), n_ctx=len(prompt) + 3), prompt, 8, stats=st)) == want[:4]
    assert st.stop == "context"
    with pytest.raises(MinferError, match="empty prompt"):
        list(generate(engine(set()), [], 3))
