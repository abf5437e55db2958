"""llama.cpp's CPU arithmetic (ggml-cpu's AVX2 kernels), reproduced in NumPy, and the
backend that computes with it (GgmlCPUBackend: `MINFER_CPU_MATH=ggml`).

The default CPU backend computes in float32 from dequantized weights. llama.cpp's
CPU build does not: it rounds each matmul's activations to 8 bits per block of 32
(q8_1 beside Q4_1 weights, q8_0 beside Q8_0), keeps the KV cache, the queries and
the attention's running output in f16, and sums in a fixed order of SIMD lanes. A
greedy stream that passes a near-tie can then part from llama.cpp's; with these
rules it follows it (SmolLM2-135M-Instruct Q4_1: the fixture prompts' first 16
tokens identical on 6 of 6, against 4 of 6 in float32).

What is reproduced (ggml-cpu, x86 AVX2, the version that made tests/fixtures):
- quantize_row_q8_0 / q8_1: d = amax/127 stored as f16, q = round-to-nearest-even
  of x * (127/amax), s = f16(d * sum(q)) (q8_1);
- ggml_vec_dot_q4_1_q8_1 and ggml_vec_dot_q8_0_q8_0 (and llamafile's tinyBLAS Q8_0
  GEMM, which sums the same way): per block, 8 lanes each holding the integer dot of
  4 consecutive elements, accumulated as fma(d_w * d_x, lane, acc) block after block;
  Q4_1's m * s terms in a scalar fma chain; the lanes summed as hsum_float_8;
- rms_norm: the squares (f32) summed in double, mean rounded to f32, 1/sqrtf;
- RoPE: theta_i = p * theta_scale^i by repeated f32 multiplication, theta_scale =
  powf(base, -2/n_dims);
- flash attention (ggml_compute_forward_flash_attn_ext_f16): q, K and V in f16,
  scores by ggml_vec_dot_f16's order, the online softmax with V's running sum kept
  in f16 (rounded after every key), divided by the sum at the end.
Not reproduced: ggml_v_expf's polynomial in SiLU (within 2 ulp of expf), and
whatever llama.cpp does differently for long prompt batches: on the fixture text
(n_ctx 512) this mode's perplexity is no closer to llama.cpp's CPU figure than the
float32 reference's (first two chunks 16.3674, 17.7764 here; llama.cpp 16.3211,
17.7185; float32 16.2659, 17.6866). Keeping the attention's running output in f32
for batches moved chunk 1 to 16.3460, so its batched attention is one of the
differences. The mode is for following llama.cpp's greedy decoding. Weight types:
Q4_1 and Q8_0 (the ones checked against llama.cpp's output); others are refused
when the mode is asked for.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT

from ..errors import MinferError
from ..kv.batch import Batch
from .cpu import CPUBackend, QuantTable

F32, F16 = np.float32, np.float16
TYPES = (QT.Q4_1, QT.Q8_0)              # weight types whose dot products are reproduced
_BLOCK = {QT.Q4_1: 20, QT.Q8_0: 34}     # bytes per block of 32
_CHUNK = 1 << 24                        # integer lane sums per batch of rows (memory bound)


def fma(a, b, c):
    """float32 fused multiply-add: the product is exact in float64, one rounding to f32
    (float64 holds a*b + c to within its own rounding, well below an f32 ulp)"""
    return (np.asarray(a, np.float64) * b + c).astype(F32)


def hsum8(lanes):
    """(..., 8) f32 -> the sum in hsum_float_8's order: (l0+l4)+(l2+l6) + (l1+l5)+(l3+l7)"""
    r = [(lanes[..., i] + lanes[..., i + 4]).astype(F32) for i in range(4)]
    return (((r[0] + r[2]).astype(F32)) + ((r[1] + r[3]).astype(F32))).astype(F32)


def quantize_q8(x, with_sum: bool):
    """x f32 (T, K) -> (q (T, K/32, 32) integers held as f32, d f32 (T, K/32) rounded through f16,
    s f32 (T, K/32) rounded through f16 or None): quantize_row_q8_1 / q8_0 (AVX2)"""
    T, K = x.shape
    xb = np.asarray(x, F32).reshape(T, K // 32, 32)
    amax = np.abs(xb).max(axis=-1)                                         # (T, nb)
    d = (amax / F32(127)).astype(F32)
    inv = (F32(127) / np.where(amax != 0, amax, F32(1))).astype(F32)
    inv = np.where(amax != 0, inv, F32(0))
    q = np.rint((xb * inv[..., None]).astype(F32))                        # round half to even
    s = (d * q.sum(axis=-1).astype(F32)).astype(F32).astype(F16).astype(F32) if with_sum else None
    return q, d.astype(F16).astype(F32), s


def weight_blocks(raw: np.ndarray, qtype, rows: int, cols: int):
    """GGUF bytes (rows, row_bytes) -> (d f32 (rows, nb), m f32 (rows, nb) or None,
    q (rows, nb, 32) in element order, integer values held as f32: every lane sum of
    4 products is an integer below 2^24, so a float32 BLAS product forms it exactly)"""
    if qtype not in TYPES:
        raise ValueError(f"ggml_cpu: no {QT(qtype).name} dot product")
    nb = cols // 32
    b = np.ascontiguousarray(raw).reshape(rows, nb, _BLOCK[qtype])
    d = b[..., 0:2].copy().view(F16)[..., 0].astype(F32)
    if qtype == QT.Q8_0:
        return d, None, b[..., 2:34].copy().view(np.int8).astype(F32)
    m = b[..., 2:4].copy().view(F16)[..., 0].astype(F32)
    qs = b[..., 4:20]
    return d, m, np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(F32)   # elements 0..15, 16..31


def matmul(x, blocks) -> np.ndarray:
    """x f32 (T, K) @ W^T, W given as weight_blocks -> f32 (T, rows): ggml's
    quantized dot of every row of W with every row of x"""
    d_w, m_w, q_w = blocks
    rows, nb = d_w.shape
    qx, dx, sx = quantize_q8(x, with_sum=m_w is not None)
    T = qx.shape[0]
    w_lanes = q_w.reshape(rows, nb, 8, 4)
    y = np.empty((T, rows), F32)
    step = max(1, _CHUNK // (rows * nb * 8))
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        lanes = np.einsum("tbli,obli->btol", qx[t0:t1].reshape(t1 - t0, nb, 8, 4).astype(F32), w_lanes,
                          optimize=True)                                   # (nb, t, rows, 8), exact
        scale = (d_w.T[:, None, :] * dx[t0:t1].T[:, :, None]).astype(F32)    # (nb, t, rows) d_w * d_x
        acc = np.zeros((t1 - t0, rows, 8), F32)
        for b in range(nb):                  # fma(d_w * d_x, lane, acc), block after block
            acc = fma(scale[b][..., None], lanes[b], acc)
        out = hsum8(acc)
        if m_w is not None:                  # the m * s terms: a scalar fma chain
            summs = np.zeros((t1 - t0, rows), F32)
            for b in range(nb):
                summs = fma(m_w[None, :, b], sx[t0:t1, b, None], summs)
            out = (out + summs).astype(F32)
        y[t0:t1] = out
    return y


def rmsnorm(x, eps: float) -> np.ndarray:
    """x (T, d) -> x / sqrt(mean(x^2) + eps), as ggml_compute_forward_rms_norm_f32"""
    x = np.asarray(x, F32)
    total = np.square(x).astype(np.float64).sum(axis=-1, keepdims=True)   # f32 squares, double sum
    mean = (total / x.shape[-1]).astype(F32)
    scale = (F32(1) / np.sqrt((mean + F32(eps)).astype(F32))).astype(F32)
    return (x * scale).astype(F32)


def rope_angles(n_pos: int, n_dims: int, base: float, factors=None) -> np.ndarray:
    """theta (n_pos, n_dims/2) f32 as ggml_rope_cache_init: theta_0 = p, theta_{i+1} =
    theta_i * powf(base, -2/n_dims) in f32; with freq factors, theta_i / factor_i"""
    scale = F32(np.float32(base) ** F32(-2.0 / n_dims))
    theta = np.empty((n_pos, n_dims // 2), F32)
    t = np.arange(n_pos, dtype=F32)
    for i in range(n_dims // 2):
        theta[:, i] = t
        t = (t * scale).astype(F32)
    if factors is not None:
        theta = (theta / np.asarray(factors, F32)[None, :]).astype(F32)
    return theta


def _dot_f16(k, q):
    """(..., 64) f16-valued f32 rows -> their dot in ggml_vec_dot_f16's order (AVX2:
    four accumulators of 8 lanes over steps of 32 elements, then a fixed reduction)"""
    *lead, n = k.shape
    kk, qq = k.reshape(*lead, n // 32, 4, 8), q.reshape(*lead, n // 32, 4, 8)
    acc = (kk[..., 0, :, :] * qq[..., 0, :, :]).astype(F32)
    for i in range(1, n // 32):
        acc = fma(kk[..., i, :, :], qq[..., i, :, :], acc)                 # (..., 4, 8)
    x0 = (acc[..., 0, :] + acc[..., 2, :]).astype(F32)
    x1 = (acc[..., 1, :] + acc[..., 3, :]).astype(F32)
    x0 = (x0 + x1).astype(F32)                                             # (..., 8)
    t = (x0[..., :4] + x0[..., 4:]).astype(F32)                            # (..., 4)
    return ((t[..., 0] + t[..., 1]).astype(F32) + (t[..., 2] + t[..., 3]).astype(F32)).astype(F32)


def flash_attention(q, k_cache, v_cache, pos0: int, n_rep: int) -> np.ndarray:
    """q (T, n_head, hd) at positions pos0.. (RoPE applied); k_cache, v_cache
    (>= pos0+T, n_kv, hd) holding f16-rounded keys and values -> (T, n_head*hd):
    ggml's f16 flash attention, key by key in order, causal"""
    T, H, hd = q.shape
    if hd % 32:
        raise ValueError(f"ggml_cpu: head dim {hd} is not a multiple of 32")
    qh = np.asarray(q, F32).astype(F16).astype(F32)
    kv_of = np.arange(H) // n_rep
    scale = F32(1.0 / np.sqrt(hd))
    pos = pos0 + np.arange(T)
    M = np.full((T, H), -np.inf, F32)
    S = np.zeros((T, H), F32)
    V = np.zeros((T, H, hd), F32)                                          # f16 values
    for j in range(pos0 + T):
        see = (pos >= j)[:, None]                                          # (T, 1)
        kj, vj = k_cache[j][kv_of], v_cache[j][kv_of]                       # (H, hd)
        s = (_dot_f16(np.broadcast_to(kj, qh.shape), qh) * scale).astype(F32)   # (T, H)
        new = see & (s > M)
        with np.errstate(invalid="ignore", over="ignore"):
            ms = np.where(new, np.exp(np.where(new, M - s, 0).astype(np.float64)).astype(F32), F32(1))
            vs = np.where(see & ~new, np.exp(np.where(see & ~new, s - M, 0).astype(np.float64)).astype(F32),
                          F32(1))
        M = np.where(new, s, M)
        V = np.where(new[..., None], (V * ms[..., None]).astype(F32).astype(F16).astype(F32), V)
        V = np.where(see[..., None], fma(vj[None], vs[..., None], V).astype(F16).astype(F32), V)
        S = np.where(see, fma(S, ms, vs), S)
    return (V * (F32(1) / S)[..., None]).astype(F32).reshape(T, H * hd)


class GgmlCPUBackend(CPUBackend):
    """The CPU backend with llama.cpp's arithmetic in place of the float32 reference:
    8-bit activations beside the quantized weights (kept quantized), its RMSNorm and
    RoPE angles, an f16 KV cache and its flash attention, so that a greedy stream
    follows llama.cpp's CPU build through near-ties."""
    math = "ggml"

    def __init__(self, cfg):
        super().__init__(cfg, keep_quantized=True)     # the dot products read the quantized blocks
        self._blocks: dict[int, tuple] = {}            # id(QuantTable) -> weight_blocks (decoded once)

    def load_weight(self, name, info, raw):
        qtype = QT(info.qtype)
        if len(info.shape) == 2 and qtype not in TYPES:
            raise MinferError(f"tensor {name}: MINFER_CPU_MATH=ggml reproduces llama.cpp's arithmetic for "
                              f"{', '.join(t.name for t in TYPES)} weights, not {qtype.name}; "
                              f"unset it for the float32 reference")
        return super().load_weight(name, info, raw)

    def rmsnorm(self, x, w, eps):
        return rmsnorm(x, eps) * w

    def linear(self, x, w: QuantTable, bias=None, residual=None):
        blocks = self._blocks.get(id(w))
        if blocks is None:
            blocks = self._blocks[id(w)] = weight_blocks(w.raw, w.qtype, *w.shape)
        y = matmul(x, blocks)
        if bias is not None:
            y += bias
        return y if residual is None else residual + y

    def rope_angles(self, n_pos: int) -> np.ndarray:
        return rope_angles(n_pos, self.cfg.head_dim, self.cfg.rope_base, self.rope_factors)

    def attention(self, q, k, v, cache, layer, pos0):
        # an f16 cache, as llama.cpp's; one sequence (through its table, if paged) or a Batch's
        if not isinstance(pos0, Batch):
            S = pos0 + q.shape[0]
            cache.k[layer, cache.rows_of(pos0, S)] = k.astype(np.float16)
            cache.v[layer, cache.rows_of(pos0, S)] = v.astype(np.float16)
            keys = cache.rows_of(0, S)
            return flash_attention(q, cache.k[layer, keys], cache.v[layer, keys], pos0, self.cfg.n_rep)
        b = pos0
        cache.k[layer, b.rows[:, 1]] = k.astype(np.float16)
        cache.v[layer, b.rows[:, 1]] = v.astype(np.float16)
        out = np.empty((q.shape[0], self.cfg.n_head * self.cfg.head_dim), np.float32)
        for s, sp in enumerate(b.spans):
            r, keys = b.seq_rows(s), b.key_rows(s)
            out[r] = flash_attention(q[r], cache.k[layer, keys], cache.v[layer, keys], sp.pos0, self.cfg.n_rep)
        return out
