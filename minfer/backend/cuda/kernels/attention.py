"""kernels/attention.cu: causal GQA attention on the f32 KV cache (head dims 64
and 128 other than the f16 cache's), tiled online softmax; and what every
attention wrapper shares: the head/position check and the span of a cache (its
rows, or one sequence's block table over a paged cache).

All attention kernels compute softmax(q k^T / sqrt(hd)) v over keys 0..pos0+t for
query t, query head h reading KV head h // (n_head / n_kv), streaming key tiles
(no T x T buffer).
"""
from __future__ import annotations

import math

import numpy as np

from ....errors import MinferError
from ..launch import NULL, blocks_1d, check, cp, kernel, out_array
from ..nvrtc import K

KV_BLOCK = K["KV_BLOCK"]                    # positions per block of a paged cache


F32_HEAD_DIMS = (64, 128)                   # the instantiations of attention.cu
_F32_INSTANCES = tuple(f"attention_f32<{hd}>" for hd in F32_HEAD_DIMS)


def _check_heads(n_head: int, n_kv: int, T: int, pos0: int, n_ctx: int, what: str) -> None:
    if n_kv < 1 or n_head % n_kv:
        raise ValueError(f"{what}: {n_head} query heads do not group over {n_kv} KV heads")
    if pos0 < 0 or pos0 + T > n_ctx:
        raise MinferError(f"positions {pos0}..{pos0 + T - 1} do not fit the KV cache of {n_ctx}")


def cache_span(k_cache, tab, n_ctx: int | None, what: str):
    """One sequence's view of a layer's cache (n_rows, n_kv, hd) -> (the positions
    it holds, the kernels' table argument). Contiguous (tab None): position p at row
    p, n_ctx at most n_rows (default n_rows). Paged: tab int32 (n_blocks,), the
    sequence's block table (kernels/common.cuh's kv_row), n_ctx at most its blocks'
    positions (default all of them); each entry a block of the cache."""
    rows = k_cache.shape[0]
    if tab is None:
        n = rows if n_ctx is None else n_ctx
        if n > rows:
            raise ValueError(f"{what}: {n} positions in a cache of {rows} rows")
        return n, NULL
    check(tab, f"{what} block table", cp.int32, ndim=1)
    n = tab.size * KV_BLOCK if n_ctx is None else n_ctx
    if n > tab.size * KV_BLOCK or rows % KV_BLOCK:
        raise ValueError(f"{what}: {n} positions through {tab.size} blocks of {KV_BLOCK} "
                         f"in a cache of {rows} rows")
    return n, tab


def attention_f32(q, k, v, k_cache, v_cache, pos0: int, out=None, tab=None, n_ctx: int | None = None):
    """q (T, n_head, hd), k/v (T, n_kv, hd) f32; k_cache/v_cache: one layer's
    (n_rows, n_kv, hd) f32, read as one sequence through tab (cache_span). Stores
    k/v at positions pos0..pos0+T-1, then attention -> (T, n_head*hd)."""
    check(q, "attention q", cp.float32, ndim=3, align16=True)
    T, n_head, hd = q.shape
    if hd not in F32_HEAD_DIMS:
        raise ValueError(f"attention: head dim {hd} not in {F32_HEAD_DIMS}")
    check(k_cache, "attention k_cache", cp.float32, ndim=3, align16=True)
    n_rows, n_kv, _ = k_cache.shape
    check(v_cache, "attention v_cache", cp.float32, (n_rows, n_kv, hd), align16=True)
    n_ctx, tab_arg = cache_span(k_cache, tab, n_ctx, "attention")
    check(k, "attention k", cp.float32, (T, n_kv, hd))
    check(v, "attention v", cp.float32, (T, n_kv, hd))
    _check_heads(n_head, n_kv, T, pos0, n_ctx, "attention")
    y = out_array(out, (T, n_head * hd), "attention out", align16=True)     # (T, n_head*hd)
    if tab is None:
        k_cache[pos0:pos0 + T] = k                                           # (T, n_kv, hd)
        v_cache[pos0:pos0 + T] = v
    else:
        at = cache_rows(tab, pos0, T)                                        # (T,)
        k_cache[at] = k
        v_cache[at] = v
    if T:
        kernel("attention.cu", f"attention_f32<{hd}>", _F32_INSTANCES)(
            (blocks_1d(T, K["ATT_BQ"]), n_head), (32 * K["ATT_WARPS"],),
            (q, k_cache, v_cache, y, np.int32(T), np.int32(n_head), np.int32(n_kv),
             np.int32(pos0), np.float32(1.0 / math.sqrt(hd)), tab_arg))
    return y


def cache_rows(tab, pos0: int, T: int):
    """The cache rows of positions pos0..pos0+T-1 through a block table -> int64 (T,)
    device array (kv_row's rule, for stores by indexing)."""
    p = cp.arange(pos0, pos0 + T, dtype=cp.int64)
    return tab[p // KV_BLOCK].astype(cp.int64) * KV_BLOCK + p % KV_BLOCK
