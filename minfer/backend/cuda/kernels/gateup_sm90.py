"""kernels/gateup_sm90.cu: the gate/up projections and SwiGLU of a prompt's FFN in
one Hopper kernel, in two forms:

    gateup_swiglu_q4k   xh f16 (T, K) with gate, up q4_K (d_ff, K) as stored
                        -> h = f16(silu(f16(xh G^T)) * f16(xh U^T)) f16 (T, d_ff)
    gateup_swiglu_f16   the same from gate and up already f16, rows [G; U] of one
                        (2 d_ff, K) array; optionally dequantizes another pair of
                        q4_K weights (the next layer's gate and up) into another
                        such array while it runs
    fits                can the kernels take these weights on this GPU?
    tiling              their whole (256-token) and half tiles for a grid of T tokens

Numerics: the f16 engine's (dequant_f16.py: each weight the f16 of its dequantized value,
products exact, f32 sums, the GEMM's output rounded to f16, swiglu_f16's
expression), so h has the bits of dequantize + cuBLAS + swiglu_f16 wherever cuBLAS
sums each output's 16-wide products in k order (tests/gpu/test_gateup.py).
paths.py (gateup_kernel) decides when each runs.
"""
from __future__ import annotations

import functools

import numpy as np
from gguf import GGMLQuantizationType as QT

from .. import dependent, tma
from ..launch import NULL, check, cp, device_cc, kernel, scratch_view, sm_count
from ..nvrtc import ARCH_SPECIFIC, K

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
    """(whole tiles, work units) of the kernels for T tokens on a GPU of n_sm SMs (one
    block an SM). Their tiles are 64 features x 256 tokens and take about the same
    time, so the units run in waves of n_sm; a last wave of r <= n_sm / 2 tiles would
    leave most SMs idle while each of its tiles runs its whole time, so those r tiles
    run as 2r half tiles (128 tokens: the same conversions, half the products) on
    twice as many SMs. Units = whole + 2 * (tiles - whole): the q4_K kernel's blocks,
    the units the f16 kernel's persistent blocks walk. Pure."""
    tiles = d_ff // FEATURES * -(-T // TOKENS)
    last = tiles % n_sm
    whole = tiles - last if 0 < 2 * last <= n_sm else tiles
    return whole, whole + 2 * (tiles - whole)


@functools.lru_cache(maxsize=None)
def _kernel(device_id: int, name: str = "gateup_swiglu_q4k"):
    """One of the file's kernels, opted in (once per device) to its > 48 KB of dynamic
    shared memory."""
    fn = kernel(_FILE, name)
    fn.fn.max_dynamic_shared_size_bytes = _SMEM[name]
    return fn


_SMEM = {"gateup_swiglu_q4k": K["GU_SMEM"], "gateup_swiglu_f16": K["GU16_SMEM"]}


def _x_maps(xh):
    """X's maps for whole and half tiles, made once per prompt length (and scratch)."""
    return tma.device_maps(tuple(tma.map_2d(xh, rows, 64, tma.SWIZZLE_128B)
                                 for rows in (TOKENS, TOKENS // 2)))


def _checked(name: str, xh, d_ff: int, out) -> tuple:
    """Both wrappers' checks: the shape fits the kernels on this GPU, xh f16 (T, n_in)
    -> (T, n_in, h f16 (T, d_ff), into out when given)."""
    T, n_in = xh.shape
    if not fits((QT.Q4_K, QT.Q4_K), d_ff, n_in, device_cc()):
        raise ValueError(f"{name}: ({d_ff}, {n_in}) weights need d_ff % {FEATURES} == 0, "
                         f"n_in % {QK_K} == 0 and a compute capability 9.0 GPU")
    check(xh, "gateup x16", cp.float16, align16=True)
    h = check(scratch_view(out, (T, d_ff), "gateup out", cp.float16), "gateup out", cp.float16,
              align16=True)                                                       # (T, d_ff)
    return T, n_in, h


def _check_q4k(raw, what: str, d_ff: int, n_in: int) -> None:
    """raw: a q4_K weight (d_ff, n_in) as stored, uint8 (d_ff, n_in/256*144)."""
    check(raw, what, cp.uint8, (d_ff, n_in // QK_K * Q4K_BYTES), align16=True)


def gateup_swiglu_q4k(xh, gate_raw, up_raw, d_ff: int, out=None):
    """xh f16 (T, n_in), gate_raw / up_raw uint8 (d_ff, n_in/256*144) q4_K blocks as
    stored -> h f16 (T, d_ff) (into out when given)."""
    T, n_in, h = _checked("gateup_swiglu_q4k", xh, d_ff, out)                      # h (T, d_ff)
    for raw, what in ((gate_raw, "gate"), (up_raw, "up")):
        _check_q4k(raw, f"gateup {what}", d_ff, n_in)
    if T == 0:
        return h
    xmaps = _x_maps(xh)
    wmaps = tma.device_maps(tuple(tma.map_2d(raw, FEATURES, box, tma.SWIZZLE_NONE)
                                  for raw in (gate_raw, up_raw) for box in (16, 32)))
    dev = cp.cuda.Device().id
    whole, blocks = tiling(T, d_ff, sm_count())
    _kernel(dev)((blocks,), (K["GU_THREADS"],),
                 (xmaps, wmaps, h, np.int32(T), np.int32(d_ff), np.int32(n_in), np.int32(whole)),
                 shared_mem=K["GU_SMEM"])
    return h


def gateup_swiglu_f16(xh, w16, d_ff: int, prefetch=None, out=None):
    """xh f16 (T, n_in), w16 f16 (2 d_ff, n_in): gate's rows, then up's, as
    dequant_f16 writes them -> h f16 (T, d_ff) (into out when given), the bits of
    gateup_swiglu_q4k on the weights w16 was dequantized from. prefetch: None, or
    (gate_raw, up_raw, out16): two more q4_K weights (d_ff, n_in) as stored, which the
    launch dequantizes into out16 (f16, 2 d_ff x n_in elements, not w16's memory) as
    dequant_f16 would."""
    T, n_in, h = _checked("gateup_swiglu_f16", xh, d_ff, out)                      # h (T, d_ff)
    check(w16, "gateup w16", cp.float16, (2 * d_ff, n_in), align16=True)
    gate_a, up_a, out_a, groups = NULL, NULL, NULL, 0
    if prefetch is not None:
        gate_a, up_a, out_a = prefetch
        for raw, what in ((gate_a, "gate"), (up_a, "up")):
            _check_q4k(raw, f"gateup prefetch {what}", d_ff, n_in)
        out_a = check(scratch_view(out_a, (2 * d_ff, n_in), "gateup prefetch out", cp.float16),
                      "gateup prefetch out", cp.float16, align16=True)               # (2 d_ff, n_in)
        a0, w0 = out_a.data.ptr, w16.data.ptr
        if a0 < w0 + w16.nbytes and w0 < a0 + out_a.nbytes:
            raise ValueError("gateup_swiglu_f16: the next weights' f16 array overlaps this launch's w16")
        groups = d_ff * n_in // 16
    if T == 0:
        raise ValueError("gateup_swiglu_f16: no tokens")
    wmap = tma.device_maps((tma.map_2d(w16, FEATURES, 64, tma.SWIZZLE_128B),))
    dev = cp.cuda.Device().id
    n_sm = sm_count()
    whole, units = tiling(T, d_ff, n_sm)
    # persistent: a block an SM walks the units (all SMs while there is a next pair:
    # each dequantizes its share of it)
    grid = n_sm if groups else min(units, n_sm)
    _kernel(dev, "gateup_swiglu_f16")(
        (grid,), (K["GU_THREADS"],),
        (_x_maps(xh), wmap, h, np.int32(T), np.int32(d_ff), np.int32(n_in), np.int32(whole), np.int32(units),
         gate_a, up_a, out_a, np.int64(groups)), shared_mem=K["GU16_SMEM"])
    # its blocks read w16 and write the next pair until each exits: a dequantization
    # right after it must not start before its wait
    dependent.scratch_launch()
    return h
