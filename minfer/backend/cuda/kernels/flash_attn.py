"""kernels/flash_attn.cu and kernels/flash_attn_sm90.cu: a prompt's attention over
the f16 KV cache (head dim 128) on tensor cores: mma.m16n8k16 on any GPU with f16
tensor cores, wgmma on Hopper (flash_kind says which runs). Q, K, V and the
probabilities are rounded to f16; scores, the softmax and the accumulators are f32.

    flash_attention  q16 over a filled cache -> (T, n_head*128) f32, or f16 (the o
                     projection's operand)
    attend_f16       flash_attention (T > 1) or decode_attention (T == 1)
    attention_f16    store_kv_f16, then attend_f16
"""
from __future__ import annotations

import functools

import numpy as np

from ..launch import DevicePos, NULL, blocks_1d, check, cp, device_cc, kernel, out_array, scratch_view
from ..nvrtc import ARCH_SPECIFIC, K
from .attention import _check_heads
from .decode_attn import FA_HD, _SCALE_LOG2, decode_attention, store_kv_f16
from .dequant_f16 import cast_f16

# flash_kind -> the kernel that runs it (the name its launches are counted under)
KERNEL = {"wgmma": "flash_attn_f16_sm90", "mma": "flash_attn_f16"}


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
        fn, threads, smem = kernel("flash_attn_sm90.cu", KERNEL[kind]), 128 * K["FA90_WG"], K["FA90_SMEM"]
    else:
        fn, threads, smem = kernel("flash_attn.cu", KERNEL[kind]), 32 * K["FA_WARPS"], K["FA_SMEM"]
    fn.fn.max_dynamic_shared_size_bytes = smem
    return fn, threads, smem


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
