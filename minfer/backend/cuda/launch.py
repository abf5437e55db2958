"""What every kernel wrapper shares: the cupy import, the argument checker, output
and scratch views, the compiled-kernel lookup, the launcher and the 1-D launch
geometry.

A wrapper (kernels/<name>.py for kernels/<name>.cu) checks its arguments with
`check`, allocates or checks its output with `out_array`, and launches through
`kernel(...)`; nothing else reaches NVRTC. The launcher counts every launch by
kernel name (LAUNCHES; counters.py reads it), so no wrapper counts by hand.
"""
from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from ...errors import MinferError
from . import dependent, nvrtc

try:
    import cupy as cp
except Exception as e:  # noqa: BLE001 - any import failure means no CUDA backend
    cp = None
    CUPY_ERROR: str | None = f"{type(e).__name__}: {e}"
else:
    CUPY_ERROR = None

THREADS_1D = nvrtc.K["THREADS_1D"]
MAX_GRID_1D = 65535          # grid-stride kernels: enough blocks to fill the GPU, no more
MAX_GRID_Y = 65535           # the grid's y dimension (CUDA's limit): kernels walk rows past it
NULL = np.uint64(0)          # a nullptr kernel argument

# launches since the process started, by kernel name (and "cublasLt matmul"):
# process-wide, as the kernels are; each backend's counters read differences of it
LAUNCHES: Counter = Counter()


def require_cupy() -> None:
    if cp is None:
        raise MinferError(f"CUDA backend unavailable: cupy does not import ({CUPY_ERROR}); "
                          f"install minfer[cuda12] or minfer[cuda13], or use --backend cpu")


def check(a, what: str, dtype, shape=None, *, size: int | None = None, ndim: int | None = None,
          align16: bool = False):
    """The argument check of every wrapper: a C-contiguous cupy array of `dtype`,
    optionally of a given shape / size / number of dimensions, and 16-byte aligned
    (kernels that move 16-byte vectors) -> a. ValueError otherwise (a bug in the
    caller, not bad user input)."""
    if not isinstance(a, cp.ndarray) or a.dtype != dtype or not a.flags.c_contiguous:
        raise ValueError(f"{what}: expected a C-contiguous {np.dtype(dtype).name} cupy array, "
                         f"got {type(a).__name__} {getattr(a, 'dtype', '?')}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{what}: shape {tuple(a.shape)}, expected {tuple(shape)}")
    if size is not None and a.size != size:
        raise ValueError(f"{what}: {a.size} elements, expected {size}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{what}: expected {ndim} dimensions, got shape {tuple(a.shape)}")
    if align16 and a.data.ptr % 16:
        raise ValueError(f"{what}: device pointer {a.data.ptr:#x} is not 16-byte aligned")
    return a


def check_rows(a, what: str, dtype, shape) -> int:
    """check() for an array whose rows (first axis) may be further apart than their
    packed size (a column block of a wider matrix: strides (ld, ..., 1 element)),
    each row packed -> ld, the row stride in elements."""
    if not isinstance(a, cp.ndarray) or a.dtype != dtype:
        raise ValueError(f"{what}: expected a {np.dtype(dtype).name} cupy array, "
                         f"got {type(a).__name__} {getattr(a, 'dtype', '?')}")
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{what}: shape {tuple(a.shape)}, expected {tuple(shape)}")
    item, row = a.itemsize, math.prod(shape[1:])
    packed = all(a.strides[i] == item * math.prod(shape[i + 1:]) for i in range(1, len(shape)))
    if not packed or a.strides[0] % item or a.strides[0] < item * row:
        raise ValueError(f"{what}: rows of strides {a.strides} are not packed rows of {row} elements")
    return a.strides[0] // item


def out_array(out, shape, what: str, dtype=None, align16: bool = False):
    """A new (shape) array of dtype (default float32) when out is None, else out
    checked to be exactly that."""
    dtype = cp.float32 if dtype is None else dtype
    if out is None:
        return cp.empty(shape, dtype=dtype)
    return check(out, what, dtype, shape, align16=align16)


def scratch_view(scratch, shape, what: str, dtype):
    """The leading prod(shape) elements of a flat scratch buffer, as `shape`
    (a new array when scratch is None)."""
    n = math.prod(shape)             # (math.prod: np.prod costs microseconds per launch)
    if scratch is None:
        return cp.empty(shape, dtype=dtype)
    check(scratch, what, dtype)
    if scratch.size < n:
        raise ValueError(f"{what}: scratch holds {scratch.size} elements, {n} needed for {tuple(shape)}")
    return scratch.reshape(-1)[:n].reshape(shape)


@dataclass(frozen=True)
class DevicePos:
    """A position that kernels read from device memory, so that a captured decode
    step replays at whatever position the buffer holds. `value` is the position
    when the work was queued (for host-side checks, which a replay does not run)."""
    value: int
    buf: object                          # cupy int32 (1,)


def pos_args(pos) -> tuple:
    """A position (int or DevicePos) -> the (pos0, pos_dev) kernel arguments."""
    if isinstance(pos, DevicePos):
        return np.int32(pos.value), pos.buf
    return np.int32(pos), NULL


def pos_value(pos) -> int:
    return pos.value if isinstance(pos, DevicePos) else int(pos)


def or_null(a):
    """A device array, or a nullptr for an absent optional argument (bias, plane)."""
    return NULL if a is None else a


class Kernel:
    """A compiled kernel of kernels/*.cu. Calling it launches on the current stream:
    as a programmatic dependent of the launch before it while dependent launches
    are on (inside a graph capture, dependent.py), the ordinary way otherwise; and
    counts the launch under its name."""
    __slots__ = ("fn", "name")

    def __init__(self, fn, name: str):
        self.fn = fn                     # the cupy kernel
        self.name = name                 # as kernel() was asked for it, template arguments included

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
        LAUNCHES[self.name] += 1
        if dependent.STATE.on:
            dependent.launch(self.fn, grid, block, args, shared_mem, cp)
        else:
            self.fn(grid, block, args, shared_mem=shared_mem)


@functools.lru_cache(maxsize=None)
def kernel(filename: str, name: str, instances: tuple[str, ...] = ()) -> Kernel:
    """The compiled kernel `name` of kernels/<filename> (compiled once per process;
    `instances` lists the template instantiations the file exports)."""
    return Kernel(nvrtc.module(filename, instances).get_function(name), name)


def blocks_1d(n: int, per_block: int = THREADS_1D) -> int:
    """Blocks that cover n items at per_block items a block."""
    return (n + per_block - 1) // per_block


def launch_grid_stride(filename: str, name: str, n: int, args: tuple) -> None:
    """A grid-stride 1-D kernel over n items: args + (n,) as int64."""
    if n:
        kernel(filename, name)((min(blocks_1d(n), MAX_GRID_1D),), (THREADS_1D,),
                               args + (np.int64(n),))


def device_cc() -> tuple[int, int]:
    """The current device's compute capability, e.g. (9, 0)."""
    return _device_cc(cp.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _device_cc(device_id: int) -> tuple[int, int]:
    cc = cp.cuda.Device(device_id).compute_capability          # e.g. "90"
    return int(cc[:-1]), int(cc[-1])


def is_oom(e: BaseException) -> bool:
    """Is e the device running out of memory (cupy's pool or a CUDA runtime call)?"""
    if cp is None:
        return False
    if isinstance(e, cp.cuda.memory.OutOfMemoryError):
        return True
    return isinstance(e, cp.cuda.runtime.CUDARuntimeError) and "MemoryAllocation" in str(e)


def sm_count() -> int:
    """The current device's SM count (the persistent kernels' grid)."""
    return _sm_count(cp.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    return int(cp.cuda.Device(device_id).attributes["MultiProcessorCount"])
