"""CUDABackend: every graph op on the GPU, activations f32 in cupy arrays.

It composes the package's parts and holds the settings once (parts.py: every
part reads the one settings object): the registered weights (weights.py), the run
state (state.py), the counters (counters.py), the linears (linears.py), the two
fused sub-blocks (attention_block.py, ffn.py), CUDA graphs (graphs.py) and the
decode step (decode.py). Device out-of-memory becomes one MinferError line at one
boundary, `guard`, which the engine wraps around loading and the graph around
each forward. No host synchronisation inside a layer: nothing reads a device
value back except `to_numpy` and `decode`.
"""
from __future__ import annotations

import contextlib

import numpy as np
from gguf import GGMLQuantizationType

from ...config import ModelConfig
from ...errors import MinferError
from ..base import Backend, Timer
from . import device
from .attention_block import AttentionBlock
from .decode import DecodeRunner
from .graphs import GraphRunner
from .kernels import argmax, attention, decode_attn, elementwise, norm
from .kernels.dequant import dequant_rows
from .kv_cache import CudaCache
from .launch import cp, device_cc, is_oom, require_cupy
from .parts import Parts
from .settings import LOAD_TIME, CudaSettings
from .weights import expected_plane_bytes, plane_check


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
        if cfg.head_dim == decode_attn.FA_HD and cfg.n_head // cfg.n_head_kv > decode_attn.DEC_MAX_G:
            raise MinferError(f"{cfg.n_head // cfg.n_head_kv} query heads per KV head: the CUDA decode "
                              f"attention takes at most {decode_attn.DEC_MAX_G}")
        self.parts = p = Parts(settings or CudaSettings.from_env(), cfg.rms_eps)
        self.store, self.state, self.launches = p.store, p.state, p.counters
        self.lin, self.ffn_block = p.lin, p.ffn
        self.attn_block = AttentionBlock(cfg, p.lin, p.state, p.get)
        # programmatic dependent launches exist from compute capability 9.0 (Hopper) on
        hopper = device_cc() >= (9, 0)
        self.graphs = GraphRunner(self.launches, self.state.keep_alive,
                                  lambda: hopper and p.settings.dependent_launches)
        self.decoder = DecodeRunner(self.graphs, lambda: p.settings.graphs and not self.graphs.failed)

    # --- settings --------------------------------------------------------------
    @property
    def settings(self) -> CudaSettings:
        return self.parts.settings

    @property
    def deterministic(self) -> bool:
        return self.parts.settings.deterministic

    def set_deterministic(self, on: bool) -> None:
        """The deterministic mode is a setting (paths.gemm_path reads it; a captured
        graph's key holds it)."""
        self.parts.settings = self.parts.settings.replace(deterministic=bool(on))

    @contextlib.contextmanager
    def using(self, **changes):
        """Run with some settings replaced (tests, A/B scripts), restored afterwards.
        The load-time ones (settings.LOAD_TIME) cannot change after load."""
        p = self.parts
        late = [k for k in changes if k in LOAD_TIME and changes[k] != getattr(p.settings, k)]
        if late:
            raise MinferError(f"{', '.join(late)}: read when the weights load; pass it to Engine.load")
        old = p.settings
        p.settings = old.replace(**changes)
        try:
            yield p.settings
        finally:
            p.settings = old

    # --- the out-of-memory boundary ------------------------------------------------
    @contextlib.contextmanager
    def guard(self, what: str):
        try:
            yield
        except Exception as e:
            if is_oom(e):
                raise device.oom_error(what, self.settings, self.store) from None
            raise

    # --- weights and state ---------------------------------------------------
    def load_weight(self, name: str, info, raw: np.ndarray):
        if len(info.shape) == 1:
            if info.qtype != GGMLQuantizationType.F32:
                raise MinferError(f"{name}: 1-D tensor of type {info.qtype.name}, expected F32")
            return cp.asarray(np.ascontiguousarray(raw).view(np.float32).reshape(info.shape))  # (n,)
        return self.store.register(name, info, raw)

    def prepare(self, weights) -> None:
        self.ffn_block.plan(weights.layers)

    def new_cache(self, max_tokens: int) -> CudaCache:
        if max_tokens < 1:
            raise MinferError(f"context size must be positive, got {max_tokens}")
        what = f"allocating the KV cache for {max_tokens} tokens"
        if CudaCache.nbytes_for(self.cfg, max_tokens) > cp.cuda.runtime.memGetInfo()[0]:
            raise device.oom_error(what, self.settings, self.store)   # before the host builds its RoPE table
        with self.guard(what):
            cache = CudaCache(self.cfg, max_tokens)
            self.state.rope(max_tokens, self.cfg.head_dim, self.cfg.rope_base, self.rope_factors)
        return cache

    def sequence_cache(self, storage: CudaCache, n_ctx: int) -> CudaCache:
        if n_ctx < 1 or n_ctx > storage.n_rows:
            raise MinferError(f"a sequence of {n_ctx} positions in a cache of {storage.n_rows}")
        with self.guard("allocating a sequence's view of the KV cache"):
            cache = CudaCache(self.cfg, n_ctx, storage=storage)
            self.state.rope(n_ctx, self.cfg.head_dim, self.cfg.rope_base, self.rope_factors)
        return cache

    def set_rope_factors(self, factors) -> None:
        super().set_rope_factors(factors)
        self.state.cos_sin = None            # new_cache builds it again with the factors

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
        return self.lin.linear(x, w, bias=bias, out=out, residual=residual)

    def linears(self, x, ws, biases):
        return self.lin.linears(x, ws, biases)

    def norm_linears(self, x, norm_w, eps: float, ws, biases):
        return self.lin.norm_linears(x, norm_w, eps, ws, biases)

    def attention_block(self, x, L, cache, layer: int, pos0):
        return self.attn_block(x, L, cache, layer, pos0)

    def ffn(self, x, L):
        return self.ffn_block(x, L)

    def rmsnorm(self, x, w, eps: float, out=None):
        return norm.rmsnorm(x, w, eps, out=out)

    def rope(self, x, pos0, out=None):
        return self.attn_block.rope(x, pos0, out=out)

    def rope_attention(self, q, k, v, cache, layer: int, pos0, out=None):
        return self.attn_block.rope_attention(q, k, v, cache, layer, pos0, out=out)

    def attention(self, q, k, v, cache, layer: int, pos0: int, out=None):
        return self.attn_block.attention(q, k, v, cache, layer, pos0, out=out)

    def swiglu(self, gate, up, out=None):
        return elementwise.swiglu(gate, up, out=out)

    def add(self, a, b, out=None):
        return elementwise.add(a, b, out=out)

    def greedy(self, logits):
        return argmax.argmax(logits)

    def rows(self, x, start: int, stop: int):
        return x[start:stop]          # contiguous: a range of whole rows

    def select_rows(self, x, idx):
        return x[cp.asarray(np.asarray(idx, np.int64))]

    def to_numpy(self, x) -> np.ndarray:
        return cp.asnumpy(x).astype(np.float32, copy=False)

    def synchronize(self) -> None:
        cp.cuda.get_current_stream().synchronize()

    @contextlib.contextmanager
    def batch_rows(self, batch):
        old = self.state.decode_rows, self.state.prompt_rows
        self.state.decode_rows, self.state.prompt_rows = batch.decode, batch.prefill
        try:
            yield
        finally:
            self.state.decode_rows, self.state.prompt_rows = old

    # --- CUDA graphs ---------------------------------------------------------
    def captured(self, cache, key, fn, x):
        """fn(x), eager on a key's first use, captured on its second, replayed after
        (graphs.py). A single-token forward runs eagerly: its position never repeats
        within a generation (the greedy decode step has its own graph: decode).
        A decode step queued on this cache is dropped: this work rewrites rows it
        read, so its token is no longer the one a fresh step would give."""
        cache.queued = None
        if not self.settings.graphs or self.graphs.failed or x.shape[0] == 1:
            return fn(x)
        return self.graphs.run(cache.graphs, (key, self.settings), fn, x)

    def captured_batch(self, cache, batch, fn, x):
        """A decode step of B sequences (f16 cache) runs from a CUDA graph per (B, table
        width, one- or two-launch attention): its positions and block tables are copied
        into buffers of the storage that every replay reads (kv_cache.BatchSlots);
        anything else (a prompt's rows) runs eagerly."""
        if not (batch.decode and self.settings.graphs and not self.graphs.failed
                and cache.k.dtype == cp.float16):
            return fn(x)
        key, dev = cache.bind_decode(batch)
        return self.graphs.run(cache.graphs, (key, decode_attn.decode_short(batch.max_pos), self.settings),
                               fn, x)

    def decode(self, cache, step, token: int, pos: int) -> tuple[int, bool]:
        """step(token, pos) on the device, token and position in a device buffer that
        the kernels read: a CUDA graph per cache, replayed one step ahead of the host
        (decode.py). The f32 KV cache (head dims other than 128) runs eagerly."""
        if cache.k.dtype != cp.float16:          # the f32 attention takes host positions
            out = step(cp.asarray(np.array([token], dtype=np.int32)), pos)
            nxt, finite = (int(v) for v in out.get())
            return nxt, bool(finite)
        # a step's graph replays at the positions of its key: those on the same side of
        # the decode attention's one-launch limit (decode_attn.decode_short)
        return self.decoder.decode(cache, step, token, pos,
                                   lambda p: (("decode", decode_attn.decode_short(p)), self.settings))

    # --- measurement -----------------------------------------------------------
    def device_info(self) -> dict[str, str | None]:
        return device.device_info()

    def close(self) -> None:
        """Free the memory pools' cached blocks (the arrays are already dropped)."""
        self.synchronize()
        cp.get_default_memory_pool().free_all_blocks()
        cp.get_default_pinned_memory_pool().free_all_blocks()

    def timer(self) -> Timer:
        return device.CudaTimer(self)

    def counters(self) -> dict:
        """Path labels and launches by kernel name (replays included), and the CUDA
        graph replays."""
        return {**self.launches.counts, "graph replays": self.graphs.replays}

    def reset_counters(self) -> None:
        self.launches.reset()
        self.graphs.replays = 0

    def memory_report(self, cache=None) -> dict[str, int]:
        m = dict(self.store.bytes)
        m["f16 GEMM scratch"] = self.state.scratch_bytes()
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
        expected = expected_plane_bytes(tensors, self.settings)
        return {"W_exp planes expected": expected,
                "problem": plane_check(expected, self.store.planes)}
