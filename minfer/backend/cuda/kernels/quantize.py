"""kernels/quantize.cu: f32 activations -> q8_1 blocks of 32 (int8 q, scale d, sum s),
the operand of the decode matvecs and the int8 MMQ.

    quantize_q8_1  x f32 (T, K) -> q8_1
    swiglu_q8_1    silu(gate) * up written as q8_1 (the down projection's operand: no
                   f32 round trip)
"""
from __future__ import annotations

import numpy as np

from ..launch import blocks_1d, check, cp, kernel, out_array
from ..nvrtc import K


def _q8_1_out(what: str, T: int, n: int, q, d, s):
    """The q8_1 form of a (T, n) f32 activation: q int8 (T, n), d and s f32 (T, n/32),
    allocated, or checked when given; n must be a whole number of blocks of 32."""
    if n % K["QK8_1"]:
        raise ValueError(f"{what}: shape {(T, n)}, the last dimension must be a multiple of 32")
    nb = n // K["QK8_1"]
    return (out_array(q, (T, n), f"{what} q", cp.int8),                  # (T, n)
            out_array(d, (T, nb), f"{what} d"),                           # (T, n/32)
            out_array(s, (T, nb), f"{what} s"))                           # (T, n/32)


def quantize_q8_1(x, q=None, d=None, s=None):
    """x f32 (T, K) -> q int8 (T, K), d f32 (T, K/32), s f32 (T, K/32)"""
    check(x, "quantize_q8_1 x", cp.float32, ndim=2)
    T, n = x.shape
    q, d, s = _q8_1_out("quantize_q8_1", T, n, q, d, s)
    nb = n // K["QK8_1"]
    if T * nb:
        warps = K["THREADS_1D"] // 32                                 # one warp per block of 32
        kernel("quantize.cu", "quantize_q8_1")((blocks_1d(T * nb, warps),), (K["THREADS_1D"],),
                                               (x, q, d, s, np.int64(T * nb)))
    return q, d, s


def swiglu_q8_1(gate, up, q=None, d=None, s=None):
    """gate, up f32 (T, n) -> silu(gate) * up as q8_1: q int8 (T, n), d, s f32 (T, n/32),
    the values of elementwise.swiglu then quantize_q8_1, bit for bit, in one launch"""
    check(gate, "swiglu_q8_1 gate", cp.float32, ndim=2)
    T, n = gate.shape
    check(up, "swiglu_q8_1 up", cp.float32, (T, n))
    q, d, s = _q8_1_out("swiglu_q8_1", T, n, q, d, s)
    nb = n // K["QK8_1"]
    if T * nb:
        warps = K["THREADS_1D"] // 32
        kernel("quantize.cu", "swiglu_q8_1")((blocks_1d(T * nb, warps),), (K["THREADS_1D"],),
                                             (gate, up, q, d, s, np.int64(T * nb)))
    return q, d, s
