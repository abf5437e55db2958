"""kernels/flash_attn.cu and kernels/flash_attn_sm90.cu: a prompt's attention over
the f16 KV cache (head dim 128) on tensor cores: mma.m16n8k16 on any GPU with f16
tensor cores, wgmma on Hopper (flash_kind says which runs). Q, K, V and the
probabilities are rounded to f16; scores, the softmax and the accumulators are f32.

    flash_attention  q16 over a filled cache -> (T, n_head*128) f32, or f16 (the o
                     projection's operand); one sequence, or several (FlashBatch)
    attend_f16       flash_attention (T > 1) or decode_attention (T == 1)
    attention_f16    store_kv_f16, then attend_f16
"""
from __future__ import annotations

import functools

import numpy as np

from ..launch import DevicePos, NULL, blocks_1d, check, cp, device_cc, kernel, out_array, scratch_view
from ..nvrtc import ARCH_SPECIFIC, K
from .attention import _check_heads, cache_span
from .decode_attn import FA_HD, _SCALE_LOG2, decode_attention, store_kv_f16
from .dequant_f16 import cast_f16

# flash_kind -> the kernel that runs it (the name its launches are counted under)
KERNEL = {"wgmma": "flash_attn_f16_sm90", "mma": "flash_attn_f16"}


def flash_kind(wgmma: bool = True) -> str:
    """Which prefill flash kernel runs on the current device: "wgmma"
    (flash_attn_sm90.cu) when asked for and the GPU is the one its target is
    for, else "mma" (flash_attn.cu, any GPU with f16 tensor cores)."""
    return "wgmma" if wgmma and device_cc() == ARCH_SPECIFIC["flash_attn_sm90.cu"][1] else "mma"


def flash_attention(q16, k_cache, v_cache, pos0: int, out=None, wgmma: bool = True, tab=None,
                    n_ctx: int | None = None, batch=None):
    """q16 (T, n_head, 128) f16; k_cache, v_cache (n_rows, n_kv, 128) f16 holding
    positions 0..pos0+T-1, read as one sequence through tab (attention.cache_span)
    -> out (T, n_head*128) f32, or f16 when out is an f16 array (the f32 values
    rounded to nearest even, as cast_f16 rounds them). wgmma=False keeps a Hopper
    GPU on the mma.sync kernel (flash_kind).
    batch: several sequences' rows in q16 (FlashAttention's varlen layout), a
    FlashBatch; pos0, tab and n_ctx are then unused."""
    check(q16, "flash_attention q16", cp.float16, ndim=3, align16=True)
    T, n_head, hd = q16.shape
    if hd != FA_HD:
        raise ValueError(f"flash_attention: q16 has shape {q16.shape}, expected (T, n_head, {FA_HD})")
    check(k_cache, "flash_attention k_cache", cp.float16, ndim=3, align16=True)
    if k_cache.shape[2] != FA_HD:
        raise ValueError(f"flash_attention: cache shape {k_cache.shape}, expected (n_ctx, n_kv, {FA_HD})")
    check(v_cache, "flash_attention v_cache", cp.float16, k_cache.shape, align16=True)
    n_kv = k_cache.shape[1]
    if batch is None:
        n_ctx, tab_arg = cache_span(k_cache, tab, n_ctx, "flash_attention")
        _check_heads(n_head, n_kv, T, pos0, n_ctx, "flash_attention")
        meta = (np.int32(T), np.int32(pos0), NULL, NULL, tab_arg)
        n_blocks = blocks_1d(T * (n_head // n_kv), K["FA_BQ"])
    else:
        if batch.n_rows != T or batch.G != n_head // n_kv:
            raise ValueError(f"flash_attention: a batch of {batch.n_rows} rows at {batch.G} heads a KV "
                             f"head for q16 {q16.shape}")
        meta = (np.int32(batch.n_items), np.int32(0), batch.seqs, batch.items, batch.tables)
        n_blocks = batch.n_items
    half = out is not None and out.dtype == cp.float16
    out = out_array(out, (T, n_head * FA_HD), "flash_attention out", cp.float16 if half else None,
                    align16=True)
    if T:
        fn, threads, smem = _flash_kernel(cp.cuda.Device().id, flash_kind(wgmma))
        T_arg, pos_arg, seqs, items, tables = meta
        fn((n_blocks, n_kv), (threads,),
           (q16, k_cache, v_cache, NULL if half else out, out if half else NULL, T_arg,
            np.int32(n_head), np.int32(n_kv), pos_arg, np.float32(_SCALE_LOG2), seqs, items, tables),
           shared_mem=smem)
    return out


class FlashBatch:
    """A batch of sequences laid out for flash_attention: seqs (n_seq, 4) int32 =
    (first row in q16, rows, position of the first, offset of its block table in
    tables), and the work items (n_items, 2) int32 = (sequence, first flattened
    row), heaviest first (the most key tiles), as flash_common.cuh's fa_item
    takes them; device copies, made once per batch and layer-independent.
    spans: (first row, rows, first position, block table) per sequence."""

    def __init__(self, spans, n_head: int, n_kv: int):
        self.G = G = n_head // n_kv
        bq, bk = K["FA_BQ"], K["FA_BK"]
        seqs, tables, items, weight = [], [], [], []
        for s, (q0, n, p0, table) in enumerate(spans):
            seqs.append((q0, n, p0, len(tables)))
            tables.extend(int(b) for b in table)
            for row0 in range(0, n * G, bq):
                last_tok = (min(row0 + bq, n * G) - 1) // G
                items.append((s, row0))
                weight.append((p0 + last_tok + bk) // bk)            # key tiles it visits
        order = np.argsort(-np.asarray(weight, np.int64), kind="stable")
        self.n_rows = sum(n for _, n, _, _ in spans)
        self.n_items = len(items)
        self.seqs = cp.asarray(np.asarray(seqs, np.int32).reshape(-1, 4))           # (n_seq, 4)
        self.items = cp.asarray(np.asarray(items, np.int32).reshape(-1, 2)[order])  # (n_items, 2)
        self.tables = cp.asarray(np.asarray(tables or [0], np.int32))              # flat


@functools.lru_cache(maxsize=None)
def _flash_kernel(device_id: int, kind: str):
    """(kernel, threads, dynamic shared bytes) of a flash kind, opted in (once per
    device) to its > 48 KB of dynamic shared memory."""
    if kind == "wgmma":
        fn, threads, smem = kernel("flash_attn_sm90.cu", KERNEL[kind]), 128 * K["FA90_WG"], K["FA90_SMEM"]
    else:
        fn, threads, smem = kernel("flash_attn.cu", KERNEL[kind]), 32 * K["FA_WARPS"], K["FA_SMEM"]
    fn.fn.max_dynamic_shared_size_bytes = smem
    return fn, threads, smem


def attend_f16(q, k_cache, v_cache, pos, out=None, q16=None, wgmma: bool = True, tab=None,
               n_ctx: int | None = None):
    """q (T, n_head, 128) f32 over one layer's f16 caches holding positions
    0..pos+T-1 (one sequence through tab: attention.cache_span) -> (T, n_head*128)
    f32. One row (decode) reads q in f32 (decode_attention; pos may be a
    launch.DevicePos); longer prompts round q into the f16 scratch q16
    (>= T*n_head*128) for the tensor-core flash_attention."""
    if q.shape[0] == 1:
        return decode_attention(q, k_cache, v_cache, pos, out, tab=tab, n_ctx=n_ctx)
    if isinstance(pos, DevicePos):
        raise ValueError("attend_f16: a device position is for one-row (decode) steps")
    qh = cast_f16(q, scratch_view(q16, q.shape, "attend_f16 q16", cp.float16))   # (T, n_head, 128)
    return flash_attention(qh, k_cache, v_cache, pos, out, wgmma, tab=tab, n_ctx=n_ctx)


def attention_f16(q, k, v, k_cache, v_cache, pos, out=None, q16=None, wgmma: bool = True, tab=None,
                  n_ctx: int | None = None):
    """q (T, n_head, 128), k/v (T, n_kv, 128) f32: stores k/v into the f16 caches at
    positions pos.., then attend_f16 -> (T, n_head*128) f32."""
    store_kv_f16(k, v, k_cache, v_cache, pos, tab=tab, n_ctx=n_ctx)
    return attend_f16(q, k_cache, v_cache, pos, out, q16, wgmma, tab=tab, n_ctx=n_ctx)
