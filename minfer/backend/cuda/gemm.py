"""Which path each matmul takes, and the linears that take it.

`gemm_path` is the one place that decides; everything else asks it. The paths
(docs/DESIGN.md has the table with the measurements behind it):

    f32 weight                      -> cupy matmul in f32                 counter f32_gemm
    T == 1 (decode)                 -> x to q8_1, then matvec (matvec.py) q4k_mv / q6k_mv
    q4_K / q6_K, and T < settings.f16_min_t or a table (the LM head over many positions)
                                    -> int8 MMQ on q8_1 activations       q4k_mmq / q6k_mmq
    otherwise (layer weights from T = f16_min_t on; every GEMM of the types the MMQ
    lacks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q5_K)
                                    -> f16 engine: W dequantized into an f16 scratch
                                       (q6_K: from its W_exp plane when it has one),
                                       one cuBLAS GEMM, f32 accumulation  q4k_f16 / q6k_f16 / q4_0_f16 ...
                                       (with settings.f16_weights, the GEMM reads the f16 copy
                                       kept since load instead: nothing dequantized)

A prompt's FFN on the f16 engine with q4_K gate and up, on a Hopper GPU: gate/up
and SwiGLU in one kernel (gateup.py, the same bits as the chain), by the lengths of
GATEUP_KERNELS either the one that reads the q4_K blocks (counted `gate/up fused`)
or the one that reads them dequantized to f16 (`gate/up f16`) and meanwhile
dequantizes the next layer's gate and up (`gate/up ahead`), so that only the first
layer's pair is dequantized on the critical path. Gate and up count q4k_f16 either
way. `gateup_kernel` decides.

A q6_K GEMM on either engine also counts where its B operand came from:
`q6k exp` (the W_exp plane: the fast path), `q6k exp=off` (planes deliberately
off), `q6k fallback!` (a plane was expected and is missing), `q6k raw` (a q6_K
tensor the bundle does not cover), `q6k f16 kept` (the f16 copy of
settings.f16_weights, made at load from the plane where there is one).
"""
from __future__ import annotations

import atexit
import math
import sys
from dataclasses import dataclass

from gguf import GGMLQuantizationType as QT

from ...errors import MinferError
from . import f16, gateup, int8, matvec, ops
from .launch import cp, device_cc
from .settings import CudaSettings
from .weights import GpuWeight, WeightStore

_PREFIX = {QT.Q4_K: "q4k", QT.Q6_K: "q6k", QT.Q4_0: "q4_0", QT.Q4_1: "q4_1", QT.Q5_0: "q5_0",
           QT.Q5_1: "q5_1", QT.Q8_0: "q8_0", QT.Q5_K: "q5k"}
COUNTERS = (("q4k_mmq", "q6k_mmq", "q4k_f16", "q6k_f16",
             "q6k exp", "q6k exp=off", "q6k fallback!", "q6k raw", "q6k f16 kept",
             "q4k_mv", "q6k_mv", "f32_gemm", "dependent launches", "early dequants",
             "flash wgmma", "flash mma", "gate/up fused", "gate/up f16", "gate/up ahead")
            + tuple(f"{p}_{e}" for t, p in _PREFIX.items() if t not in int8.MMQ_TYPES
                    for e in ("f16", "mv")))


@dataclass(frozen=True)
class GemmPath:
    engine: str                 # "f32", "matvec", "f16" or "mmq"
    counter: str                # the launch counter of the engine
    b_source: str | None        # q6_K on f16/mmq: "q6k exp", "q6k exp=off", "q6k fallback!",
                                #   "q6k raw", "q6k f16 kept"

    @property
    def reads_plane(self) -> bool:
        return self.b_source == "q6k exp"


def gemm_path(T: int, w: GpuWeight, settings: CudaSettings, has_plane: bool,
              has_f16: bool = False) -> GemmPath:
    """The path of x (T, n_in) @ w^T, from the token count, the weight (type, table or
    not, covered by the W_exp bundle or not), the settings, whether a plane is
    registered for it and whether an f16 copy is kept. Pure: same arguments, same path."""
    if w.qtype == QT.F32:
        return GemmPath("f32", "f32_gemm", None)
    if w.qtype not in _PREFIX:
        raise MinferError(f"linear {w.name}: {w.qtype.name} weights are not supported by "
                          f"the CUDA backend ({', '.join(t.name for t in _PREFIX)}, F32)")
    prefix = _PREFIX[w.qtype]
    if T == 1:
        return GemmPath("matvec", f"{prefix}_mv", None)
    mmq = w.qtype in int8.MMQ_TYPES and (T < settings.f16_min_t or w.table)
    engine = "mmq" if mmq else "f16"
    source = None
    if w.qtype == QT.Q6_K:
        if engine == "f16" and has_f16:
            source = "q6k f16 kept"
        elif not w.plane_tensor:
            source = "q6k raw"
        elif not settings.use_planes:
            source = "q6k exp=off"
        else:
            source = "q6k exp" if has_plane else "q6k fallback!"
    return GemmPath(engine, f"{prefix}_{engine}", source)


# Which gate/up + SwiGLU kernel (gateup.py) a prompt's FFN runs, by its length:
# inclusive ranges (hi None: no end) -> "q4k" (reads the q4_K blocks, converts them in
# registers) or "f16" (reads them dequantized to f16, and dequantizes the next layer's
# pair meanwhile); lengths outside every range run the chain (dequantization, cuBLAS,
# SwiGLU). The q4_K kernel's blocks take 256 tokens and convert their weight rows
# once a block, so its cost steps with ceil(T / 256) while the chain grows with T: it
# wins where its last block row is nearly full and there are few rows. Measured on
# the H200, the 7B twin's forward (docs/PERF.md 6.40, 6.43, 6.44), tokens/s against
# the chain: -8% at 32 tokens, level at 128, +12% at 192, +8-10% at 256, -9% at
# 384, +2.3% at 448, +2.4% at 480, +4.0-4.8% at 512 (+7.8% with 6.44's half tiles),
# level at 768, -1% at 1,024, -10% at 3,325. The f16 kernel (6.46), against main's
# kernels (the chain from 513 on): -12% at 512, -6% at 768 and +1.4% (another call
# -1.3%) at 1,024 (its share of the next pair's dequantization is then a large part
# of each block's time), +3.0% at 1,280, +5.9% at 1,536, +4.9-7.7% at 2,048 and
# +4.5-4.8% at 3,325.
GATEUP_KERNELS = (((128, 256), "q4k"), ((448, 512), "q4k"), ((1024, None), "f16"))


def gateup_kernel(T: int, gate: GpuWeight, up: GpuWeight, settings: CudaSettings, has_f16: bool,
                  cc: tuple[int, int]) -> str | None:
    """The gate/up + SwiGLU kernel of the f16-engine FFN of T tokens ("q4k", "f16"), or
    None for the chain: None when the kernels are turned off, outside GATEUP_KERNELS,
    with kept f16 copies (nothing to dequantize), or for weights or a GPU the kernels
    do not fit. Pure."""
    if not (settings.gateup_fused and not has_f16 and gate.n_out == up.n_out and gate.n_in == up.n_in
            and gateup.fits((gate.qtype, up.qtype), gate.n_out, gate.n_in, cc)):
        return None
    return next((kind for (lo, hi), kind in GATEUP_KERNELS if lo <= T and (hi is None or T <= hi)), None)


class Counters:
    """Launches per path since the last reset; a CUDA graph replay adds the counts
    its capture recorded."""

    def __init__(self, report_at_exit: bool = False):
        self.counts = dict.fromkeys(COUNTERS, 0)
        if report_at_exit:
            atexit.register(self._report)

    def reset(self) -> None:
        self.counts = dict.fromkeys(COUNTERS, 0)

    def add(self, counts: dict) -> None:
        for k, n in counts.items():
            self.counts[k] += n

    def count(self, path: GemmPath) -> None:
        self.counts[path.counter] += 1
        if path.b_source:
            self.counts[path.b_source] += 1

    def _report(self) -> None:
        for path, n in self.counts.items():
            print(f"[minfer mmq] {path}: {n}", file=sys.stderr)


class Gemms:
    """The linears of one backend: each asks gemm_path, counts the launch and runs
    it. Scratch (q8_1 activations, f16 activations and weights) grows to the
    largest call and is reused: one stream orders every reuse after the GEMM
    that read it."""

    def __init__(self, store: WeightStore, settings: CudaSettings):
        self.store = store
        self.settings = settings                 # replaced by CUDABackend.using
        self.counters = Counters(settings.report_counts)
        self._q8 = [None, None]                  # two slots of (q int8, d f32, s f32), flat
        self._f16x = None                        # f16 activations, flat
        self._f16w = [None, None]                # two f16 weight slots, flat (_w16, _slot)
        self._ahead = None                       # (slot, gate ptr, up ptr): the next layer's
                                                 # gate/up, written there by the last gate/up f16 launch

    def path(self, T: int, w: GpuWeight) -> GemmPath:
        return gemm_path(T, w, self.settings, self.store.plane_of(w) is not None,
                         self.store.f16_of(w) is not None)

    def linear(self, x, w: GpuWeight, bias=None, out=None, residual=None):
        """x f32 (T, n_in) @ W (n_out, n_in)^T [+ bias (n_out,)] [+ residual (T, n_out)]
        -> f32 (T, n_out). The residual is consumed: the matvec adds it in its store,
        the f16 engine's GEMM accumulates into it (beta = 1: residual + y rounded
        once, as the add); the other engines add it after the GEMM."""
        if x.ndim != 2 or x.shape[1] != w.n_in:
            raise MinferError(f"linear {w.name}: input shape {tuple(x.shape)} does not match "
                              f"the weight's {w.n_in} inputs")
        T = x.shape[0]
        p = self.path(T, w)
        if p.engine == "matvec":
            q8 = int8.quantize_q8_1(x, *self.q8_scratch(0, T, w.n_in))
            return self._matvecs(q8, (w,), (bias,), (residual,), (out,))[0]
        if p.engine == "f16":
            return self._f16_residual(f16.cast_f16(x, self._x16(x.shape)), w, residual, bias, out)
        self.counters.count(p)
        if p.engine == "f32":
            y = cp.matmul(x, w.data.T, out=out)                          # (T, n_out)
            if bias is not None:
                cp.add(y, bias, out=y)
        else:
            xq, xd, xs = int8.quantize_q8_1(x, *self.q8_scratch(0, T, w.n_in))
            if w.qtype == QT.Q4_K:
                y = int8.mmq_q4k(xq, xd, xs, w.data, w.n_out, bias, out)
            else:
                plane = self.store.plane_of(w) if p.reads_plane else None
                y = int8.mmq_q6k(xq, xd, w.data, plane, w.n_out, bias, out)
        return y if residual is None else ops.add(residual, y, out=y)

    def linear_q8(self, q8, w: GpuWeight, bias=None, residual=None):
        """A decode row given as q8_1 (a kernel wrote it: the attention's combine)
        @ W^T [+ bias] [+ residual (consumed)] -> f32 (1, n_out) by the matvec."""
        if self.path(1, w).engine != "matvec" or q8[0].shape != (1, w.n_in):
            raise ValueError(f"linear_q8 {w.name}: needs a matvec weight of {q8[0].shape[1]} inputs")
        return self._matvecs(q8, (w,), (bias,), (residual,))[0]

    def linear_f16(self, xh, w: GpuWeight, residual=None):
        """x already rounded to f16 (T, n_in) (a kernel wrote it into f16_operand: the
        flash attention's store) @ W^T [+ residual (consumed)] -> f32 (T, n_out) on
        the f16 engine: linear's values for the f32 x it was rounded from."""
        T = xh.shape[0]
        if self.path(T, w).engine != "f16" or xh.dtype != cp.float16 or xh.shape != (T, w.n_in):
            raise ValueError(f"linear_f16 {w.name}: needs an f16-engine weight and an f16 (T, {w.n_in}) x")
        return self._f16_residual(xh, w, residual)

    def f16_operand(self, shape):
        """Where a kernel may write an f16 GEMM operand for linear_f16: the f16
        activation scratch as `shape` (free between the GEMMs that read it)."""
        return self._x16(shape)

    def linears(self, x, ws, biases) -> list:
        """Weights that read the same x (q/k/v, gate/up) -> [f32 (T, n_out) each]. On
        the f16 engine x is rounded to f16 once for all of them; one decode row is
        quantized to q8_1 once and the weights share launches (_matvecs)."""
        T = x.shape[0]
        engines = {self.path(T, w).engine for w in ws}
        if all(w.n_in == x.shape[1] for w in ws):
            if engines == {"f16"}:
                return self._f16_linears(x, ws, biases)
            if engines == {"matvec"}:
                q8 = int8.quantize_q8_1(x, *self.q8_scratch(0, 1, x.shape[1]))   # once for all
                return self._matvecs(q8, ws, biases)
        return [self.linear(x, w, b) for w, b in zip(ws, biases)]

    def norm_linears(self, x, norm_w, eps: float, ws, biases, views: bool = False) -> list:
        """rmsnorm(x) * norm_w, then linears: one decode row goes from the norm straight
        to q8_1 (int8.rmsnorm_q8_1), the same values as the two steps. views: on the
        f16 engine the results may be column blocks of one GEMM's output (_f16_group),
        for a caller that reads rows of any stride."""
        if self.all_matvec(x, ws):
            q8 = int8.rmsnorm_q8_1(x, norm_w, eps, *self.q8_scratch(0, 1, x.shape[1]))
            return self._matvecs(q8, ws, biases)
        if self.all_f16(x, ws):                  # the norm writes the f16 operand itself
            xh = ops.rmsnorm(x, norm_w, eps, out=self._x16(x.shape), dtype=cp.float16)
            if views and self.groups(xh.shape[0], ws, biases):
                return self._f16_group(xh, ws)
            return [self._f16_gemm(xh, w, bias=b) for w, b in zip(ws, biases)]
        return self.linears(ops.rmsnorm(x, norm_w, eps), ws, biases)

    def groups(self, T: int, ws, biases) -> bool:
        """Do weights that read the same x run as one GEMM (_f16_group)? On the f16
        engine, dequantized per GEMM (no kept f16 copies) and without biases."""
        return (len(ws) > 1 and all(b is None for b in biases)
                and all(self.path(T, w).engine == "f16" and self.store.f16_of(w) is None for w in ws))

    def _f16_group(self, xh, ws, dtype=None) -> list:
        """xh f16 (T, n_in) @ [W_1; W_2; ...]^T as one GEMM: each weight dequantized into
        its rows of the scratch, one (T, sum n_out) output of dtype (f32, the default,
        or f16) -> its column blocks, views with that row stride. Each output element
        is the same dot product as alone (the GEMM's kernels sum over K in one order;
        tests/gpu/test_fused.py)."""
        T, n_in = xh.shape
        w16, at, todo = self._w16(sum(w.n_out * n_in for w in ws)), 0, []
        for w in ws:
            todo.append(self._dequant_args(T, w, w16[at:at + w.n_out * n_in]))
            at += w.n_out * n_in
        f16.dequant_f16_many(todo)                 # side by side, one launch for up to three
        n_all = sum(w.n_out for w in ws)
        y = f16.gemm_w16(xh, w16[:at].reshape(n_all, n_in),
                         out=cp.empty((T, n_all), dtype or cp.float32))              # (T, n_all)
        cols = [0]
        for w in ws:
            cols.append(cols[-1] + w.n_out)
        return [y[:, a:b] for a, b in zip(cols, cols[1:])]

    def ffn(self, x, norm_w, eps: float, gate: GpuWeight, up: GpuWeight, down: GpuWeight, ahead=None):
        """The feed-forward sub-block: x + down(silu(gate h) * up h), h = rmsnorm(x) * norm_w.
        One decode row: four launches (norm to q8_1; gate and up, one launch where they
        share a type; SwiGLU to q8_1; down with the residual); prompts: the f16 FFN
        (ffn_f16, which may prepare ahead: the next layer's (gate, up)) or three
        linears."""
        T, d_ff = x.shape[0], gate.n_out
        if (self.all_matvec(x, (gate, up)) and self.path(1, down).engine == "matvec"
                and up.n_out == d_ff == down.n_in and d_ff % 32 == 0):
            q8 = int8.rmsnorm_q8_1(x, norm_w, eps, *self.q8_scratch(0, 1, x.shape[1]))
            g, u = self._matvecs(q8, (gate, up), (None, None))
            h8 = int8.swiglu_q8_1(g, u, *self.q8_scratch(1, 1, d_ff))
            return self._matvecs(h8, (down,), (None,), (x,))[0]
        if self.ffn_fused(T, gate, up, down):    # x consumed: down accumulates into it
            return self.ffn_f16(ops.rmsnorm(x, norm_w, eps, out=self._x16(x.shape), dtype=cp.float16),
                                gate, up, down, residual=x, ahead=ahead)
        h = ops.rmsnorm(x, norm_w, eps)
        y = self.linear(ops.swiglu(*self.linears(h, (gate, up), (None, None))), down)
        return ops.add(x, y, out=y)

    def all_matvec(self, x, ws) -> bool:
        """Is x one row, and do all of ws take the matvec for it?"""
        return x.shape[0] == 1 and all(w.n_in == x.shape[1] and self.path(1, w).engine == "matvec"
                                       for w in ws)

    def all_f16(self, x, ws) -> bool:
        """Do all of ws take the f16 engine for x's rows?"""
        return all(w.n_in == x.shape[1] and self.path(x.shape[0], w).engine == "f16" for w in ws)

    @staticmethod
    def _accumulates(residual, bias, out, shape) -> bool:
        """Can the f16 GEMM add the residual in its store (beta = 1)? Only without a bias
        (y + bias first, then the residual, is another order) or an out of the caller's."""
        return (residual is not None and bias is None and out is None
                and residual.dtype == cp.float32 and residual.flags.c_contiguous
                and tuple(residual.shape) == shape)

    def _matvecs(self, q8, ws, biases, residuals=None, outs=None) -> list:
        """q8_1 x (1, K) @ each weight -> [y (1, n_out)]: weights of one K split whose
        types can share a launch go in one (up to matvec.MAX_SEGMENTS); every weight
        counted."""
        n = len(ws)
        residuals, outs = residuals or (None,) * n, outs or (None,) * n
        launches: list[list[int]] = []
        for i, w in enumerate(ws):
            fits = [g for g in launches if len(g) < matvec.MAX_SEGMENTS
                    and matvec.split_of(ws[g[0]].n_out) == matvec.split_of(w.n_out)
                    and matvec.can_share([ws[j].qtype for j in g] + [w.qtype])]
            if fits:
                fits[0].append(i)
            else:
                launches.append([i])
        ys: list = [None] * n
        for g in launches:
            for i in g:
                self.counters.count(self.path(1, ws[i]))
            out = matvec.matvecs(*q8, [(ws[i].qtype, ws[i].data, ws[i].n_out, biases[i], residuals[i], outs[i])
                                       for i in g])
            for i, y in zip(g, out):
                ys[i] = y
        return ys

    def ffn_fused(self, T: int, gate: GpuWeight, up: GpuWeight, down: GpuWeight) -> bool:
        """Does the FFN of T tokens run fused in f16 (all three GEMMs on the f16 engine)?"""
        return (self.settings.ffn_f16 and gate.n_out == up.n_out == down.n_in
                and all(self.path(T, w).engine == "f16" for w in (gate, up, down)))

    def ffn_f16(self, h, gate: GpuWeight, up: GpuWeight, down: GpuWeight, residual=None, ahead=None):
        """h (T, d) f32, or f16 already rounded -> down(silu(gate h) * up h) f32 (T, d)
        with the (T, d_ff) intermediates in f16: gate/up and SwiGLU in one kernel where
        gateup_kernel says so (_gateup_f16 for the f16 one), else gate/up write f16 (one
        GEMM over both weights where they group, else one each) and swiglu reads and
        writes f16; the down GEMM reads it (no f32 round trip). With a residual, the
        down GEMM accumulates into it (consumed) and returns it. ahead: the next
        layer's (gate, up), or None."""
        T, d_ff = h.shape[0], gate.n_out
        xh = h if h.dtype == cp.float16 else f16.cast_f16(h, self._x16(h.shape))   # (T, d)
        kind = gateup_kernel(T, gate, up, self.settings, self._has_f16(gate, up), device_cc())
        if kind == "f16":
            return self._f16_residual(self._gateup_f16(xh, gate, up, ahead), down, residual)
        if kind == "q4k":
            for w in (gate, up):
                self.counters.count(self.path(T, w))
            self.counters.counts["gate/up fused"] += 1
            # a buffer of its own, not the _x16 scratch: xh may live there, and the
            # kernel reads xh while it writes h
            f = gateup.gateup_swiglu_q4k(xh, gate.data, up.data, d_ff,
                                         out=cp.empty((T, d_ff), cp.float16))     # (T, d_ff)
            return self._f16_residual(f, down, residual)
        if self.groups(T, (gate, up), (None, None)):
            gu = self._f16_group(xh, (gate, up), cp.float16)                        # 2 x (T, d_ff) views
        else:
            gu = [self._f16_gemm(xh, w, out=cp.empty((T, d_ff), cp.float16))       # (T, d_ff)
                  for w in (gate, up)]
        f = f16.swiglu_f16(*gu, out=self._x16((T, d_ff)))                          # (T, d_ff)
        return self._f16_residual(f, down, residual)

    def _gateup_f16(self, xh, gate: GpuWeight, up: GpuWeight, ahead):
        """h = SwiGLU of gate/up by gateup_swiglu_f16 -> (T, d_ff) f16. Its f16 weights
        are in a slot already when the launch before (the previous layer's) wrote them
        (self._ahead names them), else they are dequantized now; the launch writes the
        next layer's pair (ahead, when it takes this kernel too) into the other slot.
        Every GEMM dequantizing in between uses the slot not held (_w16), and one
        stream orders each slot's reads before its next writes."""
        T, d_ff, n = xh.shape[0], gate.n_out, 2 * gate.n_out * gate.n_in
        held, self._ahead = self._ahead, None
        handed = held is not None and held[1:] == (gate.ptr, up.ptr)
        slot = held[0] if handed else 0
        w16 = self._slot(slot, n)
        if handed:
            for w in (gate, up):
                self.counters.count(self.path(T, w))
        else:
            f16.dequant_f16_many([self._dequant_args(T, gate, w16[:n // 2]),
                                  self._dequant_args(T, up, w16[n // 2:])])
        job = None
        if ahead is not None:
            g2, u2 = ahead
            if (g2.n_out, g2.n_in, u2.n_out, u2.n_in) == (d_ff, gate.n_in, d_ff, gate.n_in) and gateup_kernel(
                    T, g2, u2, self.settings, self._has_f16(g2, u2), device_cc()) == "f16":
                job = (g2.data, u2.data, self._slot(1 - slot, n)[:n])
        self.counters.counts["gate/up f16"] += 1
        # h in a buffer of its own, not the _x16 scratch: xh may live there
        h = gateup.gateup_swiglu_f16(xh, w16[:n].reshape(2 * d_ff, gate.n_in), d_ff, ahead=job,
                                     out=cp.empty((T, d_ff), cp.float16))        # (T, d_ff)
        if job is not None:
            self.counters.counts["gate/up ahead"] += 1
            self._ahead = (1 - slot, ahead[0].ptr, ahead[1].ptr)
        return h

    def _has_f16(self, gate: GpuWeight, up: GpuWeight) -> bool:
        """Is an f16 copy kept for gate or up (settings.f16_weights)?"""
        return self.store.f16_of(gate) is not None or self.store.f16_of(up) is not None

    def _f16_residual(self, xh, w: GpuWeight, residual=None, bias=None, out=None):
        """xh f16 @ W^T [+ bias] [+ residual (consumed)]: the GEMM accumulates into the
        residual where it can (_accumulates), else the residual is added after it."""
        if self._accumulates(residual, bias, out, (xh.shape[0], w.n_out)):
            return self._f16_gemm(xh, w, out=residual, accumulate=True)
        y = self._f16_gemm(xh, w, out=out, bias=bias)
        return y if residual is None else ops.add(residual, y, out=y)

    def _f16_linears(self, x, ws, biases):
        xh = f16.cast_f16(x, self._x16(x.shape))                                   # (T, n_in)
        return [self._f16_gemm(xh, w, bias=b) for w, b in zip(ws, biases)]

    def _f16_gemm(self, xh, w: GpuWeight, out=None, bias=None, accumulate: bool = False):
        """xh f16 @ W^T on W's f16 form (_weight16)."""
        return f16.gemm_w16(xh, self._weight16(xh.shape[0], w), out=out, bias=bias, accumulate=accumulate)

    def _weight16(self, T: int, w: GpuWeight, into=None):
        """W as an f16 GEMM operand, counted on its path for T rows: the f16 copy kept
        since load, else W dequantized (from its W_exp plane when the path reads it)
        into `into` (flat f16, default the weight scratch)."""
        w16 = self.store.f16_of(w)
        if w16 is not None:
            self.counters.count(self.path(T, w))
            return w16
        return f16.dequant_f16(*self._dequant_args(T, w, self._w16() if into is None else into))

    def _dequant_args(self, T: int, w: GpuWeight, into) -> tuple:
        """f16.dequant_f16's arguments for W into `into`, from its W_exp plane when
        its path for T rows reads one; counted on that path."""
        p = self.path(T, w)
        self.counters.count(p)
        plane = self.store.plane_of(w) if p.reads_plane else None
        return (w.data, w.qtype, w.n_out, w.n_in, into, plane)

    def q8_scratch(self, slot: int, T: int, n: int):
        """q8_1 buffers for x (T, n) in one of two slots (a decode step's FFN reads
        slot 0 and writes slot 1), grown when too small."""
        if self._q8[slot] is None or self._q8[slot][0].size < T * n:
            self._q8[slot] = (cp.empty(T * n, cp.int8),                # (T*n,)
                              cp.empty(T * n // 32, cp.float32),       # (T*n/32,)
                              cp.empty(T * n // 32, cp.float32))       # (T*n/32,)
        q, d, s = self._q8[slot]
        return (q[:T * n].reshape(T, n), d[:T * n // 32].reshape(T, n // 32),
                s[:T * n // 32].reshape(T, n // 32))

    def _x16(self, shape):
        """The f16 activation scratch as `shape` (grown when too small): the rounded x
        of a GEMM, or the SwiGLU output its down GEMM reads."""
        n = math.prod(shape)
        if self._f16x is None or self._f16x.size < n:
            self._f16x = cp.empty(n, cp.float16)                        # (T*n_in,)
        return self._f16x[:n].reshape(shape)

    def _w16(self, n: int = 0):
        """The f16 weight scratch: the slot that does not hold the next layer's gate/up
        (self._ahead), at least the largest layer weight the f16 engine dequantizes, or
        n elements (a group of weights side by side) when that is more."""
        return self._slot(0 if self._ahead is None else 1 - self._ahead[0], n)

    def _slot(self, i: int, n: int = 0):
        """f16 weight slot i (flat), grown to max(n, the largest layer weight)."""
        n = max(n, self.store.f16_elems)
        if self._f16w[i] is None or self._f16w[i].size < n:
            self._f16w[i] = cp.empty(n, cp.float16)                     # (n,)
        return self._f16w[i]

    def scratch(self) -> tuple:
        """The scratch buffers now in use (a captured graph keeps them alive)."""
        return (tuple(self._q8), self._f16x, tuple(self._f16w))

    def scratch_bytes(self) -> int:
        return sum(int(a.nbytes) for a in (self._f16x, *self._f16w) if a is not None)
