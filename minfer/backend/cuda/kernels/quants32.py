"""kernels/quants32.cu: the weight types read in 32-element groups (Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q5_K), stored as in the file; one template per job over a
per-type group decoder (q32_decode.cuh), the template argument the ggml type id.

    dequant32_f16   W (n_out, n_in) -> f16, one thread per group (the f16 engine's operand)
    q32_kernel      the instantiation of a quants32.cu template for a type (dequant.py's
                    rows kernel uses it too)
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from ..launch import blocks_1d, check, cp, kernel, scratch_view
from ..nvrtc import K

# types read in 32-element groups, stored as in the file (kernels/quants32.cu; the
# template argument is the ggml type id)
Q32_TYPES = (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q5_K)
Q32_INSTANCES = tuple(f"{k}<{int(t)}>" for t in Q32_TYPES
                      for k in ("dequant32_f16", "dequant32_rows"))


def q32_kernel(name: str, qtype):
    """The instantiation of a quants32.cu template for qtype."""
    return kernel("quants32.cu", f"{name}<{int(QT(qtype))}>", Q32_INSTANCES)


def q32_row_bytes(qtype, n: int) -> int:
    """Device bytes of one row of n elements of a Q32 type (as stored)."""
    bs, ts = GGML_QUANT_SIZES[QT(qtype)]
    return n // bs * ts


def dequant32_f16(raw, qtype, n_out: int, n_in: int, out=None):
    """dequant_f16 for the types read in 32-element groups (stored as in the file)."""
    bs = GGML_QUANT_SIZES[qtype][0]
    if n_out <= 0 or n_in <= 0 or n_in % bs:
        raise ValueError(f"dequant_f16 {qtype.name}: shape ({n_out}, {n_in}) needs n_in a positive "
                         f"multiple of {bs}")
    check(raw, f"dequant_f16 {qtype.name} raw", cp.uint8, size=n_out * q32_row_bytes(qtype, n_in))
    w16 = scratch_view(out, (n_out, n_in), "dequant_f16 out", cp.float16)          # (n_out, n_in)
    check(w16, "dequant_f16 out", cp.float16, align16=True)
    n_grp = n_out * n_in // 32
    q32_kernel("dequant32_f16", qtype)((blocks_1d(n_grp),), (K["THREADS_1D"],),
                                       (raw, w16, np.int64(n_grp)))
    return w16
