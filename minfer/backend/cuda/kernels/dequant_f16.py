"""kernels/dequant_f16.cu: the f16 engine's operands.

    dequant_f16       q4_K (144-byte blocks), q6_K padded, or q6_K through its W_exp
                      plane -> W16 (n_out, n_in) f16 (the Q32 types: quants32.py)
    dequant_f16_many  the same for several weights, up to three a launch
    cast_f16          f32 -> f16 (round to nearest even), 4 per thread
    swiglu_f16        silu(gate) * up on f16, computed in f32 (8 or 4 elements a
                      thread, by alignment)

Numerics: a dequantized weight is the f32 value of the NumPy reference rounded
once to f16 (the kernels equal np.float16(dequantize_rows(...)) bit for bit);
activations are rounded once to f16. The caller passes the scratch (state.py), so
nothing here allocates when it gives `out`.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT

from ....errors import MinferError
from .. import dependent
from ..launch import (MAX_GRID_Y, NULL, blocks_1d, check, check_rows, cp, kernel, launch_grid_stride,
                      or_null, scratch_view)
from ..nvrtc import K
from .quants32 import Q32_TYPES, dequant32_f16


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
            w16s.append(dequant32_f16(raw, qtype, n_out, n_in, out))
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
