"""kernels/matvec.cu: the decode (one-row) matvecs on q8_1 activations.

    matvecs     up to three weights that read the same x, one launch (one type, or
                q4_K beside q6_K):
                y_i = x W_i^T [+ bias_i] [+ res_i]  (q/k/v, gate/up; the residual add
                of o and down), x one row or the B rows of a decode step of B
                sequences: each weight row read once for up to MAX_NB rows of x,
                and each row's output the bits it has alone
    matvec      one weight (the same kernel)

x comes as q8_1 (quantize.py's quantize_q8_1 or swiglu_q8_1, norm.py's rmsnorm_q8_1). Weights: q4_K as
stored, q6_K padded, the 32-element group types (quants32.Q32_TYPES) as stored.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from ..launch import NULL, blocks_1d, check, cp, kernel, or_null, out_array
from ..nvrtc import K
from .mmq import BLOCK_BYTES, QK_K
from .quants32 import Q32_TYPES, q32_row_bytes

MV_TYPES = (QT.Q4_K, QT.Q6_K) + Q32_TYPES
MIXED = (QT.Q4_K, QT.Q6_K)                   # the one pair of types one launch may mix
MAX_SEGMENTS = 3                              # weights per matvecs launch
RPW = (K["MV_RPW"], 2)                        # rows per warp a launch may take
# rows of x one launch takes (kernels/matvec.cu's NB), largest first: B rows run as
# launches of these, each reading the weights once. Beyond 8 the accumulators pass
# the register file (R * NB a lane) and x's loads from L1 outgrow the weight's.
NBS = (8, 4, 2, 1)
MAX_NB = NBS[0]
RPW_NB = 2                                    # rows per warp of a launch of several x rows
# Below this many rows a weight's blocks share their rows among their warps (each
# warp a part of K): 3,584 rows at one warp per four rows is 224 blocks, under
# two per SM, and each warp walked all of K alone (the 7B's ffn_down, 18,944 wide,
# ran at half the copy bandwidth).
SPLIT_BELOW_ROWS = 8192
_INSTANCES = tuple(f"matvec<{int(a)}, {int(b)}, {r}, {nb}>" for a, b in [(t, t) for t in MV_TYPES] + [MIXED]
                   for r, nb in [(r, 1) for r in RPW] + [(RPW_NB, nb) for nb in NBS[:-1]])


def split_of(od: int) -> int:
    """The K split of a weight of od rows (kernels/matvec.cu): a row's bits depend
    on it, so it is a function of the weight alone."""
    return K["MV_WARPS"] if od < SPLIT_BELOW_ROWS else 1


def _kernel(qa, qb, rpw: int, nb: int):
    return kernel("matvec.cu", f"matvec<{int(qa)}, {int(qb)}, {rpw}, {nb}>", _INSTANCES)


def row_launches(B: int) -> list[tuple[int, int]]:
    """B rows of x -> the launches that take them: (first row, rows) each, the rows
    one of NBS (as many of the largest as fit, then smaller)."""
    out, at = [], 0
    while at < B:
        nb = next(n for n in NBS if n <= B - at)
        out.append((at, nb))
        at += nb
    return out


def blocks_of(ods, split: int, rpw: int) -> int:
    """Blocks of one launch over weights of ods rows at rpw rows per warp."""
    return sum(blocks_1d(od, K["MV_WARPS"] * rpw // split) for od in ods)


def rows_per_warp(qa, qb, split: int) -> int:
    """Rows per warp of a launch: 2 for q6_K weights whose K is split across a
    block's warps (the 7B's q6_K ffn_down: 18.3 us at 2, 22.0 at 4), else 4.
    Measured per shape on the H200 (scripts/bench/decode_breakdown.py): 1 row was slower
    everywhere, 2 equal or slower for every other shape. Every choice gives the
    same bits (a row's sums do not depend on it)."""
    return 2 if QT(qa) == QT(qb) == QT.Q6_K and split > 1 else K["MV_RPW"]


def can_share(qtypes) -> bool:
    """Can weights of these types go in one launch?"""
    kinds = set(map(QT, qtypes))
    return len(kinds) == 1 or kinds == set(MIXED)


def _row_bytes(qtype, n: int) -> int:
    return n // QK_K * BLOCK_BYTES[qtype] if qtype in BLOCK_BYTES else q32_row_bytes(qtype, n)


def _check_x(what: str, qtypes, xq, xd, xs) -> tuple[int, int]:
    """q8_1 x (B, K) -> (B, K) (K a whole number of every type's blocks)"""
    for t in qtypes:
        if t not in MV_TYPES:
            raise ValueError(f"{what}: no matvec for {QT(t).name}")
    check(xq, f"{what} xq", cp.int8, ndim=2, align16=True)
    B, n = xq.shape
    block = max(GGML_QUANT_SIZES[t][0] for t in qtypes)
    if B < 1 or n % block:
        raise ValueError(f"{what}: x has shape {xq.shape}, expected (B, K), K a multiple of {block}")
    check(xd, f"{what} xd", cp.float32, (B, n // 32))
    check(xs, f"{what} xs", cp.float32, (B, n // 32))
    return B, n


def matvecs(xq, xd, xs, segments, rpw: int | None = None) -> list:
    """q8_1 x (B, K); segments: up to three (qtype, w, od, bias, res, y) of one
    split_of(od) and types that can_share; w (od, K) device bytes; bias (od,) or
    None; res (B, od) or None (added last: the residual stream); y (B, od) or None
    (allocated) -> [y (B, od) f32 each], one launch per row_launches(B). rpw: rows
    per warp of a one-row launch (tests; default rows_per_warp's choice)."""
    if not 1 <= len(segments) <= MAX_SEGMENTS:
        raise ValueError(f"matvecs: {len(segments)} weights, 1..{MAX_SEGMENTS} per launch")
    qtypes = [QT(seg[0]) for seg in segments]
    B, n = _check_x("matvecs", qtypes, xq, xd, xs)
    if not can_share(qtypes):
        raise ValueError(f"matvecs: {[t.name for t in qtypes]} cannot share a launch")
    splits = {split_of(seg[2]) for seg in segments}
    if len(splits) != 1:
        raise ValueError(f"matvecs: weights of {[seg[2] for seg in segments]} rows split K differently")
    split = splits.pop()
    qa = qtypes[0] if len(set(qtypes)) == 1 else MIXED[0]
    qb = qtypes[0] if len(set(qtypes)) == 1 else MIXED[1]
    mask = sum(1 << i for i, t in enumerate(qtypes) if t != qa)
    if rpw is None:
        rpw = rows_per_warp(qa, qb, split)
    elif rpw not in RPW:
        raise ValueError(f"matvecs: {rpw} rows per warp, expected one of {RPW}")
    ws, ys = [], []
    for i, (qtype, w, od, bias, res, y) in enumerate(segments):
        check(w, f"matvecs w{i}", cp.uint8, (od, _row_bytes(QT(qtype), n)), align16=True)
        if bias is not None:
            check(bias, f"matvecs bias{i}", cp.float32, (od,))
        if res is not None:
            check(res, f"matvecs res{i}", cp.float32, (B, od))
        ws.append((w, or_null(bias), res, od))
        ys.append(out_array(y, (B, od), f"matvecs y{i}"))                 # (B, od)
    for r0, nb in row_launches(B):
        r = rpw if nb == 1 else RPW_NB
        blocks = blocks_of([seg[2] for seg in segments], split, r)
        if not blocks:
            continue
        args = []
        for (w, bias, res, od), y in zip(ws, ys):
            args += [w, bias, NULL if res is None else res[r0:r0 + nb], y[r0:r0 + nb], np.int32(od)]
        args += [NULL, NULL, NULL, NULL, np.int32(0)] * (MAX_SEGMENTS - len(segments))
        _kernel(qa, qb, r, nb)((blocks,), (K["MV_WARPS"] * 32,),
                               (xq[r0:r0 + nb], xd[r0:r0 + nb], xs[r0:r0 + nb], np.int32(n), np.int32(split),
                                np.int32(mask), *args))
    return ys


def matvec(qtype, xq, xd, xs, w, od: int, bias=None, y=None, res=None):
    """q8_1 x (B, K) @ W (od, K)^T [+ bias] [+ res] -> y (B, od) f32"""
    return matvecs(xq, xd, xs, [(qtype, w, od, bias, res, y)])[0]
