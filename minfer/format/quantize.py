"""Reference quantizers: NumPy ports of ggml's quantize_row_*_ref, used to write
synthetic models (minfer.tools.synth, minfer.tools.twin) and test data. What they write
dequantizes with minfer.format.quants (and gguf.quants) like ggml's own output.

    quantize(x, qtype, search=True)    float32 (rows, cols) -> uint8 (rows, row_bytes)
                                       for Q4_K, Q6_K, Q8_0, F16, F32 (QUANTIZERS)

- search=False skips the iterative scale search of the k-quants (ggml's
  make_qkx2_quants / make_qx_quants loops) and keeps only their first guess:
  valid blocks, larger error, several times faster.
- Rows are quantized in chunks on quants' thread pool (quants.set_threads sets
  its size); results do not depend on the chunking.
- Bad input (type without a quantizer, row length not a whole number of blocks,
  NaN/Inf, F16 overflow) raises MinferError.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from ..errors import MinferError
from .quants import K_SCALE_SIZE, Q6K_BLOCK, for_each_chunk, format_of, row_bytes

GROUP_MAX_EPS = 1e-15                      # ggml: below this a group quantizes to zeros

# Input elements per chunk: the quantizers' temporaries are several times the
# input, so a chunk is a quarter of the dequantizers' (quants._CHUNK_ELEMS).
_CHUNK_ELEMS = 1 << 18


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
    """6-bit scales, mins (n, 8) -> (n, 12) packed (inverse of quants._kquant_scales)."""
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


# Keyed by type, in the order the "no quantizer" message lists them.
QUANTIZERS: dict[QT, Callable[..., np.ndarray]] = {
    QT.F32: _quant_f32,
    QT.F16: _quant_f16,
    QT.Q8_0: _quant_q8_0,
    QT.Q4_K: _quant_q4_k,
    QT.Q6_K: _quant_q6_k,
}


def quantize(x: np.ndarray, qtype, search: bool = True) -> np.ndarray:
    """x float32 (rows, cols) -> uint8 (rows, row_bytes) of qtype.

    search=False (k-quants only) skips the iterative scale search: valid blocks,
    somewhat larger error, much faster (for big synthetic models)."""
    f = format_of(qtype)                    # a type the engine cannot read: MinferError
    quantize_blocks = QUANTIZERS.get(f.qtype)
    if quantize_blocks is None:
        raise MinferError(f"no quantizer for {f.qtype.name} (have: "
                          f"{', '.join(t.name for t in QUANTIZERS)})")
    x = np.asarray(x)
    if x.ndim != 2:
        raise MinferError(f"quantize: expected a 2-D (rows, cols) array, got shape {x.shape}")
    rows, cols = x.shape
    rb = row_bytes(qtype, cols)
    x = np.ascontiguousarray(x, np.float32)
    if not np.isfinite(x).all():
        raise MinferError(f"quantize {f.qtype.name}: input has NaN or Inf")
    out = np.empty((rows, rb), np.uint8)                                # (rows, row_bytes)
    step = max(1, _CHUNK_ELEMS // cols)

    def work(r0: int) -> None:
        blocks = x[r0:r0 + step].reshape(-1, f.block_size)
        out[r0:r0 + step] = quantize_blocks(blocks, search=search).reshape(-1, rb)

    for_each_chunk(work, range(0, rows, step))
    return out
