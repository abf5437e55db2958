"""Programmatic dependent launches: inside a captured graph, each of our kernels is
scheduled while the kernel before it is still finishing.

In a CUDA graph of dependent kernels the GPU otherwise idles between two of them:
the first drains and flushes, then the second is launched and its blocks placed
(~2 us a pair on the H200; scripts/bench/decode_breakdown.py shows the gaps), and a decode step is ~260 such
pairs. Launched with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, the
second kernel's blocks are placed as soon as every block of the first has started
(and passed its own wait), and wait on the SM. Every kernel of kernels/*.cu starts
with GRID_DEPENDENCY() (common.cuh: griddepcontrol.wait, then launch_dependents),
so it touches memory only after its predecessor has completed and its writes are
visible: the same reads and writes as plain stream order, the same bits. Only
those kernels are launched this way (launch.Kernel); cuBLAS's and CuPy's own
kernels launch the ordinary way, and a kernel after one of them waits for it in
full.

One kind of kernel may do its work before its wait: the f16 dequantization of a
weight (dequant_f16.cu's `early`), which reads only the quantized weights and
writes only the weight scratch. Right after a kernel of ours (which waited for
everything before it before letting this one start) that does not use the scratch
itself, every GEMM that read the scratch has completed; the dequantization then
waits before it exits, so the GEMM after it still follows everything before.
early() says when that holds.

CuPy launches through cuLaunchKernel, which takes no launch attributes; this module
calls the driver's cuLaunchKernelEx through ctypes and packs the arguments as
CuPy's launcher does: a cupy array -> its device pointer, a NumPy scalar -> its
bytes, a Python bool / int / float -> bool / int64 / float64.
"""
from __future__ import annotations

import ctypes
from contextlib import contextmanager

import numpy as np

from ...errors import MinferError

_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6      # CUlaunchAttributeID (cuda.h)


class _LaunchAttribute(ctypes.Structure):        # CUlaunchAttribute: id, pad to 8, 64-byte value
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):           # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


class _State:
    on = False           # launch.Kernel launches dependently while this is set
    launched = 0         # dependent launches issued in this process (graphs.py counts per capture)
    # the last launch on the stream was a library's kernel (cuBLAS), which may release
    # its dependents before it has waited for its own predecessors; a kernel of ours
    # clears it. Only after one of ours may a kernel start before its wait (early()).
    after_library = False
    # the last launch was a kernel of ours that reads or writes the f16 weight scratch
    # (gateup_swiglu_f16): a dequantization starting early would write the slot it may
    # still read on another SM. The next launch of ours clears it.
    after_scratch = False
    early_dequants = 0   # f16 dequantizations launched to start before their wait (kernels/dequant_f16.py)


def library_launch() -> None:
    """Say that a library (cuBLAS) launched a kernel on the stream."""
    STATE.after_library = True


def scratch_launch() -> None:
    """Say that the kernel of ours just launched uses the f16 weight scratch."""
    STATE.after_scratch = True


def early() -> bool:
    """May the kernel launched next start its work before it waits for its
    predecessor (doing the wait before it exits)? Only as a dependent launch right
    after a kernel of ours that leaves the weight scratch alone: then everything
    before that kernel has completed. The kernel must write nothing that a kernel
    still running may read or write."""
    return STATE.on and not STATE.after_library and not STATE.after_scratch


STATE = _State()
_driver = None


def _launch_ex():
    """cuLaunchKernelEx from the driver library (CUDA 12.0 and later)."""
    global _driver
    if _driver is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            fn = lib.cuLaunchKernelEx
        except (OSError, AttributeError) as e:
            raise MinferError(f"dependent kernel launches need the CUDA driver's cuLaunchKernelEx "
                              f"({e}): a driver for CUDA 12.0 or later, or MINFER_CUDA_GRAPHS=0 "
                              f"(they happen only inside CUDA graphs)") from None
        fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                       ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        fn.restype = ctypes.c_int
        _driver = fn
    return _driver


@contextmanager
def dependent_launches(enabled: bool = True):
    """Our kernels launched inside the block are programmatic dependents of the
    launch before them (when enabled)."""
    old, STATE.on = STATE.on, bool(enabled) or STATE.on
    try:
        yield
    finally:
        STATE.on = old


def _arg(a, cp):
    """One kernel argument as the bytes cuLaunchKernelEx copies (cp: cupy, or None)."""
    if isinstance(a, np.generic):
        return (ctypes.c_char * a.itemsize).from_buffer_copy(a.tobytes())
    if isinstance(a, bool):
        return ctypes.c_bool(a)
    if isinstance(a, int):
        return ctypes.c_int64(a)
    if isinstance(a, float):
        return ctypes.c_double(a)
    if cp is not None and isinstance(a, cp.ndarray):
        return ctypes.c_void_p(a.data.ptr)
    raise TypeError(f"kernel argument of type {type(a).__name__}")


def launch(fn, grid: tuple, block: tuple, args: tuple, shared_mem: int, cp) -> None:
    """Launch the CuPy kernel fn on the current stream as a programmatic dependent."""
    func = getattr(fn, "kernel", fn).ptr              # RawKernel -> its CUfunction
    grid, block = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
    held = [_arg(a, cp) for a in args]
    params = (ctypes.c_void_p * max(1, len(held)))(*[ctypes.addressof(h) for h in held])
    attr = _LaunchAttribute(id=_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1
    cfg = _LaunchConfig(*(max(1, int(g)) for g in grid), *(max(1, int(b)) for b in block),
                        int(shared_mem), cp.cuda.get_current_stream().ptr, ctypes.pointer(attr), 1)
    err = _launch_ex()(ctypes.byref(cfg), func, params, None)
    if err:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {err}")
    STATE.launched += 1
    STATE.after_library = STATE.after_scratch = False
