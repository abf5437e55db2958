"""kernels/norm.cu: RMSNorm, one block per row.

    rmsnorm       x (T, d) -> rmsnorm(x) * w, f32, or rounded once to f16 (the f16
                  engine's GEMM operand, written directly)
    rmsnorm_q8_1  the same written as q8_1 (a decode step's matvec operand)
"""
from __future__ import annotations

import numpy as np

from ..launch import check, cp, kernel, out_array
from ..nvrtc import K
from .quantize import _q8_1_out


def rmsnorm(x, w, eps: float, out=None, dtype=None):
    """x (T, d), w (d,) -> x / sqrt(mean(x^2) + eps) * w  (T, d), f32; dtype=float16
    rounds each value once to f16 (the f16 engine's operand, written directly)"""
    check(x, "rmsnorm x", cp.float32, ndim=2)
    T, d = x.shape
    check(w, "rmsnorm w", cp.float32, (d,))
    half = dtype is not None and np.dtype(dtype) == np.float16
    y = out_array(out, (T, d), "rmsnorm out", cp.float16 if half else None)    # (T, d)
    if T:
        kernel("norm.cu", "rmsnorm_f16" if half else "rmsnorm_f32")(
            (T,), (K["NORM_F16_THREADS" if half else "NORM_THREADS"],), (x, w, y, np.int32(d), np.float32(eps)))
    return y


def rmsnorm_q8_1(x, w, eps: float, q=None, d=None, s=None):
    """x f32 (T, K), w (K,) -> rmsnorm(x) * w as q8_1: q int8 (T, K), d, s f32 (T, K/32),
    the values of rmsnorm then quantize_q8_1, bit for bit, in one launch"""
    check(x, "rmsnorm_q8_1 x", cp.float32, ndim=2)
    T, n = x.shape
    check(w, "rmsnorm_q8_1 w", cp.float32, (n,))
    q, d, s = _q8_1_out("rmsnorm_q8_1", T, n, q, d, s)
    if T:
        kernel("norm.cu", "rmsnorm_q8_1")((T,), (K["NORM_THREADS"],),
                                          (x, w, q, d, s, np.int32(n), np.float32(eps)))
    return q, d, s
