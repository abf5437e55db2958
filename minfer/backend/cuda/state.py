"""The run state of one CUDA backend, held once: every grow-only scratch buffer, the
slot that holds the next layer's gate/up, and the RoPE table.

Buffers grow to the largest call and are reused: one stream orders every reuse
after the kernel that read it. A captured CUDA graph keeps the buffers it touched
alive (keep_alive), so a later growth cannot free them under it. (The KV caches
are per conversation, kv_cache.py; cuBLASLt's plans and the TMA descriptors are
memo tables of those libraries keyed by what they encode, cublas.py and tma.py.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .kernels.rope import rope_table
from .launch import cp


@dataclass(frozen=True)
class Prefetched:
    """The next layer's gate/up, dequantized to f16 into weight slot `slot` by the
    last gate/up launch (kernels/gateup_sm90.py's prefetch)."""
    slot: int
    gate_ptr: int
    up_ptr: int


class RunState:
    def __init__(self, f16_elems):
        self._f16_elems = f16_elems              # () -> the largest layer weight the f16 engine dequantizes
        self._q8 = [None, None]                  # two slots of (q int8, d f32, s f32), flat
        self._x16 = None                         # f16 activations, flat
        self._w16 = [None, None]                 # two f16 weight slots, flat
        self.prefetched: Prefetched | None = None
        self.cos_sin = None                      # (n_pos, hd/2, 2) f32: the RoPE table
        # the forward running now is a decode step of several sequences (one row each):
        # paths.gemm_path gives such rows their own engine (CUDABackend.batch_rows)
        self.decode_rows = False
        self.prompt_rows = False                 # ... or a Batch of prompt rows (Batch.prefill)

    def q8(self, slot: int, T: int, n: int):
        """q8_1 buffers for x (T, n) in one of two slots (a decode step's FFN reads
        slot 0 and writes slot 1), grown when too small."""
        if self._q8[slot] is None or self._q8[slot][0].size < T * n:
            self._q8[slot] = (cp.empty(T * n, cp.int8),                # (T*n,)
                              cp.empty(T * n // 32, cp.float32),       # (T*n/32,)
                              cp.empty(T * n // 32, cp.float32))       # (T*n/32,)
        q, d, s = self._q8[slot]
        return (q[:T * n].reshape(T, n), d[:T * n // 32].reshape(T, n // 32),
                s[:T * n // 32].reshape(T, n // 32))

    def x16(self, shape):
        """The f16 activation scratch as `shape` (grown when too small): the rounded x
        of a GEMM, or the SwiGLU output its down GEMM reads."""
        n = math.prod(shape)
        if self._x16 is None or self._x16.size < n:
            self._x16 = cp.empty(n, cp.float16)                         # (T*n_in,)
        return self._x16[:n].reshape(shape)

    def w16(self, n: int = 0):
        """The f16 weight scratch: the slot that does not hold the prefetched pair, at
        least the largest layer weight the f16 engine dequantizes, or n elements (a
        group of weights side by side) when that is more."""
        return self.slot(0 if self.prefetched is None else 1 - self.prefetched.slot, n)

    def slot(self, i: int, n: int = 0):
        """f16 weight slot i (flat), grown to max(n, the largest layer weight)."""
        n = max(n, self._f16_elems())
        if self._w16[i] is None or self._w16[i].size < n:
            self._w16[i] = cp.empty(n, cp.float16)                      # (n,)
        return self._w16[i]

    def rope(self, n_pos: int, hd: int, base: float, factors) -> None:
        """Make the RoPE table cover n_pos positions (kept when it already does)."""
        if self.cos_sin is None or self.cos_sin.shape[0] < n_pos:
            self.cos_sin = cp.asarray(rope_table(n_pos, hd, base, factors))

    def keep_alive(self) -> tuple:
        """The buffers now in use (a captured graph holds on to them)."""
        return (tuple(self._q8), self._x16, tuple(self._w16), self.cos_sin)

    def scratch_bytes(self) -> int:
        return sum(int(a.nbytes) for a in (self._x16, *self._w16) if a is not None)
