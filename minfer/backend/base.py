"""The ops the graph calls. Each backend implements all of them; the graph never
branches on device or quantization type.

Arrays are the backend's own (numpy.ndarray on the CPU, cupy.ndarray on CUDA).
Activations are float32 at this interface; a backend may keep other precisions
internally. Shapes use T = tokens in this call, d = d_model, hd = head_dim.
"""
from __future__ import annotations

import contextlib
import resource
import time
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from ..config import ModelConfig


class Timer:
    """Seconds of the work queued between start() and stop(): wall time around a
    synchronize (a device backend measures with its own events instead)."""

    def __init__(self, backend: "Backend"):
        self.backend = backend

    def start(self) -> None:
        self.backend.synchronize()
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        self.backend.synchronize()
        return time.perf_counter() - self._t0


class Backend(ABC):
    name: str = "?"

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.rope_factors = None            # rope_freqs.weight (hd/2,) float32 host, or None
        self._deterministic = False

    @property
    def deterministic(self) -> bool:
        """The deterministic mode: a row's arithmetic is fixed by what the row is (a
        prompt's or a decode step's), never by how many rows share its forward, how a
        prompt was chunked, or which other sequences run beside it."""
        return self._deterministic

    def set_deterministic(self, on: bool) -> None:
        self._deterministic = bool(on)

    def set_rope_factors(self, factors) -> None:
        """RoPE's per-pair frequency divisors (minfer/rope.py), float32 host (hd/2,) or
        None; set by load_weights before any cache exists. A backend rebuilds its
        RoPE tables from them."""
        self.rope_factors = factors

    # --- weights and state -------------------------------------------------
    def prepare(self, weights) -> None:
        """Called once with the model's loaded weights (graph/weights.py's Weights),
        before any forward: a backend may plan across layers (the CUDA backend learns
        which layer follows which, for its prefetch)."""

    @abstractmethod
    def load_weight(self, name: str, info, raw: np.ndarray) -> Any:
        """Register one GGUF tensor. raw: uint8 (rows, row_bytes) host view of the
        file bytes (info: minfer.format.gguf.TensorInfo). Returns the handle the graph
        passes back to the ops below (for 1-D tensors: a float32 vector)."""

    @abstractmethod
    def new_cache(self, max_tokens: int) -> Any:
        """KV cache for max_tokens positions; has attribute n_ctx = max_tokens. It is
        contiguous (position p at row p), or the storage of a paged cache
        (minfer/kv/): then its rows are blocks that sequence_cache views read, and a
        Batch's sequences write (attention's pos a minfer.kv.batch.Batch)."""

    @abstractmethod
    def sequence_cache(self, storage, n_ctx: int) -> Any:
        """One sequence's view of a paged cache: the same rows as storage (a
        new_cache), read through a block table that set_table(blocks, pad) sets;
        n_ctx positions. Every op takes it where it takes a contiguous cache."""

    # --- ops ----------------------------------------------------------------
    @abstractmethod
    def embed(self, table, tokens: np.ndarray) -> Any:
        """table (vocab, d) handle, tokens int32 (T,) host -> x (T, d)"""

    @abstractmethod
    def rmsnorm(self, x, w, eps: float) -> Any:
        """x (T, d), w (d,) -> x / rms(x) * w  (T, d)"""

    @abstractmethod
    def linear(self, x, w, bias=None, residual=None) -> Any:
        """x (T, n_in) @ W (n_out, n_in)^T [+ bias (n_out,)] -> y (T, n_out); with a
        residual (T, n_out): residual + y (the residual stream's add, which a backend
        may fuse into the product's store). The residual is consumed: a backend may
        write the sum into its memory and return it."""

    def linears(self, x, ws, biases) -> list:
        """Several linears of the same x (q/k/v, gate/up) -> [(T, n_out) each]; a
        backend may share work on x between them (the CUDA f16 engine rounds x once)."""
        return [self.linear(x, w, b) for w, b in zip(ws, biases)]

    # The composite ops below are the layer's sub-blocks written with the ops above;
    # a backend may fuse them (the CUDA decode step does), the math stays this.
    def norm_linears(self, x, norm_w, eps: float, ws, biases) -> list:
        """linears of rmsnorm(x) * norm_w (the attention's q/k/v, the LM head)"""
        return self.linears(self.rmsnorm(x, norm_w, eps), ws, biases)

    def ffn(self, x, L) -> Any:
        """The SwiGLU feed-forward sub-block of layer L (graph/weights.py's LayerWeights)
        with its residual: x (T, d) -> x + down(silu(gate h) * (up h)), h = rmsnorm(x) *
        ffn_norm (T, d); a backend may fuse it or keep the (T, d_ff) intermediates in
        lower precision. x is consumed, as linear's residual."""
        h = self.rmsnorm(x, L.ffn_norm, self.cfg.rms_eps)
        return self.linear(self.swiglu(*self.linears(h, (L.ffn_gate, L.ffn_up), (None, None))), L.ffn_down,
                           residual=x)

    def attention_block(self, x, L, cache, layer: int, pos0) -> Any:
        """The attention sub-block of layer L with its residual: x (T, d) -> x + o(a), a
        the attention (rope_attention) of q, k, v = the linears of rmsnorm(x) *
        attn_norm with their biases (each None or (n_out,)). x is consumed, as
        linear's residual."""
        cfg, T = self.cfg, x.shape[0]
        q, k, v = self.norm_linears(x, L.attn_norm, cfg.rms_eps, (L.attn_q, L.attn_k, L.attn_v),
                                    (L.attn_q_bias, L.attn_k_bias, L.attn_v_bias))
        a = self.rope_attention(q.reshape(T, cfg.n_head, cfg.head_dim), k.reshape(T, cfg.n_head_kv, cfg.head_dim),
                                v.reshape(T, cfg.n_head_kv, cfg.head_dim), cache, layer, pos0)
        return self.linear(a, L.attn_output, residual=x)                     # (T, n_head*hd) -> (T, d)

    def rope_attention(self, q, k, v, cache, layer: int, pos0: int) -> Any:
        """attention of q and k rotated by RoPE at positions pos0.. (see rope, attention)"""
        return self.attention(self.rope(q, pos0), self.rope(k, pos0), v, cache, layer, pos0)

    @abstractmethod
    def rope(self, x, pos0: int) -> Any:
        """x (T, n_heads, hd) at positions pos0..pos0+T-1 (or a Batch's row positions)
        -> rotated (T, n_heads, hd); NeoX (halves) or normal (adjacent pairs) per
        cfg.rope_neox, base cfg.rope_base."""

    @abstractmethod
    def attention(self, q, k, v, cache, layer: int, pos0: int) -> Any:
        """q (T, n_head, hd), k/v (T, n_head_kv, hd): stores k/v in cache[layer] at
        pos0..pos0+T-1, then causal GQA softmax(q k^T / sqrt(hd)) v over positions
        0..pos0+t for query t -> (T, n_head*hd). pos0 a minfer.kv.batch.Batch: the
        rows of several sequences, each stored at its cache rows and attending to
        its own sequence's positions only."""

    @abstractmethod
    def swiglu(self, gate, up) -> Any:
        """gate, up (T, d_ff) -> silu(gate) * up (T, d_ff)"""

    @abstractmethod
    def add(self, a, b) -> Any:
        """a + b, same shape (residual add)"""

    @abstractmethod
    def rows(self, x, start: int, stop: int) -> Any:
        """x[start:stop] (positions kept for the LM head)"""

    @abstractmethod
    def select_rows(self, x, idx) -> Any:
        """x[idx], idx a host int array (the rows of a batch the LM head runs on)"""

    @abstractmethod
    def to_numpy(self, x) -> np.ndarray:
        """-> float32 host array"""

    def greedy(self, logits):
        """logits (1, vocab) -> [the first index of the maximum, 1 if every logit is
        finite else 0], as the backend's (2,) int array"""
        return np.array([int(np.argmax(logits)), int(np.isfinite(logits).all())], np.int32)

    def decode(self, cache, step, token: int, pos: int) -> tuple[int, bool]:
        """step(tokens (1,), pos) -> greedy (2,) for one decode step; a backend may
        keep token and position in device memory and replay the step. -> (next id, finite)"""
        out = step(np.array([token], dtype=np.int32), pos)
        return int(out[0]), bool(out[1])

    @contextlib.contextmanager
    def batch_rows(self, batch):
        """Around a forward over a Batch: a backend may choose its paths by what the
        rows are (the CUDA backend gives a decode step of several sequences its own
        GEMM engine). The CPU's arithmetic is the same for every kind of row."""
        yield

    def captured(self, cache, key, fn, x):
        """fn(x) -> y: device work that a backend may record once and replay when
        the same key comes again for this cache (CUDA graphs). The CPU runs fn(x)."""
        return fn(x)

    def captured_batch(self, cache, batch, fn, x):
        """fn(x) -> y for a Batch's layers: a backend may record a decode step of B
        sequences once and replay it for later steps of B (CUDA graphs per batch
        size). The CPU runs fn(x)."""
        return fn(x)

    def synchronize(self) -> None:
        """Wait for queued device work (timing); nothing to do on the CPU."""

    @contextlib.contextmanager
    def guard(self, what: str):
        """The boundary where running out of device memory becomes one MinferError
        line naming `what` (the engine wraps loading, the graph each forward)."""
        yield

    # prompt lengths Engine.warmup runs: enough to touch what the backend sets up on
    # first use (nothing on the CPU but the code paths themselves)
    warmup_lengths: tuple[int, ...] = (2,)

    # --- measurement (minfer bench uses only these) ---------------------------
    def timer(self) -> Timer:
        return Timer(self)

    def counters(self) -> dict[str, int] | None:
        """Launches per kernel path since the last reset (None: not counted)."""
        return None

    def reset_counters(self) -> None:
        pass

    def memory_report(self, cache=None) -> dict[str, int]:
        """Bytes by kind (weights, caches, scratch); the host's peak resident set here."""
        m = {"host peak RSS": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024}
        if cache is not None:
            m["KV cache"] = int(sum(a.nbytes for a in (cache.k, cache.v)))
        return m

    def memory_check(self, tensors) -> dict:
        """Allocations checked against the GGUF tensor table (name -> TensorInfo):
        {"problem": None or why not, ...the figures compared}; empty when nothing is checked."""
        return {}

    def device_info(self) -> dict[str, str | None]:
        """What the ops run on, for run records (`minfer bench`) and the line that
        `--backend auto` prints. Exactly these keys (None where there is no such thing):
          device        the processor's name: the GPU's ("NVIDIA H200"), or the host CPU's
          driver        the NVIDIA driver's version ("570.124.06")
          cuda_driver   the CUDA version the driver supports ("12.8")
          cuda_runtime  the CUDA runtime version the backend runs on ("12.9")
        This default describes the host CPU; a device backend overrides it."""
        from ..tools.runinfo import host_cpu
        return {"device": host_cpu(), "driver": None, "cuda_driver": None, "cuda_runtime": None}

    # --- end of use ---------------------------------------------------------------
    def close(self) -> None:
        """Give back what the backend holds beyond the Python objects' lifetime
        (a device backend: its memory pools). Engine.close calls it once, after it
        has dropped the weights and caches; nothing is used afterwards."""
