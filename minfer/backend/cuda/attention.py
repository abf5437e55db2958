"""Causal GQA attention over a layer's KV cache, one wrapper per kernel:

    attention_f32    kernels/attention.cu   f32 cache, tiled online softmax (head dims 64, 128)
    store_kv_f16     kernels/decode_attn.cu k, v f32 -> f16 cache rows at a host or device position
    flash_attention  kernels/flash_attn.cu  f16 cache, tensor-core mma.m16n8k16 (head dim 128);
                     kernels/flash_attn_sm90.cu the same on Hopper through wgmma (flash_kind)
    decode_attention kernels/decode_attn.cu one query row over the f16 cache, split over the
                                            keys in chunks (flash-decoding), position from
                                            device memory; optionally RoPE and the store of
                                            the new row in the same launch; one launch in all
                                            below DEC_SHORT_KEYS positions
    rope_store_kv_f16 kernels/decode_attn.cu RoPE on q and k and the f16 store of k, v: one launch
    attention_f16    store_kv_f16, then attend_f16
    attend_f16       flash_attention (T > 1) or decode_attention (T == 1) over a filled cache

Both compute softmax(q k^T / sqrt(hd)) v over keys 0..pos0+t for query t, query
head h reading KV head h // (n_head / n_kv), streaming key tiles (no T x T
buffer). The f16 path rounds Q, K, V and the probabilities to f16 and keeps
scores, the softmax and the accumulators in f32.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ...errors import MinferError
from .f16 import cast_f16
from .launch import (NULL, DevicePos, MAX_GRID_1D, THREADS_1D, blocks_1d, check, check_rows, cp, device_cc,
                     kernel, or_null, out_array, pos_args, pos_value, scratch_view)
from .nvrtc import ARCH_SPECIFIC, K

FA_HD = K["FA_HD"]
DEC_MAX_G = K["DEC_MAX_G"]                  # query heads per KV head that decode_attention takes
DEC_SHORT_KEYS = K["DEC_SHORT_SPLITS"] * K["DEC_CHUNK"]   # below this position: one launch (decode_short)
# attn_decode_short's shared memory: per split, its warps' (m, l, accumulators) and its partial
_DEC_SHORT_SMEM = 4 * K["DEC_SHORT_SPLITS"] * DEC_MAX_G * (K["DEC_WARPS"] + 1) * (FA_HD + 2)
_SCALE_LOG2 = math.log2(math.e) / math.sqrt(FA_HD)   # scores in the log2 domain (exp2f)
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


def store_kv_f16(k, v, k_cache, v_cache, pos) -> None:
    """k, v (T, n_kv, hd) f32 -> rows pos..pos+T-1 of one layer's f16 caches
    k_cache, v_cache (n_ctx, n_kv, hd); pos an int or a launch.DevicePos."""
    check(k_cache, "store_kv_f16 k_cache", cp.float16, ndim=3, align16=True)
    n_ctx = k_cache.shape[0]
    check(v_cache, "store_kv_f16 v_cache", cp.float16, k_cache.shape, align16=True)
    T = k.shape[0]
    for a, nm in ((k, "k"), (v, "v")):
        check(a, f"store_kv_f16 {nm}", cp.float32, (T,) + k_cache.shape[1:], align16=True)
    pos0 = pos_value(pos)
    if pos0 < 0 or pos0 + T > n_ctx:
        raise MinferError(f"positions {pos0}..{pos0 + T - 1} do not fit the KV cache of {n_ctx}")
    row = k_cache.shape[1] * k_cache.shape[2]
    n4 = T * row // 4
    if n4:
        kernel("decode_attn.cu", "store_kv_f16")((min(blocks_1d(n4), MAX_GRID_1D),), (THREADS_1D,),
                                                 (k, v, k_cache, v_cache, np.int64(n4), np.int32(row),
                                                  *pos_args(pos)))


def flash_kind(wgmma: bool = True) -> str:
    """Which prefill flash kernel runs on the current device: "wgmma"
    (flash_attn_sm90.cu) when asked for and the GPU is the one its target is
    for, else "mma" (flash_attn.cu, any GPU with f16 tensor cores)."""
    return "wgmma" if wgmma and device_cc() == ARCH_SPECIFIC["flash_attn_sm90.cu"][1] else "mma"


def flash_attention(q16, k_cache, v_cache, pos0: int, out=None, wgmma: bool = True):
    """q16 (T, n_head, 128) f16; k_cache, v_cache (n_ctx, n_kv, 128) f16 holding
    positions 0..pos0+T-1 -> out (T, n_head*128) f32, or f16 when out is an f16
    array (the f32 values rounded to nearest even, as cast_f16 rounds them).
    wgmma=False keeps a Hopper GPU on the mma.sync kernel (flash_kind)."""
    check(q16, "flash_attention q16", cp.float16, ndim=3, align16=True)
    T, n_head, hd = q16.shape
    if hd != FA_HD:
        raise ValueError(f"flash_attention: q16 has shape {q16.shape}, expected (T, n_head, {FA_HD})")
    check(k_cache, "flash_attention k_cache", cp.float16, ndim=3, align16=True)
    if k_cache.shape[2] != FA_HD:
        raise ValueError(f"flash_attention: cache shape {k_cache.shape}, expected (n_ctx, n_kv, {FA_HD})")
    check(v_cache, "flash_attention v_cache", cp.float16, k_cache.shape, align16=True)
    n_ctx, n_kv, _ = k_cache.shape
    _check_heads(n_head, n_kv, T, pos0, n_ctx, "flash_attention")
    half = out is not None and out.dtype == cp.float16
    out = out_array(out, (T, n_head * FA_HD), "flash_attention out", cp.float16 if half else None,
                    align16=True)
    if T:
        fn, threads, smem = _flash_kernel(cp.cuda.Device().id, flash_kind(wgmma))
        fn((blocks_1d(T * (n_head // n_kv), K["FA_BQ"]), n_kv), (threads,),
           (q16, k_cache, v_cache, NULL if half else out, out if half else NULL, np.int32(T),
            np.int32(n_head), np.int32(n_kv), np.int32(pos0), np.float32(_SCALE_LOG2)),
           shared_mem=smem)
    return out


@functools.lru_cache(maxsize=None)
def _flash_kernel(device_id: int, kind: str):
    """(kernel, threads, dynamic shared bytes) of a flash kind, opted in (once per
    device) to its > 48 KB of dynamic shared memory."""
    if kind == "wgmma":
        fn, threads, smem = kernel("flash_attn_sm90.cu", "flash_attn_f16_sm90"), 128 * K["FA90_WG"], K["FA90_SMEM"]
    else:
        fn, threads, smem = kernel("flash_attn.cu", "flash_attn_f16"), 32 * K["FA_WARPS"], K["FA_SMEM"]
    fn.fn.max_dynamic_shared_size_bytes = smem
    return fn, threads, smem


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
                     q8=None, short: bool | None = None):
    """One query row: q (1, n_head, 128) f32; k_cache, v_cache (n_ctx, n_kv, 128) f16
    holding positions 0..pos (an int or a launch.DevicePos) -> out (1, n_head*128) f32.
    With new_kv = (k, v) (1, n_kv, 128) f32 and the RoPE table cos_sin: q and k come
    un-rotated, and the kernel rotates them and stores k and v at row pos itself
    (the values of rope_store_kv_f16 then decode_attention, in one launch fewer).
    With q8 = (q int8 (1, n), d, s f32 (1, n/32)), n = n_head*128: the output goes
    there as q8_1 instead (quantize_q8_1's bits: the o projection's operand, one
    launch fewer) and q8 is returned. short: one launch or two (default:
    decode_short(pos); True needs pos < DEC_SHORT_KEYS)."""
    check(q, "decode_attention q", cp.float32, ndim=3, align16=True)
    if q.shape[0] != 1 or q.shape[2] != FA_HD:
        raise ValueError(f"decode_attention: q has shape {q.shape}, expected (1, n_head, {FA_HD})")
    n_head = q.shape[1]
    check(k_cache, "decode_attention k_cache", cp.float16, ndim=3, align16=True)
    check(v_cache, "decode_attention v_cache", cp.float16, k_cache.shape, align16=True)
    n_ctx, n_kv, _ = k_cache.shape
    _check_heads(n_head, n_kv, 1, pos_value(pos), n_ctx, "decode_attention")
    if n_head // n_kv > DEC_MAX_G:
        raise MinferError(f"{n_head // n_kv} query heads per KV head: the decode attention "
                          f"kernel takes at most {DEC_MAX_G}")
    rope_args = (NULL, NULL, NULL, np.int32(0))
    if new_kv is not None:
        for a, nm in zip(new_kv, "kv"):
            check(a, f"decode_attention new {nm}", cp.float32, (1, n_kv, FA_HD), align16=True)
        check(cos_sin, "decode_attention cos_sin", cp.float32, ndim=3)
        if cos_sin.shape[1:] != (FA_HD // 2, 2) or pos_value(pos) >= cos_sin.shape[0]:
            raise ValueError(f"decode_attention: RoPE table {cos_sin.shape} does not cover position "
                             f"{pos_value(pos)} at head dim {FA_HD}")
        rope_args = (*new_kv, cos_sin, np.int32(bool(neox)))
    n = n_head * FA_HD
    if q8 is not None:
        if out is not None:
            raise ValueError("decode_attention: one output, f32 (out) or q8_1 (q8)")
        for a, nm, shape, dt in zip(q8, "qds", ((1, n), (1, n // 32), (1, n // 32)),
                                    (cp.int8, cp.float32, cp.float32)):
            check(a, f"decode_attention q8 {nm}", dt, shape)
        outs = (NULL, *q8)
    else:
        out = out_array(out, (1, n), "decode_attention out", align16=True)
        outs = (out, NULL, NULL, NULL)
    short = decode_short(pos_value(pos)) if short is None else short
    if short:
        if not decode_short(pos_value(pos)):
            raise ValueError(f"decode_attention: position {pos_value(pos)} is past the one-launch "
                             f"path's {DEC_SHORT_KEYS} keys")
        _decode_short_kernel(cp.cuda.Device().id)(
            (n_kv,), (K["DEC_SHORT_SPLITS"] * 32 * K["DEC_WARPS"],),
            (q, k_cache, v_cache, *outs, np.int32(n_head), np.int32(n_kv), np.int32(n_ctx),
             *pos_args(pos), np.float32(_SCALE_LOG2), *rope_args), shared_mem=_DEC_SHORT_SMEM)
        return out if q8 is None else q8
    n_split = blocks_1d(n_ctx, K["DEC_CHUNK"])                          # the whole cache
    part = cp.empty((n_head, n_split, FA_HD + 2), cp.float32)           # (n_head, splits, 130)
    kernel("decode_attn.cu", "attn_decode_f16")(
        (n_kv, n_split), (32 * K["DEC_WARPS"],),
        (q, k_cache, v_cache, part, np.int32(n_head), np.int32(n_kv), np.int32(n_split), *pos_args(pos),
         np.float32(_SCALE_LOG2), *rope_args))
    kernel("decode_attn.cu", "attn_decode_combine")((n_head,), (FA_HD,),
                                                    (part, *outs, np.int32(n_split), *pos_args(pos)))
    return out if q8 is None else q8


def rope_store_kv_f16(q, k, v, k_cache, v_cache, cos_sin, pos, neox: bool, q_out=None,
                      biases=(None, None, None)):
    """q (T, n_head, hd), k, v (T, n_kv, hd) f32 at positions pos.. (an int or a
    launch.DevicePos): rotates q into q_out (f32, or f16: the flash attention's
    operand), and k, then stores k and v into rows pos..pos+T-1 of one layer's f16
    caches (n_ctx, n_kv, hd) -> q_out. q, k and v may be column blocks of one
    wider (T, n) matrix (each token's heads packed, its rows further apart; k and v
    the same row stride). biases: the q/k/v projections' biases (n_head*hd,),
    (n_kv*hd,), (n_kv*hd,) or None, added first. The values of the bias adds,
    ops.rope (q and k), store_kv_f16 and cast_f16, bit for bit, in one launch.
    hd a multiple of 8 and every row 16-byte aligned (the kernel moves 16-byte vectors)."""
    if getattr(q, "ndim", 0) != 3:
        raise ValueError(f"rope_store_kv_f16 q: expected (T, n_head, hd), got {getattr(q, 'shape', q)}")
    T, n_head, hd = q.shape
    ldq = check_rows(q, "rope_store_kv_f16 q", cp.float32, q.shape)
    check(k_cache, "rope_store_kv_f16 k_cache", cp.float16, ndim=3, align16=True)
    n_ctx, n_kv, _ = k_cache.shape
    check(v_cache, "rope_store_kv_f16 v_cache", cp.float16, (n_ctx, n_kv, hd), align16=True)
    ldkv = check_rows(k, "rope_store_kv_f16 k", cp.float32, (T, n_kv, hd))
    if check_rows(v, "rope_store_kv_f16 v", cp.float32, (T, n_kv, hd)) != ldkv:
        raise ValueError(f"rope_store_kv_f16: k and v rows of different strides ({k.strides}, {v.strides})")
    check(cos_sin, "rope_store_kv_f16 cos_sin", cp.float32, ndim=3, align16=True)
    if hd % 8 or cos_sin.shape[1:] != (hd // 2, 2):
        raise ValueError(f"rope_store_kv_f16: table {cos_sin.shape} does not fit head dim {hd}")
    pos0 = pos_value(pos)
    if pos0 < 0 or pos0 + T > min(n_ctx, cos_sin.shape[0]):
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
             np.int32(hd), np.int64(ldq), np.int64(ldkv), *pos_args(pos), np.int32(bool(neox))))
    return q_out


def attend_f16(q, k_cache, v_cache, pos, out=None, q16=None, wgmma: bool = True):
    """q (T, n_head, 128) f32 over one layer's f16 caches holding positions
    0..pos+T-1 -> (T, n_head*128) f32. One row (decode) reads q in f32
    (decode_attention; pos may be a launch.DevicePos); longer prompts round q into
    the f16 scratch q16 (>= T*n_head*128) for the tensor-core flash_attention."""
    if q.shape[0] == 1:
        return decode_attention(q, k_cache, v_cache, pos, out)
    if isinstance(pos, DevicePos):
        raise ValueError("attend_f16: a device position is for one-row (decode) steps")
    qh = cast_f16(q, scratch_view(q16, q.shape, "attend_f16 q16", cp.float16))   # (T, n_head, 128)
    return flash_attention(qh, k_cache, v_cache, pos, out, wgmma)


def attention_f16(q, k, v, k_cache, v_cache, pos, out=None, q16=None, wgmma: bool = True):
    """q (T, n_head, 128), k/v (T, n_kv, 128) f32: stores k/v into the f16 caches at
    pos.., then attend_f16 -> (T, n_head*128) f32."""
    store_kv_f16(k, v, k_cache, v_cache, pos)
    return attend_f16(q, k_cache, v_cache, pos, out, q16, wgmma)
