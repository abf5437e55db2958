"""The feed-forward sub-block on the GPU: x + down(silu(gate h) * up h), h =
rmsnorm(x) * norm_w, in the fewest launches each length allows.

    decode rows      norm -> q8_1; gate and up (one launch where they share a type);
    (one, or a step's) SwiGLU -> q8_1; down with the residual in its store
    a prompt         the f16 FFN: the (T, d_ff) intermediates in f16, gate/up and
                     SwiGLU in one kernel where paths.gateup_kernel says so (the f16
                     kernel also prefetches the next layer's gate/up), else the chain
                     (gate/up GEMMs, swiglu_f16); down accumulates into x
    otherwise        three linears in f32

Which layer comes next is learnt once (plan), so a layer's FFN knows which pair
its f16 gate/up launch may prefetch.
"""
from __future__ import annotations

from .kernels import gateup_sm90
from .kernels.dequant_f16 import cast_f16, dequant_f16_many, swiglu_f16
from .kernels.elementwise import add, swiglu
from .kernels.norm import rmsnorm, rmsnorm_q8_1
from .kernels.quantize import swiglu_q8_1
from .launch import cp, device_cc
from .paths import gateup_kernel
from .state import Prefetched


class FFN:
    def __init__(self, linears, state, counters, settings, eps: float):
        self.lin, self.state, self.counters = linears, state, counters
        self._settings = settings                # () -> the backend's CudaSettings
        self.eps = eps
        self._next: dict[int, object] = {}       # id(layer) -> the layer after it

    def plan(self, layers) -> None:
        """The model's layers in order: each FFN may prefetch the next one's gate/up."""
        self._next = {id(a): b for a, b in zip(layers, layers[1:])}

    def __call__(self, x, L):
        """x (T, d) -> x + FFN(x) for layer L's weights; x is consumed."""
        gate, up, down = L.ffn_gate, L.ffn_up, L.ffn_down
        T, d_ff, lin = x.shape[0], gate.n_out, self.lin
        if (lin.all_matvec(x, (gate, up)) and lin.path(T, down).q8_rows
                and up.n_out == d_ff == down.n_in and d_ff % 32 == 0):
            q8 = rmsnorm_q8_1(x, L.ffn_norm, self.eps, *self.state.q8(0, T, x.shape[1]))
            g, u = lin.matvecs(q8, (gate, up), (None, None))
            h8 = swiglu_q8_1(g, u, *self.state.q8(1, T, d_ff))
            return lin.matvecs(h8, (down,), (None,), (x,))[0]
        if self.fused(T, L):                     # x consumed: down accumulates into it
            h = rmsnorm(x, L.ffn_norm, self.eps, out=self.state.x16(x.shape), dtype=cp.float16)
            return self.f16(h, L, residual=x)
        h = rmsnorm(x, L.ffn_norm, self.eps)
        y = lin.linear(swiglu(*lin.linears(h, (gate, up), (None, None))), down)
        return add(x, y, out=y)

    def fused(self, T: int, L) -> bool:
        """Does the FFN of T tokens run in f16 (all three GEMMs on the f16 engine)?"""
        gate, up, down = L.ffn_gate, L.ffn_up, L.ffn_down
        return (self._settings().ffn_f16 and gate.n_out == up.n_out == down.n_in
                and all(self.lin.path(T, w).engine == "f16" for w in (gate, up, down)))

    def f16(self, h, L, residual=None):
        """h (T, d) f32, or f16 already rounded -> down(silu(gate h) * up h) f32 (T, d)
        with the (T, d_ff) intermediates in f16; with a residual, the down GEMM
        accumulates into it (consumed) and returns it."""
        gate, up, down = L.ffn_gate, L.ffn_up, L.ffn_down
        T, d_ff, lin = h.shape[0], gate.n_out, self.lin
        xh = h if h.dtype == cp.float16 else cast_f16(h, self.state.x16(h.shape))      # (T, d)
        kind = gateup_kernel(T, gate, up, self._settings(), self._kept(gate, up), device_cc())
        if kind == "f16":
            f = self._gateup_f16(xh, L)
        elif kind == "q4k":
            for w in (gate, up):
                lin.ran(T, w)
            # a buffer of its own, not the x16 scratch: xh may live there, and the
            # kernel reads xh while it writes h
            f = gateup_sm90.gateup_swiglu_q4k(xh, gate.data, up.data, d_ff,
                                              out=cp.empty((T, d_ff), cp.float16))  # (T, d_ff)
        else:
            if lin.groups(T, (gate, up), (None, None)):
                gu = lin.f16_group(xh, (gate, up), cp.float16)                       # 2 x (T, d_ff) views
            else:
                gu = [lin.f16_gemm(xh, w, out=cp.empty((T, d_ff), cp.float16))     # (T, d_ff)
                      for w in (gate, up)]
            f = swiglu_f16(*gu, out=self.state.x16((T, d_ff)))                      # (T, d_ff)
        return lin.f16_residual(f, down, residual)

    def _gateup_f16(self, xh, L):
        """h = SwiGLU of gate/up by gateup_swiglu_f16 -> (T, d_ff) f16. Its f16 weights
        are in a slot already when the launch before (the previous layer's) prefetched
        them, else they are dequantized now; the launch prefetches the next layer's
        pair into the other slot when that layer takes this kernel too. Every GEMM
        dequantizing in between uses the slot not held (state.w16), and one stream
        orders each slot's reads before its next writes."""
        gate, up, lin = L.ffn_gate, L.ffn_up, self.lin
        T, d_ff, n = xh.shape[0], gate.n_out, 2 * gate.n_out * gate.n_in
        held, self.state.prefetched = self.state.prefetched, None
        handed = held is not None and (held.gate_ptr, held.up_ptr) == (gate.ptr, up.ptr)
        slot = held.slot if handed else 0
        w16 = self.state.slot(slot, n)
        if handed:
            for w in (gate, up):
                lin.ran(T, w)
        else:
            dequant_f16_many([lin.dequant_args(T, gate, w16[:n // 2]),
                              lin.dequant_args(T, up, w16[n // 2:])])
        nxt, job = self._next.get(id(L)), None
        if nxt is not None:
            g2, u2 = nxt.ffn_gate, nxt.ffn_up
            if (g2.n_out, g2.n_in, u2.n_out, u2.n_in) == (d_ff, gate.n_in, d_ff, gate.n_in) and gateup_kernel(
                    T, g2, u2, self._settings(), self._kept(g2, u2), device_cc()) == "f16":
                job = (g2.data, u2.data, self.state.slot(1 - slot, n)[:n])
        # h in a buffer of its own, not the x16 scratch: xh may live there
        h = gateup_sm90.gateup_swiglu_f16(xh, w16[:n].reshape(2 * d_ff, gate.n_in), d_ff, prefetch=job,
                                          out=cp.empty((T, d_ff), cp.float16))     # (T, d_ff)
        if job is not None:
            self.counters.label("gate/up prefetch")
            self.state.prefetched = Prefetched(1 - slot, g2.ptr, u2.ptr)
        return h

    def _kept(self, gate, up) -> bool:
        """Is an f16 copy kept for gate or up (settings.f16_weights)?"""
        store = self.lin.store
        return store.f16_of(gate) is not None or store.f16_of(up) is not None
