"""minfer/backend/ggml_cpu.py (llama.cpp's CPU arithmetic in NumPy) against independent
references: gguf's quantizers and dequantizers, float64 math. The order of llama.cpp's
sums cannot be checked here (that is tests/test_smollm2.py's greedy test against
llama.cpp's own output); these tests pin the values: block decoding, scales, the q8
rounding, the softmax, the RoPE angles. Irregular shapes (multiples of 32 only where
a block demands it)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from minfer.backend import ggml_cpu
from minfer.errors import MinferError


def _x(rng, *shape):
    """values of varied scale per column; past 64 columns the first block of 32 is all
    zero (amax == 0: d = 0, q = 0)"""
    x = (rng.standard_normal(shape) * rng.uniform(0.1, 3.0, shape[-1])).astype(np.float32)
    if shape[-1] > 64:
        x[..., :32] = 0.0
    return x


def test_q8_quantization_matches_ggufs_q8_0():
    """d as gguf's Q8_0 (amax/127 in f16); q equal except where x*(127/amax) and x/d
    round to different sides of a half (then by one), and within 127."""
    rng = np.random.default_rng(0)
    x = _x(rng, 3, 160)
    q, d, s = ggml_cpu.quantize_q8(x, with_sum=True)
    ref = gq.quantize(x, QT.Q8_0).reshape(3, 5, 34)
    ref_d = ref[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    ref_q = ref[..., 2:].copy().view(np.int8).astype(np.int32)
    assert np.array_equal(d, ref_d)
    diff = np.abs(q.astype(np.int32) - ref_q)
    assert diff.max() <= 1 and (diff == 0).mean() > 0.99
    assert np.abs(q).max() <= 127
    want_s = (ref_d * q.sum(-1)).astype(np.float16).astype(np.float32)      # f16(d * sum(q))
    assert np.allclose(s, want_s, rtol=2 ** -10, atol=0)


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("T,K,rows", [(1, 96, 37), (3, 160, 5), (2, 576, 64)])
def test_matmul_equals_the_dequantized_product(qtype, T, K, rows):
    """gguf's dequantized W times the q8 x (d * q), in float64: equal but for the f32
    sums and, for Q4_1, the f16 rounding of the activation sums s (the m * s terms)."""
    rng = np.random.default_rng([T, K, rows, int(qtype)])
    w = _x(rng, rows, K)
    raw = gq.quantize(w, qtype)                                          # (rows, bytes)
    x = _x(rng, T, K)
    got = ggml_cpu.matmul(x, ggml_cpu.weight_blocks(raw, qtype, rows, K))
    w_deq = gq.dequantize(raw, qtype).astype(np.float64)                  # (rows, K)
    q, d, s = ggml_cpu.quantize_q8(x, with_sum=True)
    x_deq = (q * d[..., None]).reshape(T, K).astype(np.float64)
    want = x_deq @ w_deq.T
    tol = 1e-5 * (np.abs(x_deq) @ np.abs(w_deq).T) + 1e-30
    if qtype == QT.Q4_1:                                                  # m * (s - d * sum(q))
        m = raw.reshape(rows, K // 32, 20)[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        tol += np.abs(m).sum(-1)[None, :] * np.abs(s).max() * 2 ** -10
    assert np.all(np.abs(got - want) <= tol), np.abs(got - want).max()


def test_matmul_refuses_other_types():
    with pytest.raises(ValueError, match="Q4_K"):
        ggml_cpu.weight_blocks(np.zeros((1, 144), np.uint8), QT.Q4_K, 1, 256)


def test_rmsnorm_equals_float64():
    rng = np.random.default_rng(1)
    x = _x(rng, 4, 576)
    x[1] = 0.0
    want = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, -1, keepdims=True) + 1e-5)
    assert np.allclose(ggml_cpu.rmsnorm(x, 1e-5), want, rtol=3e-7, atol=0)


def test_rope_angles_are_the_iterated_powers():
    """theta_i = p * base^(-2i/n) (float64) to within i roundings of f32"""
    th = ggml_cpu.rope_angles(300, 64, 100000.0)
    want = np.arange(300)[:, None] * 100000.0 ** (-2.0 * np.arange(32) / 64)[None, :]
    rel = np.abs(th - want) / np.maximum(want, 1e-30)
    assert rel.max() <= 40 * 2 ** -24
    factors = np.linspace(1.0, 8.0, 32).astype(np.float32)
    assert np.allclose(ggml_cpu.rope_angles(300, 64, 100000.0, factors), th / factors, rtol=2 ** -23)


@pytest.mark.parametrize("T,pos0,n_head,n_kv", [(5, 0, 9, 3), (1, 40, 4, 4), (3, 17, 6, 2)])
def test_flash_attention_equals_softmax_attention(T, pos0, n_head, n_kv):
    """Causal GQA attention of the f16-rounded q, K, V in float64: equal within the
    f16 rounding of the running output, once per key (S keys: S * 2^-11 of max |v|)."""
    rng = np.random.default_rng([T, pos0, n_head])
    hd, S = 64, pos0 + T
    q = rng.standard_normal((T, n_head, hd)).astype(np.float32)
    kc = rng.standard_normal((S + 3, n_kv, hd)).astype(np.float16).astype(np.float32)
    vc = rng.standard_normal((S + 3, n_kv, hd)).astype(np.float16).astype(np.float32)
    kc[S:] = np.nan                                                      # never read
    vc[S:] = np.nan
    got = ggml_cpu.flash_attention(q, kc, vc, pos0, n_head // n_kv).reshape(T, n_head, hd)
    qh = q.astype(np.float16).astype(np.float64)
    for t in range(T):
        for h in range(n_head):
            K, V = kc[:pos0 + t + 1, h * n_kv // n_head].astype(np.float64), vc[:pos0 + t + 1, h * n_kv // n_head]
            sc = K @ qh[t, h] / np.sqrt(hd)
            p = np.exp(sc - sc.max())
            want = p @ V / p.sum()
            assert np.abs(got[t, h] - want).max() <= (pos0 + t + 2) * 2 ** -11 * np.abs(V).max(), (t, h)


def test_the_setting_and_the_types_it_takes(synth_dir, monkeypatch):
    """MINFER_CPU_MATH: f32 (default) or ggml; another value, or a model with weights
    ggml_cpu does not reproduce (the synthetic qwen2: Q4_K, Q6_K), is one MinferError."""
    from minfer.backend import math_setting
    from minfer.engine import Engine
    from minfer.tools.synth import synth_model
    assert math_setting({}) == "f32" and math_setting({"MINFER_CPU_MATH": " GGML "}) == "ggml"
    with pytest.raises(MinferError, match="MINFER_CPU_MATH='fast'"):
        math_setting({"MINFER_CPU_MATH": "fast"})
    monkeypatch.setenv("MINFER_CPU_MATH", "ggml")
    with pytest.raises(MinferError, match="Q4_1, Q8_0 weights, not Q"):
        Engine.load(synth_model(synth_dir), backend="cpu", progress=False)
