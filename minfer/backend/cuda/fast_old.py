"""The fast prefill path for long prompts: tensor cores in f16, f32 accumulation.

Building blocks, standalone (no dependence on cuda_quant's weight classes: they
take the raw device buffers, the quantization type and the shape):

    dequant_f16     kernels/dequant_f16.cu  q4_K (raw 144 B blocks), q6_K padded
                                            (224 B stride) or q6_K via its W_exp
                                            plane -> W16 (n_out, n_in) f16
    cast_f16        kernels/dequant_f16.cu  f32 -> f16 (RNE), 4 per thread
    gemm_f16        cuBLAS GemmEx           x16 (T, K) @ w16 (N, K)^T -> (T, N) f32 or f16
    linear_f16      the three above         x (T, n_in) f32, quantized W -> (T, n_out) f32
    store_kv_f16    kernels/dequant_f16.cu  K/V (T, n_kv, 128) f32 -> f16 cache rows pos0..
    flash_attention kernels/flash_attn.cu   causal GQA, mma.m16n8k16 f16 -> (T, n_head*128) f32

Numerics. The dequantized weight is the f32 value of the NumPy reference rounded
once to f16 (the kernels equal `np.float16(dequantize_rows(...))` bit for bit);
activations are rounded once to f16; products are exact in the tensor cores and
summed in f32. Attention rounds Q, K, V and the probabilities P to f16 and keeps
scores, the softmax and the accumulators in f32.

No host synchronisation: every call only queues work on the current stream.
Scratch (x16, w16, out) is passed in by the caller, allocated once for the
longest prompt and the largest weight (DESIGN.md: allocations once, CUDA graphs).

Plugging it in (the CUDA backend's choice, not made here): the KV cache of this
path is f16, (n_layer, n_ctx, n_kv, 128), and attention_f16 replaces store +
attention; linear_f16 replaces the MMQ linear for long prompts (optional
bias). The LM head (152064 x 3584 = 1.09 GB as f16) is better left to the
matvec/MMQ path, which needs one row. `python -m minfer.backend.cuda_fast`
times every piece on the 7B's shapes.
"""
from __future__ import annotations

import ctypes
import functools
import math

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from ...errors import MinferError
from . import nvrtc as kernels

try:
    import cupy as cp
except Exception as e:  # noqa: BLE001 - any import failure means no CUDA path
    cp = None
    _CUPY_ERROR = f"{type(e).__name__}: {e}"
else:
    _CUPY_ERROR = None

QK_K = 256
Q6K_PADDED = 224                 # = Q6K_PADDED in kernels/common.cuh (seed §2.3)
DEQ_THREADS = 256                # = __launch_bounds__ of the dequant kernels
FA_HD = 128                      # = FA_HD in kernels/flash_attn.cu
FA_BQ = 64                       # = FA_BQ (queries per block)
FA_THREADS = 128                 # = FA_THREADS (4 warps)

# cuBLAS / CUDA enum values (cublas_api.h, library_types.h; stable ABI)
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
CUBLAS_POINTER_MODE_HOST = 0
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT_TENSOR_OP = 99
CUDA_R_32F = 0
CUDA_R_16F = 2
CUBLAS_WORKSPACE_BYTES = 32 << 20   # a fixed workspace: no allocation inside a graph capture


def _require_cupy() -> None:
    if cp is None:
        raise MinferError(f"the CUDA fast path needs cupy ({_CUPY_ERROR}); "
                          "install minfer[cuda12] or minfer[cuda13]")


@functools.lru_cache(maxsize=None)
def _fn(filename: str, name: str):
    """The compiled kernel (NVRTC once per process, through backend.kernels)."""
    return kernels.function(filename, name)


def _dev(a, what: str, dtype, size: int | None = None, shape=None):
    """Argument check: a C-contiguous cupy array of dtype, 16-byte aligned (the
    kernels use 16-byte vector loads/stores), with the given size or shape."""
    if not isinstance(a, cp.ndarray) or a.dtype != dtype or not a.flags.c_contiguous:
        raise ValueError(f"{what}: expected a C-contiguous {np.dtype(dtype).name} cupy array, "
                         f"got {type(a).__name__} {getattr(a, 'dtype', '?')}")
    if a.data.ptr % 16:
        raise ValueError(f"{what}: device pointer {a.data.ptr:#x} is not 16-byte aligned")
    if size is not None and a.size != size:
        raise ValueError(f"{what}: {a.size} elements, expected {size}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{what}: shape {a.shape}, expected {tuple(shape)}")
    return a


def _view(scratch, shape, what: str, dtype):
    """The leading prod(shape) elements of a flat scratch buffer, as `shape`
    (or a new array when scratch is None)."""
    n = math.prod(shape)             # (math.prod: np.prod costs microseconds per launch)
    if scratch is None:
        return cp.empty(shape, dtype=dtype)
    if not isinstance(scratch, cp.ndarray) or scratch.dtype != dtype or not scratch.flags.c_contiguous:
        raise ValueError(f"{what}: expected a C-contiguous {np.dtype(dtype).name} cupy array")
    if scratch.size < n:
        raise ValueError(f"{what}: scratch holds {scratch.size} elements, {n} needed for {tuple(shape)}")
    return scratch.reshape(-1)[:n].reshape(shape)


def _grid(n_threads: int) -> tuple[int]:
    return ((n_threads + DEQ_THREADS - 1) // DEQ_THREADS,)


# --- dequantization to f16 ----------------------------------------------------
# qtype -> (kernel, outputs per thread, device bytes per 256-element super-block)
_DEQ = {
    QT.Q4_K: ("dequant_q4k_f16", 16, GGML_QUANT_SIZES[QT.Q4_K][1]),   # raw 144-byte blocks
    QT.Q6_K: ("dequant_q6k_f16", 16, Q6K_PADDED),                     # padded 224-byte stride
}
F16_QTYPES = frozenset(_DEQ)


def dequant_f16(raw, qtype, n_out: int, n_in: int, out=None, w_exp=None):
    """Quantized W (n_out, n_in) on the device -> W16 (n_out, n_in) f16.

    raw: uint8 device bytes, q4_K as stored (n_out * n_in/256 * 144) or q6_K padded
    (n_out * n_in/256 * 224); w_exp (q6_K only, optional): the W_exp plane, int8
    (n_out, n_in) = (ql | qh<<4) - 32, read instead of ql/qh (scales and d still
    come from the padded blocks). out: f16 scratch with >= n_out*n_in elements.
    """
    _require_cupy()
    qtype = QT(qtype)
    if qtype not in _DEQ:
        raise MinferError(f"no f16 dequantizer for {qtype.name} (have: "
                          f"{', '.join(t.name for t in _DEQ)})")
    if n_out <= 0 or n_in <= 0 or n_in % QK_K:
        raise ValueError(f"dequant_f16 {qtype.name}: shape ({n_out}, {n_in}) needs n_in a positive "
                         f"multiple of {QK_K}")
    name, per_thread, block_bytes = _DEQ[qtype]
    n_blocks = n_out * (n_in // QK_K)
    _dev(raw, f"dequant_f16 {qtype.name} raw", cp.uint8, size=n_blocks * block_bytes)
    w16 = _view(out, (n_out, n_in), "dequant_f16 out", cp.float16)                 # (n_out, n_in)
    _dev(w16, "dequant_f16 out", cp.float16)
    n_threads = n_out * n_in // per_thread
    if w_exp is None:
        _fn("dequant_f16.cu", name)(_grid(n_threads), (DEQ_THREADS,),
                                    (raw, w16, np.int64(n_threads)))
    else:
        if qtype != QT.Q6_K:
            raise ValueError(f"dequant_f16: a W_exp plane belongs to q6_K, not {qtype.name}")
        _dev(w_exp, "dequant_f16 q6_K W_exp", cp.int8, size=n_out * n_in)        # (n_out, n_in)
        _fn("dequant_f16.cu", "dequant_q6k_exp_f16")(_grid(n_threads), (DEQ_THREADS,),
                                                     (raw, w_exp, w16, np.int64(n_threads)))
    return w16


def dequant_bytes(qtype, n_out: int, n_in: int, w_exp: bool = False) -> int:
    """Device bytes one dequant_f16 call reads + writes (for GB/s in benchmarks)."""
    n_sb = n_out * (n_in // QK_K)
    if QT(qtype) == QT.Q4_K:
        read = n_sb * GGML_QUANT_SIZES[QT.Q4_K][1]
    elif w_exp:
        read = n_sb * (QK_K + 32)            # plane + the scale/d sector of each padded block
    else:
        read = n_sb * Q6K_PADDED
    return read + 2 * n_out * n_in


def cast_f16(x, out=None):
    """x f32 (any shape, size % 4 == 0) -> f16 of the same shape (round to nearest even)."""
    _require_cupy()
    _dev(x, "cast_f16 x", cp.float32)
    if x.size % 4:
        raise ValueError(f"cast_f16: {x.size} elements, need a multiple of 4")
    y = _view(out, x.shape, "cast_f16 out", cp.float16)
    _dev(y, "cast_f16 out", cp.float16)
    _launch_by4("cast_f32_f16", x.size // 4, (x, y))
    return y


def swiglu_f16(gate, up, out=None):
    """gate, up f16 (same shape, size % 4 == 0) -> silu(gate) * up, f16 (f32 math)."""
    _require_cupy()
    _dev(gate, "swiglu_f16 gate", cp.float16)
    _dev(up, "swiglu_f16 up", cp.float16, shape=gate.shape)
    if gate.size % 4:
        raise ValueError(f"swiglu_f16: {gate.size} elements, need a multiple of 4")
    y = _view(out, gate.shape, "swiglu_f16 out", cp.float16)
    _dev(y, "swiglu_f16 out", cp.float16)
    _launch_by4("swiglu_f16", gate.size // 4, (gate, up, y))
    return y


def _launch_by4(kernel: str, n4: int, args: tuple) -> None:
    """A grid-stride element-wise kernel of dequant_f16.cu over n4 groups of 4."""
    if n4:
        blocks = min((n4 + DEQ_THREADS - 1) // DEQ_THREADS, 65535)      # grid-stride beyond
        _fn("dequant_f16.cu", kernel)((blocks,), (DEQ_THREADS,), args + (np.int64(n4),))


# --- GEMM ---------------------------------------------------------------------
_ONE = np.ones(1, np.float32)     # host scalars: CUBLAS_COMPUTE_32F takes float alpha/beta,
_ZERO = np.zeros(1, np.float32)   # read at call time (host pointer mode), so capture-safe


def gemm_f16(x16, w16, out):
    """x16 (T, K) f16 @ w16 (N, K)^T -> out (T, N) f32 or f16; f32 accumulation.

    Row-major trick: out^T (N, T) in column-major is out (T, N) in row-major, and
    out^T = W X^T where W (N, K) row-major is the column-major (K, N) matrix with
    lda = K (so op(A) = T) and X (T, K) row-major is column-major (K, T), ldb = K.
    """
    _require_cupy()
    if x16.ndim != 2 or w16.ndim != 2:
        raise ValueError(f"gemm_f16: x16 {x16.shape} and w16 {w16.shape} must be 2-D")
    T, K = x16.shape
    N = w16.shape[0]
    _dev(x16, "gemm_f16 x16", cp.float16)
    _dev(w16, "gemm_f16 w16", cp.float16, shape=(N, K))
    if out is None or out.dtype not in (cp.float32, cp.float16):
        raise ValueError("gemm_f16: out must be a float32 or float16 cupy array")
    _dev(out, "gemm_f16 out", out.dtype, shape=(T, N))
    if T == 0:
        return out
    lib, handle = _cublas()
    _ok(lib.cublasSetStream_v2(handle, ctypes.c_void_p(cp.cuda.get_current_stream().ptr)),
        "cublasSetStream")
    c_type = CUDA_R_32F if out.dtype == cp.float32 else CUDA_R_16F
    _ok(lib.cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, N, T, K,
                         _ONE.ctypes.data, w16.data.ptr, CUDA_R_16F, K,
                         x16.data.ptr, CUDA_R_16F, K,
                         _ZERO.ctypes.data, out.data.ptr, c_type, N,
                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT_TENSOR_OP), "cublasGemmEx")
    return out


def _ok(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cuBLAS status {status}")


@functools.lru_cache(maxsize=None)
def _cublas_lib():
    """The libcublas that cupy loaded, through ctypes: cupy's own wrappers refuse
    to run inside a stream capture, while cuBLAS itself supports capture
    (with a fixed workspace, set in _cublas)."""
    cp.cuda.device.get_cublas_handle()              # makes cupy load libcublas
    paths = sorted({line.split()[-1] for line in open("/proc/self/maps")
                    if "/libcublas.so" in line})
    if not paths:
        raise MinferError("libcublas is not loaded in this process; cannot run the f16 GEMM")
    lib = ctypes.CDLL(paths[0])
    vp, i = ctypes.c_void_p, ctypes.c_int
    lib.cublasSetStream_v2.argtypes = [vp, vp]
    lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
    lib.cublasSetPointerMode_v2.argtypes = [vp, i]
    lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
    return lib


_WORKSPACES: dict = {}               # cuBLAS handle -> its workspace (kept alive)


def _cublas():
    """(lib, handle) for the current device, with host pointer mode and a fixed
    workspace set once per handle."""
    lib = _cublas_lib()
    handle = cp.cuda.device.get_cublas_handle()
    if handle not in _WORKSPACES:
        ws = cp.empty(CUBLAS_WORKSPACE_BYTES, cp.uint8)                        # (32 MiB,)
        _ok(lib.cublasSetWorkspace_v2(handle, ctypes.c_void_p(ws.data.ptr), ws.nbytes),
            "cublasSetWorkspace")
        _ok(lib.cublasSetPointerMode_v2(handle, CUBLAS_POINTER_MODE_HOST), "cublasSetPointerMode")
        _WORKSPACES[handle] = ws
    return lib, ctypes.c_void_p(handle)


def linear_f16(x, raw, qtype, n_out: int, n_in: int, out=None, x16=None, w16=None, w_exp=None,
               bias=None):
    """x (T, n_in) f32 @ W (n_out, n_in)^T [+ bias (n_out,) f32] -> (T, n_out) f32
    (or f16 if out is f16).

    x is rounded into the f16 scratch x16 (>= T*n_in), then `linear_f16_from`.
    raw / qtype / w_exp as in dequant_f16."""
    _require_cupy()
    _dev(x, "linear_f16 x", cp.float32)
    if x.ndim != 2 or x.shape[1] != n_in:
        raise ValueError(f"linear_f16: x has shape {x.shape}, expected (T, {n_in})")
    xh = cast_f16(x, _view(x16, x.shape, "linear_f16 x16", cp.float16))            # (T, n_in)
    return linear_f16_from(xh, raw, qtype, n_out, n_in, out, w16, w_exp, bias)


def linear_f16_from(xh, raw, qtype, n_out: int, n_in: int, out=None, w16=None, w_exp=None,
                    bias=None):
    """xh (T, n_in) f16 (already rounded) @ W (n_out, n_in)^T [+ bias] -> (T, n_out).

    W is dequantized into the f16 scratch w16 (>= n_out*n_in elements, the largest
    weight's size), then one cuBLAS GEMM; the bias is added in place, in f32.
    Several weights that read the same input (q/k/v, gate/up) share one xh."""
    if xh.ndim != 2 or xh.shape[1] != n_in:
        raise ValueError(f"linear_f16: x16 has shape {xh.shape}, expected (T, {n_in})")
    T = xh.shape[0]
    if out is None:
        out = cp.empty((T, n_out), dtype=cp.float32)                              # (T, n_out)
    wh = dequant_f16(raw, qtype, n_out, n_in, w16, w_exp)                          # (n_out, n_in)
    gemm_f16(xh, wh, out)
    if bias is not None:
        if out.dtype != cp.float32:
            raise ValueError("linear_f16: a bias needs a float32 out")
        _dev(bias, "linear_f16 bias", cp.float32, shape=(n_out,))
        out += bias                                                                # (T, n_out)
    return out


# --- attention ----------------------------------------------------------------
def store_kv_f16(k, v, k_cache, v_cache, pos0: int) -> None:
    """k, v (T, n_kv, hd) f32 -> rows pos0..pos0+T-1 of one layer's f16 caches
    k_cache, v_cache (n_ctx, n_kv, hd)."""
    _require_cupy()
    T = k.shape[0]
    n_ctx = k_cache.shape[0]
    for a, c, nm in ((k, k_cache, "k"), (v, v_cache, "v")):
        _dev(a, f"store_kv_f16 {nm}", cp.float32)
        _dev(c, f"store_kv_f16 {nm}_cache", cp.float16)
        if a.ndim != 3 or c.ndim != 3 or a.shape != k.shape or a.shape[1:] != c.shape[1:] \
                or c.shape != k_cache.shape:
            raise ValueError(f"store_kv_f16: {nm} {a.shape} does not fit the cache {c.shape}")
    if pos0 < 0 or pos0 + T > n_ctx:
        raise MinferError(f"positions {pos0}..{pos0 + T - 1} do not fit the KV cache of {n_ctx}")
    for a, c in ((k, k_cache), (v, v_cache)):
        cast_f16(a, c[pos0:pos0 + T])        # a contiguous run of rows: a view, no copy


def flash_attention(q16, k_cache, v_cache, pos0: int, out=None):
    """q16 (T, n_head, 128) f16; k_cache, v_cache (n_ctx, n_kv, 128) f16 holding
    positions 0..pos0+T-1 -> out (T, n_head*128) f32: causal GQA softmax(q k^T /
    sqrt(128)) v over keys 0..pos0+t for query t (head h reads kv head
    h // (n_head / n_kv)). No T x T buffer: key tiles are streamed (online softmax)."""
    _require_cupy()
    _dev(q16, "flash_attention q16", cp.float16)
    if q16.ndim != 3 or q16.shape[2] != FA_HD:
        raise ValueError(f"flash_attention: q16 has shape {q16.shape}, expected (T, n_head, {FA_HD})")
    T, n_head, _ = q16.shape
    _dev(k_cache, "flash_attention k_cache", cp.float16)
    _dev(v_cache, "flash_attention v_cache", cp.float16, shape=k_cache.shape)
    if k_cache.ndim != 3 or k_cache.shape[2] != FA_HD:
        raise ValueError(f"flash_attention: cache shape {k_cache.shape}, expected (n_ctx, n_kv, {FA_HD})")
    n_ctx, n_kv, _ = k_cache.shape
    if n_kv < 1 or n_head % n_kv:
        raise ValueError(f"flash_attention: {n_head} query heads do not group over {n_kv} KV heads")
    if pos0 < 0 or pos0 + T > n_ctx:
        raise MinferError(f"positions {pos0}..{pos0 + T - 1} do not fit the KV cache of {n_ctx}")
    if out is None:
        out = cp.empty((T, n_head * FA_HD), dtype=cp.float32)                     # (T, n_head*128)
    _dev(out, "flash_attention out", cp.float32, shape=(T, n_head * FA_HD))
    if T:
        scale_log2 = math.log2(math.e) / math.sqrt(FA_HD)   # scores in the log2 domain (exp2f)
        _fn("flash_attn.cu", "flash_attn_f16")(
            ((T + FA_BQ - 1) // FA_BQ, n_head), (FA_THREADS,),
            (q16, k_cache, v_cache, out, np.int32(T), np.int32(n_head), np.int32(n_kv),
             np.int32(pos0), np.float32(scale_log2)))
    return out


def attention_f16(q, k, v, k_cache, v_cache, pos0: int, out=None, q16=None):
    """The Backend.attention op on the fast path: q (T, n_head, 128), k/v (T, n_kv, 128)
    f32; stores k/v into the f16 caches at pos0.., rounds q into the f16 scratch
    q16 (>= T*n_head*128), then flash_attention -> (T, n_head*128) f32."""
    store_kv_f16(k, v, k_cache, v_cache, pos0)
    qh = cast_f16(q, _view(q16, q.shape, "attention_f16 q16", cp.float16))         # (T, n_head, 128)
    return flash_attention(qh, k_cache, v_cache, pos0, out)


# --- event-timed benchmark on the 7B's shapes (python -m minfer.backend.cuda_fast) ----
# DeepSeek-R1-Distill-Qwen-7B: d 3584, d_ff 18944, 28 q heads / 4 kv heads of 128, 28 layers.
# Q4_K_M stores attn_v and ffn_down as q6_K in about half of the layers; the table
# times both q6_K forms for them.
BENCH_7B = (
    ("attn_q", QT.Q4_K, 3584, 3584),
    ("attn_k", QT.Q4_K, 512, 3584),
    ("attn_v", QT.Q6_K, 512, 3584),
    ("attn_output", QT.Q4_K, 3584, 3584),
    ("ffn_gate", QT.Q4_K, 18944, 3584),
    ("ffn_up", QT.Q4_K, 18944, 3584),
    ("ffn_down", QT.Q6_K, 3584, 18944),
)


def _time_ms(fn, reps: int = 20) -> float:
    """Median milliseconds of fn() on the current stream (CUDA events, 3 warm-ups)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b))
    return float(np.median(times))


def _bench_weight(qtype, n_out: int, n_in: int):
    """Random device bytes of a (n_out, n_in) weight with finite scales (0.01)."""
    n_sb = n_out * (n_in // QK_K)
    stride, d_at = ((GGML_QUANT_SIZES[QT.Q4_K][1], (0, 2)) if qtype == QT.Q4_K
                    else (Q6K_PADDED, (208,)))
    raw = cp.random.randint(0, 256, (n_sb, stride), dtype=cp.int32).astype(cp.uint8)
    d = cp.asarray(np.frombuffer(np.float16(0.01).tobytes(), np.uint8))
    for off in d_at:
        raw[:, off:off + 2] = d
    return raw.reshape(-1)


def bench(tokens=(512, 3325)) -> None:
    _require_cupy()
    w16 = cp.empty(18944 * 3584, cp.float16)                          # largest weight, f16
    print(f"{'op':<28}{'ms':>9}{'GB/s':>9}{'TFLOP/s':>9}")
    deq_ms = {}
    for name, qt, n_out, n_in in BENCH_7B:
        raw = _bench_weight(qt, n_out, n_in)
        forms = [(False, None)]
        if qt == QT.Q6_K:
            forms.append((True, cp.random.randint(-32, 32, n_out * n_in, dtype=cp.int32).astype(cp.int8)))
        for is_exp, plane in forms:
            ms = _time_ms(lambda: dequant_f16(raw, qt, n_out, n_in, w16, plane))
            gbs = dequant_bytes(qt, n_out, n_in, is_exp) / ms / 1e6
            label = f"dequant {name}{' (W_exp)' if is_exp else ''}"
            print(f"{label:<28}{ms:9.3f}{gbs:9.0f}{'':>9}")
            deq_ms.setdefault(name, ms)
    for T in tokens:
        x16 = cp.random.standard_normal((T, 18944)).astype(cp.float16)
        layer_ms = sum(deq_ms.values())
        for name, qt, n_out, n_in in BENCH_7B:
            xs = x16[:, :n_in].copy()
            ws = w16[: n_out * n_in].reshape(n_out, n_in)
            for dt in (cp.float32, cp.float16):
                out = cp.empty((T, n_out), dt)
                ms = _time_ms(lambda: gemm_f16(xs, ws, out))
                if dt == cp.float32:
                    layer_ms += ms
                print(f"{f'gemm T={T} {name} ->{np.dtype(dt).name}':<28}{ms:9.3f}{'':>9}"
                      f"{2 * T * n_out * n_in / ms / 1e9:9.1f}")
        n_head, n_kv = 28, 4
        q16 = cp.random.standard_normal((T, n_head, FA_HD)).astype(cp.float16)
        kc = cp.random.standard_normal((T, n_kv, FA_HD)).astype(cp.float16)
        vc = cp.random.standard_normal((T, n_kv, FA_HD)).astype(cp.float16)
        o = cp.empty((T, n_head * FA_HD), cp.float32)
        ms = _time_ms(lambda: flash_attention(q16, kc, vc, 0, o))
        flops = 4 * FA_HD * n_head * T * (T + 1) / 2                 # QK^T and PV over the causal half
        layer_ms += ms
        print(f"{f'flash_attn T={T} 28/4 heads':<28}{ms:9.3f}{'':>9}{flops / ms / 1e9:9.1f}")
        print(f"  -> 28 layers x (dequant + gemm f32 + attention) = {28 * layer_ms:.1f} ms, "
              f"{T / (28 * layer_ms / 1e3):,.0f} tok/s before norms, rope, swiglu and the LM head")


if __name__ == "__main__":
    bench()
