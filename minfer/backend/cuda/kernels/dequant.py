"""kernels/dequant.cu: selected rows of a table (the embedding lookup) -> f32,
bit-identical to minfer.format.quants.dequantize_rows; the 32-element group types through
quants32.cu's rows kernel.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT

from ....errors import MinferError
from ..launch import blocks_1d, check, cp, kernel, out_array
from ..nvrtc import K
from .quants32 import Q32_TYPES, q32_kernel


# table type -> its row-dequantization kernel (the embedding lookup)
ROW_KERNELS = {QT.Q4_K: "dequant_rows_q4k", QT.Q6_K: "dequant_rows_q6k",
               QT.Q8_0: "dequant_rows_q8_0", QT.F16: "dequant_rows_f16",
               QT.F32: "dequant_rows_f32"}


def dequant_rows(qtype, w, n_cols: int, tokens, y=None):
    """rows `tokens` (int32 (T,) device) of table w -> y f32 (T, n_cols).
    w: q4_K uint8 as stored, q6_K uint8 padded, the Q32 types and q8_0 uint8 as stored,
    f16 uint16, f32 float32."""
    qtype = QT(qtype)
    if qtype not in ROW_KERNELS and qtype not in Q32_TYPES:
        raise MinferError(f"embedding rows of type {qtype.name} are not supported on the GPU")
    check(tokens, "dequant_rows tokens", cp.int32, ndim=1)
    T = tokens.shape[0]
    y = out_array(y, (T, n_cols), "dequant_rows y")                   # (T, n_cols)
    if not (T and n_cols):
        return y
    if qtype in ROW_KERNELS:
        kernel("dequant.cu", ROW_KERNELS[qtype])((blocks_1d(n_cols), T), (K["THREADS_1D"],),
                                                 (w, tokens, y, np.int32(n_cols)))
    else:                                                             # one thread per group of 32
        q32_kernel("dequant32_rows", qtype)((blocks_1d(n_cols // 32), T), (K["THREADS_1D"],),
                                            (w, tokens, y, np.int32(n_cols)))
    return y
