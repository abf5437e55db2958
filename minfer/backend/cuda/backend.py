"""The CUDA backend: every graph op on the GPU, activations f32 in cupy arrays.

Quantized weights (q4_K, q6_K + its W_exp plane, ...) belong to
`cuda_quant.QuantState`: registration, int8 MMQ for T > 1, matvec for T == 1,
embedding rows. The rest of the graph is here, one Python wrapper per kernel
(checks dtype/shape/contiguity, computes the grid, launches):

    rmsnorm    kernels/norm.cu         one block per row
    rope       kernels/rope.cu         one thread per rotated pair, cos/sin table
    attention  kernels/flash_attn.cu   head dim 128 (both target models): f16 KV
                                       cache, tensor-core flash attention (cuda_fast)
               kernels/attention.cu    other head dims (64): tiled f32, f32 KV cache
    swiglu/add kernels/elementwise.cu  one thread per element

No host synchronisation inside a layer: nothing here reads a device value back
except `to_numpy`. Outputs come from cupy's memory pool (a first step; every op
takes `out=` so that a run state allocated once can replace it, which is what
CUDA-graph capture will need). Device out-of-memory anywhere becomes one
MinferError line that says what to turn off.
"""
from __future__ import annotations

import functools
import math
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType

from ...config import ModelConfig
from ...errors import MinferError
from . import nvrtc as kernels
from ..base import Backend
from .fast_old import FA_HD, attention_f16

try:
    import cupy as cp
except Exception as e:  # noqa: BLE001 - any import failure means no CUDA backend
    cp = None
    _CUPY_ERROR = f"{type(e).__name__}: {e}"
else:
    _CUPY_ERROR = None

NORM_THREADS = 256    # = NORM_THREADS in kernels/norm.cu
ATT_BQ = 16           # = ATT_BQ in kernels/attention.cu (query rows per block)
ATT_THREADS = 128     # = 32 * ATT_WARPS in kernels/attention.cu
ATT_HEAD_DIMS = (64, 128)
EW_THREADS = 256


def _is_oom(e: BaseException) -> bool:
    if cp is None:
        return False
    if isinstance(e, cp.cuda.memory.OutOfMemoryError):
        return True
    return isinstance(e, cp.cuda.runtime.CUDARuntimeError) and "MemoryAllocation" in str(e)


class CudaCache:
    """KV cache, preallocated: k, v (n_layer, n_ctx, n_kv, hd), f16 for the
    flash-attention head dim (128) and f32 otherwise, zero-filled so that no
    position ever holds garbage (attention never reads past pos0 + T, but zeros
    make a bug show up as a wrong number, not a NaN)."""

    def __init__(self, cfg: ModelConfig, n_ctx: int):
        self.n_ctx = n_ctx
        shape = (cfg.n_layer, n_ctx, cfg.n_head_kv, cfg.head_dim)
        dtype = cp.float16 if cfg.head_dim == FA_HD else cp.float32
        self.k = cp.zeros(shape, dtype=dtype)   # (n_layer, n_ctx, n_kv, hd)
        self.v = cp.zeros(shape, dtype=dtype)   # (n_layer, n_ctx, n_kv, hd)
        self.graphs: dict = {}                  # key -> _Graph, or SEEN after a first eager run

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def _f32(x, what: str, ndim: int | None = None):
    """Argument check shared by the wrappers: a C-contiguous float32 cupy array."""
    if not isinstance(x, cp.ndarray) or x.dtype != cp.float32 or not x.flags.c_contiguous:
        raise ValueError(f"{what}: expected a C-contiguous float32 cupy array, got "
                         f"{type(x).__name__} {getattr(x, 'dtype', '?')}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{what}: expected {ndim} dimensions, got shape {x.shape}")
    return x


def _ptr(a) -> int:
    return a.data.ptr


def _out(out, shape, what: str):
    if out is None:
        return cp.empty(shape, dtype=cp.float32)
    _f32(out, what)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{what}: out has shape {out.shape}, expected {tuple(shape)}")
    return out


def rope_table(n_pos: int, hd: int, base: float) -> np.ndarray:
    """cos/sin of theta(p, i) = p * base^(-2i/hd), computed in float64 and rounded
    once to f32 -> (n_pos, hd/2, 2) float32 (the angles of ggml's rope, without
    its f32 running product's drift)."""
    inv_freq = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)     # (hd/2,)
    theta = np.arange(n_pos, dtype=np.float64)[:, None] * inv_freq       # (n_pos, hd/2)
    return np.stack([np.cos(theta), np.sin(theta)], axis=-1).astype(np.float32)


SEEN = "seen"          # a key's first use runs eagerly; the second captures
_CAPTURE_RELAXED = getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", 2) if cp is not None else 2


class _Graph:
    """One captured replay of `fn` (Backend.captured): its input buffer, output
    array, the memory pool its intermediates live in, the launch counts one
    replay adds, and references that keep every buffer it touches alive."""

    def __init__(self, graph, inp, out, pool, counts: dict, keep: tuple):
        self.graph, self.inp, self.out, self.pool = graph, inp, out, pool
        self.counts, self.keep = counts, keep


class CUDABackend(Backend):
    name = "cuda"

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        if cp is None:
            raise MinferError(f"CUDA backend unavailable: cupy does not import ({_CUPY_ERROR}); "
                              f"install minfer[cuda12] or minfer[cuda13], or use --backend cpu")
        try:
            if cp.cuda.runtime.getDeviceCount() < 1:
                raise MinferError("CUDA backend unavailable: no CUDA device; use --backend cpu")
        except cp.cuda.runtime.CUDARuntimeError as e:
            raise MinferError(f"CUDA backend unavailable: {e}; use --backend cpu") from None
        if cfg.head_dim not in ATT_HEAD_DIMS:
            raise MinferError(f"head dimension {cfg.head_dim} is not supported by the CUDA "
                              f"attention kernel (supported: {', '.join(map(str, ATT_HEAD_DIMS))})")
        from .quant_old import QuantState   # env vars (MINFER_MMQ_*) are read here
        self.quant = QuantState()
        # MINFER_CUDA_GRAPHS=0: never capture (every forward runs eagerly)
        self.graphs_on = os.environ.get("MINFER_CUDA_GRAPHS", "1") != "0"
        self.graph_replays = 0
        self._cos_sin = None                 # (n_pos, hd/2, 2) f32 on the device

    # --- out of memory -------------------------------------------------------
    def oom_error(self, what: str) -> MinferError:
        """One line: what ran out, how much is in use, what to turn off."""
        free, total = cp.cuda.runtime.memGetInfo()
        planes = getattr(self.quant, "plane_bytes", 0) or 0
        drop = (f"set MINFER_MMQ_Q6K_EXP=0 to drop the W_exp planes ({planes / 1e9:.2f} GB "
                f"allocated so far; ~1.52 GB on the 7B)" if getattr(self.quant, "exp_env", True)
                else "the W_exp planes are already off (MINFER_MMQ_Q6K_EXP=0)")
        return MinferError(f"GPU out of memory while {what} ({free / 2**30:.2f} of "
                           f"{total / 2**30:.2f} GiB free): {drop} or use a smaller -c")

    def _guard(self, what: str, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except Exception as e:  # noqa: BLE001 - only out-of-memory is translated
            if _is_oom(e):
                raise self.oom_error(what) from None
            raise

    # --- weights and state ---------------------------------------------------
    def load_weight(self, name: str, info, raw: np.ndarray):
        if len(info.shape) == 1:
            if info.qtype != GGMLQuantizationType.F32:
                raise MinferError(f"{name}: 1-D tensor of type {info.qtype.name}, expected F32")
            host = np.ascontiguousarray(raw).view(np.float32).reshape(info.shape)
            return self._guard(f"loading {name}", cp.asarray, host)          # (n,)
        return self._guard(f"loading {name}", self.quant.register, name, info, raw)

    def new_cache(self, max_tokens: int) -> CudaCache:
        if max_tokens < 1:
            raise MinferError(f"context size must be positive, got {max_tokens}")
        cache = self._guard(f"allocating the KV cache for {max_tokens} tokens",
                            CudaCache, self.cfg, max_tokens)
        if self._cos_sin is None or self._cos_sin.shape[0] < max_tokens:
            table = rope_table(max_tokens, self.cfg.head_dim, self.cfg.rope_base)
            self._cos_sin = self._guard("allocating the RoPE table", cp.asarray, table)
        return cache

    # --- ops -----------------------------------------------------------------
    def embed(self, table, tokens: np.ndarray):
        """table handle, tokens int32 (T,) host -> x (T, d)"""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size):
            raise MinferError(f"token id out of range [0, {self.cfg.vocab_size})")
        return self._guard("embedding the tokens", lambda: self.quant.embed(table, cp.asarray(tokens)))

    def linear(self, x, w, bias=None, out=None):
        """x (T, n_in) @ W (n_out, n_in)^T [+ bias (n_out,)] -> (T, n_out)"""
        _f32(x, "linear x", 2)
        return self._guard("running a linear layer", self.quant.linear, x, w, bias=bias, out=out)

    def linears(self, x, ws, biases):
        _f32(x, "linears x", 2)
        return self._guard("running a linear layer", self.quant.linears, x, ws, biases)

    def ffn(self, h, gate, up, down):
        _f32(h, "ffn h", 2)
        y = self._guard("running the FFN", self.quant.ffn, h, gate, up, down)
        return super().ffn(h, gate, up, down) if y is None else y

    def rmsnorm(self, x, w, eps: float, out=None):
        return self._guard("running rmsnorm", rmsnorm, x, w, eps, out=out)

    def rope(self, x, pos0: int, out=None):
        if self._cos_sin is None or pos0 + x.shape[0] > self._cos_sin.shape[0]:
            have = 0 if self._cos_sin is None else self._cos_sin.shape[0]
            raise MinferError(f"RoPE positions up to {pos0 + x.shape[0]} exceed the "
                              f"{have} positions prepared by new_cache")
        if x.shape[-1] != self.cfg.head_dim:
            raise ValueError(f"rope: head dim {x.shape[-1]}, model has {self.cfg.head_dim}")
        return self._guard("running rope", rope, x, self._cos_sin, pos0, self.cfg.rope_neox, out=out)

    def attention(self, q, k, v, cache, layer: int, pos0: int, out=None):
        cfg = self.cfg
        if q.shape[1:] != (cfg.n_head, cfg.head_dim) or k.shape[1:] != (cfg.n_head_kv, cfg.head_dim):
            raise ValueError(f"attention: q {q.shape}, k {k.shape} do not match the model's heads")
        if cache.k.dtype == cp.float16:          # head dim 128: tensor-core flash attention
            return self._guard("running attention", attention_f16, q, k, v,
                               cache.k[layer], cache.v[layer], pos0, out=out)
        return self._guard("running attention", attention, q, k, v,
                           cache.k[layer], cache.v[layer], pos0, out=out)

    def swiglu(self, gate, up, out=None):
        return self._guard("running swiglu", swiglu, gate, up, out=out)

    def add(self, a, b, out=None):
        return self._guard("running add", add, a, b, out=out)

    def rows(self, x, start: int, stop: int):
        return x[start:stop]          # contiguous: a range of whole rows

    def to_numpy(self, x) -> np.ndarray:
        return cp.asnumpy(x).astype(np.float32, copy=False)

    def synchronize(self) -> None:
        cp.cuda.get_current_stream().synchronize()

    # --- CUDA graphs ---------------------------------------------------------
    def captured(self, cache, key, fn, x):
        """fn(x) eagerly on a key's first use; on its second, fn runs once more
        eagerly (filling a private memory pool), is captured into a CUDA graph
        (relaxed mode, served from that pool) and from then on replayed:
        x is copied into the graph's input buffer and its output array returned
        (valid until the next replay of the same key). Launch counters add the
        counts the captured work recorded, once per replay."""
        # a decode step (one token) runs eagerly: its position never repeats
        # within a generation, so its graph would only ever replay in benchmarks
        if not self.graphs_on or x.shape[0] == 1:
            return fn(x)
        # a capture bakes in every launch decision (GEMM engine, W_exp plane or
        # not), so the settings that make them are part of the key
        key = (key, self.quant.path_settings())
        rec = cache.graphs.get(key)
        if rec is None:
            cache.graphs[key] = SEEN
            return fn(x)
        if rec is SEEN:
            try:
                rec = cache.graphs[key] = self._guard("capturing a CUDA graph", self._capture, fn, x)
            except MinferError:
                raise
            except Exception as e:  # noqa: BLE001 - loud, once: graphs off, eager from here on
                self.graphs_on = False
                print(f"minfer: WARNING: CUDA graph capture failed ({type(e).__name__}: {e}); "
                      f"running eagerly from now on (MINFER_CUDA_GRAPHS=0 silences this)",
                      file=sys.stderr, flush=True)
                return fn(x)
        rec.inp[...] = x                                                     # (T, d)
        rec.graph.launch(cp.cuda.get_current_stream())
        self.quant.add_counts(rec.counts)
        self.graph_replays += 1
        return rec.out

    def _capture(self, fn, x) -> _Graph:
        pool = cp.cuda.MemoryPool()
        stream = cp.cuda.Stream(non_blocking=True)
        cp.cuda.get_current_stream().synchronize()       # capture sees a quiet device
        with cp.cuda.using_allocator(pool.malloc):
            inp = cp.empty_like(x)                                           # (T, d)
            with stream:
                inp[...] = x            # on the capture stream: the warm run below reads it
                # one eager run fills the private pool with every block the work
                # allocates, so the capture below is served from it (no cudaMalloc,
                # which can invalidate a capture); its results are the same bits
                fn(inp)
                stream.synchronize()
                before = self.quant.counters()
                stream.begin_capture(_CAPTURE_RELAXED)
                try:
                    out = fn(inp)
                finally:
                    graph = stream.end_capture()
        after = self.quant.counters()
        self.quant.reset_counters()                      # the capture itself ran nothing
        self.quant.add_counts(before)                    # (the eager warm run did: counted)
        counts = {k: after[k] - before[k] for k in after}
        # the scratch buffers the captured kernels read and write: kept alive for
        # the graph's lifetime, so a later growth (new buffers) cannot free them
        keep = (self.quant.scratch_refs(), self._cos_sin)
        return _Graph(graph, inp, out, pool, counts, keep)


_ATT_INSTANCES = tuple(f"attention_f32<{hd}>" for hd in ATT_HEAD_DIMS)


@functools.lru_cache(maxsize=None)
def _fn(filename: str, name: str, name_expressions: tuple[str, ...] = ()):
    """The compiled kernel (NVRTC once per process, through backend.kernels)."""
    return kernels.function(filename, name, name_expressions)


def _launch_ew(name: str, n: int, args) -> None:
    """Grid-stride element-wise launch: enough blocks to fill the GPU, no more."""
    if n == 0:
        return
    blocks = min((n + EW_THREADS - 1) // EW_THREADS, 65535)
    _fn("elementwise.cu", name)((blocks,), (EW_THREADS,), args)


# --- one wrapper per kernel --------------------------------------------------
def rmsnorm(x, w, eps: float, out=None):
    """x (T, d), w (d,) -> x / sqrt(mean(x^2) + eps) * w  (T, d)"""
    _f32(x, "rmsnorm x", 2)
    _f32(w, "rmsnorm w", 1)
    T, d = x.shape
    if w.shape[0] != d:
        raise ValueError(f"rmsnorm: weight has {w.shape[0]} elements, rows have {d}")
    y = _out(out, (T, d), "rmsnorm out")                                     # (T, d)
    if T:
        _fn("norm.cu", "rmsnorm_f32")((T,), (NORM_THREADS,), (x, w, y, np.int32(d), np.float32(eps)))
    return y


def rope(x, cos_sin, pos0: int, neox: bool, out=None):
    """x (T, n_heads, hd) at positions pos0.., cos_sin (n_pos, hd/2, 2) ->
    rotated (T, n_heads, hd); NeoX halves or adjacent pairs; out may be x"""
    _f32(x, "rope x", 3)
    _f32(cos_sin, "rope cos_sin", 3)
    T, n_heads, hd = x.shape
    if hd % 2 or cos_sin.shape[1:] != (hd // 2, 2):
        raise ValueError(f"rope: table {cos_sin.shape} does not fit head dim {hd}")
    if pos0 < 0 or pos0 + T > cos_sin.shape[0]:
        raise ValueError(f"rope: positions {pos0}..{pos0 + T - 1} outside the table of {cos_sin.shape[0]}")
    y = _out(out, x.shape, "rope out")                                       # (T, n_heads, hd)
    n_pairs = T * n_heads * (hd // 2)
    if n_pairs:
        _fn("rope.cu", "rope_f32")(((n_pairs + EW_THREADS - 1) // EW_THREADS,), (EW_THREADS,),
                                   (x, y, cos_sin, np.int32(T), np.int32(n_heads), np.int32(hd),
                                    np.int32(pos0), np.int32(bool(neox))))
    return y


def attention(q, k, v, k_cache, v_cache, pos0: int, out=None):
    """q (T, n_head, hd), k/v (T, n_kv, hd); k_cache/v_cache: one layer's
    (n_ctx, n_kv, hd). Stores k/v at pos0..pos0+T-1, then causal GQA attention
    over keys 0..pos0+t for query t -> (T, n_head*hd). No T x T buffer: the
    kernel streams key tiles (online softmax)."""
    _f32(q, "attention q", 3)
    _f32(k_cache, "attention k_cache", 3)
    _f32(v_cache, "attention v_cache", 3)
    T, n_head, hd = q.shape
    n_ctx, n_kv, _ = k_cache.shape
    if hd not in ATT_HEAD_DIMS:
        raise ValueError(f"attention: head dim {hd} not in {ATT_HEAD_DIMS}")
    if n_kv < 1 or n_head % n_kv:
        raise ValueError(f"attention: {n_head} query heads do not group over {n_kv} KV heads")
    for a, nm in ((k, "k"), (v, "v")):
        if a.shape != (T, n_kv, hd) or a.dtype != cp.float32:
            raise ValueError(f"attention: {nm} has shape {a.shape} {a.dtype}, expected {(T, n_kv, hd)} float32")
    if v_cache.shape != k_cache.shape or k_cache.shape[2] != hd:
        raise ValueError(f"attention: caches {k_cache.shape} / {v_cache.shape} vs head dim {hd}")
    if pos0 < 0 or pos0 + T > n_ctx:
        raise MinferError(f"positions {pos0}..{pos0 + T - 1} do not fit the KV cache of {n_ctx}")
    y = _out(out, (T, n_head * hd), "attention out")                         # (T, n_head*hd)
    for a, nm in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"), (y, "out")):
        if _ptr(a) % 16:                # the kernel moves rows as float4
            raise ValueError(f"attention: {nm} is not 16-byte aligned")
    k_cache[pos0:pos0 + T] = k                                               # (T, n_kv, hd)
    v_cache[pos0:pos0 + T] = v
    if T:
        _fn("attention.cu", f"attention_f32<{hd}>", _ATT_INSTANCES)(
            ((T + ATT_BQ - 1) // ATT_BQ, n_head), (ATT_THREADS,),
            (q, k_cache, v_cache, y, np.int32(T), np.int32(n_head), np.int32(n_kv),
             np.int32(pos0), np.float32(1.0 / math.sqrt(hd))))
    return y


def swiglu(gate, up, out=None):
    """gate, up (T, d_ff) -> silu(gate) * up (T, d_ff)"""
    _f32(gate, "swiglu gate")
    _f32(up, "swiglu up")
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {gate.shape} vs up {up.shape}")
    y = _out(out, gate.shape, "swiglu out")
    _launch_ew("swiglu_f32", gate.size, (gate, up, y, np.int64(gate.size)))
    return y


def add(a, b, out=None):
    """a + b, same shape (residual add); out may be a"""
    _f32(a, "add a")
    _f32(b, "add b")
    if a.shape != b.shape:
        raise ValueError(f"add: {a.shape} vs {b.shape}")
    y = _out(out, a.shape, "add out")
    _launch_ew("add_f32", a.size, (a, b, y, np.int64(a.size)))
    return y
