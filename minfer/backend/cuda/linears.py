"""The linears: x @ W^T on the path paths.gemm_path gives, one weight or several that
read the same x (q/k/v, gate/up), after a norm or not, and the decode matvecs.

Every product's weight operand is produced, and its path counted, in one place:
`ran` (the counters' path labels). Scratch comes from the run state (state.py).
"""
from __future__ import annotations

from gguf import GGMLQuantizationType as QT

from ...errors import MinferError
from .cublas import gemm_w16
from .kernels import matvec, mmq, mmq_rows
from .kernels.dequant_f16 import cast_f16, dequant_f16, dequant_f16_many
from .kernels.elementwise import add
from .kernels.norm import rmsnorm, rmsnorm_q8_1
from .kernels.quantize import quantize_q8_1
from .launch import cp
from .paths import GemmPath, gemm_path
from .weights import GpuWeight


class Linears:
    def __init__(self, store, state, counters, settings):
        self.store, self.state, self.counters = store, state, counters
        self._settings = settings                # () -> the backend's CudaSettings

    def path(self, T: int, w: GpuWeight) -> GemmPath:
        return gemm_path(T, w, self._settings(), self.store.plane_of(w) is not None,
                         self.store.f16_of(w) is not None, self.state.decode_rows, self.state.prompt_rows)

    def ran(self, T: int, w: GpuWeight) -> GemmPath:
        """Count W's product of T rows on its path -> the path."""
        p = self.path(T, w)
        for label in p.labels:
            self.counters.label(label)
        return p

    # --- one weight ------------------------------------------------------------
    def linear(self, x, w: GpuWeight, bias=None, out=None, residual=None):
        """x f32 (T, n_in) @ W (n_out, n_in)^T [+ bias (n_out,)] [+ residual (T, n_out)]
        -> f32 (T, n_out). The residual is consumed: the matvec adds it in its store,
        the f16 engine's GEMM accumulates into it (beta = 1: residual + y rounded
        once, as the add); the other engines add it after the GEMM."""
        if x.ndim != 2 or x.shape[1] != w.n_in:
            raise MinferError(f"linear {w.name}: input shape {tuple(x.shape)} does not match "
                              f"the weight's {w.n_in} inputs")
        T = x.shape[0]
        path = self.path(T, w)
        engine = path.engine
        if path.q8_rows:
            q8 = quantize_q8_1(x, *self.state.q8(0, T, w.n_in))
            return self.matvecs(q8, (w,), (bias,), (residual,), (out,))[0]
        if engine == "f16":
            return self.f16_residual(cast_f16(x, self.state.x16(x.shape)), w, residual, bias, out)
        p = self.ran(T, w)
        if engine == "f32":
            y = cp.matmul(x, w.data.T, out=out)                          # (T, n_out)
            if bias is not None:
                cp.add(y, bias, out=y)
        else:
            xq, xd, xs = quantize_q8_1(x, *self.state.q8(0, T, w.n_in))
            if w.qtype == QT.Q4_K:
                y = mmq.mmq_q4k(xq, xd, xs, w.data, w.n_out, bias, out)
            else:
                plane = self.store.plane_of(w) if p.reads_plane else None
                y = mmq.mmq_q6k(xq, xd, w.data, plane, w.n_out, bias, out)
        return y if residual is None else add(residual, y, out=y)

    def linear_q8(self, q8, w: GpuWeight, bias=None, residual=None):
        """Decode rows given as q8_1 (a kernel wrote them: the attention's combine)
        @ W^T [+ bias] [+ residual (consumed)] -> f32 (T, n_out) by the matvec."""
        T = q8[0].shape[0]
        if not self.path(T, w).q8_rows or q8[0].shape != (T, w.n_in):
            raise ValueError(f"linear_q8 {w.name}: needs a matvec weight of {q8[0].shape[1]} inputs")
        return self.matvecs(q8, (w,), (bias,), (residual,))[0]

    def linear_f16(self, xh, w: GpuWeight, residual=None):
        """x already rounded to f16 (T, n_in) (a kernel wrote it into the state's x16:
        the flash attention's store) @ W^T [+ residual (consumed)] -> f32 (T, n_out)
        on the f16 engine: linear's values for the f32 x it was rounded from."""
        T = xh.shape[0]
        if self.path(T, w).engine != "f16" or xh.dtype != cp.float16 or xh.shape != (T, w.n_in):
            raise ValueError(f"linear_f16 {w.name}: needs an f16-engine weight and an f16 (T, {w.n_in}) x")
        return self.f16_residual(xh, w, residual)

    # --- weights that read the same x ---------------------------------------------
    def linears(self, x, ws, biases) -> list:
        """-> [f32 (T, n_out) each]. On the f16 engine x is rounded to f16 once for all
        of them; one decode row is quantized to q8_1 once and the weights share
        launches (matvecs); so are a decode step's rows."""
        T = x.shape[0]
        engines = {self.path(T, w).engine for w in ws}
        if all(w.n_in == x.shape[1] for w in ws):
            if engines == {"f16"}:
                xh = cast_f16(x, self.state.x16(x.shape))                           # (T, n_in)
                return [self.f16_gemm(xh, w, bias=b) for w, b in zip(ws, biases)]
            if self.all_matvec(x, ws):
                q8 = quantize_q8_1(x, *self.state.q8(0, T, x.shape[1]))   # once for all
                return self.matvecs(q8, ws, biases)
        return [self.linear(x, w, b) for w, b in zip(ws, biases)]

    def norm_linears(self, x, norm_w, eps: float, ws, biases, views: bool = False) -> list:
        """rmsnorm(x) * norm_w, then linears: one decode row goes from the norm straight
        to q8_1 (rmsnorm_q8_1), the same values as the two steps (so do a decode
        step's rows). views: on the f16
        engine the results may be column blocks of one GEMM's output (f16_group), for
        a caller that reads rows of any stride."""
        if self.all_matvec(x, ws):
            q8 = rmsnorm_q8_1(x, norm_w, eps, *self.state.q8(0, x.shape[0], x.shape[1]))
            return self.matvecs(q8, ws, biases)
        if self.all_f16(x, ws):                  # the norm writes the f16 operand itself
            xh = rmsnorm(x, norm_w, eps, out=self.state.x16(x.shape), dtype=cp.float16)
            if views and self.groups(xh.shape[0], ws, biases):
                return self.f16_group(xh, ws)
            return [self.f16_gemm(xh, w, bias=b) for w, b in zip(ws, biases)]
        return self.linears(rmsnorm(x, norm_w, eps), ws, biases)

    def all_matvec(self, x, ws) -> bool:
        """Do all of ws take q8_1 rows for x's rows (one row, or a decode step's: the
        matvec or mmq_rows)?"""
        return all(w.n_in == x.shape[1] and self.path(x.shape[0], w).q8_rows for w in ws)

    def all_f16(self, x, ws) -> bool:
        """Do all of ws take the f16 engine for x's rows?"""
        return all(w.n_in == x.shape[1] and self.path(x.shape[0], w).engine == "f16" for w in ws)

    def groups(self, T: int, ws, biases) -> bool:
        """Do weights that read the same x run as one GEMM (f16_group)? On the f16
        engine, dequantized per GEMM (no kept f16 copies) and without biases."""
        return (len(ws) > 1 and all(b is None for b in biases)
                and all(self.path(T, w).engine == "f16" and self.store.f16_of(w) is None for w in ws))

    def f16_group(self, xh, ws, dtype=None) -> list:
        """xh f16 (T, n_in) @ [W_1; W_2; ...]^T as one GEMM: each weight dequantized into
        its rows of the scratch, one (T, sum n_out) output of dtype (f32, the default,
        or f16) -> its column blocks, views with that row stride. Each output element
        is the same dot product as alone (the GEMM's kernels sum over K in one order;
        tests/gpu/test_fused.py)."""
        T, n_in = xh.shape
        w16, at, todo = self.state.w16(sum(w.n_out * n_in for w in ws)), 0, []
        for w in ws:
            todo.append(self.dequant_args(T, w, w16[at:at + w.n_out * n_in]))
            at += w.n_out * n_in
        dequant_f16_many(todo)                     # side by side, one launch for up to three
        n_all = sum(w.n_out for w in ws)
        y = gemm_w16(xh, w16[:at].reshape(n_all, n_in), out=cp.empty((T, n_all), dtype or cp.float32))
        cols = [0]                                                                  # y (T, n_all)
        for w in ws:
            cols.append(cols[-1] + w.n_out)
        return [y[:, a:b] for a, b in zip(cols, cols[1:])]

    def matvecs(self, q8, ws, biases, residuals=None, outs=None) -> list:
        """q8_1 x (T, K) @ each weight -> [y (T, n_out)]: on mmq_rows one launch a
        weight (of 32 rows); on the matvec, weights of one K split whose types can
        share a launch go in one (up to matvec.MAX_SEGMENTS)."""
        n, T = len(ws), q8[0].shape[0]
        residuals, outs = residuals or (None,) * n, outs or (None,) * n
        ys: list = [None] * n
        launches: list[list[int]] = []
        for i, w in enumerate(ws):
            if self.ran(T, w).engine == "mvt":
                ys[i] = mmq_rows.mmq_rows(w.qtype, *q8, w.data, w.n_out, biases[i], residuals[i], outs[i])
                continue
            fits = [g for g in launches if len(g) < matvec.MAX_SEGMENTS
                    and matvec.split_of(ws[g[0]].n_out) == matvec.split_of(w.n_out)
                    and matvec.can_share([ws[j].qtype for j in g] + [w.qtype])]
            if fits:
                fits[0].append(i)
            else:
                launches.append([i])
        for g in launches:
            out = matvec.matvecs(*q8, [(ws[i].qtype, ws[i].data, ws[i].n_out, biases[i], residuals[i], outs[i])
                                       for i in g])
            for i, y in zip(g, out):
                ys[i] = y
        return ys

    # --- the f16 engine -----------------------------------------------------------
    def f16_residual(self, xh, w: GpuWeight, residual=None, bias=None, out=None):
        """xh f16 @ W^T [+ bias] [+ residual (consumed)]: the GEMM accumulates into the
        residual where it can (without a bias, which would add in another order, or
        an out of the caller's), else the residual is added after it."""
        if (residual is not None and bias is None and out is None and residual.dtype == cp.float32
                and residual.flags.c_contiguous and tuple(residual.shape) == (xh.shape[0], w.n_out)):
            return self.f16_gemm(xh, w, out=residual, accumulate=True)
        y = self.f16_gemm(xh, w, out=out, bias=bias)
        return y if residual is None else add(residual, y, out=y)

    def f16_gemm(self, xh, w: GpuWeight, out=None, bias=None, accumulate: bool = False):
        """xh f16 @ W^T on W's f16 form: the f16 copy kept since load, else W
        dequantized into the weight scratch."""
        w16 = self.store.f16_of(w)
        if w16 is not None:
            self.ran(xh.shape[0], w)
        else:
            w16 = dequant_f16(*self.dequant_args(xh.shape[0], w, self.state.w16()))
        return gemm_w16(xh, w16, out=out, bias=bias, accumulate=accumulate)

    def dequant_args(self, T: int, w: GpuWeight, into) -> tuple:
        """dequant_f16's arguments for W into `into` (flat f16), from its W_exp plane
        when its path for T rows reads one; counted on that path."""
        p = self.ran(T, w)
        plane = self.store.plane_of(w) if p.reads_plane else None
        return (w.data, w.qtype, w.n_out, w.n_in, into, plane)
