"""The decode (one-row) matvecs on q8_1 activations, kernels/matvec.cu:

    matvecs     up to three weights of one type that read the same x, one launch:
                y_i = W_i x [+ bias_i] [+ res_i]  (q/k/v, gate/up; the residual add
                of o and down)
    matvec      one weight (the same kernel)

x comes as q8_1 (int8.quantize_q8_1, rmsnorm_q8_1 or swiglu_q8_1). Weights: q4_K as
stored, q6_K padded, the 32-element group types (int8.Q32_TYPES) as stored.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from .int8 import BLOCK_BYTES, QK_K, Q32_TYPES, q32_row_bytes
from .launch import NULL, blocks_1d, check, cp, kernel, or_null, out_array
from .nvrtc import K

MV_TYPES = (QT.Q4_K, QT.Q6_K) + Q32_TYPES
MAX_SEGMENTS = 3                              # weights per matvecs launch
ROWS_PER_BLOCK = K["MV_WARPS"] * K["MV_RPW"]
_INSTANCES = tuple(f"matvec<{int(t)}>" for t in MV_TYPES)


def _kernel(qtype):
    return kernel("matvec.cu", f"matvec<{int(QT(qtype))}>", _INSTANCES)


def _row_bytes(qtype, n: int) -> int:
    return n // QK_K * BLOCK_BYTES[qtype] if qtype in BLOCK_BYTES else q32_row_bytes(qtype, n)


def _check_x(what: str, qtype, xq, xd, xs) -> int:
    """q8_1 x (1, K) -> K (a whole number of the type's blocks)"""
    if qtype not in MV_TYPES:
        raise ValueError(f"{what}: no matvec for {QT(qtype).name}")
    check(xq, f"{what} xq", cp.int8, ndim=2, align16=True)
    n = xq.shape[1]
    block = GGML_QUANT_SIZES[qtype][0]
    if xq.shape[0] != 1 or n % block:
        raise ValueError(f"{what}: x has shape {xq.shape}, expected (1, K), K a multiple of {block}")
    check(xd, f"{what} xd", cp.float32, (1, n // 32))
    check(xs, f"{what} xs", cp.float32, (1, n // 32))
    return n


def matvecs(qtype, xq, xd, xs, segments) -> list:
    """segments: up to three (w, od, bias, res, y) of weights of type qtype, w (od, K)
    device bytes; bias (od,) or None; res (1, od) or None (added last: the residual
    stream); y (1, od) or None (allocated) -> [y (1, od) f32 each], one launch."""
    qtype = QT(qtype)
    n = _check_x("matvecs", qtype, xq, xd, xs)
    if not 1 <= len(segments) <= MAX_SEGMENTS:
        raise ValueError(f"matvecs: {len(segments)} weights, 1..{MAX_SEGMENTS} per launch")
    args, ys, blocks = [], [], 0
    for i, (w, od, bias, res, y) in enumerate(segments):
        check(w, f"matvecs w{i}", cp.uint8, (od, _row_bytes(qtype, n)), align16=True)
        if bias is not None:
            check(bias, f"matvecs bias{i}", cp.float32, (od,))
        if res is not None:
            check(res, f"matvecs res{i}", cp.float32, (1, od))
        y = out_array(y, (1, od), f"matvecs y{i}")                        # (1, od)
        args += [w, or_null(bias), or_null(res), y, np.int32(od)]
        ys.append(y)
        blocks += blocks_1d(od, ROWS_PER_BLOCK)
    args += [NULL, NULL, NULL, NULL, np.int32(0)] * (MAX_SEGMENTS - len(segments))
    if blocks:
        _kernel(qtype)((blocks,), (K["MV_WARPS"] * 32,),
                                 (xq, xd, xs, np.int32(n), *args))
    return ys


def matvec(qtype, xq, xd, xs, w, od: int, bias=None, y=None, res=None):
    """q8_1 x (1, K) @ W (od, K)^T [+ bias] [+ res] -> y (1, od) f32"""
    return matvecs(qtype, xq, xd, xs, [(w, od, bias, res, y)])[0]
