"""NumPy quantization formats: dequantizers equal bit for bit to gguf.quants,
the reference k-quant quantizers (Q4_K, Q6_K) used for synthetic models, and the
q6_K padding and W_exp expansion of the seed (seed/000 §2.3, §3.2).

INTERFACE (implemented by the quants work; other modules rely on exactly this):

    QK_K = 256
    Q6K_BLOCK = 210         # ql[128] + qh[64] + scales[16] + d (f16)
    Q6K_PADDED = 224        # padded stride: 16-byte aligned super-blocks

    SUPPORTED: frozenset of GGMLQuantizationType (F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K)
    dequantize(raw: np.ndarray uint8 (rows, row_bytes) or flat, qtype, shape) -> float32 ndarray of `shape`
    dequantize_rows(raw (rows, row_bytes) uint8, qtype, n_cols) -> float32 (rows, n_cols)
    quantize(x: float32 (rows, cols), qtype, search=True) -> uint8 (rows, row_bytes)  # Q4_K, Q6_K, Q8_0, F16, F32
    row_bytes(qtype, n_cols) -> int                                        # bytes of one row
    set_threads(n)                                                         # threads per call (default: cores, <= 8)
    pad_q6k(raw: uint8 (rows, nb*210)) -> uint8 (rows, nb*224)             # zero-filled padding
    expand_q6k_dense(padded: uint8 (rows, nb*224) or flat, od, id) -> int8 (od, id)
        # W_exp: (ql | qh<<4) - 32 per element, row stride id, super-block stride 256

Details beyond the block above:
- `shape` is in numpy order (last dim = ggml ne[0] = the contiguous row).
- Results are new, writable arrays (never views of a memmap).
- Large inputs are processed in chunks of rows on a few threads (NumPy releases
  the GIL); results do not depend on the chunking.
- `quantize(x, qtype, search=True)`: search=False skips the iterative scale
  search of the k-quants (ggml's make_qkx2_quants / make_qx_quants loops) and
  keeps only their first guess: valid blocks, larger error, several times faster.
- Every format is one `_Format` entry of FORMATS (keyed by GGMLQuantizationType)
  with `dequantize_blocks((n_blocks, type_size) uint8) -> (n_blocks, block_size) f32`;
  callers never branch on the type.
- Bad input (unsupported type, row length not a whole number of blocks, byte
  count that does not match the shape) raises MinferError.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from .errors import MinferError

QK_K = 256
Q6K_BLOCK = GGML_QUANT_SIZES[QT.Q6_K][1]   # 210
K_SCALE_SIZE = 12                          # packed 6-bit scales/mins of Q4_K/Q5_K
GROUP_MAX_EPS = 1e-15                      # ggml: below this a group quantizes to zeros

# Dequantization works on chunks of this many output elements, so temporaries
# stay small (token_embd is 233M elements) and two threads can share the work
# (NumPy ufuncs release the GIL).
_CHUNK_ELEMS = 1 << 20
_THREADS = max(1, min(8, os.cpu_count() or 1))


def _f16(b: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 little-endian f16 field -> (..., 1) float32"""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


# --------------------------------------------------------------------------- #
# dequantizers: (n_blocks, type_size) uint8 -> (n_blocks, block_size) float32 #
# Float32 math in gguf.quants' operation order, so results are bit-identical.  #
# --------------------------------------------------------------------------- #

def _deq_f32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float32).copy()


def _deq_f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _deq_bf16(b: np.ndarray) -> np.ndarray:
    # bf16 is the top half of an f32: shift the 16 bits into place
    return (np.ascontiguousarray(b).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _deq_q8_0(b: np.ndarray) -> np.ndarray:
    # block_q8_0: d (f16) | qs int8[32];  y = q * d
    d = _f16(b[:, :2])                                  # (n, 1)
    q = b[:, 2:].view(np.int8).astype(np.float32)       # (n, 32)
    return q * d


def _kquant_scales(sc12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, 12) packed scales of Q4_K/Q5_K -> 6-bit (scale, min), each (n, 8) uint8.

    ggml's get_scale_min_k4: sub-blocks 0..3 keep their 6 bits in bytes 0..3
    (scale) and 4..7 (min); sub-blocks 4..7 take their low nibbles from bytes
    8..11 and their top 2 bits from the spare top bits of bytes 0..7.
    """
    lo, mid, hi = sc12[:, 0:4], sc12[:, 4:8], sc12[:, 8:12]   # (n, 4) each
    scale = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mins = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return scale, mins


def _q4k_nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 128) qs -> (n, 8, 32) 4-bit values: 64-element chunk j holds sub-block
    2j in the low nibbles of qs[32j:32j+32] and sub-block 2j+1 in the high ones."""
    qs = qs.reshape(-1, 4, 1, 32)
    return ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(-1, 8, 32)


def _deq_kquant(b: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K tail: y = (d*sc) * q - (dmin*m) per 32-element sub-block.
    b: (n, type_size) blocks, q: (n, 8, 32) unsigned quants."""
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])          # (n, 1)
    sc, m = _kquant_scales(b[:, 4:4 + K_SCALE_SIZE])     # (n, 8)
    dsc = (d * sc.astype(np.float32))[:, :, None]        # (n, 8, 1)
    dm = (dmin * m.astype(np.float32))[:, :, None]       # (n, 8, 1)
    y = q.astype(np.float32)                             # (n, 8, 32)
    y *= dsc                                             # in place: same two roundings as gguf
    y -= dm
    return y.reshape(-1, QK_K)


def _deq_q4_k(b: np.ndarray) -> np.ndarray:
    # block_q4_K: d, dmin (f16) | scales[12] | qs[128]
    return _deq_kquant(b, _q4k_nibbles(b[:, 16:144]))


def _deq_q5_k(b: np.ndarray) -> np.ndarray:
    # block_q5_K: d, dmin (f16) | scales[12] | qh[32] | qs[128]; bit s of qh[l]
    # is the 5th bit of element 32*s + l
    qh = b[:, 16:48].reshape(-1, 1, 32)
    hi = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1   # (n, 8, 32)
    return _deq_kquant(b, _q4k_nibbles(b[:, 48:176]) | (hi << 4))


def q6k_centered(ql: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """ql (n, 128), qh (n, 64) of q6_K super-blocks -> (n, 256) int8 in -32..31.

    Each 128-element half h uses ql[64h:64h+64] and qh[32h:32h+32]; element
    h*128 + 64k + 32m + l is nibble k of ql[64h + 32m + l] with 2-bit field
    (2m + 4k) of qh[32h + l] on top, minus 32.
    """
    lo = ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    lo = lo & 0x0F                                                    # (n, 2, 2, 64) [h, k, 32m+l]
    shifts = np.array([[0, 2], [4, 6]], np.uint8).reshape(1, 1, 2, 2, 1)   # [k][m]
    hi = (qh.reshape(-1, 2, 1, 1, 32) >> shifts) & 0x03               # (n, 2, 2, 2, 32)
    q = lo | (hi.reshape(-1, 2, 2, 64) << 4)
    return (q.view(np.int8) - np.int8(32)).reshape(-1, QK_K)


def _deq_q6_k(b: np.ndarray) -> np.ndarray:
    # block_q6_K: ql[128] | qh[64] | scales int8[16] | d (f16); scale j covers
    # elements 16j..16j+15
    y = q6k_centered(b[:, 0:128], b[:, 128:192]).astype(np.float32).reshape(-1, 16, 16)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)               # (n, 16)
    y *= (_f16(b[:, 208:210]) * sc)[:, :, None]                       # (d*sc) * q, (n, 16, 1)
    return y.reshape(-1, QK_K)


# --------------------------------------------------------------------------- #
# quantizers: (n_blocks, block_size) float32 -> (n_blocks, type_size) uint8    #
# --------------------------------------------------------------------------- #

def _rint(x: np.ndarray) -> np.ndarray:
    """ggml's nearest_int (round half to even) as int32."""
    return np.rint(x).astype(np.int32)


def _pack_f16(x: np.ndarray) -> np.ndarray:
    """(n,) float32 -> (n, 2) uint8"""
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _make_qkx2_quants(x: np.ndarray, w: np.ndarray | None, nmax: int, rmin: float, rdelta: float,
                      nstep: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml make_qkx2_quants (use_mad=false), over many groups at once.

    x, w: (g, n) values and weights -> (scale (g,), min (g,)) with x ~ scale*L - min,
    L in 0..nmax, min >= 0. Starts from the min/max grid and tries nstep+1 other
    grids, each refined by weighted least squares for (scale, min); keeps the
    fit of least weighted squared error.
    """
    f32 = np.float32
    xmin = np.minimum(x.min(axis=1), f32(0))              # (g,) the offset is never positive
    xmax = x.max(axis=1)
    flat = xmax == xmin
    rng = np.where(flat, f32(1), xmax - xmin)
    iscale = f32(nmax) / rng
    scale = (f32(1) / iscale).astype(f32)
    if nstep < 1:                                          # the min/max grid as is
        return np.where(flat, f32(0), scale).astype(f32), -xmin
    sum_w = w.sum(axis=1)
    sum_x = (w * x).sum(axis=1)

    def grid(iscale, mn):                                  # -> L (g, n) float32
        return np.clip(np.rint(iscale[:, None] * (x - mn[:, None])), 0, nmax)

    def dot(a, b):                                         # row-wise sum(a*b): (g, n), (g, n) -> (g,)
        return np.einsum("gi,gi->g", a, b)

    def err(scale, mn, L):
        diff = scale[:, None] * L + mn[:, None] - x
        return dot(w * diff, diff)

    mn = xmin.copy()
    best = err(scale, mn, grid(iscale, mn))
    for step in range(nstep + 1):
        # like ggml, each grid spans [current min, max]: an accepted fit moves the min
        span = xmax - mn
        live = span > 0
        L = grid((f32(rmin + rdelta * step + nmax) / np.where(live, span, f32(1))).astype(f32), mn)
        wl = w * L
        sum_l = wl.sum(axis=1)
        sum_l2 = dot(wl, L)
        sum_xl = dot(wl, x)
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = live & (D > 0)
        Ds = np.where(ok, D, f32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / Ds
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / Ds
        pos = this_min > 0                                  # an offset above zero is not allowed:
        this_min = np.where(pos, f32(0), this_min)          # refit the scale alone
        this_scale = np.where(pos, sum_xl / np.where(sum_l2 > 0, sum_l2, f32(1)), this_scale)
        cur = err(this_scale, this_min, L)
        better = ok & (cur < best)
        best = np.where(better, cur, best)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    scale = np.where(flat, f32(0), scale)
    return scale.astype(f32), (-np.where(flat, xmin, mn)).astype(f32)


def _q4k_pack_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """6-bit scales, mins (n, 8) -> (n, 12) packed (inverse of _kquant_scales)."""
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    out = np.empty((ls.shape[0], K_SCALE_SIZE), np.uint8)
    out[:, 0:4] = (ls[:, 0:4] & 0x3F) | ((ls[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (lm[:, 0:4] & 0x3F) | ((lm[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:8] & 0x0F) | ((lm[:, 4:8] & 0x0F) << 4)
    return out


def _quant_q4_k(x: np.ndarray, search: bool = True) -> np.ndarray:
    """ggml quantize_row_q4_K_ref: per 32-element sub-block (scale, min) from
    make_qkx2_quants(nmax=15, rmin=-1, rdelta=0.1, nstep=20) with weights
    rms(sub-block) + |x|; both quantized to 6 bits against the block's largest,
    then every x re-quantized against the stored (d*sc, dmin*m)."""
    f32 = np.float32
    n = x.shape[0]
    xs = x.reshape(n * 8, 32)                                         # (n*8, 32)
    if search:
        av = np.sqrt((xs * xs).sum(axis=1, keepdims=True) / f32(32))
        scales, mins = _make_qkx2_quants(xs, av + np.abs(xs), 15, -1.0, 0.1, 20)
    else:                                                             # weights only matter to the search
        scales, mins = _make_qkx2_quants(xs, None, 15, -1.0, 0.1, 0)
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    max_scale, max_min = scales.max(axis=1), mins.max(axis=1)        # (n,)
    inv_scale = np.where(max_scale > 0, f32(63) / np.where(max_scale > 0, max_scale, f32(1)), f32(0))
    inv_min = np.where(max_min > 0, f32(63) / np.where(max_min > 0, max_min, f32(1)), f32(0))
    ls = np.clip(_rint(inv_scale[:, None] * scales), 0, 63)          # (n, 8)
    lm = np.clip(_rint(inv_min[:, None] * mins), 0, 63)
    d16 = (max_scale / f32(63)).astype(np.float16)
    dmin16 = (max_min / f32(63)).astype(np.float16)

    d = d16.astype(f32)[:, None] * ls.astype(f32)                    # (n, 8) as the dequantizer sees them
    dm = dmin16.astype(f32)[:, None] * lm.astype(f32)
    nz = d != 0
    q = np.rint((x.reshape(n, 8, 32) + dm[:, :, None]) / np.where(nz, d, f32(1))[:, :, None])
    L = np.where(nz[:, :, None], np.clip(q, 0, 15), 0).astype(np.uint8)   # (n, 8, 32)

    out = np.empty((n, GGML_QUANT_SIZES[QT.Q4_K][1]), np.uint8)
    out[:, 0:2] = _pack_f16(d16)
    out[:, 2:4] = _pack_f16(dmin16)
    out[:, 4:16] = _q4k_pack_scales(ls, lm)
    L = L.reshape(n, 4, 2, 32)                                        # chunk j: sub-blocks 2j (low), 2j+1 (high)
    out[:, 16:144] = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(n, 128)
    return out


def _make_qx_quants(x: np.ndarray, nmax: int, search: bool) -> np.ndarray:
    """ggml make_qx_quants(rmse_type=1, no importance weights) over groups:
    x (g, n) -> scale (g,) (signed) with x ~ scale*l, l in -nmax..nmax-1.
    Weights x^2; tries the grids (nmax + 0.1*is)/max for is in -9..9."""
    f32 = np.float32
    g = x.shape[0]
    idx = np.abs(x).argmax(axis=1)
    amax_signed = x[np.arange(g), idx]                     # the value of largest magnitude, with its sign
    tiny = np.abs(amax_signed) < GROUP_MAX_EPS
    mx = np.where(tiny, f32(1), amax_signed)
    w = x * x

    def fit(iscale):
        l = np.clip(np.rint(iscale[:, None] * x), -nmax, nmax - 1)
        return (w * x * l).sum(axis=1), (w * l * l).sum(axis=1)

    sumlx, suml2 = fit((f32(-nmax) / mx).astype(f32))
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, f32(1)), f32(0))
    best = scale * sumlx
    if search:
        for s in range(-9, 10):
            if s == 0:
                continue
            slx, sl2 = fit((-(f32(nmax) + f32(0.1) * f32(s)) / mx).astype(f32))
            better = (sl2 > 0) & (slx * slx > best * sl2)
            new_scale = slx / np.where(sl2 > 0, sl2, f32(1))
            scale = np.where(better, new_scale, scale)
            best = np.where(better, new_scale * slx, best)
    return np.where(tiny, f32(0), scale).astype(f32)


def _quant_q6_k(x: np.ndarray, search: bool = True) -> np.ndarray:
    """ggml quantize_row_q6_K_ref: a signed scale per 16-element sub-block from
    make_qx_quants(nmax=32), quantized to int8 against the block's largest
    (so that one maps to -128), then x re-quantized against d*sc to -32..31."""
    f32 = np.float32
    n = x.shape[0]
    scales = _make_qx_quants(x.reshape(n * 16, 16), 32, search).reshape(n, 16)
    idx = np.abs(scales).argmax(axis=1)
    max_scale = scales[np.arange(n), idx]                              # (n,) signed
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = np.where(zero, f32(0), f32(-128) / np.where(zero, f32(1), max_scale))
    d16 = np.where(zero, f32(0), f32(1) / np.where(zero, f32(1), iscale)).astype(np.float16)
    sc = np.clip(_rint(iscale[:, None] * scales), -128, 127)          # (n, 16)

    d = d16.astype(f32)[:, None] * sc.astype(f32)                     # (n, 16)
    nz = d != 0
    q = np.clip(np.rint(x.reshape(n, 16, 16) / np.where(nz, d, f32(1))[:, :, None]), -32, 31)
    L = (np.where(nz[:, :, None], q, 0) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [h, quarter, l]

    out = np.empty((n, Q6K_BLOCK), np.uint8)
    lo, hi = L & 0x0F, L >> 4
    # half h: ql[64h + 32m + l] = quarter m (low nibble) | quarter m+2 (high nibble)
    out[:, 0:128] = (lo[:, :, 0:2] | (lo[:, :, 2:4] << 4)).reshape(n, 128)
    # qh[32h + l] holds quarter t's 2 high bits at bit 2t
    out[:, 128:192] = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4)
                       | (hi[:, :, 3] << 6)).reshape(n, 64)
    out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    out[:, 208:210] = _pack_f16(d16.astype(f32))
    return out


def _quant_q8_0(x: np.ndarray, search: bool = True) -> np.ndarray:
    # ggml quantize_row_q8_0_ref: d = amax/127, q = round(x/d)
    f32 = np.float32
    d = np.abs(x).max(axis=1) / f32(127)
    inv = np.where(d == 0, f32(0), f32(1) / np.where(d == 0, f32(1), d))
    q = np.clip(np.rint(x * inv[:, None]), -127, 127).astype(np.int8)
    return np.concatenate([_pack_f16(d), q.view(np.uint8)], axis=1)


def _quant_f16(x: np.ndarray, search: bool = True) -> np.ndarray:
    big = float(np.abs(x).max(initial=0.0))
    if big > float(np.finfo(np.float16).max):          # would silently become inf
        raise MinferError(f"quantize F16: |x| up to {big:g} exceeds the f16 range (65504)")
    return x.astype(np.float16).view(np.uint8)


def _quant_f32(x: np.ndarray, search: bool = True) -> np.ndarray:
    return np.ascontiguousarray(x, np.float32).view(np.uint8).copy()


# --------------------------------------------------------------------------- #
# the table                                                                    #
# --------------------------------------------------------------------------- #

@dataclass(frozen=True)
class _Format:
    qtype: QT
    dequantize_blocks: Callable[[np.ndarray], np.ndarray]
    quantize_blocks: Callable[..., np.ndarray] | None = None

    @property
    def block_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def type_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][1]


FORMATS: dict[QT, _Format] = {f.qtype: f for f in (
    _Format(QT.F32, _deq_f32, _quant_f32),
    _Format(QT.F16, _deq_f16, _quant_f16),
    _Format(QT.BF16, _deq_bf16),
    _Format(QT.Q8_0, _deq_q8_0, _quant_q8_0),
    _Format(QT.Q4_K, _deq_q4_k, _quant_q4_k),
    _Format(QT.Q5_K, _deq_q5_k),
    _Format(QT.Q6_K, _deq_q6_k, _quant_q6_k),
)}
SUPPORTED = frozenset(FORMATS)


def _format(qtype) -> _Format:
    try:
        return FORMATS[QT(qtype)]
    except (KeyError, ValueError):
        name = getattr(qtype, "name", str(qtype))
        raise MinferError(f"unsupported tensor type {name} (supported: "
                          f"{', '.join(t.name for t in FORMATS)})") from None


def row_bytes(qtype, n_cols: int) -> int:
    """Bytes of one row of n_cols elements of qtype (n_cols a multiple of the block)."""
    f = _format(qtype)
    if n_cols <= 0 or n_cols % f.block_size:
        raise MinferError(f"{f.qtype.name}: row length {n_cols} is not a positive multiple "
                          f"of the block size {f.block_size}")
    return n_cols // f.block_size * f.type_size


# --------------------------------------------------------------------------- #
# public entry points                                                          #
# --------------------------------------------------------------------------- #

def set_threads(n: int) -> None:
    """Threads each dequantize/quantize call may use (a process pool of workers sets 1)."""
    global _THREADS
    _THREADS = max(1, int(n))


def for_each_chunk(work: Callable[[int], None], starts: range) -> None:
    """Run work(start) for every chunk start; chunks write disjoint output rows,
    so threads can share them (the NumPy ufuncs inside release the GIL)."""
    if _THREADS > 1 and len(starts) > 1:
        with ThreadPoolExecutor(min(_THREADS, len(starts))) as ex:
            list(ex.map(work, starts))          # list(): re-raises a worker's exception
    else:
        for s in starts:
            work(s)


def dequantize_rows(raw: np.ndarray, qtype, n_cols: int) -> np.ndarray:
    """raw (rows, row_bytes) uint8 of qtype -> float32 (rows, n_cols)."""
    f = _format(qtype)
    rb = row_bytes(qtype, n_cols)
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise MinferError(f"dequantize: raw bytes must be uint8, got {raw.dtype}")
    if raw.ndim != 2 or raw.shape[1] != rb:
        raise MinferError(f"{f.qtype.name}: raw shape {raw.shape} does not hold rows of "
                          f"{n_cols} elements ({rb} bytes each)")
    n_rows = raw.shape[0]
    out = np.empty((n_rows, n_cols), np.float32)                       # (rows, n_cols)
    step = max(1, _CHUNK_ELEMS // n_cols)

    def work(r0: int) -> None:
        blocks = np.ascontiguousarray(raw[r0:r0 + step]).reshape(-1, f.type_size)
        out[r0:r0 + step] = f.dequantize_blocks(blocks).reshape(-1, n_cols)

    for_each_chunk(work, range(0, n_rows, step))
    return out


def dequantize(raw: np.ndarray, qtype, shape) -> np.ndarray:
    """raw uint8 (rows, row_bytes) or flat bytes of a qtype tensor -> float32 `shape`
    (numpy order; the last dim is the contiguous row)."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise MinferError("dequantize: empty shape")
    n_cols = shape[-1]
    rb = row_bytes(qtype, n_cols)
    n_rows = int(np.prod(shape[:-1], dtype=np.int64))
    raw = np.asarray(raw)
    if raw.size != n_rows * rb:
        raise MinferError(f"{_format(qtype).qtype.name}: {raw.size} bytes do not hold a "
                          f"tensor of shape {shape} ({n_rows * rb} bytes)")
    return dequantize_rows(raw.reshape(n_rows, rb), qtype, n_cols).reshape(shape)


def quantize(x: np.ndarray, qtype, search: bool = True) -> np.ndarray:
    """x float32 (rows, cols) -> uint8 (rows, row_bytes) of qtype.

    search=False (k-quants only) skips the iterative scale search: valid blocks,
    somewhat larger error, much faster (for big synthetic models)."""
    f = _format(qtype)
    if f.quantize_blocks is None:
        raise MinferError(f"no quantizer for {f.qtype.name} (have: "
                          f"{', '.join(t.name for t, g in FORMATS.items() if g.quantize_blocks)})")
    x = np.asarray(x)
    if x.ndim != 2:
        raise MinferError(f"quantize: expected a 2-D (rows, cols) array, got shape {x.shape}")
    rows, cols = x.shape
    rb = row_bytes(qtype, cols)
    x = np.ascontiguousarray(x, np.float32)
    if not np.isfinite(x).all():
        raise MinferError(f"quantize {f.qtype.name}: input has NaN or Inf")
    out = np.empty((rows, rb), np.uint8)                                # (rows, row_bytes)
    step = max(1, (_CHUNK_ELEMS // 4) // cols)                          # keeps temporaries small

    def work(r0: int) -> None:
        blocks = x[r0:r0 + step].reshape(-1, f.block_size)
        out[r0:r0 + step] = f.quantize_blocks(blocks, search=search).reshape(-1, rb)

    for_each_chunk(work, range(0, rows, step))
    return out
