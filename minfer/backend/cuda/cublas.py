"""cuBLAS GemmEx through ctypes, on a handle of our own.

cupy's cuBLAS wrappers refuse to run while a stream is being captured, while
cuBLAS itself supports capture, given a fixed workspace (no allocation inside
the capture). So the library is loaded through cuda.pathfinder (installed with
cupy; it returns the copy already in the process when cupy loaded one) and
called directly. Setting a handle's stream resets its workspace to cuBLAS's own
pool (cuBLAS documentation, cublasSetStream), so the workspace is set again
after every stream change.
"""
from __future__ import annotations

import ctypes
import functools

from ...errors import MinferError
from .launch import check, cp

# cuBLAS / CUDA enum values (cublas_api.h, library_types.h; stable ABI)
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_POINTER_MODE_HOST = 0
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT_TENSOR_OP = 99
CUDA_R_32F, CUDA_R_16F = 0, 2
WORKSPACE_BYTES = 32 << 20

_ONE = ctypes.c_float(1.0)       # host scalars: CUBLAS_COMPUTE_32F takes float alpha/beta,
_ZERO = ctypes.c_float(0.0)      # read at call time (host pointer mode), so capture-safe


def _ok(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cuBLAS status {status}")


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
        path = load_nvidia_dynamic_lib("cublas").abs_path
    except Exception as e:  # noqa: BLE001 - not found / not installed: one line
        raise MinferError(f"cuBLAS not found ({type(e).__name__}: {e}); install minfer[cuda12] "
                          f"or minfer[cuda13]") from None
    if not path:
        raise MinferError("cuBLAS not found: cuda.pathfinder returned no path")
    lib = ctypes.CDLL(path)
    vp, i = ctypes.c_void_p, ctypes.c_int
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
    lib.cublasSetStream_v2.argtypes = [vp, vp]
    lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
    lib.cublasSetPointerMode_v2.argtypes = [vp, i]
    lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
    return lib


class _Handle:
    """One cuBLAS handle (this process's current device) with its fixed workspace."""

    def __init__(self):
        self.lib = _library()
        self.ptr = ctypes.c_void_p()
        _ok(self.lib.cublasCreate_v2(ctypes.byref(self.ptr)), "cublasCreate")
        _ok(self.lib.cublasSetPointerMode_v2(self.ptr, CUBLAS_POINTER_MODE_HOST), "cublasSetPointerMode")
        self.workspace = cp.empty(WORKSPACE_BYTES, cp.uint8)                  # (32 MiB,)
        self.stream = None

    def on(self, stream_ptr: int) -> "_Handle":
        """Point the handle at a stream (and its workspace again, which the stream change reset)."""
        if stream_ptr != self.stream:
            _ok(self.lib.cublasSetStream_v2(self.ptr, ctypes.c_void_p(stream_ptr)), "cublasSetStream")
            _ok(self.lib.cublasSetWorkspace_v2(self.ptr, ctypes.c_void_p(self.workspace.data.ptr),
                                               WORKSPACE_BYTES), "cublasSetWorkspace")
            self.stream = stream_ptr
        return self


@functools.lru_cache(maxsize=1)
def _handle() -> _Handle:
    return _Handle()


def gemm_f16(x16, w16, out, accumulate: bool = False):
    """x16 (T, K) f16 @ w16 (N, K)^T -> out (T, N) f32 or f16; f32 accumulation.
    accumulate: out += the product (beta = 1: the residual add in the GEMM's store).

    Row-major trick: out^T (N, T) in column-major is out (T, N) in row-major, and
    out^T = W X^T where W (N, K) row-major is the column-major (K, N) matrix with
    lda = K (so op(A) = T) and X (T, K) row-major is column-major (K, T), ldb = K.
    """
    check(x16, "gemm_f16 x16", cp.float16, ndim=2, align16=True)
    T, n = x16.shape
    N = w16.shape[0] if w16.ndim == 2 else -1
    check(w16, "gemm_f16 w16", cp.float16, (N, n), align16=True)
    if out is None or out.dtype not in (cp.float32, cp.float16):
        raise ValueError("gemm_f16: out must be a float32 or float16 cupy array")
    check(out, "gemm_f16 out", out.dtype, (T, N), align16=True)
    if T == 0:
        return out
    h = _handle().on(cp.cuda.get_current_stream().ptr)
    c_type = CUDA_R_32F if out.dtype == cp.float32 else CUDA_R_16F
    _ok(h.lib.cublasGemmEx(h.ptr, CUBLAS_OP_T, CUBLAS_OP_N, N, T, n,
                           ctypes.byref(_ONE), w16.data.ptr, CUDA_R_16F, n,
                           x16.data.ptr, CUDA_R_16F, n,
                           ctypes.byref(_ONE if accumulate else _ZERO), out.data.ptr, c_type, N,
                           CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT_TENSOR_OP), "cublasGemmEx")
    return out
