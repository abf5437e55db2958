"""The gate/up projections and SwiGLU of a prompt's FFN in one Hopper kernel that
reads the q4_K blocks (kernels/gateup_sm90.cu):

    gateup_swiglu_q4k   xh f16 (T, K) with gate, up q4_K (d_ff, K) as stored
                        -> h = f16(silu(f16(xh G^T)) * f16(xh U^T)) f16 (T, d_ff)
    fits                can the kernel take these weights on this GPU?
    tiling              its whole (256-token) and half tiles for a grid of T tokens

Numerics: the f16 engine's (f16.py: each weight the f16 of its dequantized value,
products exact, f32 sums, the GEMM's output rounded to f16, swiglu_f16's
expression), so h has the bits of dequantize + cuBLAS + swiglu_f16 wherever cuBLAS
sums each output's 16-wide products in k order (tests/gpu/test_gateup.py).
gemm.py (gateup_fused) decides when it runs.
"""
from __future__ import annotations

import functools

import numpy as np
from gguf import GGMLQuantizationType as QT

from . import tma
from .launch import check, cp, device_cc, kernel, scratch_view
from .nvrtc import ARCH_SPECIFIC, K

_FILE = "gateup_sm90.cu"
QK_K, Q4K_BYTES = K["QK_K"], K["Q4K_BYTES"]
TOKENS, FEATURES = K["GU_TOKENS"], K["GU_FEATURES"]


def fits(qtypes, d_ff: int, n_in: int, cc: tuple[int, int]) -> bool:
    """Do gate and up of these types and shape fit the kernel on a GPU of compute
    capability cc? (q4_K both, d_ff a multiple of its 64 features a block, whole
    super-blocks, cc 9.0: the sm_90a instructions exist there alone.) Pure."""
    return (all(QT(q) == QT.Q4_K for q in qtypes) and d_ff > 0 and d_ff % FEATURES == 0
            and n_in > 0 and n_in % QK_K == 0 and tuple(cc) == ARCH_SPECIFIC[_FILE][1])


def tiling(T: int, d_ff: int, n_sm: int) -> tuple[int, int]:
    """(whole tiles, blocks) of the kernel's grid for T tokens on a GPU of n_sm SMs (one
    block an SM). Its tiles are 64 features x 256 tokens and take about the same time,
    so the grid runs in waves of n_sm; a last wave of r <= n_sm / 2 tiles would leave
    most SMs idle while each of its tiles runs its whole time, so those r tiles run
    as 2r half tiles (128 tokens: the same conversions, half the products) on twice
    as many SMs. Blocks = whole + 2 * (tiles - whole). Pure."""
    tiles = d_ff // FEATURES * -(-T // TOKENS)
    last = tiles % n_sm
    whole = tiles - last if 0 < 2 * last <= n_sm else tiles
    return whole, whole + 2 * (tiles - whole)


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    """The device's SM count (tiling's n_sm)."""
    return int(cp.cuda.Device(device_id).attributes["MultiProcessorCount"])


@functools.lru_cache(maxsize=None)
def _kernel(device_id: int):
    """gateup_swiglu_q4k, opted in (once per device) to its > 48 KB of dynamic shared
    memory."""
    fn = kernel(_FILE, "gateup_swiglu_q4k")
    fn.fn.max_dynamic_shared_size_bytes = K["GU_SMEM"]
    return fn


def gateup_swiglu_q4k(xh, gate_raw, up_raw, d_ff: int, out=None):
    """xh f16 (T, n_in), gate_raw / up_raw uint8 (d_ff, n_in/256*144) q4_K blocks as
    stored -> h f16 (T, d_ff) (into out when given)."""
    T, n_in = xh.shape
    if not fits((QT.Q4_K, QT.Q4_K), d_ff, n_in, device_cc()):
        raise ValueError(f"gateup_swiglu_q4k: ({d_ff}, {n_in}) weights need d_ff % {FEATURES} == 0, "
                         f"n_in % {QK_K} == 0 and a compute capability 9.0 GPU")
    check(xh, "gateup x16", cp.float16, align16=True)
    for raw, what in ((gate_raw, "gate"), (up_raw, "up")):
        check(raw, f"gateup {what}", cp.uint8, (d_ff, n_in // QK_K * Q4K_BYTES), align16=True)
    h = check(scratch_view(out, (T, d_ff), "gateup out", cp.float16), "gateup out", cp.float16,
              align16=True)                                                       # (T, d_ff)
    if T == 0:
        return h
    # X's maps (whole and half tiles) are made once per prompt length (and scratch),
    # the weights' once per layer
    xmaps = tma.device_maps(tuple(tma.map_2d(xh, rows, 64, tma.SWIZZLE_128B)
                                  for rows in (TOKENS, TOKENS // 2)))
    wmaps = tma.device_maps(tuple(tma.map_2d(raw, FEATURES, box, tma.SWIZZLE_NONE)
                                  for raw in (gate_raw, up_raw) for box in (16, 32)))
    dev = cp.cuda.Device().id
    whole, blocks = tiling(T, d_ff, _sm_count(dev))
    _kernel(dev)((blocks,), (K["GU_THREADS"],),
                 (xmaps, wmaps, h, np.int32(T), np.int32(d_ff), np.int32(n_in), np.int32(whole)),
                 shared_mem=K["GU_SMEM"])
    return h
