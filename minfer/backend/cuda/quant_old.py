"""Quantized weights on the GPU: registration (q6_K padded + its W_exp plane),
the int8 MMQ GEMMs (T > 1), the matvec kernels (T == 1) and embedding rows.

One Python wrapper per kernel (checks dtype/shape/contiguity, computes the grid,
launches); `QuantState` owns the settings, the W_exp map and the launch-path
counters, and is what the CUDA backend calls.

    quantize_q8_1  kernels/quantize.cu  x f32 (T, K) -> q8_1 blocks of 32
    mmq_q4k        kernels/mmq.cu       64x64 output tiles, int8 mma m16n8k16
    mmq_q6k        kernels/mmq.cu       mmq_q6k_bt<KDR, EXP> (seed §3): EXP=true
                                        stages B by cp.async from the W_exp plane
    matvec_q4k/q6k kernels/matvec.cu    x f32 (K,), one warp per row
    dequant_rows   kernels/dequant.cu   embedding rows, bit-identical to quants
    linear_f16     cuda_fast.py         T >= F16_GEMM_MIN_T: W -> f16 scratch, cuBLAS

Which engine a GEMM takes is decided here by the token count T (docs/PERF.md
has the measurements behind F16_GEMM_MIN_T): T == 1 matvec, 1 < T < F16_GEMM_MIN_T
int8 MMQ, longer prompts dequantize W into an f16 scratch (for q6_K plane
tensors: from the W_exp plane) and run one cuBLAS GEMM with f32 accumulation.
The q6_K launch label (exp / exp=off / fallback! / raw) says where B came from
in either engine; the engine has its own counter (q6k_mmq / q6k_f16 ...).

The W_exp bundle (seed/000 §2.3, §3.1, §3.2, §3.3 pitfall #1):
- planes exist only for the q6_K tensors `blk.N.attn_v.weight`,
  `blk.N.ffn_down.weight` and `output.weight`, and only when
  MINFER_MMQ_Q6K_EXP != "0";
- a plane is registered under `{name}__exp{od}x{id}` (so a same-name
  re-registration with another shape can never pick up a stale plane), and
  the map that launches consult is keyed by the PADDED weight's device pointer;
- a registration failure leaves the map without that key, warns loudly once
  per process, and its launches take EXP=false and count `fallback!`.

Environment (read once, in QuantState()):
    MINFER_MMQ_Q6K_EXP=0          register no planes (every q6_K GEMM counts `exp=off`)
    MINFER_FFN_F16=0              FFN intermediates in f32 (no fused f16 FFN)
    MINFER_MMQ_RAW_NB_DEBUG=1     print the launch-path counts at exit, one line each
    MINFER_TEST_FORCE_EXP_MISS=1  test only: simulate a failed plane registration
"""
from __future__ import annotations

import atexit
import os
import re
import sys
import weakref
from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from ... import quants
from ...errors import MinferError
from . import fast_old as cuda_fast, nvrtc as kernels

try:
    import cupy as cp
except Exception:  # noqa: BLE001 - the CUDA backend reports the import problem
    cp = None

# = the constants of kernels/mmq.cu and kernels/matvec.cu
MMQ_BM, MMQ_BN, MMQ_THREADS = 64, 64, 256
MMQ_KDR = 2                          # 32-element k-chunks per pipeline tile (k-tile 64)
MV_ROWS = 8                          # matvec rows per 256-thread block (one warp each)
QK_K = quants.QK_K
from .q6k_layout import Q6K_PADDED, expand_q6k_dense, pad_q6k

_MMQ_NAMES = (f"mmq_q4k<{MMQ_KDR}>", f"mmq_q6k_bt<{MMQ_KDR}, true>", f"mmq_q6k_bt<{MMQ_KDR}, false>")

# the q6_K tensors that get a W_exp plane (seed §2.3)
_PLANE_NAME = re.compile(r"blk\.\d+\.(attn_v|ffn_down)\.weight|output\.weight")

# launch paths, as counters() and the exit report name them
PATHS = ("q4k_mmq", "q6k_mmq", "q4k_f16", "q6k_f16",
         "q6k exp", "q6k exp=off", "q6k fallback!", "q6k raw",
         "q4k_mv", "q6k_mv", "f32_gemm")

# Prefill GEMMs of at least this many tokens take the f16 cuBLAS path, shorter
# ones the int8 MMQ. Measured on the H200 at the 7B's shapes (scripts/gemm_paths.py,
# docs/PERF.md "GEMM engine by prompt length"): the f16 path wins for the layer
# as a whole from T = 2 up, eager (0.65x the MMQ time at T = 2) and as device time
# (0.36x), so every prefill GEMM takes it; MMQ (with the W_exp bundle) serves the
# tables kept out of the f16 scratch (the LM head over many positions: perplexity,
# teacher forcing) and any caller that moves f16_min_t.
F16_GEMM_MIN_T = 2

# tables, not linears of the layer stack: never dequantized whole into the f16
# scratch (the 7B's LM head alone would need a 1.09 GB scratch; it sees one row
# in prefill and takes matvec, or MMQ when all positions' logits are asked for)
_NO_F16 = frozenset({"token_embd.weight", "output.weight"})

_EMBED_KERNEL = {QT.Q4_K: "dequant_rows_q4k", QT.Q6_K: "dequant_rows_q6k",
                 QT.Q8_0: "dequant_rows_q8_0", QT.F16: "dequant_rows_f16",
                 QT.F32: "dequant_rows_f32"}

_exp_miss_warned = False             # one loud warning per process


def _null():
    return np.uint64(0)              # a nullptr kernel argument


def _ptr_or_null(a):
    return _null() if a is None else a


def _check(a, dtype, shape, what: str):
    if not isinstance(a, cp.ndarray) or a.dtype != dtype or not a.flags.c_contiguous:
        raise ValueError(f"{what}: expected a C-contiguous {np.dtype(dtype).name} cupy array, "
                         f"got {type(a).__name__} {getattr(a, 'dtype', '?')}")
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{what}: shape {tuple(a.shape)}, expected {tuple(shape)}")
    return a


def _out(out, shape, what: str):
    if out is None:
        return cp.empty(shape, dtype=cp.float32)
    return _check(out, cp.float32, shape, what)


# --------------------------------------------------------------------------- #
# one wrapper per kernel                                                       #
# --------------------------------------------------------------------------- #

def quantize_q8_1(x, q=None, d=None, s=None):
    """x f32 (T, K) -> q int8 (T, K), d f32 (T, K/32), s f32 (T, K/32)  (quantize.cu)"""
    if x.ndim != 2 or x.shape[1] % 32:
        raise ValueError(f"quantize_q8_1: x shape {x.shape}, K must be a multiple of 32")
    T, K = x.shape
    _check(x, cp.float32, (T, K), "quantize_q8_1 x")
    q = cp.empty((T, K), cp.int8) if q is None else _check(q, cp.int8, (T, K), "q")        # (T, K)
    d = cp.empty((T, K // 32), cp.float32) if d is None else _check(d, cp.float32, (T, K // 32), "d")
    s = cp.empty((T, K // 32), cp.float32) if s is None else _check(s, cp.float32, (T, K // 32), "s")
    n_blocks = T * K // 32
    if n_blocks:
        f = kernels.function("quantize.cu", "quantize_q8_1")
        f(((n_blocks + 7) // 8,), (256,), (x, q, d, s, np.int64(n_blocks)))
    return q, d, s


def _mmq_args(xq, xd, T: int, K: int, od: int, y):
    _check(xq, cp.int8, (T, K), "mmq xq")
    _check(xd, cp.float32, (T, K // 32), "mmq xd")
    if K % QK_K:
        raise ValueError(f"mmq: K={K} is not a multiple of {QK_K}")
    y = _out(y, (T, od), "mmq y")
    grid = ((od + MMQ_BN - 1) // MMQ_BN, (T + MMQ_BM - 1) // MMQ_BM)
    return y, grid


def mmq_q4k(xq, xd, xs, w, od: int, bias=None, y=None):
    """q8_1 x (T, K) @ q4_K W (od, K)^T [+ bias] -> y (T, od) f32.
    w: uint8 (od, K/256*144) device, block_q4_K rows as stored."""
    T, K = xq.shape
    y, grid = _mmq_args(xq, xd, T, K, od, y)
    _check(xs, cp.float32, (T, K // 32), "mmq xs")
    _check(w, cp.uint8, (od, K // QK_K * GGML_QUANT_SIZES[QT.Q4_K][1]), "mmq_q4k w")
    if bias is not None:
        _check(bias, cp.float32, (od,), "mmq bias")
    if T and od:
        f = kernels.function("mmq.cu", _MMQ_NAMES[0], _MMQ_NAMES)
        f(grid, (MMQ_THREADS,), (xq, xd, xs, w, _ptr_or_null(bias), y,
                                 np.int32(T), np.int32(od), np.int32(K)))
    return y


def mmq_q6k(xq, xd, w_padded, plane, od: int, bias=None, y=None):
    """q8_1 x (T, K) @ q6_K W (od, K)^T [+ bias] -> y (T, od) f32.
    w_padded: uint8 (od, K/256*224) device; plane: int8 (od, K) W_exp -> EXP=true
    (cp.async B staging), None -> EXP=false (in-kernel expansion)."""
    T, K = xq.shape
    y, grid = _mmq_args(xq, xd, T, K, od, y)
    _check(w_padded, cp.uint8, (od, K // QK_K * Q6K_PADDED), "mmq_q6k w")
    if plane is not None:
        _check(plane, cp.int8, (od, K), "mmq_q6k W_exp plane")
    if bias is not None:
        _check(bias, cp.float32, (od,), "mmq bias")
    if T and od:
        name = _MMQ_NAMES[1] if plane is not None else _MMQ_NAMES[2]
        f = kernels.function("mmq.cu", name, _MMQ_NAMES)
        f(grid, (MMQ_THREADS,), (xq, xd, w_padded, _ptr_or_null(plane), _ptr_or_null(bias), y,
                                 np.int32(T), np.int32(od), np.int32(K)))
    return y


def _matvec(kernel: str, block_bytes: int, x, w, od: int, bias, y):
    K = x.shape[-1]
    if K % QK_K:
        raise ValueError(f"{kernel}: K={K} is not a multiple of {QK_K}")
    _check(x, cp.float32, (1, K), f"{kernel} x")
    _check(w, cp.uint8, (od, K // QK_K * block_bytes), f"{kernel} w")
    if bias is not None:
        _check(bias, cp.float32, (od,), f"{kernel} bias")
    y = _out(y, (1, od), f"{kernel} y")
    if od:
        f = kernels.function("matvec.cu", kernel)
        f(((od + MV_ROWS - 1) // MV_ROWS,), (MV_ROWS * 32,),
          (w, x, _ptr_or_null(bias), y, np.int32(od), np.int32(K)))
    return y


def matvec_q4k(x, w, od: int, bias=None, y=None):
    """x f32 (1, K) @ q4_K W (od, K)^T [+ bias] -> y (1, od); w as stored"""
    return _matvec("matvec_q4k", GGML_QUANT_SIZES[QT.Q4_K][1], x, w, od, bias, y)


def matvec_q6k(x, w_padded, od: int, bias=None, y=None):
    """x f32 (1, K) @ q6_K W (od, K)^T [+ bias] -> y (1, od); w padded (224 stride)"""
    return _matvec("matvec_q6k", Q6K_PADDED, x, w_padded, od, bias, y)


def dequant_rows(qtype, w, n_cols: int, tokens, y=None):
    """rows `tokens` (int32 (T,) device) of table w -> y f32 (T, n_cols)  (dequant.cu).
    w: q4_K uint8 as stored, q6_K uint8 padded, q8_0 uint8, f16 uint16, f32 float32."""
    qtype = QT(qtype)
    if qtype not in _EMBED_KERNEL:
        raise MinferError(f"embedding rows of type {qtype.name} are not supported on the GPU")
    _check(tokens, cp.int32, (tokens.shape[0],), "dequant_rows tokens")
    T = tokens.shape[0]
    y = _out(y, (T, n_cols), "dequant_rows y")
    if T and n_cols:
        f = kernels.function("dequant.cu", _EMBED_KERNEL[qtype])
        f(((n_cols + 255) // 256, T), (256,), (w, tokens, y, np.int32(n_cols)))
    return y


# --------------------------------------------------------------------------- #
# weights and state                                                            #
# --------------------------------------------------------------------------- #

@dataclass(eq=False)
class GpuWeight:
    """A registered weight (n_out, n_in). data is on the device: q4_K/q8_0 uint8
    (n_out, row_bytes) as stored, q6_K uint8 (n_out, n_in/256*224) PADDED, f16 uint16
    (n_out, n_in), f32 float32 (n_out, n_in)."""
    name: str
    qtype: QT
    n_out: int
    n_in: int
    data: object
    plane_tensor: bool = False         # a q6_K tensor the W_exp bundle covers (by name, id % 256 == 0)
    kind: str = field(default="other")  # memory_report() bucket

    @property
    def ptr(self) -> int:
        return int(self.data.data.ptr)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_out, self.n_in)


class QuantState:
    """One per backend/process: settings, the W_exp registry and map, counters."""

    def __init__(self):
        if cp is None:
            raise MinferError("cuda_quant needs cupy")
        self.exp_env = os.environ.get("MINFER_MMQ_Q6K_EXP", "1") != "0"
        self.debug = os.environ.get("MINFER_MMQ_RAW_NB_DEBUG") == "1"
        self.force_miss = os.environ.get("MINFER_TEST_FORCE_EXP_MISS") == "1"
        self._exp_on = self.exp_env          # runtime toggle (set_exp_enabled)
        self.planes: dict[str, object] = {}  # "{name}__exp{od}x{id}" -> int8 (od, id) plane
        self.q6k_exp: dict[int, object] = {} # padded weight device ptr -> its plane
        self._mem = {"q4_K weights": 0, "q6_K padded": 0, "other": 0}
        self._counts = dict.fromkeys(PATHS, 0)
        self._scratch = None                 # grow-only q8_1 activation buffers
        self.f16_min_t = F16_GEMM_MIN_T      # GEMM engine switch (bench scripts may move it)
        # MINFER_FFN_F16=0: the FFN's (T, d_ff) intermediates stay f32 (three
        # linears + swiglu, as the CPU reference), for A/B and numerics checks
        self.ffn_f16 = os.environ.get("MINFER_FFN_F16", "1") != "0"
        self._w16_cap = 0                    # elements of the largest f16-path weight
        self._f16 = None                     # (x16, w16) grow-only f16 scratch
        if self.debug:
            atexit.register(self._report_counts)

    # --- registration ----------------------------------------------------------
    def register(self, name: str, info, raw: np.ndarray) -> GpuWeight:
        """info: minfer.gguf.TensorInfo; raw: uint8 (rows, row_bytes) host bytes."""
        qtype = QT(info.qtype)
        shape = tuple(int(s) for s in info.shape)
        n_in = shape[-1]
        n_out = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        if qtype not in _EMBED_KERNEL:
            raise MinferError(f"{name}: tensor type {qtype.name} is not supported by the CUDA "
                              f"backend (supported: {', '.join(t.name for t in _EMBED_KERNEL)})")
        rb = quants.row_bytes(qtype, n_in)
        raw = np.asarray(raw)
        if raw.dtype != np.uint8 or raw.size != n_out * rb:
            raise MinferError(f"{name}: {raw.size} bytes of {raw.dtype} do not hold a "
                              f"{qtype.name} tensor of shape {shape}")
        raw = raw.reshape(n_out, rb)
        if qtype == QT.Q6_K:
            host = pad_q6k(np.ascontiguousarray(raw))              # (n_out, nb*224)
            kind = "q6_K padded"
        elif qtype == QT.F16:
            host = np.ascontiguousarray(raw).view(np.uint16)              # (n_out, n_in)
            kind = "other"
        elif qtype == QT.F32:
            host = np.ascontiguousarray(raw).view(np.float32)             # (n_out, n_in)
            kind = "other"
        else:
            host = np.ascontiguousarray(raw)                              # (n_out, rb)
            kind = "q4_K weights" if qtype == QT.Q4_K else "other"
        w = GpuWeight(name, qtype, n_out, n_in, cp.asarray(host), kind=kind)
        if qtype in (QT.Q4_K, QT.Q6_K) and name not in _NO_F16:
            self._w16_cap = max(self._w16_cap, n_out * n_in)
        self._mem[kind] += w.data.nbytes
        weakref.finalize(w, self._forget, kind, w.data.nbytes, None, None)
        if qtype == QT.Q6_K and _PLANE_NAME.fullmatch(name) and n_in % 256 == 0:
            # id % 256 == 0 is the plane's gate (seed §3.1): launch geometry and the
            # 16-byte alignment of every cp.async source in the dense plane
            w.plane_tensor = True
            if self.exp_env:
                self._register_plane(w, host)
        return w

    def _register_plane(self, w: GpuWeight, padded_host: np.ndarray) -> None:
        od, id_ = w.n_out, w.n_in
        exp_name = f"{w.name}__exp{od}x{id_}"     # geometry-encoded (seed §3.1)
        try:
            if self.force_miss:
                raise RuntimeError("MINFER_TEST_FORCE_EXP_MISS=1 (simulated failure)")
            plane = cp.asarray(expand_q6k_dense(padded_host, od, id_))   # (od, id) int8
        except Exception as e:  # noqa: BLE001 - any alloc/upload failure: no plane, loud once
            global _exp_miss_warned
            if not _exp_miss_warned:
                _exp_miss_warned = True
                print(f"minfer: WARNING: W_exp plane registration failed for {w.name} "
                      f"({type(e).__name__}: {e}); q6_K GEMMs run the in-kernel expansion "
                      f"(EXP=false) and count as 'q6k fallback!'", file=sys.stderr, flush=True)
            return
        self.planes[exp_name] = plane
        # seed pitfall #1: the key is the PADDED weight's pointer (what a launch
        # holds), never the plane's own pointer
        self.q6k_exp[w.ptr] = plane
        weakref.finalize(w, self._forget, None, 0, w.ptr, exp_name, plane)

    def _forget(self, kind, nbytes, ptr=None, exp_name=None, plane=None) -> None:
        """A GpuWeight was garbage-collected: drop its bytes and its plane entries."""
        if kind is not None:
            self._mem[kind] -= nbytes
        if ptr is not None and self.q6k_exp.get(ptr) is plane:
            del self.q6k_exp[ptr]
        if exp_name is not None and self.planes.get(exp_name) is plane:
            del self.planes[exp_name]

    @property
    def plane_bytes(self) -> int:
        """Total bytes of the W_exp planes on the device (0 when off)."""
        return sum(int(p.nbytes) for p in self.planes.values())

    @property
    def plane_sum_odid(self) -> int:
        """sum of od*id over the registered planes: what plane_bytes must equal (seed §2.3)."""
        return sum(int(p.shape[0]) * int(p.shape[1]) for p in self.planes.values())

    def memory_report(self) -> dict[str, int]:
        f16 = 0 if self._f16 is None else sum(int(a.nbytes) for a in self._f16)
        return {**self._mem, "f16 GEMM scratch": f16, "W_exp planes": self.plane_bytes}

    def set_exp_enabled(self, on: bool) -> None:
        """A/B toggle: planes stay allocated; while off, q6_K GEMMs take EXP=false
        and count `exp=off`."""
        self._exp_on = bool(on) and self.exp_env

    # --- counters ------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        return dict(self._counts)

    def reset_counters(self) -> None:
        self._counts = dict.fromkeys(PATHS, 0)

    def add_counts(self, counts: dict) -> None:
        """Add launch counts (a CUDA graph replay re-runs the launches it captured)."""
        for k, n in counts.items():
            self._counts[k] += n

    def path_settings(self) -> tuple:
        """What decides each launch's path besides the shapes (a CUDA graph key)."""
        return (self._exp_on, self.f16_min_t, self.ffn_f16)

    def scratch_refs(self) -> tuple:
        """The scratch buffers now in use (a captured graph keeps them alive)."""
        return (self._scratch, self._f16)

    def _report_counts(self) -> None:
        for path, n in self._counts.items():
            print(f"[minfer mmq] {path}: {n}", file=sys.stderr)

    # --- ops -------------------------------------------------------------------
    def _q8_scratch(self, T: int, K: int):
        """q8_1 buffers for x (T, K), grown when too small, reused otherwise (one
        stream: the next quantize cannot overtake the GEMM that reads them)."""
        if self._scratch is None or self._scratch[0].size < T * K:
            self._scratch = (cp.empty(T * K, cp.int8),                 # (T*K,)
                             cp.empty(T * K // 32, cp.float32),        # (T*K/32,)
                             cp.empty(T * K // 32, cp.float32))        # (T*K/32,)
        q, d, s = self._scratch
        return (q[:T * K].reshape(T, K), d[:T * K // 32].reshape(T, K // 32),
                s[:T * K // 32].reshape(T, K // 32))

    def linear(self, x, w: GpuWeight, bias=None, out=None):
        """x f32 (T, n_in) @ W (n_out, n_in)^T [+ bias (n_out,)] -> f32 (T, n_out).
        T == 1: matvec on f32 x; 1 < T < f16_min_t: x -> q8_1, then the MMQ GEMM;
        longer: W -> f16 scratch (q6_K plane tensors from their W_exp plane), cuBLAS."""
        if x.ndim != 2 or x.shape[1] != w.n_in:
            raise MinferError(f"linear {w.name}: input shape {tuple(x.shape)} does not match "
                              f"the weight's {w.n_in} inputs")
        T = x.shape[0]
        if w.qtype == QT.F32:
            self._counts["f32_gemm"] += 1
            y = cp.matmul(x, w.data.T, out=out)                        # (T, n_out)
            return y if bias is None else cp.add(y, bias, out=y)
        if w.qtype not in (QT.Q4_K, QT.Q6_K):
            raise MinferError(f"linear {w.name}: {w.qtype.name} weights are not supported by "
                              f"the CUDA backend (q4_K, q6_K, f32)")
        if T == 1:
            if w.qtype == QT.Q4_K:
                self._counts["q4k_mv"] += 1
                return matvec_q4k(x, w.data, w.n_out, bias, out)
            self._counts["q6k_mv"] += 1
            return matvec_q6k(x, w.data, w.n_out, bias, out)
        if self._f16_ok(T, w):
            return self._linears_f16(x, (w,), (bias,), (out,))[0]
        plane = None
        if w.qtype == QT.Q6_K:
            path, plane = self._q6k_path(w)
            self._counts[path] += 1
        xq, xd, xs = quantize_q8_1(x, *self._q8_scratch(T, w.n_in))
        if w.qtype == QT.Q4_K:
            self._counts["q4k_mmq"] += 1
            return mmq_q4k(xq, xd, xs, w.data, w.n_out, bias, out)
        self._counts["q6k_mmq"] += 1
        return mmq_q6k(xq, xd, w.data, plane, w.n_out, bias, out)

    def _f16_ok(self, T: int, w: GpuWeight) -> bool:
        """Does a GEMM of T tokens with w take the f16 cuBLAS engine?"""
        return (T >= self.f16_min_t and w.qtype in (QT.Q4_K, QT.Q6_K)
                and w.n_out * w.n_in <= self._w16_cap)

    def linears(self, x, ws, biases):
        """Several weights reading the same x (q/k/v, gate/up) -> [f32 (T, n_out) each].
        On the f16 engine x is rounded to f16 once for all of them."""
        T = x.shape[0]
        if not all(self._f16_ok(T, w) and w.n_in == x.shape[1] for w in ws):
            return [self.linear(x, w, b) for w, b in zip(ws, biases)]
        return self._linears_f16(x, ws, biases, (None,) * len(ws))

    def ffn(self, h, gate: GpuWeight, up: GpuWeight, down: GpuWeight):
        """SwiGLU FFN on the f16 engine: h f32 (T, d) -> down(silu(gate h) * up h)
        f32 (T, d), its (T, d_ff) intermediates in f16 (the gate/up GEMMs write f16,
        swiglu reads and writes f16, the down GEMM reads it: no f32 round trip).
        None when the f16 engine does not take these weights at this T."""
        T = h.shape[0]
        if not (self.ffn_f16 and all(self._f16_ok(T, w) for w in (gate, up, down))
                and gate.n_in == up.n_in == h.shape[1] and down.n_in == gate.n_out == up.n_out):
            return None
        d_ff = gate.n_out
        x16, w16 = self._f16_scratch(T * max(h.shape[1], d_ff))
        xh = cuda_fast.cast_f16(h, x16[:h.size].reshape(h.shape))                # (T, d)
        gu = [cuda_fast.linear_f16_from(xh, w.data, w.qtype, w.n_out, w.n_in,
                                        out=cp.empty((T, d_ff), cp.float16),     # (T, d_ff)
                                        w16=w16, w_exp=self._count_f16(w))
              for w in (gate, up)]
        f = cuda_fast.swiglu_f16(*gu, out=x16)                                   # (T, d_ff)
        return cuda_fast.linear_f16_from(f, down.data, down.qtype, down.n_out, down.n_in,
                                         w16=w16, w_exp=self._count_f16(down))

    def _count_f16(self, w: GpuWeight):
        """Count one f16-engine GEMM of w -> the W_exp plane to dequantize from, or None."""
        plane = None
        if w.qtype == QT.Q6_K:
            path, plane = self._q6k_path(w)
            self._counts[path] += 1
        self._counts["q4k_f16" if w.qtype == QT.Q4_K else "q6k_f16"] += 1
        return plane

    def _linears_f16(self, x, ws, biases, outs):
        T = x.shape[0]
        x16, w16 = self._f16_scratch(T * x.shape[1])
        xh = cuda_fast.cast_f16(x, x16[:x.size].reshape(x.shape))                # (T, n_in)
        ys = []
        for w, b, o in zip(ws, biases, outs):
            ys.append(cuda_fast.linear_f16_from(xh, w.data, w.qtype, w.n_out, w.n_in, out=o,
                                                w16=w16, w_exp=self._count_f16(w), bias=b))
        return ys

    def _q6k_path(self, w: GpuWeight):
        """-> (launch label, the W_exp plane or None) for a q6_K GEMM of w."""
        plane = self.q6k_exp.get(w.ptr)            # the lookup is by the PADDED pointer
        if not w.plane_tensor:
            return "q6k raw", None                 # not a plane tensor (e.g. a tied q6_K head)
        if not self._exp_on:
            return "q6k exp=off", None             # deliberately off (env or set_exp_enabled)
        if plane is not None:
            return "q6k exp", plane
        return "q6k fallback!", None               # a plane was expected and is missing

    def _f16_scratch(self, n_x: int):
        """f16 scratch: x16 (>= n_x) and w16 (the largest f16-path weight), grown
        when too small, reused otherwise (one stream orders the reuse)."""
        x16, w16 = self._f16 if self._f16 is not None else (None, None)
        if x16 is None or x16.size < n_x:
            x16 = cp.empty(n_x, cp.float16)                      # (T*n_in,)
        if w16 is None or w16.size < self._w16_cap:
            w16 = cp.empty(self._w16_cap, cp.float16)            # (n_out*n_in,) of the largest
        self._f16 = (x16, w16)
        return self._f16

    def embed(self, w: GpuWeight, tokens_dev):
        """rows `tokens_dev` (cupy int32 (T,), ids checked by the caller) of the
        table w -> f32 (T, n_in), bit-identical to quants.dequantize_rows."""
        return dequant_rows(w.qtype, w.data, w.n_in, tokens_dev)
