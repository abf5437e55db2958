"""The f16 engine of long prefills: tensor cores in f16, f32 accumulation.

    dequant_f16      kernels/dequant_f16.cu  q4_K (144-byte blocks), q6_K padded, or q6_K
                                             through its W_exp plane -> W16 (n_out, n_in) f16
    dequant_f16_many                         the same for several weights, up to three a launch
    cast_f16         kernels/dequant_f16.cu  f32 -> f16 (round to nearest even), 4 per thread
    swiglu_f16       kernels/dequant_f16.cu  silu(gate) * up on f16, computed in f32 (8 or 4
                                             elements a thread, by alignment)
    linear_f16_from  dequant_f16 + gemm_w16: xh f16 (T, n_in) @ W^T
    gemm_w16         cublas.gemm_f16 [+ bias] on an f16 weight (the scratch, or a kept copy)

Numerics: a dequantized weight is the f32 value of the NumPy reference rounded
once to f16 (the kernels equal np.float16(dequantize_rows(...)) bit for bit);
activations are rounded once to f16; the tensor cores multiply exactly and sum
in f32. Scratch (x16, w16) is passed in by the caller (gemm.py), allocated for
the longest prompt and the largest weight, so nothing here allocates when the
caller gives `out`.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from ...errors import MinferError
from . import dependent
from .cublas import gemm_f16
from .int8 import Q32_TYPES, q32_kernel, q32_row_bytes
from .launch import (MAX_GRID_Y, NULL, blocks_1d, check, check_rows, cp, kernel, launch_grid_stride,
                     or_null, scratch_view)
from .nvrtc import K

QK_K = K["QK_K"]
_PER_THREAD = 16                 # outputs per thread of the dequant kernels
MAX_SEGMENTS = K["DQ_SEGMENTS"]  # weights per dequant_f16_segments launch

# qtype -> (segment type, device bytes per 256-element super-block)
_DEQ = {QT.Q4_K: (K["DQ_Q4K"], K["Q4K_BYTES"]),        # blocks as stored
        QT.Q6_K: (K["DQ_Q6K"], K["Q6K_PADDED"])}       # padded 224-byte stride
F16_QTYPES = frozenset(_DEQ) | frozenset(Q32_TYPES)   # (Q32: quants32.cu, one thread per group)


def dequant_f16(raw, qtype, n_out: int, n_in: int, out=None, w_exp=None):
    """Quantized W (n_out, n_in) on the device -> W16 (n_out, n_in) f16.

    raw: uint8 device bytes, q4_K as stored or q6_K padded; w_exp (q6_K only): the
    W_exp plane, int8 (n_out, n_in) = (ql | qh<<4) - 32, read instead of ql/qh
    (the scales and d still come from the padded blocks). out: f16 scratch with
    >= n_out*n_in elements.
    """
    return dequant_f16_many([(raw, qtype, n_out, n_in, out, w_exp)])[0]


def dequant_f16_many(weights) -> list:
    """dequant_f16 for each (raw, qtype, n_out, n_in, out, w_exp) of `weights` ->
    their W16 arrays; runs of up to MAX_SEGMENTS k-quant weights share a launch
    (the same per-element work as one launch each)."""
    w16s, run = [], []
    for raw, qtype, n_out, n_in, out, w_exp in weights:
        qtype = QT(qtype)
        if qtype not in F16_QTYPES:
            raise MinferError(f"no f16 dequantizer for {qtype.name} (have: "
                              f"{', '.join(t.name for t in F16_QTYPES)})")
        if qtype in Q32_TYPES:
            w16s.append(_dequant32_f16(raw, qtype, n_out, n_in, out))
            continue
        seg = _segment(raw, qtype, n_out, n_in, out, w_exp)
        w16s.append(seg[2])
        run.append(seg)
        if len(run) == MAX_SEGMENTS:
            _launch_segments(run)
            run = []
    if run:
        _launch_segments(run)
    return w16s


def _segment(raw, qtype: QT, n_out: int, n_in: int, out, w_exp) -> tuple:
    """One k-quant weight's checked arguments -> (w, plane, W16, threads, type)."""
    if n_out <= 0 or n_in <= 0 or n_in % QK_K:
        raise ValueError(f"dequant_f16 {qtype.name}: shape ({n_out}, {n_in}) needs n_in a positive "
                         f"multiple of {QK_K}")
    seg_type, block_bytes = _DEQ[qtype]
    check(raw, f"dequant_f16 {qtype.name} raw", cp.uint8,
          size=n_out * (n_in // QK_K) * block_bytes, align16=True)
    w16 = scratch_view(out, (n_out, n_in), "dequant_f16 out", cp.float16)          # (n_out, n_in)
    check(w16, "dequant_f16 out", cp.float16, align16=True)
    if w_exp is not None:
        if qtype != QT.Q6_K:
            raise ValueError(f"dequant_f16: a W_exp plane belongs to q6_K, not {qtype.name}")
        check(w_exp, "dequant_f16 q6_K W_exp", cp.int8, size=n_out * n_in, align16=True)
        seg_type = K["DQ_Q6K_EXP"]
    return raw, or_null(w_exp), w16, n_out * n_in // _PER_THREAD, seg_type


def _launch_segments(segs) -> None:
    """One dequant_f16_segments launch over 1..MAX_SEGMENTS segments (_segment's)."""
    args, firsts, blocks = [], [], 0
    for raw, plane, w16, n_threads, seg_type in segs:
        firsts.append(blocks)
        blocks += blocks_1d(n_threads)
        args += [raw, plane, w16, np.int64(n_threads), np.int32(seg_type)]
    for _ in range(MAX_SEGMENTS - len(segs)):          # absent: no block reaches them
        firsts.append(blocks)
        args += [NULL, NULL, NULL, np.int64(0), np.int32(0)]
    # work before the wait where that is safe (dependent.early, dequant_f16.cu): the
    # scratch is written while the kernel before still finishes
    early = dependent.early()
    dependent.STATE.early_dequants += early
    kernel("dequant_f16.cu", "dequant_f16_segments")(
        (blocks,), (K["THREADS_1D"],), (*args, *(np.int32(f) for f in firsts[1:]), np.int32(early)))


def _dequant32_f16(raw, qtype, n_out: int, n_in: int, out=None):
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


def _by4(x, what: str) -> int:
    if x.size % 4:
        raise ValueError(f"{what}: {x.size} elements, need a multiple of 4")
    return x.size // 4


def cast_f16(x, out=None):
    """x f32 (any shape, size % 4 == 0) -> f16 of the same shape (round to nearest even)."""
    check(x, "cast_f16 x", cp.float32, align16=True)
    n4 = _by4(x, "cast_f16")
    y = check(scratch_view(out, x.shape, "cast_f16 out", cp.float16), "cast_f16 out",
              cp.float16, align16=True)
    launch_grid_stride("dequant_f16.cu", "cast_f32_f16", n4, (x, y))
    return y


def swiglu_f16(gate, up, out=None):
    """gate, up f16 (T, n), n % 4 == 0 -> silu(gate) * up, f16 (T, n) packed (f32 math).
    gate and up may be column blocks of one matrix (rows of the same stride, e.g. the
    grouped gate/up GEMM's output)."""
    if gate.ndim != 2 or gate.shape[1] % 4:
        raise ValueError(f"swiglu_f16: gate has shape {gate.shape}, expected (T, n), n % 4 == 0")
    ld = check_rows(gate, "swiglu_f16 gate", cp.float16, gate.shape)
    if check_rows(up, "swiglu_f16 up", cp.float16, gate.shape) != ld or ld % 4:
        raise ValueError(f"swiglu_f16: rows {gate.strides} / {up.strides} apart, expected one stride, "
                         f"a multiple of 4 elements")
    for a, what in ((gate, "gate"), (up, "up")):
        if a.data.ptr % 8:
            raise ValueError(f"swiglu_f16 {what}: device pointer {a.data.ptr:#x} is not 8-byte aligned")
    y = check(scratch_view(out, gate.shape, "swiglu_f16 out", cp.float16), "swiglu_f16 out",
              cp.float16, align16=True)
    # 8 elements a thread (16-byte accesses) where every row start allows it, else 4
    v = 8 if (gate.shape[1] % 8 == 0 and ld % 8 == 0
              and gate.data.ptr % 16 == 0 and up.data.ptr % 16 == 0) else 4
    rows, colsv = gate.shape[0], gate.shape[1] // v
    if rows and colsv:
        kernel("dequant_f16.cu", "swiglu_f16_x8" if v == 8 else "swiglu_f16")(
            (blocks_1d(colsv), min(rows, MAX_GRID_Y)), (K["THREADS_1D"],),
            (gate, up, y, np.int32(colsv), np.int64(ld // v), np.int32(rows)))
    return y


def linear_f16_from(xh, raw, qtype, n_out: int, n_in: int, out=None, w16=None, w_exp=None,
                    bias=None):
    """xh (T, n_in) f16 (already rounded) @ W (n_out, n_in)^T [+ bias] -> (T, n_out)
    f32 (or f16 when out is f16).

    W is dequantized into the f16 scratch w16 (>= n_out*n_in elements), then one
    cuBLAS GEMM; the bias is added in place, in f32. Weights that read the same
    input (q/k/v, gate/up) share one xh."""
    if xh.ndim != 2 or xh.shape[1] != n_in:
        raise ValueError(f"linear_f16: x16 has shape {xh.shape}, expected (T, {n_in})")
    return gemm_w16(xh, dequant_f16(raw, qtype, n_out, n_in, w16, w_exp), out, bias)


def gemm_w16(xh, w16, out=None, bias=None, accumulate: bool = False):
    """xh (T, n_in) f16 @ w16 (n_out, n_in)^T f16 [+ bias] -> (T, n_out) f32 (or f16
    when out is f16); accumulate: out += the product (out holds the residual)."""
    n_out = w16.shape[0]
    if accumulate and bias is not None:
        raise ValueError("gemm_w16: a bias with accumulate would add in another order than "
                         "(x @ W^T + bias) + addend")
    if out is None:
        if accumulate:
            raise ValueError("gemm_w16: accumulate needs an out holding the addend")
        out = cp.empty((xh.shape[0], n_out), dtype=cp.float32)                    # (T, n_out)
    gemm_f16(xh, w16, out, accumulate)
    if bias is not None:
        if out.dtype != cp.float32:
            raise ValueError("linear_f16: a bias needs a float32 out")
        check(bias, "linear_f16 bias", cp.float32, (n_out,))
        out += bias                                                               # (T, n_out)
    return out


def linear_f16(x, raw, qtype, n_out: int, n_in: int, out=None, x16=None, w16=None, w_exp=None,
               bias=None):
    """x (T, n_in) f32 -> rounded into the f16 scratch x16, then linear_f16_from."""
    check(x, "linear_f16 x", cp.float32, ndim=2)
    if x.shape[1] != n_in:
        raise ValueError(f"linear_f16: x has shape {x.shape}, expected (T, {n_in})")
    xh = cast_f16(x, scratch_view(x16, x.shape, "linear_f16 x16", cp.float16))     # (T, n_in)
    return linear_f16_from(xh, raw, qtype, n_out, n_in, out, w16, w_exp, bias)
