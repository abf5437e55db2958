"""TMA tensor maps (CUtensorMap) for the Hopper kernels that copy tiles with
cp.async.bulk.tensor (kernels/gateup_sm90.cu).

A map describes a 2-D row-major array in device memory and the box one copy
moves; the driver's cuTensorMapEncodeTiled (through ctypes: CuPy does not wrap
it) encodes that into 128 opaque bytes, which are copied to device memory where
the kernel reads them. Maps are cached by everything they encode (address, shape,
row stride, box, swizzle), so later calls and CUDA-graph replays on the same
buffers reuse them. Making one copies to the device, which a graph capture cannot
hold: a capture's warm run (graphs.py) makes every map the captured work needs
first, and a map missing inside a capture is an error, not a silent copy. The cache
is never emptied: 128 bytes a map, a few per layer and one per prompt length (a
stale entry still describes its address and shape correctly).
"""
from __future__ import annotations

import ctypes

import numpy as np

from ...errors import MinferError
from .launch import cp

MAP_BYTES = 128
UINT8, FLOAT16 = 0, 6                    # CUtensorMapDataType
SWIZZLE_NONE, SWIZZLE_128B = 0, 3        # CUtensorMapSwizzle
_L2_PROMOTION_128B = 2                   # CUtensorMapL2promotion

_encode = None
_maps: dict[tuple, object] = {}


def _encoder():
    global _encode
    if _encode is None:
        try:
            fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
        except (OSError, AttributeError) as e:
            raise MinferError(f"the Hopper kernels need the CUDA driver's cuTensorMapEncodeTiled ({e}): "
                              f"a driver for CUDA 12.0 or later") from None
        fn.restype = ctypes.c_int
        _encode = fn
    return _encode


def encode(ptr: int, dtype: int, rows: int, cols: int, row_bytes: int, box_cols: int, box_rows: int,
           swizzle: int) -> bytes:
    """The 128 bytes of a map over a (rows, cols) array of dtype at ptr, rows row_bytes
    apart, copied in boxes of (box_rows, box_cols). Rows past the end arrive as zeros."""
    m = (ctypes.c_uint64 * (MAP_BYTES // 8))()
    err = _encoder()(ctypes.byref(m), dtype, 2, ctypes.c_void_p(ptr),
                     (ctypes.c_uint64 * 2)(cols, rows), (ctypes.c_uint64 * 1)(row_bytes),
                     (ctypes.c_uint32 * 2)(box_cols, box_rows), (ctypes.c_uint32 * 2)(1, 1),
                     0, swizzle, _L2_PROMOTION_128B, 0)
    if err:
        raise MinferError(f"cuTensorMapEncodeTiled failed (CUresult {err}) for a ({rows}, {cols}) "
                          f"array at {ptr:#x}, {row_bytes}-byte rows, box ({box_rows}, {box_cols})")
    return bytes(m)


def device_maps(specs: tuple) -> object:
    """Maps side by side in device memory (uint8, 128 bytes each), one per spec
    (encode's arguments), cached by the specs."""
    got = _maps.get(specs)
    if got is None:
        if cp.cuda.get_current_stream().is_capturing():
            raise MinferError("a TMA map was first needed inside a CUDA graph capture "
                              "(the capture's warm run should have made it)")
        host = np.frombuffer(b"".join(encode(*s) for s in specs), np.uint8)
        got = _maps[specs] = cp.asarray(host)                                   # (128 * len(specs),)
    return got


def map_2d(a, box_rows: int, box_cols: int, swizzle: int) -> tuple:
    """encode's arguments for the whole of the 2-D device array a (f16 or uint8;
    rows of a stride that is a multiple of 16 bytes)."""
    dtype = {cp.dtype(cp.float16): FLOAT16, cp.dtype(cp.uint8): UINT8}.get(a.dtype)
    if dtype is None or a.ndim != 2 or a.strides[1] != a.itemsize:
        raise ValueError(f"TMA map: need a 2-D f16 or uint8 array with contiguous rows, got "
                         f"{a.dtype} {a.shape} strides {a.strides}")
    if a.data.ptr % 16 or a.strides[0] % 16:
        raise ValueError(f"TMA map: the address {a.data.ptr:#x} and the row stride {a.strides[0]} "
                         f"must be multiples of 16 bytes")
    return (a.data.ptr, dtype, a.shape[0], a.shape[1], a.strides[0], box_cols, box_rows, swizzle)
