"""kernels/attention.cu: causal GQA attention on the f32 KV cache (head dims 64
and 128 other than the f16 cache's), tiled online softmax; and the head/position
check every attention wrapper shares.

All attention kernels compute softmax(q k^T / sqrt(hd)) v over keys 0..pos0+t for
query t, query head h reading KV head h // (n_head / n_kv), streaming key tiles
(no T x T buffer).
"""
from __future__ import annotations

import math

import numpy as np

from ....errors import MinferError
from ..launch import blocks_1d, check, cp, kernel, out_array
from ..nvrtc import K


F32_HEAD_DIMS = (64, 128)                   # the instantiations of attention.cu
_F32_INSTANCES = tuple(f"attention_f32<{hd}>" for hd in F32_HEAD_DIMS)


def _check_heads(n_head: int, n_kv: int, T: int, pos0: int, n_ctx: int, what: str) -> None:
    if n_kv < 1 or n_head % n_kv:
        raise ValueError(f"{what}: {n_head} query heads do not group over {n_kv} KV heads")
    if pos0 < 0 or pos0 + T > n_ctx:
        raise MinferError(f"positions {pos0}..{pos0 + T - 1} do not fit the KV cache of {n_ctx}")


def attention_f32(q, k, v, k_cache, v_cache, pos0: int, out=None):
    """q (T, n_head, hd), k/v (T, n_kv, hd) f32; k_cache/v_cache: one layer's
    (n_ctx, n_kv, hd) f32. Stores k/v at pos0..pos0+T-1, then attention -> (T, n_head*hd)."""
    check(q, "attention q", cp.float32, ndim=3, align16=True)
    T, n_head, hd = q.shape
    if hd not in F32_HEAD_DIMS:
        raise ValueError(f"attention: head dim {hd} not in {F32_HEAD_DIMS}")
    check(k_cache, "attention k_cache", cp.float32, ndim=3, align16=True)
    n_ctx, n_kv, _ = k_cache.shape
    check(v_cache, "attention v_cache", cp.float32, (n_ctx, n_kv, hd), align16=True)
    check(k, "attention k", cp.float32, (T, n_kv, hd))
    check(v, "attention v", cp.float32, (T, n_kv, hd))
    _check_heads(n_head, n_kv, T, pos0, n_ctx, "attention")
    y = out_array(out, (T, n_head * hd), "attention out", align16=True)     # (T, n_head*hd)
    k_cache[pos0:pos0 + T] = k                                               # (T, n_kv, hd)
    v_cache[pos0:pos0 + T] = v
    if T:
        kernel("attention.cu", f"attention_f32<{hd}>", _F32_INSTANCES)(
            (blocks_1d(T, K["ATT_BQ"]), n_head), (32 * K["ATT_WARPS"],),
            (q, k_cache, v_cache, y, np.int32(T), np.int32(n_head), np.int32(n_kv),
             np.int32(pos0), np.float32(1.0 / math.sqrt(hd))))
    return y
