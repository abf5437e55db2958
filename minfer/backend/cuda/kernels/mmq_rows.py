"""kernels/mmq_rows.cu: tensor-core products of few rows, the linears of a decode step
of B sequences on q4_K and q6_K weights.

    mmq_rows   q8_1 x (T, K) @ W (od, K)^T [+ bias] [+ res] -> y (T, od) f32; W q4_K as
               stored or q6_K padded (the matvec's layouts); T rows in launches of up
               to ROWS_PER_LAUNCH, each reading W once

Each output's f32 sums are one fixed sequence whatever T, so a row's bits do not
depend on the rows beside it (tests/gpu/test_mmq_rows.py).
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT

from ..launch import NULL, blocks_1d, check, cp, kernel, or_null, out_array
from ..nvrtc import K
from .mmq import BLOCK_BYTES, QK_K

MR_TYPES = (QT.Q4_K, QT.Q6_K)
ROWS_PER_LAUNCH = 32                       # two m-tiles of 16 rows of x (the kernel's MT = 2)
# n-tiles of 8 weight rows a block owns (RT): one where K is short, so a weight has
# blocks enough to fill the GPU and x (T x K) stays in each SM's L1 for the blocks
# that read it again; two where K is long (ffn_down), halving the blocks that each
# read all of x from L2. (A row's sums do not depend on RT.)
SHORT_K = 4096
_INSTANCES = tuple(f"mmq_rows<{int(t)}, {mt}, {rt}>" for t in MR_TYPES for mt in (1, 2) for rt in (1, 2))


def row_tiles(K: int) -> int:
    return 1 if K <= SHORT_K else 2


def mmq_rows(qtype, xq, xd, xs, w, od: int, bias=None, res=None, y=None):
    """q8_1 x: xq int8 (T, K), xd, xs f32 (T, K/32); w (od, K) device bytes; bias (od,)
    or None; res (T, od) or None (added last; y may be res) -> y (T, od) f32"""
    qtype = QT(qtype)
    if qtype not in MR_TYPES:
        raise ValueError(f"mmq_rows: no kernel for {qtype.name} (only {', '.join(t.name for t in MR_TYPES)})")
    check(xq, "mmq_rows xq", cp.int8, ndim=2, align16=True)
    T, n = xq.shape
    if T < 1 or n % QK_K:
        raise ValueError(f"mmq_rows: x has shape {xq.shape}, expected (T >= 1, K), K a multiple of {QK_K}")
    check(xd, "mmq_rows xd", cp.float32, (T, n // 32))
    check(xs, "mmq_rows xs", cp.float32, (T, n // 32))
    check(w, "mmq_rows w", cp.uint8, (od, n // QK_K * BLOCK_BYTES[qtype]), align16=True)
    if bias is not None:
        check(bias, "mmq_rows bias", cp.float32, (od,))
    if res is not None:
        check(res, "mmq_rows res", cp.float32, (T, od))
    y = out_array(y, (T, od), "mmq_rows y")                               # (T, od)
    if not od:
        return y
    rt = row_tiles(n)
    for r0 in range(0, T, ROWS_PER_LAUNCH):
        nb = min(ROWS_PER_LAUNCH, T - r0)
        rows = slice(r0, r0 + nb)
        kernel("mmq_rows.cu", f"mmq_rows<{int(qtype)}, {1 if nb <= 16 else 2}, {rt}>", _INSTANCES)(
            (blocks_1d(od, 8 * rt),), (K["MR_WARPS"] * 32,),
            (xq[rows], xd[rows], xs[rows], np.int32(nb), np.int32(n), w, or_null(bias),
             NULL if res is None else res[rows], y[rows], np.int32(od)))
    return y
