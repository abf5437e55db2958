"""f16 GEMMs through cuBLASLt (ctypes, a handle of our own), the algorithm picked here.

Why cuBLASLt and not cublasGemmEx: cuBLAS picks a kernel for each exact problem
(the prompt length is one of its dimensions) and loads a kernel the first time it
runs it, 3-5 ms apiece (H200: a prompt of a length never seen before paid ~10 ms
across the 7B's four GEMM shapes, against ~17 ms for the whole forward at 512
tokens). cuBLASLt shows the heuristic's ranked candidates, so the choice is ours:

- the first time a weight shape (N, K, output type) is seen, the first choices at
  a fixed grid of prompt lengths are loaded (a small GEMM per kernel, and one
  with beta = 1 for an f32 output; ~0.06 s per shape on the 7B, inside
  Engine.warmup's prefills);
- eager work takes the heuristic's best candidate among the kernels loaded for
  its shape (a one-shot prompt pays a heuristic query, ~0.1 ms per shape, not
  kernel loads); work recorded for replay (a CUDA graph's capture and the warm
  run before it, `best_kernels()`) takes the heuristic's first choice, whose
  load is paid once for all the replays (the preloaded alternative runs up to
  ~5% slower, measured at 3,325 tokens).

Candidates that split K are left out (unless there is no other): every remaining
kernel sums each output over K in the same order, so whichever runs gives the
same bits (tests/gpu/test_fast.py checks it) and the policy above cannot change
a result.

Capture: cupy's cuBLAS wrappers refuse to run while a stream is being captured;
cuBLASLt supports capture given a fixed workspace (no allocation inside), which
every call passes. A shape is always seen eagerly before any capture (graphs
capture only work that ran once before). The library is found through
cuda.pathfinder (installed with cupy; it returns the copy already in the process
when cupy loaded one).
"""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools

from ...errors import MinferError
from . import dependent
from .launch import LAUNCHES, check, cp

# cuBLAS / cuBLASLt enum values (cublas_api.h, cublasLt.h, library_types.h; stable ABI)
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_COMPUTE_32F = 68
CUDA_R_32F, CUDA_R_16F = 0, 2
DESC_TRANSA, DESC_TRANSB = 3, 4                         # cublasLtMatmulDescAttributes_t
PREF_MAX_WORKSPACE_BYTES = 1                            # cublasLtMatmulPreferenceAttributes_t
PREF_MIN_ALIGNMENT = (5, 6, 7, 8)                       # ..._MIN_ALIGNMENT_{A,B,C,D}_BYTES
# cublasLtMatmulAlgoConfigAttributes_t that select the kernels a launch loads (the GEMM
# kernel, and the reduction's when split-K reduces separately), with their sizes; the
# split count and the CTA swizzle are launch parameters of the same kernels
KERNEL_CONFIG = ((0, 4), (1, 4), (3, 4), (5, 4), (6, 4), (7, 2), (8, 2))
#                ID      TILE    REDUCTION CUSTOM STAGES  INNER   CLUSTER
CONFIG_SPLITK_NUM = 2
WORKSPACE_BYTES = 32 << 20
CANDIDATES = 8                 # heuristic results looked at per problem
GRID_STEP, GRID_MAX = 64, 4096  # the preload grid: 2..32, then every 64 up to 4,096 tokens

_BEST = contextvars.ContextVar("minfer_gemm_best_kernels", default=False)
_ONE = ctypes.c_float(1.0)       # host scalars (f32 scale type), read at call time
_ZERO = ctypes.c_float(0.0)      # (host pointer mode), so capture-safe


class _Algo(ctypes.Structure):           # cublasLtMatmulAlgo_t
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):      # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _ok(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cuBLAS status {status}")


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
        path = load_nvidia_dynamic_lib("cublasLt").abs_path
    except Exception as e:  # noqa: BLE001 - not found / not installed: one line
        raise MinferError(f"cuBLASLt not found ({type(e).__name__}: {e}); install minfer[cuda12] "
                          f"or minfer[cuda13]") from None
    if not path:
        raise MinferError("cuBLASLt not found: cuda.pathfinder returned no path")
    lib = ctypes.CDLL(path)
    vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    lib.cublasLtCreate.argtypes = [ctypes.POINTER(vp)]
    lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(vp), i, i]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, i, vp, sz]
    lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(vp), i, ctypes.c_uint64,
                                               ctypes.c_uint64, ctypes.c_int64]
    lib.cublasLtMatmulPreferenceCreate.argtypes = [ctypes.POINTER(vp)]
    lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, i, vp, sz]
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, i,
                                                   ctypes.POINTER(_Heuristic), ctypes.POINTER(i)]
    lib.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [ctypes.POINTER(_Algo), i, vp, sz,
                                                         ctypes.POINTER(sz)]
    lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp,
                                   ctypes.POINTER(_Algo), vp, sz, vp]
    return lib


def _config(algo: _Algo, attr: int, size: int = 4) -> int:
    v = ctypes.c_uint32(0)
    _ok(_library().cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), size,
                                                        ctypes.byref(ctypes.c_size_t())),
        "cublasLtMatmulAlgoConfigGetAttribute")
    return v.value


def _kernel_key(algo: _Algo) -> tuple[int, ...]:
    """The configuration attributes that select the kernels cuBLASLt loads."""
    return tuple(_config(algo, attr, size) for attr, size in KERNEL_CONFIG)


def _alignment(*ptrs: int) -> int:
    """The largest power of two up to 256 dividing every pointer (the heuristic must
    not pick a kernel that assumes more than the operands have)."""
    a = 256
    while a > 16 and any(p % a for p in ptrs):
        a //= 2
    return a


def preload_grid() -> list[int]:
    """The prompt lengths whose first-choice kernels a shape preloads."""
    return [2, 4, 8, 16, 32] + list(range(GRID_STEP, GRID_MAX + 1, GRID_STEP))


class _Lt:
    """One cuBLASLt handle (this process's current device), its fixed workspace, the
    kernels preloaded per weight shape and the algorithm of each problem once chosen."""

    def __init__(self):
        self.lib = lib = _library()
        self.ptr = ctypes.c_void_p()
        _ok(lib.cublasLtCreate(ctypes.byref(self.ptr)), "cublasLtCreate")
        self.desc = ctypes.c_void_p()
        _ok(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
            "cublasLtMatmulDescCreate")
        for attr, op in ((DESC_TRANSA, CUBLAS_OP_T), (DESC_TRANSB, CUBLAS_OP_N)):
            v = ctypes.c_int32(op)
            _ok(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4),
                "cublasLtMatmulDescSetAttribute")
        self.workspace = cp.empty(WORKSPACE_BYTES, cp.uint8)                  # (32 MiB,)
        self._layouts: dict[tuple, ctypes.c_void_p] = {}
        self._prefs: dict[int, ctypes.c_void_p] = {}
        # problem -> (the eager algorithm, the heuristic's first choice)
        self._plans: dict[tuple, tuple[_Algo, _Algo]] = {}
        self.preloaded: dict[tuple, set] = {}     # (N, K, C type) -> kernel keys loaded for it
        self.stats = {"problems": 0, "first choice": 0, "preloaded alternative": 0,
                      "not preloaded": 0, "preloaded kernels": 0}

    def _layout(self, dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        key = (dtype, rows, cols, ld)
        if key not in self._layouts:
            lay = ctypes.c_void_p()
            _ok(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype, rows, cols, ld),
                "cublasLtMatrixLayoutCreate")
            self._layouts[key] = lay
        return self._layouts[key]

    def _pref(self, align: int) -> ctypes.c_void_p:
        if align not in self._prefs:
            p = ctypes.c_void_p()
            _ok(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(p)), "cublasLtMatmulPreferenceCreate")
            ws = ctypes.c_uint64(WORKSPACE_BYTES)
            _ok(self.lib.cublasLtMatmulPreferenceSetAttribute(p, PREF_MAX_WORKSPACE_BYTES,
                                                              ctypes.byref(ws), 8),
                "cublasLtMatmulPreferenceSetAttribute")
            a = ctypes.c_uint32(align)
            for attr in PREF_MIN_ALIGNMENT:
                _ok(self.lib.cublasLtMatmulPreferenceSetAttribute(p, attr, ctypes.byref(a), 4),
                    "cublasLtMatmulPreferenceSetAttribute")
            self._prefs[align] = p
        return self._prefs[align]

    def _operands(self, N: int, K: int, T: int, c_type: int):
        """Row-major out (T, N) = x (T, K) @ W (N, K)^T as cuBLAS's column-major
        out^T (N, T) = op(W) X^T: W row-major is the column-major (K, N) matrix with
        ld = K, taken transposed; x row-major is column-major (K, T), ld = K."""
        return (self._layout(CUDA_R_16F, K, N, K), self._layout(CUDA_R_16F, K, T, K),
                self._layout(c_type, N, T, N))

    def candidates(self, N: int, K: int, T: int, c_type: int, align: int = 256) -> list[_Algo]:
        """The heuristic's algorithms for the problem, best first; those that split K
        only when there is nothing else."""
        a, b, c = self._operands(N, K, T, c_type)
        res, n = (_Heuristic * CANDIDATES)(), ctypes.c_int(0)
        _ok(self.lib.cublasLtMatmulAlgoGetHeuristic(self.ptr, self.desc, a, b, c, c, self._pref(align),
                                                    CANDIDATES, res, ctypes.byref(n)),
            "cublasLtMatmulAlgoGetHeuristic")
        out = [res[j].algo for j in range(n.value) if res[j].state == 0]
        if not out:
            raise MinferError(f"cuBLASLt has no f16 GEMM algorithm for ({T} x {K}) @ ({N} x {K})^T")
        return [alg for alg in out if _config(alg, CONFIG_SPLITK_NUM) <= 1] or out[:1]

    def algo(self, N: int, K: int, T: int, c_type: int, align: int, best: bool) -> _Algo:
        """The problem's algorithm: best, the heuristic's first choice; else the
        best candidate among the kernels preloaded for its shape (the first choice
        when none is)."""
        key = (N, K, T, c_type, align)
        plan = self._plans.get(key)
        if plan is None:
            loaded = self._preload((N, K, c_type))
            cands = self.candidates(N, K, T, c_type, align)
            eager = next((c for c in cands if _kernel_key(c) in loaded), None)
            self.stats["problems"] += 1
            self.stats["not preloaded" if eager is None else "first choice" if eager is cands[0]
                       else "preloaded alternative"] += 1
            plan = self._plans[key] = (cands[0] if eager is None else eager, cands[0])
        return plan[1] if best else plan[0]

    def _preload(self, shape: tuple[int, int, int]) -> set:
        """The kernel keys of the shape's first choices over preload_grid(), each new
        kernel loaded by a GEMM of 64 rows (made once per shape); with an f32 output
        (the GEMMs that may accumulate into the residual) also by one with beta = 1:
        a kernel preloaded with beta = 0 only took ~5 ms more on its first launch with
        beta = 1 than after (H200; scripts/bench/bench_ops.py times the GEMMs)."""
        loaded = self.preloaded.get(shape)
        if loaded is not None:
            return loaded
        N, K, c_type = shape
        stream = cp.cuda.get_current_stream()
        if stream.is_capturing():
            raise RuntimeError(f"GEMM shape {shape} first seen inside a CUDA graph capture: "
                               f"its kernels would be preloaded into the graph")
        todo = {}
        for T in preload_grid():
            algo = self.candidates(N, K, T, c_type)[0]
            todo.setdefault(_kernel_key(algo), algo)
        t_run = 64
        w = cp.empty((N, K), cp.float16)            # contents unused: the GEMM only loads its kernel
        x = cp.zeros((t_run, K), cp.float16)
        out = cp.zeros((t_run, N), cp.float32 if c_type == CUDA_R_32F else cp.float16)
        betas = (_ZERO, _ONE) if c_type == CUDA_R_32F else (_ZERO,)
        for algo in todo.values():
            for beta in betas:
                self.matmul(x, w, out, beta, algo, stream.ptr)
        stream.synchronize()
        self.preloaded[shape] = loaded = set(todo)
        self.stats["preloaded kernels"] += len(loaded)
        return loaded

    def matmul(self, x16, w16, out, beta: ctypes.c_float, algo: _Algo, stream_ptr: int) -> None:
        T, K = x16.shape
        N = w16.shape[0]
        a, b, c = self._operands(N, K, T, CUDA_R_32F if out.dtype == cp.float32 else CUDA_R_16F)
        _ok(self.lib.cublasLtMatmul(self.ptr, self.desc, ctypes.byref(_ONE), w16.data.ptr, a,
                                    x16.data.ptr, b, ctypes.byref(beta), out.data.ptr, c,
                                    out.data.ptr, c, ctypes.byref(algo), self.workspace.data.ptr,
                                    WORKSPACE_BYTES, ctypes.c_void_p(stream_ptr)), "cublasLtMatmul")


@functools.lru_cache(maxsize=1)
def _lt() -> _Lt:
    return _Lt()


def gemm_f16(x16, w16, out, accumulate: bool = False):
    """x16 (T, K) f16 @ w16 (N, K)^T -> out (T, N) f32 or f16; f32 accumulation.
    accumulate: out += the product (beta = 1: the residual add in the GEMM's store)."""
    check(x16, "gemm_f16 x16", cp.float16, ndim=2, align16=True)
    T, n = x16.shape
    N = w16.shape[0] if w16.ndim == 2 else -1
    check(w16, "gemm_f16 w16", cp.float16, (N, n), align16=True)
    if out is None or out.dtype not in (cp.float32, cp.float16):
        raise ValueError("gemm_f16: out must be a float32 or float16 cupy array")
    check(out, "gemm_f16 out", out.dtype, (T, N), align16=True)
    if T == 0:
        return out
    lt = _lt()
    c_type = CUDA_R_32F if out.dtype == cp.float32 else CUDA_R_16F
    algo = lt.algo(N, n, T, c_type, _alignment(x16.data.ptr, w16.data.ptr, out.data.ptr), _BEST.get())
    lt.matmul(x16, w16, out, _ONE if accumulate else _ZERO, algo, cp.cuda.get_current_stream().ptr)
    LAUNCHES["cublasLt matmul"] += 1
    dependent.library_launch()
    return out


def gemm_w16(xh, w16, out=None, bias=None, accumulate: bool = False):
    """xh (T, n_in) f16 @ w16 (n_out, n_in)^T f16 [+ bias] -> (T, n_out) f32 (or f16
    when out is f16); accumulate: out += the product (out holds the residual). The
    bias is added after the GEMM, in place, in f32."""
    n_out = w16.shape[0]
    if accumulate and bias is not None:
        raise ValueError("gemm_w16: a bias with accumulate would add in another order than "
                         "(x @ W^T + bias) + addend")
    if out is None:
        if accumulate:
            raise ValueError("gemm_w16: accumulate needs an out holding the addend")
        out = cp.empty((xh.shape[0], n_out), dtype=cp.float32)                    # (T, n_out)
    gemm_f16(xh, w16, out, accumulate)
    if bias is not None:
        if out.dtype != cp.float32:
            raise ValueError("gemm_w16: a bias needs a float32 out")
        check(bias, "gemm_w16 bias", cp.float32, (n_out,))
        out += bias                                                               # (T, n_out)
    return out


@contextlib.contextmanager
def best_kernels():
    """GEMMs inside take the heuristic's first choice for their problem (work that
    will be replayed, so a kernel load is worth paying)."""
    token = _BEST.set(True)
    try:
        yield
    finally:
        _BEST.reset(token)


def stats() -> dict[str, int]:
    """Problems (shape and prompt length) met so far and what eager work runs for
    each: the heuristic's first choice, preloaded; a preloaded alternative to it; a
    kernel not preloaded (loaded on first use); and the kernels preloaded over all
    shapes."""
    return dict(_lt().stats)
