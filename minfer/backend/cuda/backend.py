"""CUDABackend: every graph op on the GPU, activations f32 in cupy arrays.

It composes the package's parts: the settings (settings.py), the registered
weights (weights.py), the linears and their path decisions (gemm.py), the
layer ops (ops.py), attention (attention.py) and CUDA graphs (graphs.py).
Device out-of-memory becomes one MinferError line at one boundary, `guard`,
which the engine wraps around loading and the graph around each forward.
No host synchronisation inside a layer: nothing reads a device value back
except `to_numpy`.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
from gguf import GGMLQuantizationType

from ...config import ModelConfig
from ...errors import MinferError
from ..base import Backend, Timer
from . import attention, ops
from .decode import DecodeRunner
from .gemm import Gemms
from .graphs import GraphRunner
from .int8 import dequant_rows
from .launch import cp, device_cc, is_oom, pos_value, require_cupy
from .settings import CudaSettings
from .weights import WeightStore, expected_plane_bytes, plane_check


class CudaCache:
    """KV cache, preallocated: k, v (n_layer, n_ctx, n_kv, hd), f16 at the flash
    attention's head dim and f32 otherwise, zero-filled so that no position ever
    holds garbage (attention never reads past pos0 + T, but zeros make a bug show
    up as a wrong number, not a NaN). `graphs` holds the CUDA graphs that write it."""

    def __init__(self, cfg: ModelConfig, n_ctx: int):
        self.n_ctx = n_ctx
        shape, dtype = self.layout(cfg, n_ctx)
        self.k = cp.zeros(shape, dtype=dtype)   # (n_layer, n_ctx, n_kv, hd)
        self.v = cp.zeros(shape, dtype=dtype)   # (n_layer, n_ctx, n_kv, hd)
        self.graphs: dict = {}                  # key -> graphs.Graph, or SEEN after a first eager run
        self.ahead = None                       # decode.Queued: the decode step queued ahead
        self.io = None                          # decode.DecodeIO: pinned buffers of the decode steps

    @staticmethod
    def layout(cfg: ModelConfig, n_ctx: int) -> tuple[tuple[int, ...], object]:
        """-> (shape, dtype) of k and of v: f16 where the flash attention reads them."""
        dtype = cp.float16 if cfg.head_dim == attention.FA_HD else cp.float32
        return (cfg.n_layer, n_ctx, cfg.n_head_kv, cfg.head_dim), dtype

    @classmethod
    def nbytes_for(cls, cfg: ModelConfig, n_ctx: int) -> int:
        """Device bytes a cache of n_ctx positions takes (k and v)."""
        shape, dtype = cls.layout(cfg, n_ctx)
        return 2 * math.prod(shape) * np.dtype(dtype).itemsize


class CudaTimer(Timer):
    """CUDA events around the work queued between start() and stop()."""

    def __init__(self, backend):
        super().__init__(backend)
        self._t0, self._t1 = cp.cuda.Event(), cp.cuda.Event()

    def start(self) -> None:
        self.backend.synchronize()             # the device is idle when the clock starts
        self._t0.record()

    def stop(self) -> float:
        self._t1.record()
        self._t1.synchronize()
        return cp.cuda.get_elapsed_time(self._t0, self._t1) / 1e3


class CUDABackend(Backend):
    name = "cuda"
    # a short and a medium prompt: every GEMM shape is met (cublas.py then preloads
    # its kernels), the kernel modules load and the scratch buffers are allocated
    warmup_lengths = (2, 256)

    def __init__(self, cfg: ModelConfig, settings: CudaSettings | None = None):
        super().__init__(cfg)
        require_cupy()
        try:
            if cp.cuda.runtime.getDeviceCount() < 1:
                raise MinferError("CUDA backend unavailable: no CUDA device; use --backend cpu")
        except cp.cuda.runtime.CUDARuntimeError as e:
            raise MinferError(f"CUDA backend unavailable: {e}; use --backend cpu") from None
        if cfg.head_dim not in attention.F32_HEAD_DIMS:
            raise MinferError(f"head dimension {cfg.head_dim} is not supported by the CUDA attention "
                              f"kernels (supported: {', '.join(map(str, attention.F32_HEAD_DIMS))})")
        if cfg.head_dim == attention.FA_HD and cfg.n_head // cfg.n_head_kv > attention.DEC_MAX_G:
            raise MinferError(f"{cfg.n_head // cfg.n_head_kv} query heads per KV head: the CUDA decode "
                              f"attention takes at most {attention.DEC_MAX_G}")
        self._settings = settings or CudaSettings.from_env()
        self.store = WeightStore(self._settings)
        self.gemm = Gemms(self.store, self._settings)
        # programmatic dependent launches exist from compute capability 9.0 (Hopper) on
        hopper = device_cc() >= (9, 0)
        self.graphs = GraphRunner(self.gemm.counters, self._graph_keep_alive,
                                  lambda: hopper and self._settings.dependent_launches)
        self.decoder = DecodeRunner(self.graphs, lambda: self._settings.graphs and not self.graphs.failed)
        self._cos_sin = None                 # (n_pos, hd/2, 2) f32 on the device

    # --- settings --------------------------------------------------------------
    @property
    def settings(self) -> CudaSettings:
        return self._settings

    @contextlib.contextmanager
    def using(self, **changes):
        """Run with some settings replaced (tests, A/B scripts), restored afterwards.
        The load-time settings (exp_planes, force_exp_miss) take effect at load only."""
        old = self._settings
        self._settings = self.gemm.settings = old.replace(**changes)
        try:
            yield self._settings
        finally:
            self._settings = self.gemm.settings = old

    # --- the out-of-memory boundary ------------------------------------------------
    @contextlib.contextmanager
    def guard(self, what: str):
        try:
            yield
        except Exception as e:
            if is_oom(e):
                raise self._oom_error(what) from None
            raise

    def _oom_error(self, what: str) -> MinferError:
        """One line: what ran out, how much is in use, what to turn off."""
        free, total = cp.cuda.runtime.memGetInfo()
        drop = (f"set MINFER_MMQ_Q6K_EXP=0 to drop the W_exp planes ({self.store.plane_bytes / 1e9:.2f} "
                f"GB allocated so far; ~1.52 GB on the 7B)" if self._settings.exp_planes
                else "the W_exp planes are already off (MINFER_MMQ_Q6K_EXP=0)")
        if self._settings.f16_weights:
            drop = (f"unset MINFER_F16_WEIGHTS to drop the kept f16 weights "
                    f"({self.store.bytes.get('f16 weights', 0) / 1e9:.2f} GB so far), {drop}")
        return MinferError(f"GPU out of memory while {what} ({free / 2**30:.2f} of "
                           f"{total / 2**30:.2f} GiB free): {drop}, or use a smaller -c")

    # --- weights and state ---------------------------------------------------
    def load_weight(self, name: str, info, raw: np.ndarray):
        if len(info.shape) == 1:
            if info.qtype != GGMLQuantizationType.F32:
                raise MinferError(f"{name}: 1-D tensor of type {info.qtype.name}, expected F32")
            return cp.asarray(np.ascontiguousarray(raw).view(np.float32).reshape(info.shape))  # (n,)
        return self.store.register(name, info, raw)

    def new_cache(self, max_tokens: int) -> CudaCache:
        if max_tokens < 1:
            raise MinferError(f"context size must be positive, got {max_tokens}")
        what = f"allocating the KV cache for {max_tokens} tokens"
        if CudaCache.nbytes_for(self.cfg, max_tokens) > cp.cuda.runtime.memGetInfo()[0]:
            raise self._oom_error(what)                  # before the host builds its RoPE table
        with self.guard(what):
            cache = CudaCache(self.cfg, max_tokens)
            if self._cos_sin is None or self._cos_sin.shape[0] < max_tokens:
                self._cos_sin = cp.asarray(ops.rope_table(max_tokens, self.cfg.head_dim,
                                                          self.cfg.rope_base, self.rope_factors))
        return cache

    def set_rope_factors(self, factors) -> None:
        super().set_rope_factors(factors)
        self._cos_sin = None                 # new_cache builds it again with the factors

    # --- ops -----------------------------------------------------------------
    def embed(self, table, tokens):
        """table handle, tokens int32 (T,) (host, or on the device in a decode step, checked
        by the caller) -> x (T, d), bit-identical to quants.dequantize_rows"""
        if not isinstance(tokens, cp.ndarray):
            tokens = np.ascontiguousarray(tokens, dtype=np.int32)
            if tokens.size and (tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size):
                raise MinferError(f"token id out of range [0, {self.cfg.vocab_size})")
            tokens = cp.asarray(tokens)
        return dequant_rows(table.qtype, table.data, table.n_in, tokens)

    def linear(self, x, w, bias=None, out=None, residual=None):
        return self.gemm.linear(x, w, bias=bias, out=out, residual=residual)

    def linears(self, x, ws, biases):
        return self.gemm.linears(x, ws, biases)

    def norm_linears(self, x, norm_w, eps: float, ws, biases):
        return self.gemm.norm_linears(x, norm_w, eps, ws, biases)

    def ffn(self, x, norm_w, eps: float, gate, up, down, ahead=None):
        return self.gemm.ffn(x, norm_w, eps, gate, up, down, ahead=ahead)

    def rmsnorm(self, x, w, eps: float, out=None):
        return ops.rmsnorm(x, w, eps, out=out)

    def rope(self, x, pos0, out=None):
        self._rope_check(x, pos0)
        return ops.rope(x, self._cos_sin, pos0, self.cfg.rope_neox, out=out)

    def _rope_check(self, x, pos0) -> None:
        end = pos_value(pos0) + x.shape[0]
        if self._cos_sin is None or end > self._cos_sin.shape[0]:
            have = 0 if self._cos_sin is None else self._cos_sin.shape[0]
            raise MinferError(f"RoPE positions up to {end} exceed the "
                              f"{have} positions prepared by new_cache")
        if x.shape[-1] != self.cfg.head_dim:
            raise ValueError(f"rope: head dim {x.shape[-1]}, model has {self.cfg.head_dim}")

    def attention_block(self, x, norm_w, eps: float, wq, wk, wv, biases, wo, cache, layer: int, pos0):
        """On the f16 cache. A decode row: norm_linears' fused launches, the attention
        (RoPE and the KV store inside) with its combine writing the q8_1 operand of the
        o projection, which adds x in its store. A prompt whose q/k/v take the f16
        engine: the norm writes the GEMMs' f16 operand, the q/k/v biases are added in
        the RoPE + KV-store kernel (the same f32 sums), the flash attention writes the
        o projection's f16 operand when o takes the f16 engine, and the o projection
        accumulates into x. Otherwise (the f32 cache, other engines) the composition."""
        T, cfg = x.shape[0], self.cfg
        hd, n_out = cfg.head_dim, cfg.n_head * cfg.head_dim
        if cache.k.dtype == cp.float16 and T == 1 and self.gemm.all_matvec(x, (wq, wk, wv)) \
                and self.gemm.path(1, wo).engine == "matvec" and wo.n_in == n_out:
            # a decode row: the attention's combine writes o's q8_1 operand itself
            q, k, v = self.gemm.norm_linears(x, norm_w, eps, (wq, wk, wv), biases)
            q8 = self._rope_attention_f16(q.reshape(1, cfg.n_head, hd), k.reshape(1, cfg.n_head_kv, hd),
                                          v.reshape(1, cfg.n_head_kv, hd), cache, layer, pos0,
                                          q8=self.gemm.q8_scratch(0, 1, n_out))
            return self.gemm.linear_q8(q8, wo, residual=x)
        if not (T > 1 and cache.k.dtype == cp.float16 and self.gemm.all_f16(x, (wq, wk, wv))):
            return super().attention_block(x, norm_w, eps, wq, wk, wv, biases, wo, cache, layer, pos0)
        q, k, v = self.gemm.norm_linears(x, norm_w, eps, (wq, wk, wv), (None, None, None), views=True)
        o_f16 = self.gemm.path(T, wo).engine == "f16" and wo.n_in == n_out
        a = self._rope_attention_f16(q.reshape(T, cfg.n_head, hd), k.reshape(T, cfg.n_head_kv, hd),
                                     v.reshape(T, cfg.n_head_kv, hd), cache, layer, pos0,
                                     out=self.gemm.f16_operand((T, n_out)) if o_f16 else None,
                                     biases=biases)
        return self.gemm.linear_f16(a, wo, residual=x) if o_f16 else self.gemm.linear(a, wo, residual=x)

    def rope_attention(self, q, k, v, cache, layer: int, pos0, out=None):
        """The f16 cache (head dim 128): _rope_attention_f16. The f32 cache: rope,
        rope, attention."""
        if cache.k.dtype != cp.float16:
            return self.attention(self.rope(q, pos0), self.rope(k, pos0), v, cache, layer, pos0, out=out)
        return self._rope_attention_f16(q, k, v, cache, layer, pos0, out=out)

    def _rope_attention_f16(self, q, k, v, cache, layer: int, pos0, out=None, biases=(None, None, None),
                            q8=None):
        """One decode row rotates, stores and attends in one kernel (and its combine
        writes the q8_1 form of the output into q8 when given); a prompt runs the
        biases, RoPE, the KV store and q's rounding to f16 in one launch, then the
        flash attention. A decode row takes no biases (its matvecs add them)."""
        self._check_heads(q, k)
        self._rope_check(q, pos0)
        kc, vc = cache.k[layer], cache.v[layer]
        if q.shape[0] == 1:
            if any(b is not None for b in biases):
                raise ValueError("decode attention: the q/k/v biases belong to the matvecs")
            return attention.decode_attention(q, kc, vc, pos0, out, new_kv=(k, v), cos_sin=self._cos_sin,
                                              neox=self.cfg.rope_neox, q8=q8)
        q16 = attention.rope_store_kv_f16(q, k, v, kc, vc, self._cos_sin, pos0, self.cfg.rope_neox,
                                          q_out=cp.empty(q.shape, cp.float16), biases=biases)
        return attention.flash_attention(q16, kc, vc, pos_value(pos0), out=out, wgmma=self._flash_wgmma())

    def _flash_wgmma(self) -> bool:
        """The settings' choice of flash kernel, counted as the kernel that runs."""
        wgmma = self._settings.flash_wgmma
        self.gemm.counters.counts["flash " + attention.flash_kind(wgmma)] += 1
        return wgmma

    def _check_heads(self, q, k) -> None:
        cfg = self.cfg
        if q.shape[1:] != (cfg.n_head, cfg.head_dim) or k.shape[1:] != (cfg.n_head_kv, cfg.head_dim):
            raise ValueError(f"attention: q {q.shape}, k {k.shape} do not match the model's heads")

    def attention(self, q, k, v, cache, layer: int, pos0: int, out=None):
        self._check_heads(q, k)
        if cache.k.dtype == cp.float16:          # head dim 128: tensor-core flash attention
            wgmma = self._flash_wgmma() if q.shape[0] > 1 else True
            return attention.attention_f16(q, k, v, cache.k[layer], cache.v[layer], pos0, out=out, wgmma=wgmma)
        return attention.attention_f32(q, k, v, cache.k[layer], cache.v[layer], pos0, out=out)

    def swiglu(self, gate, up, out=None):
        return ops.swiglu(gate, up, out=out)

    def add(self, a, b, out=None):
        return ops.add(a, b, out=out)

    def greedy(self, logits):
        return ops.argmax(logits)

    def rows(self, x, start: int, stop: int):
        return x[start:stop]          # contiguous: a range of whole rows

    def to_numpy(self, x) -> np.ndarray:
        return cp.asnumpy(x).astype(np.float32, copy=False)

    def synchronize(self) -> None:
        cp.cuda.get_current_stream().synchronize()

    # --- CUDA graphs ---------------------------------------------------------
    def captured(self, cache, key, fn, x):
        """fn(x), eager on a key's first use, captured on its second, replayed after
        (graphs.py). A single-token forward runs eagerly: its position never repeats
        within a generation (the greedy decode step has its own graph: decode).
        A decode step queued ahead on this cache is dropped: this work rewrites rows
        it read, so its token is no longer the one a fresh step would give."""
        cache.ahead = None
        if not self._settings.graphs or self.graphs.failed or x.shape[0] == 1:
            return fn(x)
        return self.graphs.run(cache.graphs, (key, self._settings), fn, x)

    def decode(self, cache, step, token: int, pos: int) -> tuple[int, bool]:
        """step(token, pos) on the device, token and position in a device buffer that
        the kernels read: a CUDA graph per cache, replayed one step ahead of the host
        (decode.py). The f32 KV cache (head dims other than 128) runs eagerly."""
        if cache.k.dtype != cp.float16:          # the f32 attention takes host positions
            out = step(cp.asarray(np.array([token], dtype=np.int32)), pos)
            nxt, finite = (int(v) for v in out.get())
            return nxt, bool(finite)
        # a step's graph replays at the positions of its key: those on the same side of
        # the decode attention's one-launch limit (attention.decode_short)
        return self.decoder.decode(cache, step, token, pos,
                                   lambda p: (("decode", attention.decode_short(p)), self._settings))

    def _graph_keep_alive(self) -> tuple:
        return (self.gemm.scratch(), self._cos_sin)

    # --- measurement -----------------------------------------------------------
    def device_info(self) -> dict[str, str | None]:
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        name = props["name"]
        return {"device": name.decode() if isinstance(name, bytes) else str(name),
                "driver": _nvidia_driver_version(),
                "cuda_driver": _cuda_version(cp.cuda.runtime.driverGetVersion()),
                "cuda_runtime": _cuda_version(cp.cuda.runtime.runtimeGetVersion())}

    def close(self) -> None:
        """Free the memory pools' cached blocks (the arrays are already dropped)."""
        self.synchronize()
        cp.get_default_memory_pool().free_all_blocks()
        cp.get_default_pinned_memory_pool().free_all_blocks()

    def timer(self) -> Timer:
        return CudaTimer(self)

    def counters(self) -> dict:
        """Launches per GEMM path (replays included) and the CUDA graph replays."""
        return {**self.gemm.counters.counts, "graph replays": self.graphs.replays}

    def reset_counters(self) -> None:
        self.gemm.counters.reset()
        self.graphs.replays = 0

    def memory_report(self, cache=None) -> dict[str, int]:
        m = dict(self.store.bytes)
        m["f16 GEMM scratch"] = self.gemm.scratch_bytes()
        m["W_exp planes"] = self.store.plane_bytes
        if cache is not None:
            m["KV cache"] = int(cache.k.nbytes + cache.v.nbytes)
            m["CUDA graph pools"] = sum(int(g.pool.total_bytes()) for g in cache.graphs.values()
                                        if hasattr(g, "pool"))
        pool = cp.get_default_memory_pool()
        free, total = cp.cuda.runtime.memGetInfo()
        m.update({"memory pool used": int(pool.used_bytes()), "memory pool total": int(pool.total_bytes()),
                  "device used": int(total - free), "device total": int(total)})
        return m

    def memory_check(self, tensors) -> dict:
        expected = expected_plane_bytes(tensors, self._settings)
        return {"W_exp planes expected": expected,
                "problem": plane_check(expected, self.store.planes)}


def _cuda_version(v: int) -> str:
    """CUDA's integer version (12080) -> "12.8"."""
    return f"{v // 1000}.{v % 1000 // 10}"


def _nvidia_driver_version() -> str | None:
    """The NVIDIA kernel driver's version, from /proc (Linux), else None."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            head = f.readline()
    except OSError:
        return None
    words = head.split()
    return next((w for w in words if w[:1].isdigit() and "." in w), None)
