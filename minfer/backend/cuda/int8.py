"""Kernels on quantized weights that read the blocks as stored, one wrapper each:

    quantize_q8_1  kernels/quantize.cu  x f32 (T, K) -> q8_1 blocks of 32 (int8 q, scale d, sum s)
    mmq_q4k        kernels/mmq.cu       q8_1 x @ q4_K W^T on int8 tensor cores (mma m16n8k16)
    mmq_q6k        kernels/mmq.cu       q8_1 x @ q6_K W^T; with a W_exp plane, B is staged
                                        by cp.async from the plane (EXP=true), else the
                                        padded blocks are expanded in the kernel (EXP=false)
    rmsnorm_q8_1   kernels/norm.cu      rmsnorm whose output is written as q8_1 (a decode
                                        step's matvec operand: no f32 round trip)
    swiglu_q8_1    kernels/quantize.cu  silu(gate) * up written as q8_1 (the same for the
                                        down projection)
    dequant_rows   kernels/dequant.cu   selected rows of a table (the embedding), bit-identical
                                        to minfer.quants.dequantize_rows
    dequant32_rows kernels/quants32.cu  the same for the types read in 32-element groups
                                        (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q5_K), one template
                                        over a per-type group decoder (q32_decode.cuh)
The decode matvecs on q8_1 activations are in matvec.py.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from ...errors import MinferError
from .launch import blocks_1d, check, cp, kernel, or_null, out_array
from .nvrtc import K

QK_K = K["QK_K"]
MMQ_BM, MMQ_BN, MMQ_THREADS, MMQ_KDR = K["MMQ_BM"], K["MMQ_BN"], K["MMQ_THREADS"], K["MMQ_KDR"]
_MMQ = (f"mmq_q4k<{MMQ_KDR}>", f"mmq_q6k_bt<{MMQ_KDR}, true>", f"mmq_q6k_bt<{MMQ_KDR}, false>")

# the types the int8 MMQ GEMMs take (every other type's GEMMs run on the f16 engine)
MMQ_TYPES = (QT.Q4_K, QT.Q6_K)

# device bytes of one 256-element super-block of a weight row, as registered
BLOCK_BYTES = {QT.Q4_K: K["Q4K_BYTES"], QT.Q6_K: K["Q6K_PADDED"]}

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

# table type -> its row-dequantization kernel (the embedding lookup)
ROW_KERNELS = {QT.Q4_K: "dequant_rows_q4k", QT.Q6_K: "dequant_rows_q6k",
               QT.Q8_0: "dequant_rows_q8_0", QT.F16: "dequant_rows_f16",
               QT.F32: "dequant_rows_f32"}


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


def rmsnorm_q8_1(x, w, eps: float, q=None, d=None, s=None):
    """x f32 (T, K), w (K,) -> rmsnorm(x) * w as q8_1: q int8 (T, K), d, s f32 (T, K/32),
    the values of ops.rmsnorm then quantize_q8_1, bit for bit, in one launch"""
    check(x, "rmsnorm_q8_1 x", cp.float32, ndim=2)
    T, n = x.shape
    check(w, "rmsnorm_q8_1 w", cp.float32, (n,))
    q, d, s = _q8_1_out("rmsnorm_q8_1", T, n, q, d, s)
    if T:
        kernel("norm.cu", "rmsnorm_q8_1")((T,), (K["NORM_THREADS"],),
                                          (x, w, q, d, s, np.int32(n), np.float32(eps)))
    return q, d, s


def swiglu_q8_1(gate, up, q=None, d=None, s=None):
    """gate, up f32 (T, n) -> silu(gate) * up as q8_1: q int8 (T, n), d, s f32 (T, n/32),
    the values of ops.swiglu then quantize_q8_1, bit for bit, in one launch"""
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
