"""NumPy dequantization of the GGUF tensor types the engine reads, bit for bit
equal to gguf.quants.dequantize (float32 math in the same operation order).

    QK_K = 256, Q6K_BLOCK = 210                 k-quant super-block: elements, q6_K bytes
    SUPPORTED                                   F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
                                                Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
    dequantize(raw, qtype, shape)               uint8 (rows, row_bytes) or flat -> float32 `shape`
    dequantize_rows(raw, qtype, n_cols)         uint8 (rows, row_bytes) -> float32 (rows, n_cols)
    row_bytes(qtype, n_cols)                    bytes of one row of n_cols elements
    format_of(qtype)                            its FORMATS entry (block and type size)
    set_threads(n), for_each_chunk(work, starts)   the row-chunk thread pool
    q6k_centered(ql, qh)                        q6_K quants as int8 in -32..31 (also the
                                                W_exp plane of minfer/backend/cuda/q6k_layout.py)

- `shape` is in numpy order (last dim = ggml ne[0] = the contiguous row).
- Results are new, writable arrays (never views of a memmap).
- Large inputs are processed in chunks of rows on a few threads (NumPy releases
  the GIL); results do not depend on the chunking. minfer.format.quantize (the
  reference quantizers) chunks through the same pool.
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

from ..errors import MinferError

QK_K = 256
Q6K_BLOCK = GGML_QUANT_SIZES[QT.Q6_K][1]   # 210
K_SCALE_SIZE = 12                          # packed 6-bit scales/mins of Q4_K/Q5_K

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


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """(n, 16) qs of a 32-element block -> (n, 32) 4-bit values: element j < 16 is
    the low nibble of qs[j], element 16 + j its high nibble."""
    return ((qs[:, None, :] >> np.array([0, 4], np.uint8).reshape(1, 2, 1)) & 0x0F).reshape(-1, 32)


def _fifth_bits(qh4: np.ndarray) -> np.ndarray:
    """(n, 4) qh of a Q5_0/Q5_1 block (a little-endian uint32) -> (n, 32) values
    with bit 4 set from bit j of qh for element j."""
    qh = np.ascontiguousarray(qh4).view("<u4")                           # (n, 1)
    return (((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4)


def _deq_q4_0(b: np.ndarray) -> np.ndarray:
    # block_q4_0: d (f16) | qs[16];  y = d * (q - 8)
    q = (_nibbles32(b[:, 2:18]).astype(np.int8) - np.int8(8)).astype(np.float32)
    return _f16(b[:, :2]) * q


def _deq_q4_1(b: np.ndarray) -> np.ndarray:
    # block_q4_1: d, m (f16) | qs[16];  y = d * q + m, the product rounded before
    # the sum as in gguf (a fused multiply-add rounds once and differs)
    return _f16(b[:, :2]) * _nibbles32(b[:, 4:20]).astype(np.float32) + _f16(b[:, 2:4])


def _deq_q5_0(b: np.ndarray) -> np.ndarray:
    # block_q5_0: d (f16) | qh[4] | qs[16];  y = d * ((q | h << 4) - 16)
    q = ((_nibbles32(b[:, 6:22]) | _fifth_bits(b[:, 2:6])).astype(np.int8) - np.int8(16))
    return _f16(b[:, :2]) * q.astype(np.float32)


def _deq_q5_1(b: np.ndarray) -> np.ndarray:
    # block_q5_1: d, m (f16) | qh[4] | qs[16];  y = d * (q | h << 4) + m
    q = (_nibbles32(b[:, 8:24]) | _fifth_bits(b[:, 4:8])).astype(np.float32)
    return _f16(b[:, :2]) * q + _f16(b[:, 2:4])


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


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """(n, 64) qs of a Q2_K/Q3_K super-block -> (n, 256) 2-bit values: element
    128h + 32s + l is bits 2s..2s+1 of qs[32h + l]."""
    qs = qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return (qs & 0x03).reshape(-1, QK_K)


def _deq_q2_k(b: np.ndarray) -> np.ndarray:
    # block_q2_K: scales[16] | qs[64] | d, dmin (f16); byte j of scales covers
    # elements 16j..16j+15: low nibble the scale, high nibble the min;
    # y = (d * sc) * q - (dmin * m)
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])                     # (n, 1)
    sc = b[:, 0:16]
    dl = (d * (sc & 0x0F).astype(np.float32))[:, :, None]              # (n, 16, 1)
    ml = (dmin * (sc >> 4).astype(np.float32))[:, :, None]
    q = _crumbs(b[:, 16:80]).reshape(-1, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(-1, QK_K)


def _q3k_scales(sc12: np.ndarray) -> np.ndarray:
    """(n, 12) packed scales of Q3_K -> (n, 16) int8 in -32..31: scale j has its low
    4 bits in nibble j // 8 of byte j % 8 and its high 2 bits in bits
    2 * (j // 4)..+1 of byte 8 + j % 4; minus 32."""
    lo = (sc12[:, None, 0:8] >> np.array([0, 4], np.uint8).reshape(1, 2, 1)).reshape(-1, 16)
    hi = (sc12[:, None, 8:12] >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)).reshape(-1, 16)
    return ((lo & 0x0F) | ((hi & 0x03) << 4)).astype(np.int8) - np.int8(32)


def _deq_q3_k(b: np.ndarray) -> np.ndarray:
    # block_q3_K: hmask[32] | qs[64] | scales[12] | d (f16). Element e: 2 low bits
    # from qs as in Q2_K; bit e // 32 of hmask[e % 32] set means q as is, clear
    # means q - 4 (so q is in -4..3); scale j = e // 16; y = (d * sc) * q
    d = _f16(b[:, 108:110])                                            # (n, 1)
    dl = (d * _q3k_scales(b[:, 96:108]).astype(np.float32))[:, :, None]   # (n, 16, 1)
    hm = b[:, None, 0:32] >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # (n, 8, 32)
    low4 = ((hm & 1) ^ 1) << 2                                         # 4 where the bit is clear
    q = _crumbs(b[:, 32:96]).astype(np.int8) - low4.reshape(-1, QK_K).astype(np.int8)
    return (dl * q.reshape(-1, 16, 16).astype(np.float32)).reshape(-1, QK_K)


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
# the table                                                                    #
# --------------------------------------------------------------------------- #

@dataclass(frozen=True)
class _Format:
    qtype: QT
    dequantize_blocks: Callable[[np.ndarray], np.ndarray]

    @property
    def block_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def type_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][1]


FORMATS: dict[QT, _Format] = {f.qtype: f for f in (
    _Format(QT.F32, _deq_f32),
    _Format(QT.F16, _deq_f16),
    _Format(QT.BF16, _deq_bf16),
    _Format(QT.Q4_0, _deq_q4_0),
    _Format(QT.Q4_1, _deq_q4_1),
    _Format(QT.Q5_0, _deq_q5_0),
    _Format(QT.Q5_1, _deq_q5_1),
    _Format(QT.Q8_0, _deq_q8_0),
    _Format(QT.Q2_K, _deq_q2_k),
    _Format(QT.Q3_K, _deq_q3_k),
    _Format(QT.Q4_K, _deq_q4_k),
    _Format(QT.Q5_K, _deq_q5_k),
    _Format(QT.Q6_K, _deq_q6_k),
)}
SUPPORTED = frozenset(FORMATS)


def format_of(qtype) -> _Format:
    """The FORMATS entry of qtype; MinferError naming the supported types if none."""
    try:
        return FORMATS[QT(qtype)]
    except (KeyError, ValueError):
        name = getattr(qtype, "name", str(qtype))
        raise MinferError(f"unsupported tensor type {name} (supported: "
                          f"{', '.join(t.name for t in FORMATS)})") from None


def row_bytes(qtype, n_cols: int) -> int:
    """Bytes of one row of n_cols elements of qtype (n_cols a multiple of the block)."""
    f = format_of(qtype)
    if n_cols <= 0 or n_cols % f.block_size:
        raise MinferError(f"{f.qtype.name}: row length {n_cols} is not a positive multiple "
                          f"of the block size {f.block_size}")
    return n_cols // f.block_size * f.type_size


# --------------------------------------------------------------------------- #
# public entry points                                                          #
# --------------------------------------------------------------------------- #

def set_threads(n: int) -> None:
    """Threads each call that chunks through for_each_chunk may use (dequantize_rows,
    minfer.format.quantize.quantize, ...); a process pool of workers sets 1."""
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
    f = format_of(qtype)
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
        raise MinferError(f"{format_of(qtype).qtype.name}: {raw.size} bytes do not hold a "
                          f"tensor of shape {shape} ({n_rows * rb} bytes)")
    return dequantize_rows(raw.reshape(n_rows, rb), qtype, n_cols).reshape(shape)

