"""The CPU reference backend: dequantize to float32 once, then plain NumPy math.

Written for clarity: it is what the CUDA backend is judged against. Every op is
vectorized over tokens (BLAS for the matmuls); the only Python loops are over
KV-head groups in attention.

Memory: every quantized 2-D weight is dequantized to float32 at load, except
the token embedding, which stays quantized (a copy of its bytes) and is
dequantized row by row in `embed` (151,936 x 1,536 f32 would be 0.9 GB for a
lookup of T rows). If the embedding is also the LM head (tied output), its dense
float32 copy is made lazily, once, on the first `linear` call. Nothing refers to
the file's mapping after load.

Running out of host memory (the KV cache, attention's scratch, the weights) is
one MinferError line naming what to lower (`guard`, `new_cache`).

When the float32 weights would not fit (more than FIT_FRACTION of the memory
available at start: the 7B needs ~30 GB), every quantized weight stays
quantized and `linear` dequantizes it on each call instead: the same numbers
(the same dequantizer, the same matmul), slower; one line on stderr says so.

`MINFER_CPU_MATH=ggml` selects another backend class instead, which trades the
float32 reference for llama.cpp's own CPU arithmetic (ggml_cpu.py).
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from ..format import quants
from .. import rope
from ..config import ModelConfig
from ..errors import MinferError
from .base import Backend
from ..kv.batch import Batch
from ..kv.blocks import BLOCK_TOKENS, cache_rows
from .host_memory import available_bytes


class QuantTable:
    """A 2-D tensor kept as its GGUF bytes; rows dequantized on demand."""

    def __init__(self, raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]):
        # uint8 (rows, row_bytes), copied out of the mapping: decode reads it every
        # step, and a file truncated underneath must not fault the run (SIGBUS)
        self.raw = np.array(raw, dtype=np.uint8, copy=True)
        self.qtype = qtype
        self.shape = shape                 # (rows, cols) in float32 terms
        self._dense: np.ndarray | None = None

    def rows(self, idx: np.ndarray) -> np.ndarray:
        """idx int (T,) -> float32 (T, cols)"""
        return quants.dequantize_rows(np.ascontiguousarray(self.raw[idx]), self.qtype, self.shape[1])

    def dense(self, keep: bool = True) -> np.ndarray:
        """The whole table as float32 (rows, cols); kept after the first call
        (tied LM head) unless keep=False (weights too large to hold as f32)."""
        if self._dense is not None:
            return self._dense
        d = quants.dequantize_rows(self.raw, self.qtype, self.shape[1])
        if keep:
            self._dense = d
        return d


@dataclass
class CPUCache:
    """Contiguous (table None: position p at row p), or one sequence's view of a
    paged cache's rows through its block table (minfer/kv/: position p at row
    table[p // 64] * 64 + p % 64)."""
    k: np.ndarray      # (n_layer, n_rows, n_kv, hd) float32
    v: np.ndarray      # (n_layer, n_rows, n_kv, hd) float32
    n_ctx: int
    table: np.ndarray | None = None     # int64 (n_ctx / 64,) block ids

    def set_table(self, blocks, pad: int) -> None:
        """The sequence this view reads: its blocks, then `pad` (CudaCache.set_table)."""
        if len(blocks) > self.table.size:
            raise ValueError(f"set_table: {len(blocks)} blocks for a table of {self.table.size}")
        self.table[:] = pad
        self.table[:len(blocks)] = blocks

    def rows_of(self, start: int, stop: int) -> np.ndarray | slice:
        """The cache rows of positions start..stop-1."""
        return slice(start, stop) if self.table is None else cache_rows(self.table, start, stop)


FIT_FRACTION = 0.7     # f32 weights may take this share of the available memory


def f32_weight_bytes(cfg: ModelConfig) -> int:
    """Bytes of the layer stack and LM head as float32 (the embedding stays quantized)."""
    d, kv, ff = cfg.d_model, cfg.kv_dim, cfg.d_ff
    per_layer = d * d + 2 * d * kv + d * d + 3 * d * ff            # q, k, v, o, gate, up, down
    return 4 * (cfg.n_layer * per_layer + cfg.vocab_size * d)


class CPUBackend(Backend):
    name = "cpu"
    math = "f32"                            # MINFER_CPU_MATH's name for this arithmetic

    def __init__(self, cfg: ModelConfig, keep_quantized: bool | None = None):
        super().__init__(cfg)
        if keep_quantized is None:          # decided once, from the model's size and this machine
            need, have = f32_weight_bytes(cfg), available_bytes()
            keep_quantized = have is not None and need > FIT_FRACTION * have
            if keep_quantized:
                print(f"minfer: the float32 weights ({need / 2**30:.1f} GiB) would not fit in "
                      f"{have / 2**30:.1f} GiB available: keeping them quantized and "
                      f"dequantizing in each linear (slower)", file=sys.stderr)
        self.keep_quantized = keep_quantized
        self.set_rope_factors(None)

    # --- weights and state -------------------------------------------------
    def load_weight(self, name, info, raw):
        qtype = GGMLQuantizationType(info.qtype)
        if qtype not in quants.SUPPORTED:
            raise MinferError(f"tensor {name}: quantization type {qtype.name} is not supported")
        if len(info.shape) == 1:
            return quants.dequantize_rows(raw, qtype, info.shape[0]).reshape(info.shape[0])  # (n,)
        if len(info.shape) != 2:
            raise MinferError(f"tensor {name}: expected 1 or 2 dimensions, got shape {info.shape}")
        if name == "token_embd.weight" or (self.keep_quantized and qtype != GGMLQuantizationType.F32):
            return QuantTable(raw, qtype, tuple(info.shape))                  # (rows, cols) quantized
        return quants.dequantize_rows(raw, qtype, info.shape[1])              # (n_out, n_in) f32

    def new_cache(self, max_tokens: int) -> CPUCache:
        cfg = self.cfg
        shape = (cfg.n_layer, max_tokens, cfg.n_head_kv, cfg.head_dim)
        need = 2 * 4 * cfg.n_layer * max_tokens * cfg.kv_dim              # k and v, float32
        have = available_bytes()
        # np.zeros is lazily committed, so a cache far beyond the memory would only
        # fail (or be OOM-killed) once the run fills it: refuse it up front
        if have is not None and need > have:
            raise MinferError(f"the KV cache for a context of {max_tokens} tokens needs "
                              f"{need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB available: lower -c")
        try:
            return CPUCache(k=np.zeros(shape, np.float32), v=np.zeros(shape, np.float32), n_ctx=max_tokens)
        except MemoryError:
            raise MinferError(f"out of host memory allocating the KV cache for a context of "
                              f"{max_tokens} tokens ({need / 2**30:.1f} GiB): lower -c") from None

    def sequence_cache(self, storage: CPUCache, n_ctx: int) -> CPUCache:
        if n_ctx < 1 or n_ctx > storage.n_ctx:
            raise MinferError(f"a sequence of {n_ctx} positions in a cache of {storage.n_ctx}")
        return CPUCache(k=storage.k, v=storage.v, n_ctx=n_ctx,
                        table=np.zeros(-(-n_ctx // BLOCK_TOKENS), np.int64))

    @contextlib.contextmanager
    def guard(self, what: str):
        """Host allocations failing inside `what` (weights, activations, attention's
        (T, S) scores) -> one line."""
        try:
            yield
        except MemoryError:
            have = available_bytes()
            free = f", {have / 2**30:.1f} GiB available" if have is not None else ""
            raise MinferError(f"out of host memory while {what}{free}: use a shorter prompt "
                              f"or a smaller -c, or free memory") from None

    # --- ops ----------------------------------------------------------------
    def embed(self, table: QuantTable, tokens):
        """table (vocab, d), tokens int32 (T,) -> x (T, d)"""
        tokens = np.asarray(tokens)
        bad = (tokens < 0) | (tokens >= table.shape[0])
        if bad.any():
            raise MinferError(f"token id {int(tokens[bad][0])} is outside the vocabulary (0..{table.shape[0] - 1})")
        return table.rows(tokens)

    def rmsnorm(self, x, w, eps):
        """x (T, d), w (d,) -> x / sqrt(mean(x^2) + eps) * w"""
        ms = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True)     # (T, 1) f64, as ggml
        return (x * (1.0 / np.sqrt(ms + eps)).astype(np.float32)) * w

    def linear(self, x, w, bias=None, residual=None):
        """x (T, n_in) @ W (n_out, n_in)^T [+ bias (n_out,)] [residual + ] -> (T, n_out)"""
        if isinstance(w, QuantTable):       # tied LM head, or weights kept quantized
            w = w.dense(keep=not self.keep_quantized)
        if self.deterministic:              # one row at a time: a row's sums whatever T (the
            y = np.empty((x.shape[0], w.shape[0]), np.float32)   # BLAS's order may follow it)
            for i in range(x.shape[0]):
                y[i] = x[i] @ w.T
        else:
            y = x @ w.T
        if bias is not None:
            y += bias
        return y if residual is None else residual + y

    def set_rope_factors(self, factors):
        super().set_rope_factors(factors)
        hd = self.cfg.head_dim
        self._cos = np.empty((0, hd // 2), np.float32)                                    # (n_pos, hd/2)
        self._sin = np.empty((0, hd // 2), np.float32)

    def _rope_tables(self, n_pos: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin of pos * theta_i for pos < n_pos: (n_pos, hd/2) float32, grown on demand."""
        if self._cos.shape[0] < n_pos:
            n = max(n_pos, 2 * self._cos.shape[0])
            angle = self.rope_angles(n)                                                   # (n, hd/2)
            angle = np.asarray(angle, np.float64)       # cos, sin rounded once to f32 (as cosf, sinf)
            self._cos, self._sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
        return self._cos[:n_pos], self._sin[:n_pos]

    def rope_angles(self, n_pos: int) -> np.ndarray:
        """RoPE's angles pos * theta_i for pos < n_pos (minfer/rope.py) -> (n_pos, hd/2)"""
        return rope.angles(n_pos, self.cfg.head_dim, self.cfg.rope_base, self.rope_factors)

    def rope(self, x, pos0):
        """x (T, n_heads, hd) at positions pos0.. (or a Batch's row positions) -> rotated (T, n_heads, hd)"""
        T, _, hd = x.shape
        if isinstance(pos0, Batch):
            cos, sin = self._rope_tables(pos0.max_pos + 1)
            at = pos0.positions
            cos, sin = cos[at, None, :], sin[at, None, :]                                 # (T, 1, hd/2)
        else:
            cos, sin = self._rope_tables(pos0 + T)
            cos, sin = cos[pos0:, None, :], sin[pos0:, None, :]                           # (T, 1, hd/2)
        if self.cfg.rope_neox:      # rotate (x_i, x_{i+hd/2})
            x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
            return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        x1, x2 = x[..., 0::2], x[..., 1::2]                                              # rotate (x_2i, x_2i+1)
        out = np.empty_like(x)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x2 * cos + x1 * sin
        return out

    def attention(self, q, k, v, cache: CPUCache, layer, pos0):
        """q (T, n_head, hd), k/v (T, n_kv, hd) -> causal GQA attention (T, n_head*hd):
        one sequence at positions pos0.., or a Batch's sequences, each over its own keys"""
        if not isinstance(pos0, Batch):
            at = cache.rows_of(pos0, pos0 + q.shape[0])
            cache.k[layer, at] = k
            cache.v[layer, at] = v
            keys = cache.rows_of(0, pos0 + q.shape[0])
            return self._attend(q, cache.k[layer, keys], cache.v[layer, keys], pos0)
        b = pos0
        cache.k[layer, b.rows[:, 1]] = k
        cache.v[layer, b.rows[:, 1]] = v
        out = np.empty((q.shape[0], self.cfg.n_head * self.cfg.head_dim), np.float32)
        for s, sp in enumerate(b.spans):
            r, keys = b.seq_rows(s), b.key_rows(s)
            out[r] = self._attend(q[r], cache.k[layer, keys], cache.v[layer, keys], sp.pos0)
        return out

    def _attend(self, q, K, V, pos0: int):
        """_attend_rows: every query row over its keys; in the deterministic mode one
        row at a time over exactly the keys it sees (the products' and the softmax
        sums' order would follow the rows and keys beside it)."""
        if not self.deterministic:
            return self._attend_rows(q, K, V, pos0)
        out = np.empty((q.shape[0], self.cfg.n_head * self.cfg.head_dim), np.float32)
        for t in range(q.shape[0]):
            n = pos0 + t + 1                                  # keys 0..pos0+t
            out[t] = self._attend_rows(q[t:t + 1], K[:n], V[:n], pos0 + t)[0]
        return out

    def _attend_rows(self, q, K, V, pos0: int):
        """q (T, n_head, hd) at positions pos0.., K, V (pos0 + T, n_kv, hd): positions
        0..pos0+T-1 -> (T, n_head*hd), query t seeing keys 0..pos0+t"""
        cfg = self.cfg
        T, _, hd = q.shape
        S = pos0 + T                                          # keys visible to the last query
        # query t (position pos0+t) sees keys 0..pos0+t
        masked = np.arange(S)[None, :] > (pos0 + np.arange(T))[:, None]                  # (T, S)
        scale = np.float32(1.0 / np.sqrt(hd))
        out = np.empty((T, cfg.n_head, hd), np.float32)                                   # (T, n_head, hd)
        for g in range(cfg.n_head_kv):
            heads = slice(g * cfg.n_rep, (g + 1) * cfg.n_rep)    # query heads sharing KV head g
            # the group's queries stacked as one 2-D matrix: one BLAS GEMM instead of
            # n_rep small batched ones (NumPy's stacked matmul is far slower)
            qg = q[:, heads].transpose(1, 0, 2).reshape(cfg.n_rep * T, hd)    # (n_rep*T, hd)
            Kg, Vg = K[:, g], V[:, g]                                           # (S, hd) each
            s = (qg @ Kg.T).reshape(cfg.n_rep, T, S)                            # (n_rep, T, S)
            s *= scale
            s[:, masked] = -np.inf
            s -= s.max(axis=-1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(axis=-1, keepdims=True)
            o = (p.reshape(cfg.n_rep * T, S) @ Vg).reshape(cfg.n_rep, T, hd)  # (n_rep, T, hd)
            out[:, heads] = o.transpose(1, 0, 2)
        return out.reshape(T, cfg.n_head * hd)

    def swiglu(self, gate, up):
        """gate, up (T, d_ff) -> silu(gate) * up"""
        with np.errstate(over="ignore"):    # exp(-g) -> inf for g << 0 gives silu = -0, correctly
            return gate / (np.float32(1.0) + np.exp(-gate)) * up

    def add(self, a, b):
        return a + b

    def rows(self, x, start, stop):
        return x[start:stop]

    def select_rows(self, x, idx):
        return x[np.asarray(idx, np.int64)]

    def to_numpy(self, x):
        return np.asarray(x, dtype=np.float32)
