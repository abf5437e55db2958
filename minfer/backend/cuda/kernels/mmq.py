"""kernels/mmq.cu: q8_1 x @ W^T on int8 tensor cores (mma m16n8k16), reading the
weight blocks as stored.

    mmq_q4k   q4_K weights
    mmq_q6k   q6_K weights; with a W_exp plane, B is staged by cp.async from the plane
              (EXP=true), else the padded blocks are expanded in the kernel (EXP=false)
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT

from ..launch import blocks_1d, check, cp, kernel, or_null, out_array
from ..nvrtc import K


QK_K = K["QK_K"]
MMQ_BM, MMQ_BN, MMQ_THREADS, MMQ_KDR = K["MMQ_BM"], K["MMQ_BN"], K["MMQ_THREADS"], K["MMQ_KDR"]
_MMQ = (f"mmq_q4k<{MMQ_KDR}>", f"mmq_q6k_bt<{MMQ_KDR}, true>", f"mmq_q6k_bt<{MMQ_KDR}, false>")
# the types the int8 MMQ GEMMs take (every other type's GEMMs run on the f16 engine)
MMQ_TYPES = (QT.Q4_K, QT.Q6_K)
# device bytes of one 256-element super-block of a weight row, as registered
BLOCK_BYTES = {QT.Q4_K: K["Q4K_BYTES"], QT.Q6_K: K["Q6K_PADDED"]}


def _mmq(name: str, xq, xd, extra: tuple, w, qtype, od: int, bias, y):
    """The launch shared by the two MMQ kernels: checks x (q8_1), W's bytes, bias, y."""
    check(xq, "mmq xq", cp.int8, ndim=2)
    T, n = xq.shape
    if n % QK_K:
        raise ValueError(f"mmq: K={n} is not a multiple of {QK_K}")
    check(xd, "mmq xd", cp.float32, (T, n // 32))
    check(w, f"{name} w", cp.uint8, (od, n // QK_K * BLOCK_BYTES[qtype]))
    if bias is not None:
        check(bias, "mmq bias", cp.float32, (od,))
    y = out_array(y, (T, od), "mmq y")                                # (T, od)
    if T and od:
        kernel("mmq.cu", name, _MMQ)((blocks_1d(od, MMQ_BN), blocks_1d(T, MMQ_BM)), (MMQ_THREADS,),
                                     (xq, xd) + extra + (or_null(bias), y,
                                                         np.int32(T), np.int32(od), np.int32(n)))
    return y


def mmq_q4k(xq, xd, xs, w, od: int, bias=None, y=None):
    """q8_1 x (T, K) @ q4_K W (od, K)^T [+ bias] -> y (T, od) f32.
    w: uint8 (od, K/256*144) device, block_q4_K rows as stored; xs: the q8_1 sums."""
    check(xs, "mmq xs", cp.float32, xd.shape)
    return _mmq(_MMQ[0], xq, xd, (xs, w), w, QT.Q4_K, od, bias, y)


def mmq_q6k(xq, xd, w_padded, plane, od: int, bias=None, y=None):
    """q8_1 x (T, K) @ q6_K W (od, K)^T [+ bias] -> y (T, od) f32.
    w_padded: uint8 (od, K/256*224) device; plane: int8 (od, K) W_exp -> EXP=true
    (cp.async B staging), None -> EXP=false (in-kernel expansion)."""
    if plane is not None:
        check(plane, "mmq_q6k W_exp plane", cp.int8, (od, xq.shape[1]))
    return _mmq(_MMQ[1] if plane is not None else _MMQ[2], xq, xd, (w_padded, or_null(plane)),
                w_padded, QT.Q6_K, od, bias, y)
