"""kernels/decode_attn.cu: the f16 KV cache's stores and one-row attention.

    store_kv_f16      k, v f32 -> f16 cache rows at a host or device position
    decode_attention  one query row over the f16 cache, split over the keys in chunks
                      (flash-decoding), position from device memory; optionally RoPE
                      and the store of the new row in the same launch; one launch in
                      all below DEC_SHORT_KEYS positions
    rope_store_kv_f16 a prompt's biases, RoPE on q and k, the f16 store of k, v and
                      q's rounding to f16: one launch
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ....errors import MinferError
from ..launch import (NULL, MAX_GRID_1D, THREADS_1D, DevicePos, blocks_1d, check, check_rows, cp, kernel,
                      or_null, out_array, pos_args, pos_value)
from ..nvrtc import K
from .attention import _check_heads, cache_span


FA_HD = K["FA_HD"]
DEC_MAX_G = K["DEC_MAX_G"]                  # query heads per KV head that decode_attention takes
DEC_SHORT_KEYS = K["DEC_SHORT_SPLITS"] * K["DEC_CHUNK"]   # below this position: one launch (decode_short)
# attn_decode_short's shared memory: per split, its warps' (m, l, accumulators) and its partial
_DEC_SHORT_SMEM = 4 * K["DEC_SHORT_SPLITS"] * DEC_MAX_G * (K["DEC_WARPS"] + 1) * (FA_HD + 2)
_SCALE_LOG2 = math.log2(math.e) / math.sqrt(FA_HD)   # scores in the log2 domain (exp2f)


def store_kv_f16(k, v, k_cache, v_cache, pos, rows=None, tab=None, n_ctx: int | None = None) -> None:
    """k, v (T, n_kv, hd) f32 -> positions pos..pos+T-1 of one layer's f16 caches
    k_cache, v_cache (n_rows, n_kv, hd), read as one sequence through tab
    (attention.cache_span); pos an int or a launch.DevicePos. With rows ((T, 2)
    int32 device: position, cache row; a batch of sequences): at rows[:, 1]."""
    check(k_cache, "store_kv_f16 k_cache", cp.float16, ndim=3, align16=True)
    n_ctx, tab_arg = cache_span(k_cache, tab, n_ctx, "store_kv_f16")
    check(v_cache, "store_kv_f16 v_cache", cp.float16, k_cache.shape, align16=True)
    T = k.shape[0]
    for a, nm in ((k, "k"), (v, "v")):
        check(a, f"store_kv_f16 {nm}", cp.float32, (T,) + k_cache.shape[1:], align16=True)
    pos0 = pos_value(pos)
    if rows is not None:
        check(rows, "store_kv_f16 rows", cp.int32, (T, 2))
    elif pos0 < 0 or pos0 + T > n_ctx:
        raise MinferError(f"positions {pos0}..{pos0 + T - 1} do not fit the KV cache of {n_ctx}")
    row = k_cache.shape[1] * k_cache.shape[2]
    n4 = T * row // 4
    if n4:
        kernel("decode_attn.cu", "store_kv_f16")((min(blocks_1d(n4), MAX_GRID_1D),), (THREADS_1D,),
                                                 (k, v, k_cache, v_cache, np.int64(n4), np.int32(row),
                                                  *pos_args(pos), or_null(rows), tab_arg))


def decode_short(pos: int) -> bool:
    """Does a decode step at pos attend in one launch (attn_decode_short: its keys'
    splits are sub-blocks of one block per KV head, merged in shared memory) instead
    of two (the splits' blocks, then attn_decode_combine)? Below DEC_SHORT_KEYS
    positions; the same bits either way. A captured decode step replays at other
    positions, so its graph key holds this answer (backend.decode)."""
    return pos < DEC_SHORT_KEYS


@functools.lru_cache(maxsize=None)
def _decode_short_kernel(device_id: int):
    """attn_decode_short, opted in (once per device) to its > 48 KB of dynamic shared memory."""
    fn = kernel("decode_attn.cu", "attn_decode_short")
    fn.fn.max_dynamic_shared_size_bytes = _DEC_SHORT_SMEM
    return fn


def decode_attention(q, k_cache, v_cache, pos, out=None, new_kv=None, cos_sin=None, neox: bool = True,
                     q8=None, short: bool | None = None, tab=None, n_ctx: int | None = None):
    """One query row: q (1, n_head, 128) f32; k_cache, v_cache (n_rows, n_kv, 128) f16
    holding positions 0..pos (an int or a launch.DevicePos), read as one sequence
    through tab (attention.cache_span) -> out (1, n_head*128) f32.
    B rows at once (batched decode): q (B, n_head, 128), pos a DevicePos whose
    buffer holds the B positions (value: the largest, for the checks), tab (B,
    n_blocks) their block tables (n_ctx positions each), new_kv (B, n_kv, 128),
    out (B, n_head*128), q8 of B rows; each row's values as if it ran alone.
    With new_kv = (k, v) (1, n_kv, 128) f32 and the RoPE table cos_sin: q and k come
    un-rotated, and the kernel rotates them and stores k and v at row pos itself
    (the values of rope_store_kv_f16 then decode_attention, in one launch fewer).
    With q8 = (q int8 (1, n), d, s f32 (1, n/32)), n = n_head*128: the output goes
    there as q8_1 instead (quantize_q8_1's bits: the o projection's operand, one
    launch fewer) and q8 is returned. short: one launch or two (default:
    decode_short(pos); True needs pos < DEC_SHORT_KEYS)."""
    check(q, "decode_attention q", cp.float32, ndim=3, align16=True)
    B, n_head = q.shape[0], q.shape[1]
    if B < 1 or q.shape[2] != FA_HD:
        raise ValueError(f"decode_attention: q has shape {q.shape}, expected (B, n_head, {FA_HD})")
    check(k_cache, "decode_attention k_cache", cp.float16, ndim=3, align16=True)
    check(v_cache, "decode_attention v_cache", cp.float16, k_cache.shape, align16=True)
    n_kv = k_cache.shape[1]
    tab_stride = 0
    if B > 1 or isinstance(pos, DevicePos) and getattr(tab, "ndim", 1) == 2:      # a decode Batch's rows
        if not isinstance(pos, DevicePos) or pos.buf.size != B or tab is None:
            raise ValueError("decode_attention: B rows take their positions from device memory "
                             "(a DevicePos of B) and a block table each")
        check(tab, "decode_attention block tables", cp.int32, ndim=2)
        if tab.shape[0] != B:
            raise ValueError(f"decode_attention: {tab.shape[0]} block tables for {B} rows")
        tab_stride = tab.shape[1]
        n_ctx, tab_arg = cache_span(k_cache, tab[0], n_ctx, "decode_attention")
        tab_arg = tab
    else:
        n_ctx, tab_arg = cache_span(k_cache, tab, n_ctx, "decode_attention")
    _check_heads(n_head, n_kv, 1, pos_value(pos), n_ctx, "decode_attention")
    if n_head // n_kv > DEC_MAX_G:
        raise MinferError(f"{n_head // n_kv} query heads per KV head: the decode attention "
                          f"kernel takes at most {DEC_MAX_G}")
    rope_args = (NULL, NULL, NULL, np.int32(0))
    if new_kv is not None:
        for a, nm in zip(new_kv, "kv"):
            check(a, f"decode_attention new {nm}", cp.float32, (B, n_kv, FA_HD), align16=True)
        check(cos_sin, "decode_attention cos_sin", cp.float32, ndim=3)
        if cos_sin.shape[1:] != (FA_HD // 2, 2) or pos_value(pos) >= cos_sin.shape[0]:
            raise ValueError(f"decode_attention: RoPE table {cos_sin.shape} does not cover position "
                             f"{pos_value(pos)} at head dim {FA_HD}")
        rope_args = (*new_kv, cos_sin, np.int32(bool(neox)))
    n = n_head * FA_HD
    if q8 is not None:
        if out is not None:
            raise ValueError("decode_attention: one output, f32 (out) or q8_1 (q8)")
        for a, nm, shape, dt in zip(q8, "qds", ((B, n), (B, n // 32), (B, n // 32)),
                                    (cp.int8, cp.float32, cp.float32)):
            check(a, f"decode_attention q8 {nm}", dt, shape)
        outs = (NULL, *q8)
    else:
        out = out_array(out, (B, n), "decode_attention out", align16=True)
        outs = (out, NULL, NULL, NULL)
    short = decode_short(pos_value(pos)) if short is None else short
    if short:
        if not decode_short(pos_value(pos)):
            raise ValueError(f"decode_attention: position {pos_value(pos)} is past the one-launch "
                             f"path's {DEC_SHORT_KEYS} keys")
        _decode_short_kernel(cp.cuda.Device().id)(
            (n_kv, B), (K["DEC_SHORT_SPLITS"] * 32 * K["DEC_WARPS"],),
            (q, k_cache, v_cache, *outs, np.int32(n_head), np.int32(n_kv), np.int32(n_ctx),
             *pos_args(pos), np.float32(_SCALE_LOG2), *rope_args, tab_arg, np.int32(tab_stride)),
            shared_mem=_DEC_SHORT_SMEM)
        return out if q8 is None else q8
    n_split = blocks_1d(n_ctx, K["DEC_CHUNK"])                          # the whole context
    part = cp.empty((B, n_head, n_split, FA_HD + 2), cp.float32)        # (B, n_head, splits, 130)
    kernel("decode_attn.cu", "attn_decode_f16")(
        (n_kv, n_split, B), (32 * K["DEC_WARPS"],),
        (q, k_cache, v_cache, part, np.int32(n_head), np.int32(n_kv), np.int32(n_split), *pos_args(pos),
         np.float32(_SCALE_LOG2), *rope_args, tab_arg, np.int32(tab_stride)))
    kernel("decode_attn.cu", "attn_decode_combine")((n_head, B), (FA_HD,),
                                                    (part, *outs, np.int32(n_split), *pos_args(pos)))
    return out if q8 is None else q8


def rope_store_kv_f16(q, k, v, k_cache, v_cache, cos_sin, pos, neox: bool, q_out=None,
                      biases=(None, None, None), rows=None, tab=None, n_ctx: int | None = None):
    """q (T, n_head, hd), k, v (T, n_kv, hd) f32 at positions pos.. (an int or a
    launch.DevicePos): rotates q into q_out (f32, or f16: the flash attention's
    operand), and k, then stores k and v into rows pos..pos+T-1 of one layer's f16
    caches (n_rows, n_kv, hd), read as one sequence through tab (attention.cache_span),
    or with rows ((T, 2) int32 device: position, cache row; a batch of sequences,
    whose positions the caller checked) token t at rows[t] -> q_out. q, k and v may be column blocks of one
    wider (T, n) matrix (each token's heads packed, its rows further apart; k and v
    the same row stride). biases: the q/k/v projections' biases (n_head*hd,),
    (n_kv*hd,), (n_kv*hd,) or None, added first. The values of the bias adds,
    rope.py's rope (q and k), store_kv_f16 and cast_f16, bit for bit, in one launch.
    hd a multiple of 8 and every row 16-byte aligned (the kernel moves 16-byte vectors)."""
    if getattr(q, "ndim", 0) != 3:
        raise ValueError(f"rope_store_kv_f16 q: expected (T, n_head, hd), got {getattr(q, 'shape', q)}")
    T, n_head, hd = q.shape
    ldq = check_rows(q, "rope_store_kv_f16 q", cp.float32, q.shape)
    check(k_cache, "rope_store_kv_f16 k_cache", cp.float16, ndim=3, align16=True)
    n_rows, n_kv, _ = k_cache.shape
    check(v_cache, "rope_store_kv_f16 v_cache", cp.float16, (n_rows, n_kv, hd), align16=True)
    n_ctx, tab_arg = cache_span(k_cache, tab, n_ctx, "rope_store_kv_f16")
    ldkv = check_rows(k, "rope_store_kv_f16 k", cp.float32, (T, n_kv, hd))
    if check_rows(v, "rope_store_kv_f16 v", cp.float32, (T, n_kv, hd)) != ldkv:
        raise ValueError(f"rope_store_kv_f16: k and v rows of different strides ({k.strides}, {v.strides})")
    check(cos_sin, "rope_store_kv_f16 cos_sin", cp.float32, ndim=3, align16=True)
    if hd % 8 or cos_sin.shape[1:] != (hd // 2, 2):
        raise ValueError(f"rope_store_kv_f16: table {cos_sin.shape} does not fit head dim {hd}")
    pos0 = pos_value(pos)
    if rows is not None:
        check(rows, "rope_store_kv_f16 rows", cp.int32, (T, 2))
    elif pos0 < 0 or pos0 + T > min(n_ctx, cos_sin.shape[0]):
        raise MinferError(f"positions {pos0}..{pos0 + T - 1} do not fit the KV cache of {n_ctx}")
    half = q_out is not None and q_out.dtype == cp.float16
    q_out = out_array(q_out, q.shape, "rope_store_kv_f16 q_out", cp.float16 if half else None,
                      align16=True)
    for b, heads, nm in zip(biases, (n_head, n_kv, n_kv), "qkv"):
        if b is not None:
            check(b, f"rope_store_kv_f16 bias {nm}", cp.float32, (heads * hd,), align16=True)
    for a, ld, nm in ((q, ldq, "q"), (k, ldkv, "k"), (v, ldkv, "v")):    # rows of any stride
        if a.data.ptr % 16 or ld % 4:
            raise ValueError(f"rope_store_kv_f16 {nm}: rows not 16-byte aligned (16-byte vectors)")
    n = T * (n_head + n_kv) * (hd // 8)                # a thread per four pairs
    if n:
        kernel("decode_attn.cu", "rope_store_kv_f16")(
            (blocks_1d(n),), (THREADS_1D,),
            (q, NULL if half else q_out, q_out if half else NULL, k, v, *map(or_null, biases),
             k_cache, v_cache, cos_sin, np.int32(T), np.int32(n_head), np.int32(n_kv),
             np.int32(hd), np.int64(ldq), np.int64(ldkv), *pos_args(pos), np.int32(bool(neox)),
             or_null(rows), tab_arg))
    return q_out
